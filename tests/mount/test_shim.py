"""The nvcc shim, kcachefs-nvcc: unmodified DeepGEMM with
DG_JIT_NVCC_COMPILER=kcachefs-nvcc compiles each kernel once per node through the mount;
calls it does not take over, and calls whose output is not on a kcachefs mount, behave
exactly like nvcc."""
import errno
import hashlib
import multiprocessing
import os
import shutil
import struct
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

import deepgemm
from conftest import (EM_CUDA, KERNELS, NVCC, SHIM, Mount, elf_machine, elf_symbols,
                      run_parallel, sample, write_script)

# K distinct kernels that include a header through -I, as DeepGEMM's do.
TEMPLATE = """#include <kc_test/scale.cuh>
extern "C" __global__ void scale_%d(const float *in, float *out, int n)
{
	int i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i < n)
		out[i] = kc_scale<%d>(in[i]);
}
"""


def shim(args, cwd=None, env=None, **kw):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([str(SHIM)] + [str(a) for a in args], cwd=cwd, env=e,
                          capture_output=True, text=True, **kw)


def nvcc(args, cwd=None):
    return subprocess.run([str(NVCC)] + [str(a) for a in args], cwd=cwd, capture_output=True,
                          text=True)


def lonely(tmp_path, kernel="vector_add"):
    """A copy of a sample kernel alone in a directory of its own, as DeepGEMM's sources are
    (a source with other files beside it is nvcc's: they could be its headers)."""
    d = Path(tempfile.mkdtemp(dir=tmp_path))
    shutil.copy(KERNELS / (kernel + ".cu"), d / (kernel + ".cu"))
    return d / (kernel + ".cu")


def shim_entries(m):
    d = m.mnt / "kcachefs-nvcc"
    return sorted(os.listdir(d)) if d.exists() else []


def test_version_and_other_calls_are_nvccs(mount_factory, tmp_path):
    m = mount_factory()
    for args in (["--version"], ["--help"], ["--no-such-option"]):
        a, b = shim(args), nvcc(args)
        assert (a.returncode, a.stdout, a.stderr) == (b.returncode, b.stdout, b.stderr), args
    assert "release " in shim(["--version"]).stdout
    # Not a cubin compile (here -ptx), even with the output on the mount: nvcc's business.
    src = KERNELS / "vector_add.cu"
    r = shim([src, "-ptx", "-o", m.mnt / "v.ptx", "-arch=sm_90a"])
    assert r.returncode == 0, r.stderr
    assert b".entry vector_add" in (m.mnt / "v.ptx").read_bytes()
    assert shim_entries(m) == [] and m.stats()["compiles_total"] == 0


def test_off_the_mount_it_is_plain_nvcc(mount_factory, tmp_path):
    m = mount_factory()
    out = tmp_path / "v.cubin"
    # -ccbin would be refused on the mount; off it the shim is nvcc and nvcc takes it.
    r = shim([KERNELS / "vector_add.cu", "-cubin", "-o", out, "-arch=sm_90a",
              "-ccbin", shutil.which("g++") or "/usr/bin/g++"])
    assert r.returncode == 0, r.stderr
    data = out.read_bytes()
    assert elf_machine(data) == EM_CUDA and "vector_add" in elf_symbols(data)
    bad_src = tmp_path / "b.cu"
    shutil.copy(KERNELS / "broken.cu", bad_src)
    a = shim([bad_src, "-cubin", "-o", tmp_path / "b.cubin", "-arch=sm_90a"], cwd=tmp_path)
    b = nvcc([bad_src, "-cubin", "-o", tmp_path / "b.cubin", "-arch=sm_90a"], cwd=tmp_path)
    assert (a.returncode, a.stdout, a.stderr) == (b.returncode, b.stdout, b.stderr)
    assert shim_entries(m) == [] and m.stats()["compiles_total"] == 0


def deepgemm_run(m, tmp_path, kernels, compiler, counted_nvcc=None):
    """8 ranks of the current DeepGEMM sequence over kernels, all released together before
    each kernel; returns each rank's {name: sha256}."""
    root = m.mnt / "dg"
    ctx = multiprocessing.get_context("fork")
    per_kernel = ctx.Barrier(8)

    def rank(i):
        os.environ["DG_JIT_NVCC_COMPILER"] = str(compiler)
        if counted_nvcc:
            os.environ["KCACHEFS_NVCC"] = str(counted_nvcc)
        out = {}
        for name, src in kernels.items():
            per_kernel.wait(timeout=120)
            out[name] = hashlib.sha256(deepgemm.current(str(root), name, src)).hexdigest()
        return out

    results = run_parallel(8, rank)
    assert all(isinstance(r, dict) for r in results), "a rank failed: %s" % results
    for name, src in kernels.items():
        assert len({r[name] for r in results}) == 1, "ranks loaded different bytes"
        entry = deepgemm.entry_dir(str(root), name, src, str(compiler))
        data = deepgemm.load(entry)
        assert elf_machine(data) == EM_CUDA and name in elf_symbols(data)
    assert os.listdir(root / "tmp") == [], "temp files left behind"
    return results


