"""The evidence a node checks before it takes another node's cubin, with the compiler as
the oracle (doc/cluster.md, "What a key and its evidence cover").

Node A compiles a kernel with real nvcc and shares it through a dir: store. Then, for each
mutation of the tree (the -I directories, the toolkit, the host compiler, the daemon's
environment), at the same paths, a fresh node B (remote_mode=ro, so that it stores
nothing) opens the same kernel, and a node C with no store compiles it: C's bytes are what
B's own compiler makes. B must take A's cubin only where C's bytes are A's (else a false
hit: a wrong cubin), and should where they are (else a false miss: a compile too many).
The nodes are one machine at three moments; the toolkit is a copy of the real one, made
once for the module (real bytes, not hard links: a link made or removed moves the ctime
of the real toolkit's files, which a compile running meanwhile takes for a change), and
every mutation replaces a file there, which the next case's tree puts back.
"""
import mmap
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kcmount import KCACHEFS, NVCC, SHIM, Mount, read_result, wait_until

SOURCE = b"""#include <kc_a.h>
#if __has_include(<kc_opt.h>)
#include <kc_opt.h>
#endif
#ifndef KC_OPT
#define KC_OPT 1
#endif
#if __has_include(<kc_gone.h>)
#include <kc_gone.h>
#endif
#ifndef KC_GONE
#define KC_GONE 1
#endif
#include <kc_next.h>
#include <kc_link.h>
#ifndef KC_PROF
#define KC_PROF 0
#endif
#ifndef KC_TKHDR
#define KC_TKHDR 0
#endif
#ifndef KC_HOST
#define KC_HOST 0
#endif
#ifndef KC_ENV
#define KC_ENV 0
#endif
extern "C" __global__ void k(int *x)
{
    x[0] = KC_A; x[1] = KC_OPT; x[2] = KC_GONE; x[3] = KC_NEXT; x[4] = KC_LINK;
    x[5] = KC_PROF; x[6] = KC_TKHDR; x[7] = KC_HOST; x[8] = KC_ENV;
}
"""

TOOLKIT = Path(NVCC).resolve().parent.parent


def replace(path, data, mode=0o644):
    """Put data at path by a rename (a new inode: the next case's tree puts the file back)."""
    tmp = path.with_name(path.name + ".kc-new")
    tmp.write_bytes(data)
    os.chmod(tmp, mode)
    if path.is_symlink() or path.is_file():
        path.unlink()
    os.rename(tmp, path)


def copy_toolkit(dst):
    """A copy of the toolkit nvcc needs (bin, nvvm, the headers)."""
    dst.mkdir()
    for part in ("bin", "nvvm", "include", "targets"):
        if (TOOLKIT / part).exists():
            subprocess.run(["cp", "-a", str(TOOLKIT / part), str(dst / part)], check=True)


@pytest.fixture(scope="module")
def toolkit(tmp_path_factory):
    d = tmp_path_factory.mktemp("toolkit")
    os.chmod(d, 0o755)
    copy_toolkit(d / "tk")
    return d / "tk"


class Tree:
    """The tree a compile sees, rebuilt at the same paths before each case."""

    def __init__(self, root, tk):
        self.root = root
        self.tk = tk
        self.inc = [root / "inc1", root / "inc2", root / "inc3"]
        self.nvcc = self.tk / "bin" / "nvcc"
        self.flags = ("-O3\n-std=c++17\n" + "".join("-I%s\n" % d for d in self.inc)).encode()

    def build(self):
        for d in self.inc:
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir()
        i1, i2, i3 = self.inc
        (i1 / "kc_next.h").write_text("#include_next <kc_next.h>\n")
        (i2 / "kc_a.h").write_text("#define KC_A 1\n")
        (i2 / "kc_gone.h").write_text("#define KC_GONE 2\n")
        (i3 / "kc_next.h").write_text("#define KC_NEXT 3\n")
        replace(self.tk / "include" / "kc_linked.h", b"#define KC_LINK 4\n")
        (i2 / "kc_link.h").symlink_to(self.tk / "include" / "kc_linked.h")
        # the toolkit as copied: what earlier cases replaced goes back to the original
        for rel in ("bin/nvcc.profile", "include/cuda_runtime.h", "bin/ptxas"):
            orig = TOOLKIT / rel
            replace(self.tk / rel, orig.read_bytes(), os.stat(orig).st_mode & 0o7777)
        for extra in ("bin/gcc", "include/kc_ts.h", "include/cccl/kcsel"):
            p = self.tk / extra
            if p.is_symlink() or p.exists():
                p.unlink()
        for extra in ("include/kc_v1", "include/kc_v2"):
            shutil.rmtree(self.tk / extra, ignore_errors=True)


