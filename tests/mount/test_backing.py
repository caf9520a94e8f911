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

from conftest import KCACHEFS, Mount, read_result, sample

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
    with open(big, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC
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
