"""Real JIT clients' cache protocols on the mount, unchanged: DeepGEMM current and
older, Triton's file cache and FlashInfer's lock file. Each runs as 8 processes at once on a
cold mount, then again warm. Every process must load a valid cubin of each kernel, all the
same bytes, with no error, and leave no temp file behind. The emulators are
tests/mount/{deepgemm,triton_cache,flashinfer_jit}.py."""
import fnmatch
import hashlib
import os

import pytest

import deepgemm
import flashinfer_jit
import triton_cache
from conftest import EM_CUDA, elf_machine, elf_symbols, run_parallel, sample

KERNELS = ("vector_add", "saxpy")


def deepgemm_client(protocol):
    fn = getattr(deepgemm, protocol)

    def run(root, name, src, nvcc):
        os.environ["DG_JIT_NVCC_COMPILER"] = str(nvcc)
        return fn(str(root), name, src)
    return run


CLIENTS = {
    "deepgemm-current": deepgemm_client("current"),
    "deepgemm-older": deepgemm_client("older"),
    "triton": lambda root, name, src, nvcc: triton_cache.compile_and_load(str(root), name, src, str(nvcc)),
    "flashinfer": lambda root, name, src, nvcc: flashinfer_jit.build_and_load(str(root), name, src, str(nvcc)),
}


def tree(root):
    """Every path under root, relative."""
    out = []
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            out.append(os.path.relpath(os.path.join(d, n), root))
    return sorted(out)


def check_leftovers(client, root):
    """No temp file of the client's own protocol is left; the layout is what it writes."""
    paths = tree(root)
    if client.startswith("deepgemm"):
        assert os.listdir(root / "tmp") == [], "DeepGEMM temp files left: %s" % paths
        for e in os.listdir(root / "cache"):
            assert sorted(os.listdir(root / "cache" / e)) == ["kernel.cu", "kernel.cubin"]
        assert len(os.listdir(root / "cache")) == len(KERNELS)
    elif client == "triton":
        assert not fnmatch.filter(paths, "*tmp.pid_*"), "Triton temp dirs left: %s" % paths
        assert len(os.listdir(root)) == len(KERNELS)
        for d in os.listdir(root):
            files = sorted(os.listdir(root / d))
            assert len(files) == 7 and any(f.startswith("__grp__") for f in files), files
    else:
        assert sorted(os.listdir(root / "tmp")) == sorted(k + ".lock" for k in KERNELS), \
            "FlashInfer leaves exactly its lock files: %s" % paths
        for k in KERNELS:
            assert sorted(os.listdir(root / "cached_ops" / k)) == [
                ".ninja_log", "build.ninja", k + ".cubin"]


@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_eight_processes_cold_then_warm(mount_factory, counting_nvcc, client):
    make_nvcc, calls = counting_nvcc
    nvcc = make_nvcc()
    m = mount_factory()
    root = m.mnt / "jit" / client
    root.mkdir(parents=True)
    kernels = {k: sample(k)[0] for k in KERNELS}
    run = CLIENTS[client]

    def proc(i):
        out = {}
        for j in range(len(KERNELS)):  # process i starts at kernel i: the compiles overlap
            name = KERNELS[(i + j) % len(KERNELS)]
            out[name] = hashlib.sha256(run(root, name, kernels[name], nvcc)).hexdigest()
        return out

    cold = run_parallel(8, proc)
    assert all(isinstance(r, dict) for r in cold), "a process failed: %s" % cold
    for name in KERNELS:
        assert len({r[name] for r in cold}) == 1, "processes loaded different bytes of " + name
    cold_compiles = calls()
    assert len(KERNELS) <= cold_compiles <= 8 * len(KERNELS)
    if client == "flashinfer":
        assert cold_compiles == len(KERNELS), "the lock file must serialise the builds"
    check_leftovers(client, root)

    # Every cubin any of them can find is a whole CUDA ELF of its kernel.
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".cubin"):
                data = open(os.path.join(d, f), "rb").read()
                assert elf_machine(data) == EM_CUDA, os.path.join(d, f)
                assert any(k in elf_symbols(data) for k in KERNELS)
                assert hashlib.sha256(data).hexdigest() in {cold[0][k] for k in KERNELS}

    warm = run_parallel(8, proc)
    assert warm == cold, "a warm run loaded other bytes"
    assert calls() == cold_compiles, "a warm run compiled"
    check_leftovers(client, root)
    assert os.listdir(m.backing / ".kcachefs" / "tmp") == []
    assert m.stats()["compiles_total"] == 0, "these clients compile for themselves"
    assert m.stop() == 0