def test_deepgemm_through_the_shim_compiles_each_kernel_once(mount_factory, counting_nvcc,
                                                             tmp_path):
    """The acceptance run: 8 ranks x K kernels, exactly K compiler runs on the node with the
    shim, 8 x K without it, no error either way."""
    make_nvcc, calls = counting_nvcc
    counted = make_nvcc()
    K = 4
    kernels = {"scale_%d" % k: (TEMPLATE % (k, k + 2)).encode() for k in range(K)}

    m = mount_factory(["nvcc=%s" % counted], name="with-shim")
    with_shim = deepgemm_run(m, tmp_path, kernels, SHIM, counted_nvcc=counted)
    assert calls() == K, "with the shim: %d compiler runs for %d kernels" % (calls(), K)
    assert m.stats()["compiles_total"] == K
    assert len(shim_entries(m)) == K
    # Every rank got the mount's cubin: the bytes in DeepGEMM's entries are the mount's.
    for name, src in kernels.items():
        theirs = deepgemm.load(deepgemm.entry_dir(str(m.mnt / "dg"), name, src, str(SHIM)))
        ours = [(m.mnt / "kcachefs-nvcc" / e / "kernel.cubin").read_bytes() for e in shim_entries(m)]
        assert theirs in ours
    # A warm second job: DeepGEMM's own cache hits; nothing compiles.
    assert deepgemm_run(m, tmp_path, kernels, SHIM, counted_nvcc=counted) == with_shim
    assert calls() == K

    m2 = mount_factory(name="without-shim")
    deepgemm_run(m2, tmp_path, kernels, counted)
    assert calls() - K == 8 * K, "without the shim every rank compiles every kernel"
    assert m2.stats()["compiles_total"] == 0


def test_failing_source_gives_nvccs_status_and_errors(mount_factory, counting_nvcc, tmp_path):
    make_nvcc, calls = counting_nvcc
    m = mount_factory(["nvcc=%s" % make_nvcc()])
    work = m.mnt / "tmp" / "1"
    work.mkdir(parents=True)
    shutil.copy(KERNELS / "broken.cu", work / "kernel.cu")
    args = [work / "kernel.cu", "-cubin", "-o", work / "kernel.cubin", "-arch=sm_90a"]
    want = nvcc(args)
    assert want.returncode != 0
    for attempt in range(2):
        r = shim(args)
        assert r.returncode == want.returncode, r.stderr
        assert "undefined_symbol_kcachefs_test" in r.stderr and "error" in r.stderr
        assert not r.stderr.startswith("kcachefs"), "a rejection prints the compiler's words"
        assert r.stderr == want.stderr, "the errors name the caller's file, as nvcc's do"
        assert sorted(os.listdir(work)) == ["kernel.cu"], "no output, no temp file"
    assert calls() == 1, "the rejection is remembered: the second call does not compile"


def test_a_rejection_by_the_mount_is_checked_by_nvcc(mount_factory, tmp_path):
    """The mount's compiler rejected the source (here a fake that always fails): nvcc runs
    the call once more, so the caller gets nvcc's verdict, not the mount's."""
    fail3 = write_script(tmp_path / "nvcc-fail3",
                         'case "$*" in *-cubin*) echo "k.cu(1): error: fake"; exit 3;; esac\n'
                         'exec %s "$@"\n' % NVCC)
    m = mount_factory(["nvcc=%s" % fail3])
    out = m.mnt / "v.cubin"
    r = shim([lonely(tmp_path), "-cubin", "-o", out, "-arch=sm_90a"])
    assert r.returncode == 0 and r.stderr == "", r
    assert "vector_add" in elf_symbols(out.read_bytes())
    assert m.stats()["compile_failures_total"] == 1


def test_refused_flags_stage_nothing(mount_factory, tmp_path):
    """Flags that would turn the compiler against the node fail the call; flags the mount
    merely does not take are nvcc's (a warning says so)."""
    m = mount_factory()
    src = KERNELS / "vector_add.cu"
    opts = tmp_path / "opts"
    opts.write_text("-O3\n")
    refused = {
        "picks a host compiler": ["-ccbin", "/usr/bin/gcc"],
        "runs a program": ["--run"],
        "host compiler option '-fplugin=/x.so'": ["-Xcompiler", "-fplugin=/x.so"],
        "reads arguments from a file": ["--options-file", str(opts)],
        "names an output": ["-odir", str(tmp_path)],
    }
    for why, extra in refused.items():
        out = m.mnt / "k.cubin"
        r = shim([src, "-cubin", "-o", out, "-arch=sm_90a"] + extra)
        assert r.returncode == 1, (extra, r.stderr)
        assert r.stderr.startswith("kcachefs-nvcc: flag ") and why in r.stderr, r.stderr
        assert not out.exists()
    for why, extra in {"split it at the comma": ["-I", "/usr/include,/tmp"],
                       "not on the allow-list": ["--frobnicate"]}.items():
        out = m.mnt / "k.cubin"
        args = [src, "-cubin", "-o", out, "-arch=sm_90a"] + extra
        r = shim(args)
        assert r.stderr.startswith("kcachefs-nvcc: warning: flag ") and why in r.stderr, r.stderr
        want = nvcc(args)
        assert r.returncode == want.returncode and r.stderr.endswith(want.stderr)
        if out.exists():
            out.unlink()
    assert shim_entries(m) == [] and m.stats()["compiles_total"] == 0


def test_key_follows_the_include_tree(mount_factory, tmp_path):
    m = mount_factory()
    inc = tmp_path / "include"
    shutil.copytree(KERNELS / "include", inc)
    (tmp_path / "src").mkdir()
    src = tmp_path / "src" / "k.cu"
    src.write_text(TEMPLATE % (0, 3))
    out = m.mnt / "k.cubin"
    args = [src, "-cubin", "-o", out, "-arch=sm_90a", "-I", inc]
    assert shim(args).returncode == 0
    first = out.read_bytes()
    assert shim(args).returncode == 0 and len(shim_entries(m)) == 1, "same tree, same entry"
    header = inc / "kc_test" / "scale.cuh"
    header.write_text(header.read_text().replace("x * static_cast<float>(N)",
                                                 "x * static_cast<float>(N) + 1.0f"))
    r = shim(args)
    assert r.returncode == 0, r.stderr
    assert len(shim_entries(m)) == 2, "a changed header must give another key"
    assert out.read_bytes() != first, "the new cubin is compiled from the new header"
    assert m.stats()["compiles_total"] == 2
    flags = [(m.mnt / "kcachefs-nvcc" / e / "kernel.flags").read_text() for e in shim_entries(m)]
    assert all(f.startswith("# kcachefs-nvcc: ") and "# include-root " in f and
               " %s\n" % inc in f for f in flags)


