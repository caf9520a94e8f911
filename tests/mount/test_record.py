"""The bytes of record: once a cubin is published, no rename, exchange, link or write from
either side of the call makes kernel.cubin (or kernel.cu, kernel.flags) name other bytes,
not even for a moment after the call returns, through read, mmap or a held descriptor."""
import ctypes
import errno
import mmap
import multiprocessing
import os
import subprocess

import pytest

from conftest import NVCC, elf_symbols, entry_name, sample

LIBC = ctypes.CDLL(None, use_errno=True)
AT_FDCWD = -100
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2


def renameat2(old, new, flags):
    """renameat2(2); raises OSError like os.rename."""
    if LIBC.renameat2(AT_FDCWD, os.fsencode(old), AT_FDCWD, os.fsencode(new), flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), str(old))


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    """Two valid client cubins of different kernels: {"saxpy": bytes, "vector_add": bytes}."""
    d = tmp_path_factory.mktemp("cubins")
    out = {}
    for name in ("saxpy", "vector_add"):
        (d / (name + ".cu")).write_bytes(sample(name)[0])
        subprocess.run([str(NVCC), str(d / (name + ".cu")), "-cubin", "-o", str(d / name),
                        "--gpu-architecture=sm_90a"], check=True)
        out[name] = (d / name).read_bytes()
    return out


def publish(m, name, cubin, source=None):
    """A client's entry (no recipe; kernel.cu alone if source, as older DeepGEMM writes)
    with cubin published in it; returns the entry."""
    entry = m.mnt / "cache" / entry_name(name, cubin)
    entry.mkdir(parents=True)
    if source is not None:
        (entry / "kernel.cu").write_bytes(source)
    (entry / "kernel.cubin").write_bytes(cubin)
    return entry


def refused(call, *args):
    with pytest.raises(OSError) as e:
        call(*args)
    assert e.value.errno == errno.EPERM, e.value


def test_no_rename_exchange_or_link_changes_what_a_staged_name_holds(mount_factory, cubins):
    """Every call that would change which bytes kernel.cu,
    kernel.flags or kernel.cubin name, from either side, is refused with EPERM and a log
    line; the published bytes stay, across a remount too."""
    m = mount_factory()
    a, b = cubins["saxpy"], cubins["vector_add"]
    entry = publish(m, "saxpy", a, sample("saxpy")[0])
    other = entry / "other.bin"
    other.write_bytes(b)
    cu = entry / "kernel.cu"
    out = m.mnt / "cache" / "moved"
    cases = [
        (renameat2, entry / "kernel.cubin", other, RENAME_EXCHANGE),  # the call
        (renameat2, other, entry / "kernel.cubin", RENAME_EXCHANGE),
        (renameat2, cu, other, RENAME_EXCHANGE),
        (renameat2, cu, entry / "kernel.cubin", RENAME_EXCHANGE),
        (renameat2, entry / "kernel.cubin", out, RENAME_NOREPLACE),  # moved away
        (os.rename, entry / "kernel.cubin", out),
        (os.rename, entry / "kernel.cubin", entry / "kernel.cu"),
        (os.rename, cu, out),
        (os.link, entry / "kernel.cubin", out),
        (os.link, other, entry / "kernel.flags"),
        (os.link, cu, out),
    ]
    for call, *args in cases:
        refused(call, *args)
    sub = m.mnt / "cache" / "d"
    sub.mkdir()
    refused(os.rename, sub, entry / "kernel.flags")  # a directory never takes the name
    os.symlink("x", m.mnt / "cache" / "l")
    refused(os.rename, m.mnt / "cache" / "l", entry / "kernel.flags")
    assert "refused (EPERM)" in m.daemon_log()
    assert sorted(os.listdir(entry)) == ["kernel.cu", "kernel.cubin", "other.bin"]
    assert not out.exists()
    assert (entry / "kernel.cubin").read_bytes() == a
    assert other.read_bytes() == b and cu.read_bytes() == sample("saxpy")[0]
    # unlink stays allowed: the entry then holds no cubin, never another one
    (entry / "kernel.cubin").unlink()
    assert not (entry / "kernel.cubin").exists()
    m.stop()
    m.start()
    assert sorted(os.listdir(entry)) == ["kernel.cu", "other.bin"]