def shadow(t):
    (t.inc[0] / "kc_a.h").write_text("#define KC_A 7\n")


def has_include(t):
    (t.inc[1] / "kc_opt.h").write_text("#define KC_OPT 7\n")


def include_next(t):
    (t.inc[1] / "kc_next.h").write_text("#define KC_NEXT 7\n")


def symlink_to_file(t):
    replace(t.inc[1] / "kc_link.h", b"#define KC_LINK 7\n")


def nvcc_profile(t):
    p = t.tk / "bin" / "nvcc.profile"
    replace(p, p.read_bytes() + b'\nINCLUDES += "-DKC_PROF=7" $(_SPACE_)\n')


def toolkit_header(t):
    p = t.tk / "include" / "cuda_runtime.h"
    replace(p, p.read_bytes() + b"\n#define KC_TKHDR 7\n")


def ptxas_swapped(t):
    replace(t.tk / "bin" / "ptxas",
            b'#!/bin/sh\nexec %s "$@" -O0\n' % str(TOOLKIT / "bin" / "ptxas").encode(), 0o755)


def host_compiler(t):
    # nvcc finds the host compiler through PATH, its own directory first
    replace(t.tk / "bin" / "gcc", b'#!/bin/sh\nexec /usr/bin/gcc -DKC_HOST=7 "$@"\n', 0o755)


def header_removed(t):
    (t.inc[1] / "kc_gone.h").unlink()


def header_to_directory(t):
    (t.inc[1] / "kc_gone.h").unlink()
    (t.inc[1] / "kc_gone.h").mkdir()


def unrelated_file(t):
    (t.inc[0] / "kc_unrelated.h").write_text("#define KC_UNRELATED 1\n")


def bytes_changed_stamps_kept(t):
    p = t.inc[1] / "kc_a.h"
    st = os.stat(p)
    with open(p, "r+b") as f:
        f.write(b"#define KC_A 8\n")  # the same size
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))


ENV = {"NVCC_APPEND_FLAGS": "-DKC_ENV=7", "NVCC_PREPEND_FLAGS": "-DKC_ENV=7",
       "CPATH": "/nonexistent-kc", "CPLUS_INCLUDE_PATH": "/nonexistent-kc"}

CASES = [
    ("nothing changed", None, None),
    ("a header of the same name in an earlier -I directory", shadow, None),
    ("__has_include finds a header A's compile did not", has_include, None),
    ("#include_next finds a header between A's two", include_next, None),
    ("a symlink into the toolkit on A, a file of other bytes on B", symlink_to_file, None),
    ("nvcc.profile gains a -D", nvcc_profile, None),
    ("a toolkit header at another version", toolkit_header, None),
    ("ptxas swapped for another build", ptxas_swapped, None),
    ("another host compiler first in nvcc's PATH", host_compiler, None),
    ("a header removed", header_removed, None),
    ("a header replaced by a directory", header_to_directory, None),
    ("a new file in a search directory that no compile names", unrelated_file, None),
    ("a header's bytes changed, size and mtime restored", bytes_changed_stamps_kept, None),
    ("variables nvcc and gcc read, in the daemon's environment", None, ENV),
]


def node(root, name, tree, store=None, env=None):
    opts = ["nvcc=%s" % tree.nvcc, "arch=sm_90a"]
    if store:
        opts += ["remote=dir:%s" % store, "remote_mode=ro"]
    d = root / name
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir()
    full_env = None
    if env:
        full_env = dict(os.environ)
        full_env.update(env)
    return Mount(d, opts, env=full_env).start()


def cubin(m, tree):
    r = m.stage("k", SOURCE, tree.flags) / "kernel.cubin"
    got = read_result(r)
    return got, r


def outcome(m):
    s = m.stats()
    return "fetched" if s["remote_hits_total"] == 1 and s["compiles_total"] == 0 else \
        "compiled" if s["compiles_total"] == 1 else "neither: %s" % s