def header_tree(base, mtime=None, scale="x * static_cast<float>(N)"):
    """A copy of the sample include tree under base (its own bytes, new files), with
    mtime (seconds) set on every file when given; returns the include directory."""
    inc = base / "include"
    shutil.copytree(KERNELS / "include", inc)
    header = inc / "kc_test" / "scale.cuh"
    header.write_text(header.read_text().replace("x * static_cast<float>(N)", scale))
    for f in inc.rglob("*"):
        if mtime is not None and f.is_file():
            os.utime(f, (mtime, mtime))
    return inc


def kernel_source(tmp_path, i=0):
    """A DeepGEMM-like kernel source alone in a directory of its own."""
    d = Path(tempfile.mkdtemp(dir=tmp_path))
    (d / "k.cu").write_text(TEMPLATE % (i, 3))
    return d / "k.cu"


def test_same_headers_at_two_prefixes_one_compile(mount_factory, counting_nvcc, tmp_path):
    """A key is made of bytes. Two users' copies of one header tree (other paths,
    other mtimes): one compile, one entry, byte-identical cubins. The tree touched, and
    reinstalled with the same bytes: no compile."""
    make_nvcc, calls = counting_nvcc
    m = mount_factory(["nvcc=%s" % make_nvcc()])
    a = header_tree(tmp_path / "alice" / "site-packages" / "deep_gemm", mtime=1000000000)
    b = header_tree(tmp_path / "bob" / "venv" / "lib" / "deep_gemm", mtime=1700000000)
    outs = []
    for who, inc in (("a", a), ("b", b)):
        out = m.mnt / ("%s.cubin" % who)
        r = shim([kernel_source(tmp_path), "-cubin", "-o", out, "-arch=sm_90a", "-I", inc])
        assert r.returncode == 0 and r.stderr == "", r.stderr
        outs.append(out.read_bytes())
    assert outs[0] == outs[1] and "scale_0" in elf_symbols(outs[0])
    assert calls() == 1 and len(shim_entries(m)) == 1, "one compile for the same bytes"
    flags = (m.mnt / "kcachefs-nvcc" / shim_entries(m)[0] / "kernel.flags").read_text()
    assert "# include-root " in flags and "mtime" not in flags
    # touched (pip's install time), then reinstalled: the same bytes, no compile
    for f in b.rglob("*"):
        os.utime(f, None)
    shutil.rmtree(a)
    header_tree(a.parent)
    for who, inc in (("a2", a), ("b2", b)):
        out = m.mnt / ("%s.cubin" % who)
        r = shim([kernel_source(tmp_path), "-cubin", "-o", out, "-arch=sm_90a", "-I", inc])
        assert r.returncode == 0 and r.stderr == "", r.stderr
        assert out.read_bytes() == outs[0]
    assert calls() == 1 and len(shim_entries(m)) == 1


def test_shared_mount_two_users_copies_one_compile(public_mount_factory, counting_nvcc):
    """On a shared mount the second user's own copy of the headers (another path, another
    owner) finds the entry the first user staged, which it cannot write: no compile."""
    make_nvcc, calls = counting_nvcc
    m = public_mount_factory(["allow_other", "nvcc=%s" % make_nvcc()])
    work = m.mnt / "work"
    work.mkdir()
    os.chmod(work, 0o1777)
    homes = Path(tempfile.mkdtemp(prefix="kcachefs-homes-"))  # off the mount, all may read
    try:
        os.chmod(homes, 0o755)
        srcs = {}
        for who in ("root", "nobody"):
            d = homes / who
            inc = header_tree(d / "pkg")
            (d / "src").mkdir()
            (d / "src" / "k.cu").write_text(TEMPLATE % (0, 3))
            srcs[who] = (d / "src" / "k.cu", inc)
            for p in [d] + list(d.rglob("*")):
                os.chmod(p, 0o755 if p.is_dir() else 0o644)
                if who == "nobody":
                    os.chown(p, 65534, 65534)
        src, inc = srcs["root"]
        r = shim([src, "-cubin", "-o", work / "root.cubin", "-arch=sm_90a", "-I", inc])
        assert r.returncode == 0 and r.stderr == "", r.stderr
        src, inc = srcs["nobody"]
        r = as_nobody([SHIM, src, "-cubin", "-o", work / "n.cubin", "-arch=sm_90a", "-I", inc])
        assert r.returncode == 0 and r.stderr == "", r.stderr
        assert (work / "n.cubin").read_bytes() == (work / "root.cubin").read_bytes()
        assert calls() == 1 and len(shim_entries(m)) == 1
    finally:
        shutil.rmtree(homes)


