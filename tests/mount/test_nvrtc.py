"""The NVRTC compile backend: -o compiler=nvrtc for a whole mount, or
--kcachefs-compiler=nvrtc in an entry's kernel.flags; part of the entry's identity. The
backend, kcachefs-nvrtc, is run by the daemon as nvcc is (own process, timeout, log)."""
import errno
import shutil
import subprocess

import pytest

from conftest import (EM_CUDA, KCACHEFS, KERNELS, NVCC, SHIM, Mount, elf_machine,
                      elf_symbols, read_result, sample)

NVRTC = KCACHEFS.parent / "kcachefs-nvrtc"
pytestmark = pytest.mark.skipif(not NVRTC.exists(), reason="built without libnvrtc")


@pytest.mark.parametrize("kernel", ["vector_add", "block_sum"])
def test_a_mount_of_nvrtc_compiles_valid_cubins(mount_factory, kernel):
    m = mount_factory(["compiler=nvrtc"])
    entry = m.stage(kernel, *sample(kernel))
    data = (entry / "kernel.cubin").read_bytes()
    assert elf_machine(data) == EM_CUDA and kernel in elf_symbols(data)
    head = (entry / "kernel.log").read_text().splitlines()[0]
    assert "published (ok)" in head and "with %s," % NVRTC in head, head
    info = [l for l in (m.mnt / ".kcachefs" / "metrics.prom").read_text().splitlines()
            if l.startswith("kcachefs_info{")][0]
    assert "NVRTC 13" in info or "NVRTC " in info, info


def test_an_entry_chooses_its_backend_and_that_is_its_identity(mount_factory):
    m = mount_factory()  # nvcc by default
    src, flags = sample("vector_add")
    by_nvcc = m.stage("vector_add", src, flags)
    by_nvrtc = m.stage("vector_add", src, flags + b"--kcachefs-compiler=nvrtc\n")
    a = (by_nvcc / "kernel.cubin").read_bytes()
    b = (by_nvrtc / "kernel.cubin").read_bytes()
    assert "vector_add" in elf_symbols(a) and "vector_add" in elf_symbols(b)
    assert "/nvcc," in (by_nvcc / "kernel.log").read_text().splitlines()[0]
    assert "kcachefs-nvrtc," in (by_nvrtc / "kernel.log").read_text().splitlines()[0]
    assert m.stats()["compiles_total"] == 2
    # The choice is a staged flag like any other: only nvcc and nvrtc are allowed.
    bad = m.mnt / "cache" / "kernel.vector_add.0123456789abcdef01"
    bad.mkdir()
    with pytest.raises(OSError) as e:
        (bad / "kernel.flags").write_bytes(b"--kcachefs-compiler=clang\n")
    assert e.value.errno == errno.EINVAL


def test_nvrtc_failures_give_eio_and_say_why(mount_factory):
    m = mount_factory(["compiler=nvrtc"])
    broken = m.stage("broken", *sample("broken"))
    assert read_result(broken / "kernel.cubin") == ("err", errno.EIO)
    assert read_result(broken / "kernel.cubin") == ("err", errno.EIO)
    log = (broken / "kernel.log").read_text()
    assert "rejected" in log.splitlines()[0] and "undefined_symbol_kcachefs_test" in log
    assert m.stats()["compile_failures_total"] == 1, "the rejection is remembered"
    # A virtual architecture gives PTX, not a cubin: refused with the reason.
    ptx = m.stage("vector_add", sample("vector_add")[0], b"--gpu-architecture=compute_90\n")
    assert read_result(ptx / "kernel.cubin") == ("err", errno.EIO)
    assert "no cubin" in (ptx / "kernel.log").read_text()


# block_sum's CUB kernel and a kernel that needs NVRTC's own options: a function with no
# execution space is a host function without -default-device, and __int128 in device code
# needs --device-int128.
DEFAULT_DEVICE_SOURCE = (KERNELS / "block_sum.cu").read_bytes() + b"""
static unsigned __int128 wide(unsigned long long a) { return (unsigned __int128)a * a; }

extern "C" __global__ void wide_square_high(unsigned long long a, unsigned long long *high)
{
	*high = (unsigned long long)(wide(a) >> 64);
}
"""


def deepgemm_nvrtc_flags(extra=b""):
    """DeepGEMM's NVRTC options (csrc/jit/compiler.hpp), with the toolkit's include
    directory and its CCCL directory for CUB."""
    cuda = NVCC.parent.parent
    return (b"-std=c++17\n--diag-suppress=39,161,174,177,186,940\n"
            b"--ptxas-options=--register-usage-level=10\n-I%s/include\n-I%s/include/cccl\n"
            b"--gpu-architecture=sm_90a\n-default-device\n--pch\n--device-int128\n"
            % (bytes(cuda), bytes(cuda))) + extra


