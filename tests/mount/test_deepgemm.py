"""Both DeepGEMM cache sequences, 8 ranks at once, on the mount (DESIGN.md)."""
import hashlib
import os

import pytest

import deepgemm
from conftest import EM_CUDA, elf_machine, elf_symbols, run_parallel, sample


@pytest.mark.parametrize("protocol", ["current", "older"])
def test_eight_ranks_leave_one_valid_entry(mount_factory, protocol):
    m = mount_factory()
    cache_root = str(m.mnt / "dg")
    kernels = {name: sample(name)[0] for name in ("vector_add", "saxpy")}
    run = getattr(deepgemm, protocol)

    def rank(i):
        out = {}
        for name, src in kernels.items():
            out[name] = hashlib.sha256(run(cache_root, name, src)).hexdigest()
        return out

    results = run_parallel(8, rank)
    assert all(isinstance(r, dict) for r in results), results
    for name, src in kernels.items():
        assert len({r[name] for r in results}) == 1, "ranks loaded different bytes"
        entry = deepgemm.entry_dir(cache_root, name, src)
        assert sorted(os.listdir(entry)) == ["kernel.cu", "kernel.cubin"]
        data = deepgemm.load(entry)
        assert elf_machine(data) == EM_CUDA and name in elf_symbols(data)
        assert hashlib.sha256(data).hexdigest() == results[0][name]
        assert open(os.path.join(entry, "kernel.cu"), "rb").read() == src
    assert os.listdir(os.path.join(cache_root, "tmp")) == [], "temp files left behind"
    assert sorted(os.listdir(os.path.join(cache_root, "cache"))) == sorted(
        os.path.basename(deepgemm.entry_dir(cache_root, n, s)) for n, s in kernels.items())
    # A warm run: every rank hits.
    assert run_parallel(8, rank) == results
    # The clients compiled for themselves; the mount compiled nothing.
    assert m.stats()["compiles_total"] == 0