def test_one_header_byte_differs_both_compile(mount_factory, counting_nvcc, tmp_path):
    """sccache 2863's case: stripping paths must not hand one tree's cubin to another whose
    header differs. Each gets the cubin of its own bytes, as nvcc makes it."""
    make_nvcc, calls = counting_nvcc
    m = mount_factory(["nvcc=%s" % make_nvcc()])
    a = header_tree(tmp_path / "a", mtime=1000000000)
    b = header_tree(tmp_path / "b", mtime=1000000000, scale="x * static_cast<float>(M)")
    b_header = b / "kc_test" / "scale.cuh"
    b_header.write_text(b_header.read_text().replace("template <int N>", "template <int M>"))
    os.utime(b_header, (1000000000, 1000000000))
    got = {}
    for who, inc in (("a", a), ("b", b), ("a", a), ("b", b)):
        out = m.mnt / ("%s.cubin" % who)
        src = kernel_source(tmp_path)
        r = shim([src, "-cubin", "-o", out, "-arch=sm_90a", "-I", inc])
        assert r.returncode == 0 and r.stderr == "", r.stderr
        want = tmp_path / ("%s-nvcc.cubin" % who)
        if who not in got:
            assert nvcc([src, "-cubin", "-o", want, "-arch=sm_90a", "-I", inc]).returncode == 0
        got[who] = out.read_bytes()
        assert got[who] == want.read_bytes(), "%s got another tree's cubin" % who
    assert calls() == 2 and len(shim_entries(m)) == 2


def test_header_edited_with_size_and_mtime_kept_compiles(mount_factory, counting_nvcc, tmp_path):
    """An edit that keeps the header's size and mtime (rsync -t, touch -r) is a new key:
    a compile, never the old cubin."""
    make_nvcc, calls = counting_nvcc
    m = mount_factory(["nvcc=%s" % make_nvcc()])
    inc = header_tree(tmp_path, scale="x * static_cast<float>(N) + 1.0f")
    header = inc / "kc_test" / "scale.cuh"
    src = kernel_source(tmp_path)
    args = [src, "-cubin", "-o", m.mnt / "k.cubin", "-arch=sm_90a", "-I", inc]
    assert shim(args).returncode == 0
    first = (m.mnt / "k.cubin").read_bytes()
    st = header.stat()
    text = header.read_text().replace("+ 1.0f", "+ 2.0f")
    header.write_text(text)
    os.utime(header, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert header.stat().st_size == st.st_size and header.stat().st_mtime_ns == st.st_mtime_ns
    r = shim(args)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert calls() == 2 and len(shim_entries(m)) == 2
    assert (m.mnt / "k.cubin").read_bytes() != first
    want = tmp_path / "want.cubin"
    assert nvcc([src, "-cubin", "-o", want, "-arch=sm_90a", "-I", inc]).returncode == 0
    assert (m.mnt / "k.cubin").read_bytes() == want.read_bytes()


def test_lineinfo_keeps_paths_in_the_key(mount_factory, counting_nvcc, tmp_path):
    """-lineinfo writes the header paths into the cubin: a relocated tree compiles, and each
    cubin names its own tree."""
    make_nvcc, calls = counting_nvcc
    m = mount_factory(["nvcc=%s" % make_nvcc()])
    outs = {}
    for who in ("first", "second"):
        inc = header_tree(tmp_path / who)
        out = m.mnt / ("%s.cubin" % who)
        r = shim([kernel_source(tmp_path), "-cubin", "-o", out, "-arch=sm_90a", "-lineinfo",
                  "-I", inc])
        assert r.returncode == 0 and r.stderr == "", r.stderr
        outs[who] = out.read_bytes()
        assert str(inc).encode() in outs[who], "nvcc writes the header's path"
    assert calls() == 2 and len(shim_entries(m)) == 2
    assert str(tmp_path / "first").encode() not in outs["second"]


@pytest.mark.parametrize("target", [
    ["-gencode", "arch=compute_100a,code=sm_100a"],
    ["--generate-code=arch=compute_120f,code=[sm_120f]"],
    ["--gpu-architecture=sm_100a"],
    ["-arch=sm_120f"],
])
def test_blackwell_targets_go_through_the_mount(mount_factory, counting_nvcc, tmp_path, target):
    """One -gencode pair and the family or architecture-specific targets are the
    mount's, keyed by the exact target; the cubin is nvcc's own."""
    make_nvcc, calls = counting_nvcc
    m = mount_factory(["nvcc=%s" % make_nvcc()])
    inc = header_tree(tmp_path)
    src = kernel_source(tmp_path)
    out = m.mnt / "k.cubin"
    r = shim([src, "-cubin", "-o", out, "-I", inc] + target)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert calls() == 1 and len(shim_entries(m)) == 1
    want = tmp_path / "want.cubin"
    assert nvcc([src, "-cubin", "-o", want, "-I", inc] + target).returncode == 0
    assert out.read_bytes() == want.read_bytes()


def test_several_targets_go_to_nvcc_with_the_reason(mount_factory, tmp_path):
    m = mount_factory()
    src = lonely(tmp_path)
    for target, reason in (
            (["-gencode", "arch=compute_90a,code=sm_90a", "-gencode",
              "arch=compute_100a,code=sm_100a"], "2 -gencode targets"),
            (["-gencode", "arch=compute_100a,code=[sm_100a,compute_100a]"], "PTX as well")):
        out = m.mnt / "k.cubin"
        r = shim([src, "-cubin", "-o", out] + target)
        # nvcc's own answer to a cubin with several targets, and the shim's reason
        assert reason in r.stderr and "compiling with" in r.stderr, r.stderr
    assert shim_entries(m) == [] and m.stats()["compiles_total"] == 0


def key_entry(m1, args):
    """Run the shim once on a scratch mount to learn the entry (name, kernel.flags bytes)
    it uses for args."""
    r = shim(args)
    assert r.returncode == 0, r.stderr
    entry, = shim_entries(m1)
    return entry, (m1.mnt / "kcachefs-nvcc" / entry / "kernel.flags").read_bytes()


def test_an_entry_holding_other_bytes_is_not_trusted(mount_factory, tmp_path):
    """Someone staged another source under the name the shim computes: the shim says so and
    compiles the caller's source with nvcc, never handing back the other cubin."""
    src = lonely(tmp_path)
    m1 = mount_factory(name="learn")
    entry, flags = key_entry(m1, [src, "-cubin", "-o", m1.mnt / "v.cubin", "-arch=sm_90a"])
    m2 = mount_factory(name="poisoned")
    bad = m2.mnt / "kcachefs-nvcc" / entry
    bad.mkdir(parents=True)
    (bad / "kernel.flags").write_bytes(flags)
    (bad / "kernel.cu").write_bytes((KERNELS / "saxpy.cu").read_bytes())
    out = m2.mnt / "v.cubin"
    r = shim([src, "-cubin", "-o", out, "-arch=sm_90a"])
    assert r.returncode == 0, r.stderr
    assert "holds another source" in r.stderr and "compiling with" in r.stderr
    data = out.read_bytes()
    assert "vector_add" in elf_symbols(data) and "saxpy" not in elf_symbols(data)


def test_a_planted_client_cubin_is_never_served(mount_factory, tmp_path):
    """The right source and another kernel's cubin planted under the shim's key (a client
    may publish a cubin into an entry without a recipe): the mount refuses to give that
    entry a recipe, and the shim compiles the caller's source itself."""
    src = lonely(tmp_path)
    m1 = mount_factory(name="learn")
    entry, flags = key_entry(m1, [src, "-cubin", "-o", m1.mnt / "v.cubin", "-arch=sm_90a"])
    other = (m1.mnt / "kcachefs-nvcc" / entry / "kernel.cubin").read_bytes()
    shutil.copy(KERNELS / "saxpy.cu", tmp_path / "s.cu")
    assert shim([tmp_path / "s.cu", "-cubin", "-o", tmp_path / "s.cubin", "-arch=sm_90a"]).returncode == 0
    saxpy = (tmp_path / "s.cubin").read_bytes()
    m2 = mount_factory(name="planted")
    bad = m2.mnt / "kcachefs-nvcc" / entry
    bad.mkdir(parents=True)
    (bad / "kernel.cu").write_bytes(src.read_bytes())
    (bad / "kernel.cubin").write_bytes(saxpy)  # a client publish: allowed, no recipe yet
    out = m2.mnt / "v.cubin"
    r = shim([src, "-cubin", "-o", out, "-arch=sm_90a"])
    assert r.returncode == 0, r.stderr
    assert "compiling with" in r.stderr, r.stderr
    data = out.read_bytes()
    assert "vector_add" in elf_symbols(data) and "saxpy" not in elf_symbols(data)
    assert (bad / "kernel.cubin").read_bytes() == saxpy, "the client's cubin stays as it was"
    assert not (bad / "kernel.flags").exists(), "no recipe was given to that entry"
    assert other != saxpy


def as_nobody(args):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd="/",
                          preexec_fn=lambda: (os.setgid(65534), os.setuid(65534)))


