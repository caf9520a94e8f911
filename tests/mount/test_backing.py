"""The backing disk fails under the mount: full (bytes, inodes) during a compile and a
staging write, and read-only. The writer gets the error, nothing partial is published,
existing entries stay readable and the daemon keeps answering. Uses a small ext4 image
on a loop device (root, as in CI)."""
import errno
import os
import shutil
import subprocess
import time

import pytest

from conftest import KCACHEFS, SHIM, Mount, elf_symbols, entry_name, read_result, sample

needs_loop = pytest.mark.skipif(not shutil.which("mkfs.ext4") or not os.path.exists("/dev/loop-control"),
                                reason="needs mkfs.ext4 and loop devices")


@pytest.fixture
def small_disk(tmp_path):
    """A 24 MiB ext4 filesystem with few inodes, mounted on tmp_path/disk."""
    image, disk = tmp_path / "disk.img", tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["truncate", "-s", "24M", str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-N", "256", str(image)], check=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(disk)], check=True)
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def mount_on(disk, tmp_path, options=()):
    (tmp_path / "m").mkdir()
    m = Mount(tmp_path / "m", options)
    os.rmdir(m.backing)
    m.backing = disk
    return m.start()


def fill(disk, inodes=False):
    """Use up the disk's bytes (one big file) or its inodes (many empty files)."""
    if inodes:
        d = disk / "filler-inodes"
        d.mkdir()
        i = 0
        while True:
            try:
                (d / str(i)).touch()
            except OSError as e:
                assert e.errno == errno.ENOSPC
                return lambda: shutil.rmtree(d)
            i += 1
    big = disk / "filler"
    fd = os.open(big, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        # Down to 0 bytes free: smaller writes after each ENOSPC, and again after a sync,
        # which gives back what delayed allocation had reserved.
        for chunk in (1 << 20, 64 << 10, 4 << 10, 4 << 10, 512):
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC
            os.fsync(fd)
    finally:
        os.close(fd)
    return big.unlink


@needs_loop
@pytest.mark.parametrize("inodes", [False, True], ids=["bytes", "inodes"])
def test_disk_full(small_disk, tmp_path, inodes):
    m = mount_on(small_disk, tmp_path, ["compile_timeout=60"])
    try:
        good = m.stage("saxpy", *sample("saxpy"))
        good_bytes = (good / "kernel.cubin").read_bytes()
        waiting = m.stage("vector_add", *sample("vector_add"))  # staged, not compiled yet
        (m.mnt / "cache" / "later").mkdir()
        free = fill(small_disk, inodes)
        # A compile with no room fails (EIO) and is not remembered; nothing is published.
        assert read_result(waiting / "kernel.cubin") == ("err", errno.EIO)
        assert not (small_disk / waiting.relative_to(m.mnt) / "kernel.cubin").exists()
        # A staging write gets ENOSPC itself.
        with pytest.raises(OSError) as e:
            with open(m.mnt / "cache" / "later" / "x.bin", "wb") as f:
                f.write(b"x" * (4 << 20))
        assert e.value.errno == errno.ENOSPC
        # What was published stays readable, and the daemon answers.
        assert (good / "kernel.cubin").read_bytes() == good_bytes
        assert os.listdir(m.mnt / "cache")
        assert os.listdir(small_disk / ".kcachefs" / "scratch") == []
        free()
        time.sleep(2.2)  # past the retry hold-off
        assert read_result(waiting / "kernel.cubin")[0] == "ok"
    finally:
        m.stop()


def fill_but(disk, room):
    """Fill the disk but for about room bytes (a pad file made first, removed after)."""
    pad = disk / "pad"
    pad.write_bytes(b"p" * room)
    os.sync()
    free = fill(disk)
    pad.unlink()
    return free


def padded(src, size=1 << 20):
    """src with a comment of size bytes after it: too big for what fill_but leaves."""
    return src + b"\n// " + b"x" * size + b"\n"


@needs_loop
def test_a_failed_staging_write_stages_nothing(small_disk, tmp_path):
    """A staging write that fails (ENOSPC, or short and then ENOSPC) is the client's error,
    and nothing is committed: not the empty file a buffered writer leaves, not the bytes
    written before the failure. The entry is as it was, and stages once there is room."""
    m = mount_on(small_disk, tmp_path, ["compile_timeout=60"])
    try:
        src, flags = sample("saxpy")
        cache = m.mnt / "cache"
        entries = [cache / entry_name("saxpy%d" % i, src, flags) for i in range(4)]
        for e in entries:
            e.mkdir(parents=True)
        for e in entries[:3]:
            (e / "kernel.flags").write_bytes(flags)  # the shim's order: flags first
        (entries[3] / "kernel.cu").write_bytes(src)
        # A writer that wrote fine before the disk filled, then failed.
        early = os.open(entries[1] / "kernel.cu", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        assert os.write(early, src[:100]) == 100
        free = fill(small_disk)
        # A plain file whose write failed is not staged by a rename either (below).
        failed_plain = cache / "x.cu"
        with pytest.raises(OSError) as e:
            with open(failed_plain, "wb") as f:
                f.write(src)
        assert e.value.errno == errno.ENOSPC
        # Python's way, as in the issue: nothing reaches the disk, close() commits nothing.
        with pytest.raises(OSError) as e:
            with open(entries[0] / "kernel.cu", "wb") as f:
                f.write(src)
        assert e.value.errno == errno.ENOSPC
        # kernel.flags the same way.
        with pytest.raises(OSError) as e:
            with open(entries[3] / "kernel.flags", "wb") as f:
                f.write(flags)
        assert e.value.errno == errno.ENOSPC
        # The early writer's next write fails; its close says so too, and the close of a
        # dup of it (a second FLUSH) commits nothing either. Its discarded stage gives its
        # block back.
        dup = os.dup(early)
        with pytest.raises(OSError) as e:
            os.write(early, src[100:] + b"x" * (1 << 20))
        assert e.value.errno == errno.ENOSPC
        with pytest.raises(OSError) as e:
            os.close(early)
        assert e.value.errno == errno.ENOSPC
        os.close(dup)
        free()
        # A short write (some room, not enough): the error stands, nothing commits.
        free = fill_but(small_disk, 64 << 10)
        with pytest.raises(OSError) as e:
            with open(entries[2] / "kernel.cu", "wb") as f:
                f.write(padded(src))
        assert e.value.errno == errno.ENOSPC
        free()
        for e, left in zip(entries, (["kernel.flags"],) * 3 + (["kernel.cu"],)):
            assert sorted(os.listdir(small_disk / e.relative_to(m.mnt))) == left, e
            assert sorted(os.listdir(e)) == left, e
            assert read_result(e / "kernel.cubin") == ("err", errno.ENOENT)
        with pytest.raises(OSError) as e:
            os.rename(failed_plain, entries[0] / "kernel.cu")
        assert e.value.errno == errno.EIO
        assert sorted(os.listdir(entries[0])) == ["kernel.flags"]
        failed_plain.write_bytes(src)  # written again in full: it stages
        os.rename(failed_plain, entries[0] / "kernel.cu")
        # With room again, each stages, and compiles the real source.
        for e in entries:
            (e / ("kernel.flags" if e == entries[3] else "kernel.cu")).write_bytes(
                flags if e == entries[3] else src)
            assert (e / "kernel.cu").read_bytes() == src
            assert "saxpy" in elf_symbols((e / "kernel.cubin").read_bytes())
    finally:
        m.stop()


@needs_loop
def test_the_shim_stages_again_after_a_failed_stage(small_disk, tmp_path, counting_nvcc):
    """The shim's kernel.cu does not fit: the shim goes to nvcc, and no partial stage is
    left behind, so its next call, with room, stages and compiles through the mount."""
    make_nvcc, calls = counting_nvcc
    m = mount_on(small_disk, tmp_path, ["nvcc=%s" % make_nvcc(), "compile_timeout=60"])
    try:
        d = tmp_path / "src"
        d.mkdir()
        (d / "k.cu").write_bytes(padded(sample("vector_add")[0]))
        args = [str(SHIM), d / "k.cu", "-cubin", "-o", m.mnt / "k.cubin", "-arch=sm_90a"]
        free = fill_but(small_disk, 64 << 10)
        subprocess.run(args, capture_output=True, timeout=300)  # nvcc's: room or not
        free()
        shim_dir = small_disk / "kcachefs-nvcc"
        staged = [sorted(os.listdir(e)) for e in shim_dir.iterdir()]
        assert staged == [["kernel.flags"]], "the flags were staged, the source failed"
        assert calls() == 0
        for _ in range(2):
            r = subprocess.run(args, capture_output=True, text=True, timeout=300)
            assert r.returncode == 0 and r.stderr == "", r.stderr
            assert "vector_add" in elf_symbols((m.mnt / "k.cubin").read_bytes())
        assert calls() == 1, "the second call went through the mount, the third was served"
    finally:
        m.stop()


@needs_loop
def test_space_freed_through_the_mount_is_free_when_the_call_returns(small_disk, tmp_path):
    """On a full disk, a file unlinked through the mount gives its space back before the
    call returns: a file of its size is written at once. A file a client holds open keeps
    working after its unlink."""
    m = mount_on(small_disk, tmp_path)
    try:
        size = 2 << 20
        d = m.mnt / "plain"
        d.mkdir()
        (d / "big").write_bytes(b"b" * size)
        held = d / "held"
        held.write_bytes(b"h" * 4096)
        free = fill(small_disk)
        with open(held, "rb") as f:
            held.unlink()
            assert f.read() == b"h" * 4096 and os.fstat(f.fileno()).st_size == 4096
        for i in range(4):
            # An O_PATH descriptor (no open, no handle) keeps the kernel's reference to the
            # inode, as a FORGET not sent yet does: the space must not wait for it.
            pinned = os.open(d / "big", os.O_PATH)
            (d / "big").unlink()
            (d / "big").write_bytes(b"u" * size)  # no sleep: the room is there
            os.close(pinned)
        assert (d / "big").read_bytes() == b"u" * size
        free()
    finally:
        m.stop()


@needs_loop
def test_read_only_backing(small_disk, tmp_path):
    m = mount_on(small_disk, tmp_path)
    try:
        good = m.stage("saxpy", *sample("saxpy"))
        good_bytes = (good / "kernel.cubin").read_bytes()
        waiting = m.stage("vector_add", *sample("vector_add"))
        subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
        started = time.monotonic()
        with pytest.raises(OSError) as e:
            (m.mnt / "new").mkdir()
        assert e.value.errno == errno.EROFS
        with pytest.raises(OSError) as e:
            (m.mnt / "f").write_bytes(b"x")
        assert e.value.errno == errno.EROFS
        assert read_result(waiting / "kernel.cubin") == ("err", errno.EIO)
        assert (good / "kernel.cubin").read_bytes() == good_bytes
        assert time.monotonic() - started < 30, "no hang on a read-only disk"
        subprocess.run(["mount", "-o", "remount,rw", str(small_disk)], check=True)
        time.sleep(2.2)
        assert read_result(waiting / "kernel.cubin")[0] == "ok"
    finally:
        m.stop()
        subprocess.run(["mount", "-o", "remount,rw", str(small_disk)], capture_output=True)
    # A daemon does not start on a read-only backing directory, and says why.
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    r = subprocess.run([str(KCACHEFS), "-f", str(small_disk), str(m.mnt)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "Read-only" in r.stderr, r.stderr
    assert not os.path.ismount(m.mnt)