def report(rows):
    """The table the test prints (pytest -s shows it; a failure shows it too)."""
    out = ["%-62s %-9s %-10s %s" % ("mutation of B's tree", "B", "B's own", "verdict")]
    for name, b, same, verdict in rows:
        out.append("%-62s %-9s %-10s %s" % (name, b, "same" if same else "other", verdict))
    hits = sum(r[3] == "FALSE HIT" for r in rows)
    misses = sum(r[3] == "false miss" for r in rows)
    out.append("false hits: %d, false misses: %d, of %d cases" % (hits, misses, len(rows)))
    return "\n".join(out)


def judge(b, same):
    if b == "fetched":
        return "right" if same else "FALSE HIT"
    if b == "compiled":
        return "false miss" if same else "right"
    return "ERROR"


@pytest.fixture
def setup(tmp_path, toolkit):
    os.chmod(tmp_path, 0o755)
    tree = Tree(tmp_path, toolkit)
    store = tmp_path / "store"
    store.mkdir()
    mounts = []

    def start(*args, **kw):
        m = node(tmp_path, *args, **kw)
        mounts.append(m)
        return m

    try:
        yield tmp_path, tree, store, start
    finally:
        for m in mounts:
            m.stop()
        for m in mounts:
            assert not os.path.ismount(m.mnt), "mount left behind"


def compile_on_a(tree, store, start):
    tree.build()
    a = start("a", tree, store=None)
    a.stop()
    # A shares: a node of its own with the store, read-write
    a = Mount(a.root, ["nvcc=%s" % tree.nvcc, "arch=sm_90a", "remote=dir:%s" % store]).start()
    try:
        got_a, _ = cubin(a, tree)
        assert got_a[0] == "ok", a.daemon_log()
        wait_until(lambda: " stored (" in a.daemon_log(), a.daemon_log, 180)
    finally:
        a.stop()
    return got_a


def test_fetch_only_where_the_compiler_agrees(setup):
    """Every mutation: B takes A's cubin only where its own compile gives A's bytes."""
    tmp, tree, store, start = setup
    got_a = compile_on_a(tree, store, start)
    rows = []
    for i, (name, mutate, env) in enumerate(CASES):
        tree.build()
        if mutate:
            mutate(tree)
        b = start("b%d" % i, tree, store=store, env=env)
        got_b, _ = cubin(b, tree)
        b_did = outcome(b)
        b.stop()
        c = start("c%d" % i, tree, env=env)
        got_c, _ = cubin(c, tree)
        c.stop()
        same = got_c[0] == "ok" and got_c[1] == got_a[1]
        if b_did == "fetched":
            assert got_b == got_a
        elif got_c[0] == "ok":
            assert got_b == got_c, "B's compile is not the oracle's: %s" % name
        rows.append((name, b_did, same, judge(b_did, same)))
    table = report(rows)
    print("\n" + table)
    verdicts = dict((r[0], r[3]) for r in rows)
    assert "FALSE HIT" not in verdicts.values(), table
    assert "ERROR" not in verdicts.values(), table
    # the evidence is not so broad that nothing is shared
    for name in ("nothing changed", "a new file in a search directory that no compile names",
                 "variables nvcc and gcc read, in the daemon's environment"):
        assert verdicts[name] == "right", table


def test_write_through_a_mapping_is_seen(setup):
    """A header written through a shared mapping whose page was dirty already (no stamp
    moves) after B hashed it: B's next fetch sees the new bytes."""
    tmp, tree, store, start = setup
    got_a = compile_on_a(tree, store, start)
    tree.build()
    header = tree.inc[1] / "kc_a.h"
    fd = os.open(header, os.O_RDWR)
    try:
        m = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        m[0:1] = m[0:1]  # the page dirty, its stamps moved once
        b = start("b", tree, store=store)
        # the start check hashed the list (the headers as they are now: A's bytes)
        wait_until(lambda: "is this node's headers" in b.daemon_log(), b.daemon_log, 60)
        before = os.stat(header)
        m[14:15] = b"9"  # "#define KC_A 9": through the dirty page, no stamp moves
        after = os.stat(header)
        assert (before.st_mtime_ns, before.st_ctime_ns) == (after.st_mtime_ns, after.st_ctime_ns)
        got_b, _ = cubin(b, tree)
        b_did = outcome(b)
        b.stop()
        m.flush()
        c = start("c", tree)
        got_c, _ = cubin(c, tree)
        c.stop()
        m.close()
    finally:
        os.close(fd)
    assert got_c[0] == "ok" and got_c[1] != got_a[1]
    assert b_did == "compiled" and got_b == got_c, (b_did, b.daemon_log())


