"""Kernel entries: stage a recipe, the first open compiles, everyone reads one compile's
bytes, failures are EIO with a log, and staged files are immutable."""
import errno
import fcntl
import hashlib
import mmap
import os
import subprocess
import time

import pytest

from conftest import (KCACHEFS, KERNELS, NVCC, EM_CUDA, elf_machine, elf_symbols, entry_name, read_result, run_parallel,
                      sample, write_script)
from kcmount import wait_until


def test_open_compiles_a_valid_cuda_elf(mount_factory):
    m = mount_factory()
    src, flags = sample("vector_add")
    entry = m.stage("vector_add", src, flags)
    data = (entry / "kernel.cubin").read_bytes()
    assert elf_machine(data) == EM_CUDA
    assert "vector_add" in elf_symbols(data)
    backing = m.backing / entry.relative_to(m.mnt)
    assert (backing / "kernel.cubin").read_bytes() == data
    assert "published" in (entry / "kernel.log").read_text()
    s = m.stats()
    assert s["compiles_total"] == 1 and s["misses_total"] == 1
    assert s["published_bytes_total"] == len(data)


def test_header_heavy_kernel_compiles(mount_factory):
    m = mount_factory()
    src, flags = sample("block_sum")
    data = (m.stage("block_sum", src, flags) / "kernel.cubin").read_bytes()
    assert "block_sum" in elf_symbols(data)
    assert m.stats()["compile_duration_seconds_sum"] > 0


def race_openers(mount_factory, counting_nvcc, kernel, n):
    """Mount with a compiler that counts its runs and takes a second longer, stage kernel,
    and open its kernel.cubin from n processes at once. Returns (mount, entry, results,
    calls) where calls() counts compiler runs."""
    make, calls = counting_nvcc
    m = mount_factory(["nvcc=%s" % make(delay=1)])
    entry = m.stage(kernel, *sample(kernel))
    results = run_parallel(n, lambda i, p: read_result(p), str(entry / "kernel.cubin"))
    return m, entry, results, calls


def test_16_openers_one_compile_identical_bytes(mount_factory, counting_nvcc):
    m, entry, results, calls = race_openers(mount_factory, counting_nvcc, "saxpy", 16)
    assert all(r[0] == "ok" for r in results), results
    assert len({r[1] for r in results}) == 1, "openers read different bytes"
    assert all(r[2] == r[3] > 0 for r in results), "fstat size differs from bytes read"
    assert calls() == 1
    s = m.stats()
    assert s["compiles_total"] == 1
    assert s["misses_total"] == 1
    # Later opens are hits or kernel-cached: never another compile.
    assert read_result(entry / "kernel.cubin")[1] == results[0][1]
    assert calls() == 1


def test_failing_source_gives_eio_to_all_and_keeps_log(mount_factory, counting_nvcc):
    m, entry, results, calls = race_openers(mount_factory, counting_nvcc, "broken", 8)
    assert results == [("err", errno.EIO)] * 8
    log = (entry / "kernel.log").read_text()
    assert "rejected" in log and "undefined_symbol_kcachefs_test" in log
    assert not (m.backing / entry.relative_to(m.mnt) / "kernel.cubin").exists()
    assert calls() == 1
    # A re-open does not run the compiler again on the same failing recipe.
    for _ in range(3):
        assert read_result(entry / "kernel.cubin") == ("err", errno.EIO)
    assert calls() == 1
    s = m.stats()
    assert s["compile_failures_total"] == 1 and s["compiles_total"] == 0
    assert s["rejected_lookups_total"] >= 3
    # Re-staging a fixed source (remove the recipe, stage again) compiles it.
    (entry / "kernel.cu").unlink()
    (entry / "kernel.cu").write_bytes(sample("vector_add")[0])
    assert read_result(entry / "kernel.cubin")[0] == "ok"
    assert calls() == 2


