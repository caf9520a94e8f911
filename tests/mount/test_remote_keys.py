"""On the cluster, a key is made of bytes. Simulated nodes (daemons with their own
backing directory and mountpoint sharing one dir: store) run the real nvcc through the
kcachefs-nvcc shim, with DeepGEMM-like kernels that include a header tree through -I.
The same headers at another prefix, with other mtimes, or reinstalled, are one compile in
the cluster; one byte differs, and each node compiles its own."""
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from conftest import KERNELS, NVCC, SHIM, elf_symbols
from kccluster import LISTS_KEY
from kcmount import wait_until

TEMPLATE = """#include <kc_test/scale.cuh>
extern "C" __global__ void scale_%d(const float *in, float *out, int n)
{
	int i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i < n)
		out[i] = kc_scale<%d>(in[i]);
}
"""


def tree(base, mtime=None, scale="x * static_cast<float>(N)"):
    """A copy of the sample include tree under base, readable by all (compiles run as uids
    of their own), every file's mtime set to mtime when given."""
    inc = base / "include"
    shutil.copytree(KERNELS / "include", inc)
    header = inc / "kc_test" / "scale.cuh"
    header.write_text(header.read_text().replace("x * static_cast<float>(N)", scale))
    for p in [base] + list(base.rglob("*")):
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
        if mtime is not None and p.is_file():
            os.utime(p, (mtime, mtime))
    return inc