def test_exchanged_entries_each_serve_their_own_recipe(mount_factory):
    """Two entry directories exchanged (or renamed, as DeepGEMM does) carry their recipes
    and cubins with them: each name's kernel.cubin is its recipe's compile."""
    m = mount_factory()
    s_src, s_flags = sample("saxpy")
    v_src, v_flags = sample("vector_add")
    s = m.stage("saxpy", s_src, s_flags)
    v = m.stage("vector_add", v_src, v_flags)
    assert "saxpy" in elf_symbols((s / "kernel.cubin").read_bytes())
    renameat2(s, v, RENAME_EXCHANGE)
    assert (s / "kernel.cu").read_bytes() == v_src
    assert "vector_add" in elf_symbols((s / "kernel.cubin").read_bytes())
    assert "saxpy" in elf_symbols((v / "kernel.cubin").read_bytes())
    assert m.stats()["compiles_total"] == 2


def reader(path, want, renaming, stop, bad, errors):
    """Open, read and map path over and over; count the reads of other bytes by opens that
    began while no rename was in flight (so after one returned), and failed opens."""
    while not stop.value:
        quiet = not renaming.value
        try:
            with open(path, "rb") as f:
                data = f.read()
                with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
                    mapped = mm[:]
        except OSError:
            errors.value += 1
            continue
        if quiet and (data != want or mapped != want):
            bad.value += 1


def test_discarded_rename_is_never_read_after_it_returns(mount_factory, cubins):
    """A valid cubin renamed over a published one is discarded; once
    rename() returned, processes that open kernel.cubin read the published bytes, by read
    and by mmap."""
    m = mount_factory()
    a, b = cubins["saxpy"], cubins["vector_add"]
    entry = publish(m, "saxpy", a)
    ctx = multiprocessing.get_context("fork")
    renaming, stop = ctx.RawValue("i", 0), ctx.RawValue("i", 0)
    bad, errors = ctx.RawValue("i", 0), ctx.RawValue("i", 0)
    procs = [ctx.Process(target=reader, args=(str(entry / "kernel.cubin"), a, renaming, stop,
                                              bad, errors)) for _ in range(2)]
    for p in procs:
        p.start()
    try:
        for i in range(200):
            tmp = entry.parent / ("upload.%d" % i)
            tmp.write_bytes(b)
            renaming.value = 1
            os.rename(tmp, entry / "kernel.cubin")  # succeeds: discarded
            renaming.value = 0
            assert not tmp.exists()
    finally:
        stop.value = 1
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert bad.value == 0, "%d reads of discarded bytes after rename() returned" % bad.value
    assert errors.value == 0, "%d opens of kernel.cubin failed" % errors.value
    assert (m.backing / entry.relative_to(m.mnt) / "kernel.cubin").read_bytes() == a
    assert "other bytes discarded" in m.daemon_log()


def test_a_descriptor_that_no_longer_names_a_stage_cannot_write(mount_factory, cubins):
    """A file written, renamed onto kernel.cubin (published) and written
    again through the same descriptor: the write fails and changes no cache; new opens,
    held descriptors and maps read the published bytes. A stage descriptor written again
    after its commit starts a new version that never reaches the published inode's pages."""
    m = mount_factory()
    a, b = cubins["saxpy"], cubins["vector_add"]
    entry = m.mnt / "cache" / entry_name("saxpy", a)
    entry.mkdir(parents=True)
    fd = os.open(entry / "upload.tmp", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.write(fd, a)
        os.rename(entry / "upload.tmp", entry / "kernel.cubin")  # publishes a
        held = open(entry / "kernel.cubin", "rb")
        mm = mmap.mmap(held.fileno(), 0, prot=mmap.PROT_READ)
        with pytest.raises(OSError) as e:
            os.pwrite(fd, b[: len(a)], 0)
        assert e.value.errno in (errno.EBADF, errno.EPERM)
    finally:
        os.close(fd)
    assert (entry / "kernel.cubin").read_bytes() == a
    assert os.pread(held.fileno(), len(a) + 1, 0) == a
    assert mm[:] == a
    mm.close()
    held.close()
    assert (m.backing / entry.relative_to(m.mnt) / "kernel.cubin").read_bytes() == a

    # The same through the descriptor that created and committed kernel.cubin.
    entry2 = m.mnt / "cache" / entry_name("vector_add", b)
    entry2.mkdir()
    fd = os.open(entry2 / "kernel.cubin", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b)
    dup = os.dup(fd)
    os.close(fd)  # the writer's close: published
    try:
        with open(entry2 / "kernel.cubin", "rb") as f:
            assert f.read() == b
            os.pwrite(dup, b"garbage!", 0)  # a new version, kept out of every cache
            assert os.pread(f.fileno(), len(b) + 1, 0) == b
        assert (entry2 / "kernel.cubin").read_bytes() == b
    finally:
        with pytest.raises(OSError) as e:
            os.close(dup)  # the new version is refused: the published cubin stays
    assert e.value.errno == errno.EINVAL
    assert (entry2 / "kernel.cubin").read_bytes() == b