def test_shared_mount_two_users_one_compile(public_mount_factory, counting_nvcc):
    """With allow_other, a second user's shim finds the entry the first user staged (the
    kcachefs-nvcc directory is sticky and writable by all) and compiles nothing."""
    make_nvcc, calls = counting_nvcc
    m = public_mount_factory(["allow_other", "nvcc=%s" % make_nvcc()])  # run by the daemon
    work = m.mnt / "work"
    for d in ("work", "work/a", "work/b", "work/out"):
        (m.mnt / d).mkdir()
        os.chmod(m.mnt / d, 0o1777)
    src = work / "a" / "k.cu"
    shutil.copy(KERNELS / "vector_add.cu", src)
    os.chmod(src, 0o644)
    assert shim([src, "-cubin", "-o", work / "out" / "root.cubin", "-arch=sm_90a"]).returncode == 0
    assert (m.mnt / "kcachefs-nvcc").stat().st_mode & 0o7777 == 0o1777
    r = as_nobody([SHIM, src, "-cubin", "-o", work / "out" / "nobody.cubin", "-arch=sm_90a"])
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert (work / "out" / "nobody.cubin").read_bytes() == (work / "out" / "root.cubin").read_bytes()
    assert (work / "out" / "nobody.cubin").stat().st_uid == 65534
    assert calls() == 1 and len(shim_entries(m)) == 1
    # The second user's own new kernel gets its own entry in the shared directory.
    src2 = work / "b" / "k2.cu"
    shutil.copy(KERNELS / "saxpy.cu", src2)
    os.chmod(src2, 0o644)
    r = as_nobody([SHIM, src2, "-cubin", "-o", work / "out" / "n2.cubin", "-arch=sm_90a"])
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert calls() == 2 and len(shim_entries(m)) == 2


def test_the_key_names_the_mounts_compiler(mount_factory, tmp_path):
    """The mount compiles with its own compiler: the key names that one, not whatever the
    caller's CUDA_HOME points at."""
    m = mount_factory()
    info = [l for l in (m.mnt / ".kcachefs" / "metrics.prom").read_text().splitlines()
            if l.startswith("kcachefs_info{")]
    nvcc_digest = hashlib.sha256(Path(os.path.realpath(NVCC)).read_bytes()).hexdigest()
    assert len(info) == 1 and 'compiler="Build ' in info[0], info  # nvcc's --version line
    assert "sha256:%s" % nvcc_digest in info[0] and str(NVCC) not in info[0], info
    r = shim([lonely(tmp_path), "-cubin", "-o", m.mnt / "v.cubin", "-arch=sm_90a"])
    assert r.returncode == 0, r.stderr
    flags = (m.mnt / "kcachefs-nvcc" / shim_entries(m)[0] / "kernel.flags").read_text()
    compiler = info[0].split('compiler="')[1].split('"')[0]
    assert flags.splitlines()[0] == "# kcachefs-nvcc: " + compiler