def compile_on(node, inc, i, tmp_path, extra=()):
    """The shim's compile of kernel i against inc, its output on node's mount: the bytes."""
    d = Path(tempfile.mkdtemp(dir=tmp_path))
    (d / "k.cu").write_text(TEMPLATE % (i, 3))
    out = node.mnt / ("k%d-%s.cubin" % (i, os.urandom(4).hex()))
    r = subprocess.run([str(SHIM), str(d / "k.cu"), "-cubin", "-o", str(out), "-arch=sm_90a",
                        "-I", str(inc)] + list(extra), capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    data = out.read_bytes()
    assert "scale_%d" % i in elf_symbols(data)
    return data


def stored(node, n, timeout=120):
    """Wait until node has stored n kernels (the share follows the publish)."""
    wait_until(lambda: node.daemon_log().count(" stored (") >= n, node.daemon_log, timeout)


def nodes(mount_factory, tmp_path, make_nvcc, *names):
    store = tmp_path / "store"
    store.mkdir(exist_ok=True)
    os.chmod(tmp_path, 0o755)
    opts = ["remote=dir:%s" % store, "nvcc=%s" % make_nvcc()]
    return [mount_factory(opts, name=n) for n in names]


def test_same_tree_at_two_prefixes_one_compile_in_the_cluster(mount_factory, counting_nvcc,
                                                             tmp_path):
    make_nvcc, calls = counting_nvcc
    a, b, c = nodes(mount_factory, tmp_path, make_nvcc, "a", "b", "c")
    ta = tree(tmp_path / "opt" / "venv-a" / "deep_gemm", mtime=1000000000)
    tb = tree(tmp_path / "home" / "u" / ".local" / "deep_gemm", mtime=1750000000)
    first = [compile_on(a, ta, i, tmp_path) for i in range(2)]
    stored(a, 2)
    assert [compile_on(b, tb, i, tmp_path) for i in range(2)] == first
    assert calls() == 2, "node B compiled headers it shares by bytes"
    assert b.stats()["remote_hits_total"] == 2
    # B's tree touched (pip's new install time), then reinstalled: no compile on B (its
    # entries have the same key), and a new node C with the reinstalled tree fetches
    for f in tb.rglob("*"):
        os.utime(f, None)
    assert [compile_on(b, tb, i, tmp_path) for i in range(2)] == first
    shutil.rmtree(tb)
    tree(tb.parent)
    assert [compile_on(b, tb, i, tmp_path) for i in range(2)] == first
    assert [compile_on(c, tb, i, tmp_path) for i in range(2)] == first
    assert calls() == 2 and c.stats()["remote_hits_total"] == 2
    assert b.stats()["compiles_total"] == 0 and c.stats()["compiles_total"] == 0


def test_one_header_byte_differs_each_node_compiles_its_own(mount_factory, counting_nvcc,
                                                           tmp_path):
    """sccache 2863 on the cluster: B's tree differs from A's in one byte; B never gets
    A's cubin, and a third node with A's bytes at B's path gets A's."""
    make_nvcc, calls = counting_nvcc
    a, b, c = nodes(mount_factory, tmp_path, make_nvcc, "a", "b", "c")
    ta = tree(tmp_path / "ta", mtime=1000000000)
    tb = tree(tmp_path / "tb", mtime=1000000000, scale="x / static_cast<float>(N)")  # one byte
    ra = compile_on(a, ta, 0, tmp_path)
    stored(a, 1)
    rb = compile_on(b, tb, 0, tmp_path)
    assert calls() == 2 and rb != ra and b.stats()["remote_hits_total"] == 0
    want = tmp_path / "want.cubin"
    src = tmp_path / "want.cu"
    src.write_text(TEMPLATE % (0, 3))
    subprocess.run([str(NVCC), str(src),
                    "-cubin", "-o", str(want), "-arch=sm_90a", "-I", str(tb)], check=True)
    assert rb == want.read_bytes(), "B's cubin is not the compile of B's headers"
    stored(b, 1)
    shutil.rmtree(tb)
    tree(tb.parent, mtime=1750000000)  # A's bytes now at B's path
    assert compile_on(c, tb, 0, tmp_path) == ra
    assert calls() == 2 and c.stats()["remote_hits_total"] == 1


def test_lineinfo_relocated_tree_compiles(mount_factory, counting_nvcc, tmp_path):
    """-lineinfo puts the header paths into the cubin: the paths stay in the key, so the
    node with the tree at another prefix compiles (its cubin names its own tree)."""
    make_nvcc, calls = counting_nvcc
    a, b = nodes(mount_factory, tmp_path, make_nvcc, "a", "b")
    ta, tb = tree(tmp_path / "ta"), tree(tmp_path / "tb")
    ra = compile_on(a, ta, 0, tmp_path, ["-lineinfo"])
    stored(a, 1)
    rb = compile_on(b, tb, 0, tmp_path, ["-lineinfo"])
    assert calls() == 2 and b.stats()["remote_hits_total"] == 0
    assert str(tb).encode() in rb and str(ta).encode() not in rb


def test_manifest_is_small_and_bytes_moved_near_the_cubin(mount_factory, counting_nvcc,
                                                          tmp_path):
    """A shim kernel's index names its header list by one digest (the -I tree's bytes are
    in the key): well under a kilobyte. A joining node moves about the cubin's bytes per
    kernel, plus one header list for all kernels."""
    make_nvcc, calls = counting_nvcc
    a, b = nodes(mount_factory, tmp_path, make_nvcc, "a", "b")
    ta, tb = tree(tmp_path / "ta"), tree(tmp_path / "tb")
    n = 4
    cubins = [compile_on(a, ta, i, tmp_path) for i in range(n)]
    stored(a, n)
    index = [p.read_bytes() for p in (tmp_path / "store" / "objects").glob("*/*")
             if p.read_bytes()[19:25] == b"index " and b" @headers\n" in p.read_bytes()
             and p.name != LISTS_KEY]
    assert len(index) == n and all(len(i) < 1024 for i in index), [len(i) for i in index]
    assert not any(str(ta).encode() in i for i in index)
    assert [compile_on(b, tb, i, tmp_path) for i in range(n)] == cubins
    s = b.stats()
    assert s["remote_hits_total"] == n and calls() == n
    lists = [p.stat().st_size for p in (tmp_path / "store" / "objects").glob("*/*")
             if p.read_bytes()[19:25] == b"index " and b" @headers\n" not in p.read_bytes()]
    assert len(lists) == 1, "one header list for every kernel"
    # compile ahead's histories (the record of the contexts and A's history) are read
    # once, at B's start: not per kernel
    histories = sum(p.stat().st_size for p in (tmp_path / "store" / "objects").glob("*/*")
                    if p.read_bytes()[19:27] == b"history ")
    assert 0 < histories < 4096 * n, histories
    per_kernel = (s["remote_bytes_in_total"] - lists[0] - histories) / n
    cubin = sum(map(len, cubins)) / n
    assert per_kernel <= 1.2 * cubin + 1024, (per_kernel, cubin)
    # only B's first fetch reads an index: the later ones ask for the object of B's own
    # manifest of the header list that matched, one get each
    objects = sum(p.stat().st_size for p in (tmp_path / "store" / "objects").glob("*/*")
                  if p.read_bytes()[19:25] == b"cubin ")
    assert s["remote_bytes_in_total"] - lists[0] - histories - objects in [
        len(i) for i in index], (s["remote_bytes_in_total"], lists[0], objects,
                                 [len(i) for i in index])