def test_timeout_is_a_passing_failure(mount_factory, tmp_path):
    """A compile killed by compile_timeout gives EIO to every waiter from one compiler run
    (openers queued behind it are held off briefly); a later open compiles again."""
    calls = tmp_path / "calls"
    # The compile after the timeout must not race compile_timeout=2 on a loaded machine: it
    # hands over a cubin nvcc made beforehand (the daemon still checks it as any cubin).
    made = tmp_path / "made.cubin"
    tag = b"sleep 60.%d%d" % (os.getpid(), time.monotonic_ns() % 1000000)  # this run's own
    subprocess.run([str(NVCC), "-cubin", "-arch=sm_90a", "-o", str(made), str(KERNELS / "vector_add.cu")],
                   check=True, timeout=300)
    os.chmod(made, 0o644)
    nvcc = write_script(tmp_path / "nvcc-hangs-once",
                        'case "$*" in *-cubin*) echo run >> %s\n'
                        '  if [ ! -e %s.done ]; then touch %s.done; exec %s; fi\n'
                        '  while [ $# -gt 0 ]; do [ "$1" = -o ] && exec cp %s "$2"; shift; done\n'
                        '  exit 1;; esac\n'
                        'exec %s "$@"\n' % (calls, calls, calls, tag.decode(), made, NVCC))
    m = mount_factory(["nvcc=%s" % nvcc, "compile_timeout=2"])
    entry = m.stage("vector_add", *sample("vector_add"))
    started = time.monotonic()
    results = run_parallel(8, lambda i, p: read_result(p), str(entry / "kernel.cubin"))
    assert results == [("err", errno.EIO)] * 8
    assert time.monotonic() - started < 30, "waiters were not answered promptly"
    assert calls.read_text().count("run") == 1, "one compiler run for all waiters"
    assert "timed out" in (entry / "kernel.log").read_text()
    assert tag not in subprocess.run(["ps", "ax", "-o", "args"], capture_output=True).stdout
    assert not (m.backing / entry.relative_to(m.mnt) / "kernel.cubin").exists()
    time.sleep(2.2)  # the hold-off after a passing failure
    assert read_result(entry / "kernel.cubin")[0] == "ok"
    assert calls.read_text().count("run") == 2
    assert m.stats()["compiles_total"] == 1


def test_nothing_staged_is_enoent(mount_factory):
    m = mount_factory()
    entry = m.mnt / "cache" / entry_name("empty", b"")
    entry.mkdir(parents=True)
    assert read_result(entry / "kernel.cubin") == ("err", errno.ENOENT)
    # Source without flags: a plain entry (older DeepGEMM compiles for itself).
    (entry / "kernel.cu").write_bytes(sample("vector_add")[0])
    assert read_result(entry / "kernel.cubin") == ("err", errno.ENOENT)
    assert sorted(os.listdir(entry)) == ["kernel.cu"]
    # Once the flags arrive, kernel.cubin is listed and opens.
    (entry / "kernel.flags").write_bytes(b"-O3\n")
    assert "kernel.cubin" in os.listdir(entry)
    assert read_result(entry / "kernel.cubin")[0] == "ok"
    assert m.stats()["compiles_total"] == 1


def test_autocompile_compiles_source_without_flags(mount_factory):
    m = mount_factory(["autocompile"])
    src = sample("vector_add")[0]
    entry = m.stage("vector_add", src, flags=None)
    data = (entry / "kernel.cubin").read_bytes()
    assert "vector_add" in elf_symbols(data)


def test_restaging_same_bytes_is_noop_other_bytes_eexist(mount_factory):
    m = mount_factory()
    src, flags = sample("vector_add")
    entry = m.stage("vector_add", src, flags)
    cubin = (entry / "kernel.cubin").read_bytes()
    (entry / "kernel.cu").write_bytes(src)  # same bytes: fine
    (entry / "kernel.flags").write_bytes(flags)
    with pytest.raises(OSError) as e:
        (entry / "kernel.cu").write_bytes(src + b"// changed\n")
    assert e.value.errno == errno.EEXIST
    with pytest.raises(OSError) as e:
        (entry / "kernel.flags").write_bytes(b"-O0\n")
    assert e.value.errno == errno.EEXIST
    # Renaming other bytes into place is refused the same way, and the file stays.
    tmp = entry.parent / "tmp-source"
    tmp.write_bytes(b"// other\n")
    with pytest.raises(OSError) as e:
        os.rename(tmp, entry / "kernel.cu")
    assert e.value.errno == errno.EEXIST
    assert tmp.read_bytes() == b"// other\n"
    # Renaming identical bytes succeeds and consumes the source name.
    tmp.write_bytes(src)
    os.rename(tmp, entry / "kernel.cu")
    assert not tmp.exists()
    assert (entry / "kernel.cu").read_bytes() == src
    assert (entry / "kernel.cubin").read_bytes() == cubin
    # A published cubin is immutable.
    with pytest.raises(OSError) as e:
        os.truncate(entry / "kernel.cubin", 0)
    assert e.value.errno == errno.EPERM
    for flags in (os.O_WRONLY, os.O_RDWR, os.O_WRONLY | os.O_TRUNC, os.O_WRONLY | os.O_APPEND,
                  os.O_RDONLY | os.O_TRUNC):
        with pytest.raises(OSError) as e:
            os.open(entry / "kernel.cubin", flags)
        assert e.value.errno == errno.EPERM
    for change in (lambda p: os.chmod(p, 0o666), lambda p: os.utime(p, (1, 1))):
        with pytest.raises(OSError) as e:
            change(entry / "kernel.cubin")
        assert e.value.errno == errno.EPERM
    # O_TRUNC with O_RDONLY on a staged source is a staging write like any other.
    with pytest.raises(OSError) as e:
        os.close(os.open(entry / "kernel.cu", os.O_RDONLY | os.O_TRUNC))
    assert e.value.errno == errno.EEXIST
    assert (entry / "kernel.cu").read_bytes() == src
    # Another valid cubin renamed over it: the published one stays (racing ranks).
    other = sample_cubin(m, "saxpy")
    (entry.parent / "other.cubin").write_bytes(other)
    os.rename(entry.parent / "other.cubin", entry / "kernel.cubin")
    assert not (entry.parent / "other.cubin").exists()
    # The kernel moved its entry to the renamed file; the daemon invalidates it right after.
    wait_until(lambda: (entry / "kernel.cubin").read_bytes() == cubin,
               "the published cubin is not served again", 10)
    assert (m.backing / entry.relative_to(m.mnt) / "kernel.cubin").read_bytes() == cubin
    assert m.stats()["compiles_total"] == 2