def test_calls_the_mount_cannot_serve_go_to_nvcc(mount_factory, tmp_path):
    m = mount_factory()
    # A header next to the source, included with quotes: nvcc finds it there only.
    local = m.mnt / "local"
    local.mkdir()
    (local / "helper.cuh").write_text("#define KC_SCALE 3.0f\n")
    (local / "k.cu").write_text('#include "helper.cuh"\n' + (KERNELS / "vector_add.cu").read_text())
    r = shim([local / "k.cu", "-cubin", "-o", local / "k.cubin", "-arch=sm_90a"])
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert "vector_add" in elf_symbols((local / "k.cubin").read_bytes())
    # An output that is a symbolic link: nvcc writes through it.
    target = tmp_path / "target.cubin"
    target.write_bytes(b"")
    (m.mnt / "link.cubin").symlink_to(target)
    r = shim([KERNELS / "vector_add.cu", "-cubin", "-o", m.mnt / "link.cubin", "-arch=sm_90a"])
    assert r.returncode == 0, r.stderr
    assert (m.mnt / "link.cubin").is_symlink() and target.read_bytes()[:4] == b"\x7fELF"
    # A missing source: nvcc's own error and status.
    a = shim([m.mnt / "none.cu", "-cubin", "-o", m.mnt / "none.cubin", "-arch=sm_90a"])
    b = nvcc([m.mnt / "none.cu", "-cubin", "-o", m.mnt / "none.cubin", "-arch=sm_90a"])
    assert (a.returncode, a.stderr) == (b.returncode, b.stderr) and a.returncode != 0
    assert shim_entries(m) == [] and m.stats()["compiles_total"] == 0


def test_a_shim_that_would_run_itself_stops(tmp_path):
    loop = tmp_path / "bin"
    loop.mkdir()
    shutil.copy(SHIM, loop / "nvcc")
    for env in ({"KCACHEFS_NVCC": str(SHIM)},
                {"PATH": "%s:%s" % (loop, os.environ["PATH"]), "CUDA_HOME": "/nonexistent",
                 "KCACHEFS_NVCC": ""}):
        r = shim(["--version"], env=env, timeout=20)
        assert r.returncode == 1 and "kcachefs-nvcc again" in r.stderr, (env, r)


def test_kcachefs_mount_variable(mount_factory, tmp_path):
    m = mount_factory()
    out = tmp_path / "v.cubin"
    args = [lonely(tmp_path), "-cubin", "-o", out, "-arch=sm_90a"]
    r = shim(args, env={"KCACHEFS_MOUNT": str(m.mnt)})
    assert r.returncode == 0, r.stderr
    assert len(shim_entries(m)) == 1 and m.stats()["compiles_total"] == 1
    assert out.read_bytes() == (m.mnt / "kcachefs-nvcc" / shim_entries(m)[0] / "kernel.cubin").read_bytes()
    out.unlink()
    r = shim(args, env={"KCACHEFS_MOUNT": str(tmp_path)})
    assert r.returncode == 0 and "is not the root of a kcachefs mount" in r.stderr
    assert "compiling with" in r.stderr and out.read_bytes()[:4] == b"\x7fELF"
    assert m.stats()["compiles_total"] == 1, "nvcc compiled it, not the mount"