def test_deepgemms_nvrtc_options_compile_through_the_mount(mount_factory):
    m = mount_factory(["compiler=nvrtc"])
    entry = m.stage("block_sum", DEFAULT_DEVICE_SOURCE, deepgemm_nvrtc_flags())
    data = (entry / "kernel.cubin").read_bytes()
    assert elf_machine(data) == EM_CUDA
    assert {"block_sum", "wide_square_high"} <= elf_symbols(data)
    log = (entry / "kernel.log").read_text()
    assert "published (ok)" in log.splitlines()[0], log
    # Automatic PCH wrote its file in the warm worker's private scratch directory (named
    # in the log), and nowhere in the shared /tmp; it lives as long as the worker.
    pch = [l for l in log.splitlines() if "creating precompiled header file" in l]
    assert pch and "/tmp/__nvrtc_auto_pch" not in pch[0], log
    files = list(m.backing.rglob("*.pch"))
    assert files and all((f.parent.parent / "worker.log").exists() for f in files), files
    # A PCH file or directory of the client's choosing is refused when staged.
    bad = m.mnt / "cache" / "kernel.block_sum.0123456789abcdef01"
    bad.mkdir()
    (bad / "kernel.cu").write_bytes(DEFAULT_DEVICE_SOURCE)
    for opt in (b"--pch-dir=/tmp", b"--create-pch=/tmp/x.pch", b"--use-pch=/tmp/x.pch"):
        with pytest.raises(OSError) as e:
            (bad / "kernel.flags").write_bytes(deepgemm_nvrtc_flags(opt + b"\n"))
        assert e.value.errno == errno.EINVAL
        assert "'%s' refused" % opt.decode() in (bad / "kernel.log").read_text()
    m.stop()
    assert not list(m.backing.rglob("*.pch")), "no PCH file is left behind"


def test_nvrtcs_own_options_fail_an_nvcc_compile_with_nvccs_message(mount_factory):
    m = mount_factory()  # nvcc by default
    entry = m.stage("block_sum", DEFAULT_DEVICE_SOURCE, deepgemm_nvrtc_flags())
    assert read_result(entry / "kernel.cubin") == ("err", errno.EIO)
    assert "Unknown option '-default-device'" in (entry / "kernel.log").read_text()


def test_compiler_option_errors(tmp_path):
    def start(binary, opt):
        (tmp_path / "b").mkdir(exist_ok=True)
        (tmp_path / "m").mkdir(exist_ok=True)
        return subprocess.run([str(binary), "-f", "-o", opt, str(tmp_path / "b"),
                               str(tmp_path / "m")], capture_output=True, text=True, timeout=30)
    r = start(KCACHEFS, "compiler=clang")
    assert r.returncode != 0 and "compiler=clang: must be nvcc or nvrtc" in r.stderr
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(KCACHEFS, alone / "kcachefs")  # without kcachefs-nvrtc beside it
    r = start(alone / "kcachefs", "compiler=nvrtc")
    assert r.returncode != 0 and "kcachefs-nvrtc is not next to kcachefs" in r.stderr


def test_the_default_backend_is_part_of_every_recipe(tmp_path):
    """Remounting with another -o compiler= recompiles the entries that did not choose; the
    nvcc shim's entries choose nvcc, so they stay nvcc's compiles on an NVRTC mount."""
    (tmp_path / "r").mkdir()
    m = Mount(tmp_path / "r")
    try:
        m.start()
        entry = m.stage("vector_add", *sample("vector_add"))
        assert "vector_add" in elf_symbols((entry / "kernel.cubin").read_bytes())
        assert "/nvcc," in (entry / "kernel.log").read_text().splitlines()[0]
        m.stop()
        m.options = ["compiler=nvrtc"]
        m.start()
        assert "vector_add" in elf_symbols((entry / "kernel.cubin").read_bytes())
        assert "kcachefs-nvrtc," in (entry / "kernel.log").read_text().splitlines()[0]
        assert m.stats()["compiles_total"] == 1
        src = tmp_path / "alone" / "k.cu"
        src.parent.mkdir()
        shutil.copy(KERNELS / "saxpy.cu", src)
        r = subprocess.run([str(SHIM), str(src), "-cubin", "-o", str(m.mnt / "s.cubin"),
                            "-arch=sm_90a"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        logs = [p.read_text() for p in (m.mnt / "kcachefs-nvcc").glob("*/kernel.log")]
        assert len(logs) == 1 and "/nvcc," in logs[0].splitlines()[0], logs
    finally:
        m.stop()