def sample_cubin(m, name):
    """Compile a sample kernel through the mount and return its cubin bytes."""
    return (m.stage(name, *sample(name)) / "kernel.cubin").read_bytes()


def test_refused_flags(mount_factory, tmp_path):
    m = mount_factory()
    src = sample("vector_add")[0]
    entry = m.mnt / "cache" / entry_name("vector_add", src, b"bad")
    entry.mkdir(parents=True)
    (entry / "kernel.cu").write_bytes(src)
    pwned = tmp_path / "pwned"
    # nvcc runs its sub-commands through a shell: values it quotes with "" or not at all
    shell = [b"-DX=$(touch %s)\n" % bytes(pwned), b"-Xptxas=-v;touch${IFS}%s;echo\n" % bytes(pwned),
             b"--compiler-options=-Wall`touch %s`\n" % bytes(pwned)]
    for bad in [b"-ccbin=/bin/sh\n", b"-o\n/tmp/x\n", b"--run\n", b"@/etc/passwd\n"] + shell:
        with pytest.raises(OSError) as e:
            (entry / "kernel.flags").write_bytes(bad)
        assert e.value.errno == errno.EINVAL
        assert "refused" in (entry / "kernel.log").read_text()
    assert not (entry / "kernel.flags").exists()
    assert read_result(entry / "kernel.cubin") == ("err", errno.EIO), "a refusal is told"
    assert not pwned.exists()
    # the same through -o flags= at mount time: the daemon does not start
    r = subprocess.run([str(KCACHEFS), "-f", "-o", "flags=-DX=$(touch %s)" % pwned,
                        str(tmp_path / "b"), str(tmp_path / "m")], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode != 0 and "shell metacharacter" in r.stderr
    assert not pwned.exists()


def test_client_published_cubin_is_served_as_is(mount_factory, tmp_path):
    m = mount_factory()
    src = sample("saxpy")[0]
    (tmp_path / "s.cu").write_bytes(src)
    out = tmp_path / "saxpy.cubin"
    subprocess.run(["/usr/local/cuda/bin/nvcc", str(tmp_path / "s.cu"), "-cubin", "-o", str(out),
                    "--gpu-architecture=sm_90a"], check=True)
    entry = m.mnt / "cache" / entry_name("saxpy", src)
    entry.mkdir(parents=True)
    (entry / "kernel.cu").write_bytes(src)
    (entry / "kernel.cubin").write_bytes(out.read_bytes())
    assert (entry / "kernel.cubin").read_bytes() == out.read_bytes()
    assert m.stats()["compiles_total"] == 0
    # A non-ELF or truncated cubin is refused at close and never published.
    other = m.mnt / "cache" / entry_name("other", b"x")
    other.mkdir()
    for bad in (b"not an elf file at all" * 10, out.read_bytes()[: out.stat().st_size // 2]):
        with pytest.raises(OSError) as e:
            (other / "kernel.cubin").write_bytes(bad)
        assert e.value.errno == errno.EINVAL
    # An empty one (created, never written) is refused when its creator closes it.
    with pytest.raises(OSError) as e:
        open(other / "kernel.cubin", "wb").close()
    assert e.value.errno == errno.EINVAL
    assert not (m.backing / other.relative_to(m.mnt) / "kernel.cubin").exists()
    assert read_result(other / "kernel.cubin") == ("err", errno.ENOENT)
    assert "kernel.cubin refused" in m.daemon_log()


KC_IOC_GET_KEY = (2 << 30) | (64 << 16) | (ord("k") << 8) | 1  # _IOR('k', 1, char[64]), key.h


def recipe_key(source, flags):
    """src/entry/key.h's key of a recipe, computed here independently."""
    h = hashlib.sha256(b"kcachefs-key-v1\n")
    for field in (source, flags):
        h.update(b"%d\n" % len(field) + field + b"\n")
    return h.hexdigest().encode()


def test_a_recipe_and_a_client_cubin_never_share_an_entry(mount_factory, tmp_path):
    """A client's cubin is no compile of any recipe: an entry that holds one cannot be given
    a recipe (EEXIST), and one renamed into an entry with a recipe is discarded (the rename
    succeeds, as over a published cubin) while the mount serves its own compile. The open
    cubin tells which recipe it was compiled from (KC_IOC_GET_KEY)."""
    m = mount_factory()
    vsrc, vflags = sample("vector_add")
    (tmp_path / "s.cu").write_bytes(sample("saxpy")[0])
    saxpy = tmp_path / "saxpy.cubin"
    subprocess.run(["/usr/local/cuda/bin/nvcc", str(tmp_path / "s.cu"), "-cubin", "-o", str(saxpy),
                    "--gpu-architecture=sm_90a"], check=True)
    # 1. kernel.cu + a client's (other) cubin; adding kernel.flags is refused.
    a = m.mnt / "cache" / entry_name("vector_add", vsrc, b"a")
    a.mkdir(parents=True)
    (a / "kernel.cu").write_bytes(vsrc)
    (a / "kernel.cubin").write_bytes(saxpy.read_bytes())
    with pytest.raises(OSError) as e:
        (a / "kernel.flags").write_bytes(vflags)
    assert e.value.errno == errno.EEXIST
    assert sorted(os.listdir(a)) == ["kernel.cu", "kernel.cubin", "kernel.log"]
    assert "published by a client" in (a / "kernel.log").read_text()
    assert (a / "kernel.cubin").read_bytes() == saxpy.read_bytes(), "what was stored stays"
    assert "published by a client" in m.daemon_log()
    with open(a / "kernel.cubin", "rb") as f:
        with pytest.raises(OSError) as e:
            fcntl.ioctl(f.fileno(), KC_IOC_GET_KEY, b"\0" * 64)
        assert e.value.errno == errno.ENODATA, "a client's cubin has no recipe key"
    # 2. A recipe, then a client's cubin renamed over kernel.cubin: discarded.
    b = m.stage("vector_add", vsrc, vflags)
    tmp = b / "upload.tmp"
    tmp.write_bytes(saxpy.read_bytes())
    os.rename(tmp, b / "kernel.cubin")
    time.sleep(0.2)  # the kernel's entry is invalidated asynchronously
    with open(b / "kernel.cubin", "rb") as f:
        data = f.read()
        key = fcntl.ioctl(f.fileno(), KC_IOC_GET_KEY, b"\0" * 64)
    assert "vector_add" in elf_symbols(data) and "saxpy" not in elf_symbols(data)
    assert key == recipe_key(vsrc, vflags)
    assert m.stats()["compiles_total"] == 1
    # 3. A cubin placed in the backing directory beside a recipe (not through the mount, or
    # left by an older kcachefs) is no compile of it: removed and compiled.
    c = m.stage("vector_add", vsrc + b"// c\n", vflags)
    (m.backing / c.relative_to(m.mnt) / "kernel.cubin").write_bytes(saxpy.read_bytes())
    data = (c / "kernel.cubin").read_bytes()
    assert "vector_add" in elf_symbols(data) and "saxpy" not in elf_symbols(data)
    assert "was not compiled by the mount" in m.daemon_log()
    # ioctls other than the key are not the mount's
    with open(b / "kernel.cubin", "rb") as f:
        with pytest.raises(OSError) as e:
            fcntl.ioctl(f.fileno(), 0x80086601, b"\0" * 8)  # FS_IOC_GETFLAGS
        assert e.value.errno in (errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP)


@pytest.mark.parametrize("reader", ["cat", "cp", "mmap", "python", "stat"])
def test_first_reader_sees_full_size(mount_factory, tmp_path, reader):
    m = mount_factory()
    src, flags = sample("vector_add")
    entry = m.stage("vector_add", src, flags)
    cubin = entry / "kernel.cubin"
    if reader == "cat":
        data = subprocess.run(["cat", str(cubin)], capture_output=True, check=True).stdout
    elif reader == "cp":
        subprocess.run(["cp", str(cubin), str(tmp_path / "copy")], check=True)
        data = (tmp_path / "copy").read_bytes()
    elif reader == "mmap":
        with open(cubin, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mm:
                data = bytes(mm[:])
    elif reader == "python":
        with open(cubin, "rb") as f:
            data = f.read()
    else:
        size = os.stat(cubin).st_size
        data = cubin.read_bytes()
        assert size == len(data)
    expected = (m.backing / entry.relative_to(m.mnt) / "kernel.cubin").read_bytes()
    assert len(expected) > 0 and data == expected