ASSERT_HEADER = b"""#pragma once
#include <cstdio>
/* as DeepGEMM's DG_DEVICE_ASSERT: __FILE__ in device code */
#define KC_DEVICE_ASSERT(c) \\
    do { if (!(c)) printf("assertion failed: %s:%d\\n", __FILE__, __LINE__); } while (0)
__device__ inline void kc_check(int v) { KC_DEVICE_ASSERT(v > 0); }
"""

SHIM_SOURCE = """#include <kc_dg/assert.cuh>
#include <kc_dg/value.cuh>
extern "C" __global__ void k(int *x)
{
    kc_check(x[0]);
    x[1] = KC_VALUE;
}
"""


def site(base, value=1, shadow=False):
    """A DeepGEMM-style install under base: two include roots (the library's headers and
    a second tree searched after it); returns the two include directories."""
    lib, extra = base / "deep_gemm" / "include", base / "third-party" / "include"
    (lib / "kc_dg").mkdir(parents=True)
    (extra / "kc_dg").mkdir(parents=True)
    (lib / "kc_dg" / "assert.cuh").write_bytes(ASSERT_HEADER)
    (extra / "kc_dg" / "value.cuh").write_text("#define KC_VALUE %d\n" % value)
    if shadow:  # a header of the same name in the root searched first
        (lib / "kc_dg" / "value.cuh").write_text("#define KC_VALUE 7\n")
    return lib, extra