def test_a_compile_that_times_out_says_why(mount_factory, tmp_path):
    """A compile the mount gave up on (killed at compile_timeout) is no verdict on the
    source: the shim says so and nvcc compiles it."""
    hang = write_script(tmp_path / "nvcc-hang",
                        'case "$*" in *-cubin*) sleep 30;; esac\nexec %s "$@"\n' % NVCC)
    m = mount_factory(["nvcc=%s" % hang, "compile_timeout=1"])
    out = m.mnt / "v.cubin"
    r = shim([lonely(tmp_path), "-cubin", "-o", out, "-arch=sm_90a"], timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stderr.startswith("kcachefs-nvcc: warning: the mount's compile of ") and \
        "failed (see its kernel.log)" in r.stderr, r.stderr
    assert "vector_add" in elf_symbols(out.read_bytes())


def test_environment_nvcc_reads_and_odd_inputs_are_nvccs(mount_factory, tmp_path):
    """NVCC_APPEND_FLAGS and the like change what nvcc compiles in ways the mount cannot see;
    an empty source, an include directory on the mount itself: nvcc's business too."""
    m = mount_factory()
    src = tmp_path / "f.cu"
    src.write_text('#ifndef FACTOR\n#define FACTOR 1\n#endif\n'
                   'extern "C" __global__ void f(float *o) { o[0] = FACTOR * 1.5f; }\n')
    out = m.mnt / "f.cubin"
    r = shim([src, "-cubin", "-o", out, "-arch=sm_90a"], env={"NVCC_APPEND_FLAGS": "-DFACTOR=9"})
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert struct.pack("<f", 13.5) in out.read_bytes(), "NVCC_APPEND_FLAGS was applied"
    empty = tmp_path / "e.cu"
    empty.write_bytes(b"")
    for _ in range(3):
        r = shim([empty, "-cubin", "-o", m.mnt / "e.cubin", "-arch=sm_90a"])
        assert r.returncode == 0, r.stderr
    inc = m.mnt / "inc"
    inc.mkdir()
    r = shim([KERNELS / "vector_add.cu", "-cubin", "-o", m.mnt / "v.cubin", "-arch=sm_90a",
              "-I", inc])
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert shim_entries(m) == [] and m.stats()["compiles_total"] == 0


def test_links_and_foreign_directories_are_not_followed(mount_factory, tmp_path):
    """In a shared kcachefs-nvcc/ another user could plant a symbolic link where an entry
    goes (to a directory, or a filesystem, of their own) or own the directory itself: the
    shim follows neither, writes nothing there, and compiles with nvcc."""
    src = lonely(tmp_path)
    m1 = mount_factory(name="learn")
    entry, _ = key_entry(m1, [src, "-cubin", "-o", m1.mnt / "v.cubin", "-arch=sm_90a"])
    m = mount_factory(name="planted")
    (m.mnt / "kcachefs-nvcc").mkdir(mode=0o1777)
    trap = tmp_path / "trap"
    trap.mkdir()
    # The mount refuses a link named like an entry; the shim does not follow one either
    # (planted behind the mount here, as an older kcachefs would have let it be).
    with pytest.raises(OSError) as e:
        (m.mnt / "kcachefs-nvcc" / entry).symlink_to(trap)
    assert e.value.errno == errno.EINVAL
    (m.backing / "kcachefs-nvcc" / entry).symlink_to(trap)
    out = m.mnt / "v.cubin"
    r = shim([src, "-cubin", "-o", out, "-arch=sm_90a"])
    assert r.returncode == 0 and "compiling with" in r.stderr, r.stderr
    assert os.listdir(trap) == [], "nothing is staged through the link"
    assert "vector_add" in elf_symbols(out.read_bytes())
    # kcachefs-nvcc/ itself owned by another user: not trusted.
    m2 = mount_factory(name="foreign")
    (m2.mnt / "kcachefs-nvcc").mkdir()
    os.chown(m2.mnt / "kcachefs-nvcc", 65534, 65534)
    r = shim([src, "-cubin", "-o", m2.mnt / "v.cubin", "-arch=sm_90a"])
    assert r.returncode == 0 and "not owned by root or you" in r.stderr, r.stderr
    assert os.listdir(m2.mnt / "kcachefs-nvcc") == []


def test_more_calls_only_nvcc_can_reproduce(mount_factory, tmp_path):
    """Headers next to the source however they are included, nvcc.profile's variables,
    an include tree that reaches into the mount, an output that is a file of an entry."""
    m = mount_factory()
    d = tmp_path / "src"
    d.mkdir()
    (d / "h.cuh").write_text("#define KN 7.0f\n")
    (d / "k.cu").write_text('#define HDR "h.cuh"\n#include HDR\n'
                            'extern "C" __global__ void k(float *o) { o[0] = KN; }\n')
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "h.cuh").write_text("#define KN 5.0f\n")
    out = m.mnt / "k.cubin"
    r = shim([d / "k.cu", "-cubin", "-o", out, "-arch=sm_90a", "-I", inc])
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert struct.pack("<f", 7.0) in out.read_bytes(), "the header beside the source"
    src = lonely(tmp_path)
    r = shim([src, "-cubin", "-o", out, "-arch=sm_90a"], env={"INCLUDES": "-DKC_X=1"})
    assert r.returncode == 0 and r.stderr == "", r.stderr
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "into-the-mount").symlink_to(m.mnt)
    r = shim([src, "-cubin", "-o", out, "-arch=sm_90a", "-I", linked])
    assert r.returncode == 0 and "reaches into the mount" in r.stderr, r.stderr
    e = m.stage("vector_add", *sample("vector_add"))
    r = shim([src, "-cubin", "-o", e / "kernel.cubin", "-arch=sm_90a"])
    assert r.returncode == nvcc([src, "-cubin", "-o", e / "kernel.cubin", "-arch=sm_90a"]).returncode
    assert shim_entries(m) == [] and m.stats()["compiles_total"] <= 1


def old_shim_flags(compiler, inc):
    """kernel.flags as the shim staged it before keys were made of bytes: the include tree fingerprinted by
    path, size and mtime, the key v1 over these exact bytes."""
    lines = []
    for f in sorted(p for p in inc.rglob("*") if p.is_file()):
        st = f.stat()
        lines.append("%s %d %d%09d\n" % (str(f)[len(str(inc)):], st.st_size,
                                          st.st_mtime_ns // 10**9, st.st_mtime_ns % 10**9))
    fp = hashlib.sha256("".join(sorted(lines)).encode()).hexdigest()
    return ("# kcachefs-nvcc: %s\n# include-tree %s %s\n--kcachefs-compiler=nvcc\n-I%s\n"
            "-arch=sm_90a\n" % (compiler, inc, fp, inc)).encode()


def key_v1(source, flags):
    h = hashlib.sha256(b"kcachefs-key-v1\n")
    for part in (source, flags):
        h.update(b"%d\n" % len(part) + part + b"\n")
    return h.hexdigest()


def test_upgrade_from_path_keys_no_client_sees_an_error(mount_factory, counting_nvcc,
                                                        tmp_path):
    """The upgrade of keys: an entry the old shim staged (key v1 over path and mtime
    fingerprints) stays valid under its old name across a restart, compiles nothing, and is
    never served under a new key: the new shim's call compiles under its own name (not
    migrated), and every call and open succeeds."""
    make_nvcc, calls = counting_nvcc
    opts = ["nvcc=%s" % make_nvcc(), "verify_keys"]
    m = mount_factory(opts)
    info = [l for l in (m.mnt / ".kcachefs" / "metrics.prom").read_text().splitlines()
            if l.startswith("kcachefs_info{")][0]
    compiler = info.split('compiler="')[1].split('"')[0]
    inc = header_tree(tmp_path / "pkg")
    src = kernel_source(tmp_path)
    flags = old_shim_flags(compiler, inc)
    old = m.mnt / "kcachefs-nvcc" / ("kernel.nvcc." + key_v1(src.read_bytes(), flags))
    old.mkdir(parents=True)
    (old / "kernel.flags").write_bytes(flags)
    (old / "kernel.cu").write_bytes(src.read_bytes())
    before = (old / "kernel.cubin").read_bytes()
    assert calls() == 1 and "scale_0" in elf_symbols(before)
    m.stop()
    m = mount_factory(opts)  # the upgraded daemon on the same backing directory
    assert (old / "kernel.cubin").read_bytes() == before and calls() == 1
    out = m.mnt / "new.cubin"
    r = shim([src, "-cubin", "-o", out, "-arch=sm_90a", "-I", inc])
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert calls() == 2, "the new key is compiled once, not served from the old entry"
    new, = [e for e in shim_entries(m) if e != old.name]
    assert new != old.name and out.read_bytes() == before  # same bytes, compiled again
    assert (old / "kernel.cubin").read_bytes() == before
    assert m.stats()["compile_failures_total"] == 0


def test_an_entry_claiming_another_trees_bytes_is_never_compiled(mount_factory, counting_nvcc,
                                                                 tmp_path):
    """The digest of an include root replaces its path in the key: an entry that names the
    right digest but points -I at other bytes has the honest key. The daemon takes the
    digest again before compiling and refuses it (EIO, the reason in kernel.log); the honest
    caller gets nvcc's cubin of its own headers, never one of the other tree."""
    make_nvcc, calls = counting_nvcc
    good = header_tree(tmp_path / "good")
    evil = header_tree(tmp_path / "evil", scale="x / static_cast<float>(N)")
    src = kernel_source(tmp_path)
    opts = ["nvcc=%s" % make_nvcc()]  # one compiler: one key on both mounts
    m1 = mount_factory(opts, name="learn")
    entry, flags = key_entry(m1, [src, "-cubin", "-o", m1.mnt / "k.cubin", "-arch=sm_90a",
                                  "-I", good])
    assert calls() == 1
    m2 = mount_factory(opts, name="claimed")
    bad = m2.mnt / "kcachefs-nvcc" / entry
    bad.mkdir(parents=True)
    (bad / "kernel.flags").write_bytes(flags.replace(str(good).encode(), str(evil).encode()))
    (bad / "kernel.cu").write_bytes(src.read_bytes())
    with pytest.raises(OSError) as e:
        (bad / "kernel.cubin").read_bytes()
    assert e.value.errno == errno.EIO
    assert "no longer the bytes kernel.flags names" in (bad / "kernel.log").read_text()
    assert calls() == 1, "the claimed recipe was compiled"
    out = m2.mnt / "k.cubin"
    r = shim([src, "-cubin", "-o", out, "-arch=sm_90a", "-I", good])
    assert r.returncode == 0 and "compiling with" in r.stderr, r.stderr
    want = tmp_path / "want.cubin"
    assert nvcc([src, "-cubin", "-o", want, "-arch=sm_90a", "-I", good]).returncode == 0
    assert out.read_bytes() == want.read_bytes() and calls() == 1
    assert shim_entries(m2) == [entry], "the honest call uses the entry of its key"


def test_the_shim_remembers_file_digests_and_a_lying_memo_serves_nothing(mount_factory,
                                                                         tmp_path):
    """The shim keeps each header's digest under its inode, size, mtime and ctime
    ($XDG_CACHE_HOME/kcachefs-nvcc/tree-memo), so a later call stats the tree instead of
    reading it. A memo that lies (a wrong digest under the right stamps) only names bytes
    the tree does not hold: the daemon's own check refuses the compile, and the caller gets
    nvcc's cubin of its own headers."""
    m = mount_factory()
    memo = Path(os.environ["XDG_CACHE_HOME"]) / "kcachefs-nvcc" / "tree-memo"
    if memo.exists():
        memo.unlink()
    inc = header_tree(tmp_path / "pkg")
    time.sleep(0.05)  # the headers' ctimes behind the clock: memoizable
    src = kernel_source(tmp_path)
    args = [src, "-cubin", "-o", m.mnt / "k.cubin", "-arch=sm_90a", "-I", inc]
    r = shim(args)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    header = inc / "kc_test" / "scale.cuh"
    st = header.stat()
    lines = memo.read_text().splitlines()
    mine = [l for l in lines if l.split()[:2] == [str(st.st_dev), str(st.st_ino)]]
    assert len(mine) == 1 and mine[0].split()[-1] == hashlib.sha256(header.read_bytes()).hexdigest()
    assert oct(memo.stat().st_mode & 0o777) == "0o600"
    memo.write_text("\n".join(l if l not in mine else l[:-64] + "0" * 64 for l in lines) + "\n")
    os.chmod(memo, 0o600)
    src2 = kernel_source(tmp_path, 1)
    out = m.mnt / "k1.cubin"
    r = shim([src2, "-cubin", "-o", out, "-arch=sm_90a", "-I", inc])
    assert r.returncode == 0 and "compiling with" in r.stderr, r.stderr
    want = tmp_path / "want.cubin"
    assert nvcc([src2, "-cubin", "-o", want, "-arch=sm_90a", "-I", inc]).returncode == 0
    assert out.read_bytes() == want.read_bytes()