def shim_compile(m, tmp, roots, name):
    d = tmp / ("src-" + name)
    d.mkdir()
    (d / "kernel.cu").write_text(SHIM_SOURCE)
    out = m.mnt / ("%s.cubin" % name)
    args = [str(SHIM), str(d / "kernel.cu"), "-cubin", "-o", str(out), "-arch=sm_90a",
            "-std=c++17"]
    for r in roots:
        args += ["-I", str(r)]
    r = subprocess.run(args, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr + m.daemon_log()
    return out.read_bytes()


@pytest.mark.parametrize("key_paths", [False, True])
def test_paths_in_the_cubin_through_the_shim(tmp_path, key_paths):
    """DeepGEMM through the nvcc shim, its headers at another path on node B: a cubin whose
    device code prints __FILE__ names the include root's path. By default B takes A's
    cubin (the difference is that path alone, accepted on purpose), says so in the entry's
    log and its daemon log, and counts it; with -o key_paths B compiles its own, which
    names B's path. A shadowing header in B's first root is never taken from A."""
    os.chmod(tmp_path, 0o755)
    store = tmp_path / "store"
    store.mkdir()
    opts = ["remote=dir:%s" % store, "arch=sm_90a"] + (["key_paths"] if key_paths else [])
    roots_a = site(tmp_path / "venv-a" / "site-packages")
    roots_b = site(tmp_path / "other" / "lib" / "python3" / "site-packages")
    roots_c = site(tmp_path / "venv-c", shadow=True)
    mounts = []
    try:
        for n in ("a", "b", "c"):
            (tmp_path / n).mkdir()
            mounts.append(Mount(tmp_path / n, opts).start())
        a, b, c = mounts
        ca = shim_compile(a, tmp_path, roots_a, "a")
        assert str(roots_a[0]).encode() in ca, "the cubin names A's include root"
        wait_until(lambda: " stored (" in a.daemon_log(), a.daemon_log, 120)
        shutil.rmtree(tmp_path / "venv-a")  # A's paths are A's: not on node B
        cb = shim_compile(b, tmp_path, roots_b, "b")
        sb = b.stats()
        if key_paths:
            assert sb["compiles_total"] == 1 and sb["remote_hits_total"] == 0, sb
            assert str(roots_b[0]).encode() in cb and str(roots_a[0]).encode() not in cb
        else:
            assert cb == ca and sb["remote_hits_total"] == 1 and sb["compiles_total"] == 0
            assert sb["remote_foreign_paths_total"] == 1, sb
            assert "it names %s/kc_dg/assert.cuh, a path of the node that compiled it" % \
                roots_a[0] in b.daemon_log()
        cc = shim_compile(c, tmp_path, roots_c, "c")
        sc = c.stats()
        assert sc["compiles_total"] == 1 and sc["remote_hits_total"] == 0, sc
        assert cc != ca
    finally:
        for m in mounts:
            m.stop()
    for m in mounts:
        assert not os.path.ismount(m.mnt)


def one_case(tmp, tree, name, src, mutate, after_a=None):
    """Node A compiles src and shares it (after_a runs as soon as A's reader has its
    cubin), mutate() changes the tree, a read-only node B opens the same recipe and a node
    C with no store compiles it. Returns (what B did, whether C's bytes are A's, A's log)."""
    store = tmp / ("store-" + name)
    store.mkdir()
    nodes = []

    def start(n, with_store, ro=True):
        opts = ["nvcc=%s" % tree.nvcc, "arch=sm_90a"]
        if with_store:
            opts += ["remote=dir:%s" % store] + (["remote_mode=ro"] if ro else [])
        d = tmp / ("%s-%s" % (n, name))
        d.mkdir()
        m = Mount(d, opts).start()
        nodes.append(m)
        return m

    try:
        a = start("a", True, ro=False)
        got_a = read_result(a.stage("k", src, tree.flags) / "kernel.cubin")
        if after_a:
            after_a()
        assert got_a[0] == "ok", a.daemon_log()
        wait_until(lambda: " stored (" in a.daemon_log() or "not shared" in a.daemon_log(),
                   a.daemon_log, 180)
        a_log = a.daemon_log()
        a.stop()
        mutate()
        b = start("b", True)
        got_b = read_result(b.stage("k", src, tree.flags) / "kernel.cubin")
        b_did = outcome(b)
        b.stop()
        c = start("c", False)
        got_c = read_result(c.stage("k", src, tree.flags) / "kernel.cubin")
        c.stop()
    finally:
        for m in nodes:
            m.stop()
    for m in nodes:
        assert not os.path.ismount(m.mnt), "mount left behind"
    same = got_c[0] == "ok" and got_c[1] == got_a[1]
    if b_did == "fetched":
        assert got_b == got_a
    return b_did, same, a_log


BODY = b'\nextern "C" __global__ void k(int *x) { x[0] = KC_V; }\n'


@pytest.fixture
def tree(tmp_path, toolkit):
    os.chmod(tmp_path, 0o755)
    t = Tree(tmp_path, toolkit)
    t.build()
    return t


def test_a_link_on_a_system_headers_path(tmp_path, tree):
    """cc1plus opens a system header by its canonical name (realpath(3), through readlink):
    a link on the way, re-pointed on B, is in the evidence as the link it read."""
    inc = tree.tk / "include"
    for v in (1, 2):
        (inc / ("kc_v%d" % v)).mkdir()
        (inc / ("kc_v%d" % v) / "kc_sys.h").write_text("#define KC_V %d\n" % v)
    link = inc / "cccl" / "kcsel"
    link.symlink_to("../kc_v1")

    def repoint():
        link.unlink()
        link.symlink_to("../kc_v2")
    b_did, same, _ = one_case(tmp_path, tree, "syslink", b"#include <kcsel/kc_sys.h>" + BODY,
                              repoint)
    assert not same and b_did == "compiled"


def test_a_header_under_dev_shm_is_evidence_and_proc_root_is_refused(tmp_path, tree):
    """/dev/shm holds files like any directory: listed and checked. A header read through
    /proc/self/root (a way to any file) cannot be shown: the compile is not shared."""
    shm = Path("/dev/shm") / ("kc-evidence-%d" % os.getpid())
    shm.mkdir()
    flags = tree.flags
    try:
        os.chmod(shm, 0o755)
        (shm / "kc_s.h").write_text("#define KC_V 1\n")
        tree.flags += b"-I%s\n" % str(shm).encode()
        b_did, same, _ = one_case(tmp_path, tree, "shm", b"#include <kc_s.h>" + BODY,
                                  lambda: (shm / "kc_s.h").write_text("#define KC_V 2\n"))
        assert not same and b_did == "compiled"
    finally:
        shutil.rmtree(shm)
        tree.flags = flags
    px = tmp_path / "px"
    px.mkdir()
    (px / "kc_p.h").write_text("#define KC_V 1\n")
    src = b'#include "/proc/self/root%s"' % str(px / "kc_p.h").encode() + BODY
    b_did, same, a_log = one_case(tmp_path, tree, "procroot", src,
                                  lambda: (px / "kc_p.h").write_text("#define KC_V 2\n"))
    assert not same and b_did == "compiled"
    assert "not shared: the compile read /proc/self/root" in a_log, a_log


def test_a_header_changed_before_the_pass_is_not_shared(tmp_path, tree):
    """A header replaced after A's compile read it, before its dependency pass ran: the
    pass would list bytes the compile did not read. Not shared."""
    h = tree.inc[1] / "kc_r.h"
    h.write_text("#define KC_V 1\n")
    b_did, same, a_log = one_case(tmp_path, tree, "race", b"#include <kc_r.h>" + BODY,
                                  lambda: None,
                                  after_a=lambda: replace(h, b"#define KC_V 2\n"))
    assert not same and b_did == "compiled"
    assert "kc_r.h changed while the compile ran" in a_log, a_log


def test_the_interpreter_of_a_toolchain_script(tmp_path, tree):
    """A host compiler wrapper script's "#!" interpreter is opened by the kernel, not by
    any call of the compile: the tracer lists it, so another interpreter on B is seen."""
    interp = tmp_path / "shell"
    shutil.copy("/bin/dash", interp)
    replace(tree.tk / "bin" / "gcc",
            b'#!%s\nif [ -n "$BASH_VERSION" ]; then X=2; else X=1; fi\n'
            b'exec /usr/bin/gcc -DKC_V=$X "$@"\n' % str(interp).encode(), 0o755)

    def other_shell():
        interp.unlink()
        shutil.copy("/bin/bash", interp)
    b_did, same, _ = one_case(tmp_path, tree, "shebang", BODY, other_shell)
    assert not same and b_did == "compiled"


DEFAULT_V = b"#ifndef KC_V\n#define KC_V 1\n#endif\n"


def test_the_mode_of_a_program_the_toolchain_searches(tmp_path, tree):
    """nvcc's search of PATH for the host compiler passes a file that is not executable:
    a wrapper there made non-executable on B is another lookup's outcome, not the same
    bytes."""
    gcc = tree.tk / "bin" / "gcc"
    replace(gcc, b'#!/bin/sh\nexec /usr/bin/gcc -DKC_V=7 "$@"\n', 0o755)
    b_did, same, _ = one_case(tmp_path, tree, "xbit", DEFAULT_V + BODY,
                              lambda: os.chmod(gcc, 0o644))
    assert not same and b_did == "compiled"


def test_a_header_that_expands_timestamp(tmp_path, tree):
    """__TIMESTAMP__ is the header's mtime: a header whose bytes name it is evidence with
    its mtime (as in ccache's direct mode); touched on B, another outcome."""
    h = tree.tk / "include" / "kc_ts.h"
    h.write_text('static __device__ const char kc_ts[] = __TIMESTAMP__;\n'
                 '#define KC_V kc_ts[x[1]]\n')
    os.utime(h, (1e9, 1e9))
    b_did, same, _ = one_case(tmp_path, tree, "ts", b"#include <kc_ts.h>" + BODY,
                              lambda: os.utime(h, (1.5e9, 1.5e9)))
    assert not same and b_did == "compiled"


def test_a_daemon_without_its_tracer_says_so_and_shares_nothing(tmp_path):
    """kcachefs-trace is found beside the daemon: a daemon installed without it says so at
    start, still compiles, and says why each compile is not shared."""
    os.chmod(tmp_path, 0o755)
    alone = tmp_path / "bin"
    alone.mkdir()
    shutil.copy(KCACHEFS, alone / "kcachefs")
    store = tmp_path / "store"
    store.mkdir()
    (tmp_path / "n").mkdir()
    m = Mount(tmp_path / "n", ["remote=dir:%s" % store, "arch=sm_90a"],
              bin=alone / "kcachefs").start()
    try:
        assert "kcachefs-trace is not next to kcachefs: this node fetches, but shares none" \
            in m.daemon_log()
        got = read_result(m.stage("k", b'extern "C" __global__ void k(int *x) { x[0] = 1; }\n')
                          / "kernel.cubin")
        assert got[0] == "ok", m.daemon_log()
        wait_until(lambda: "not shared: its dependency pass has no tracer" in m.daemon_log(),
                   m.daemon_log, 60)
    finally:
        m.stop()
    assert not os.path.ismount(m.mnt)
