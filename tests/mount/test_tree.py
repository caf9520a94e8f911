"""The mount is a real directory tree on local disk with POSIX semantics (the mount's
contract, doc/clients.md)."""
import errno
import fcntl
import os
import subprocess
import sys

import pytest

from conftest import run_parallel


def test_files_and_directories(mount_factory):
    m = mount_factory()
    d = m.mnt / "a" / "b"
    d.mkdir(parents=True)
    with pytest.raises(FileExistsError):
        d.mkdir()
    f = d / "f.txt"
    f.write_text("hello")
    assert (m.backing / "a" / "b" / "f.txt").read_text() == "hello"
    with open(f, "a") as fh:
        fh.write(" world")
    assert f.read_text() == "hello world"
    os.truncate(f, 5)
    assert f.read_text() == "hello"
    os.chmod(f, 0o600)
    assert os.stat(f).st_mode & 0o777 == 0o600
    os.utime(f, (1000000, 2000000))
    assert os.stat(f).st_mtime == 2000000
    assert sorted(os.listdir(d)) == ["f.txt"]
    os.symlink("f.txt", d / "link")
    assert os.readlink(d / "link") == "f.txt"
    assert (d / "link").read_text() == "hello"
    os.link(f, d / "hard")
    assert os.stat(d / "hard").st_nlink == 2
    os.rename(d / "hard", d / "moved")
    assert (d / "moved").read_text() == "hello"
    for name in ("moved", "link", "f.txt"):
        os.unlink(d / name)
    with pytest.raises(OSError) as e:
        os.rmdir(m.mnt / "a")
    assert e.value.errno == errno.ENOTEMPTY
    os.rmdir(d)
    os.rmdir(m.mnt / "a")
    assert sorted(os.listdir(m.mnt)) == [".kcachefs"]
    st = os.statvfs(m.mnt)
    assert st.f_blocks > 0 and st.f_bsize > 0


def test_rename_directory_onto_nonempty_fails_cleanly(mount_factory):
    m = mount_factory()
    (m.mnt / "src").mkdir()
    (m.mnt / "src" / "x").write_text("1")
    (m.mnt / "dst").mkdir()
    (m.mnt / "dst" / "y").write_text("2")
    with pytest.raises(OSError) as e:
        os.rename(m.mnt / "src", m.mnt / "dst")
    assert e.value.errno in (errno.ENOTEMPTY, errno.EEXIST)
    (m.mnt / "empty").mkdir()
    os.rename(m.mnt / "src", m.mnt / "empty")
    assert (m.mnt / "empty" / "x").read_text() == "1"


def test_fsync_on_readonly_descriptors_and_directories(mount_factory):
    m = mount_factory()
    f = m.mnt / "f"
    f.write_bytes(b"data")
    fd = os.open(f, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    fd = os.open(m.mnt, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(fd)
    os.close(fd)


def test_no_stale_negative_lookup(mount_factory):
    """A name created by one process is visible to the next lookup of another."""
    m = mount_factory()
    target = m.mnt / "later"
    assert not target.exists()  # the kernel has now seen a miss
    subprocess.run([sys.executable, "-c", "open(%r, 'w').write('x')" % str(target)], check=True)
    assert target.read_text() == "x"
    # A directory renamed into place right after a failed lookup.
    assert not (m.mnt / "entry").exists()
    (m.mnt / "staging").mkdir()
    subprocess.run(["mv", str(m.mnt / "staging"), str(m.mnt / "entry")], check=True)
    assert (m.mnt / "entry").is_dir()


def test_32_processes_mkdir_p_shared_parents(mount_factory):
    m = mount_factory()

    def worker(i, root):
        os.makedirs(os.path.join(root, "p", "q", "r", "own%d" % i), exist_ok=True)
        return sorted(os.listdir(os.path.join(root, "p", "q", "r")))

    results = run_parallel(32, worker, str(m.mnt))
    assert all(isinstance(r, list) for r in results), results
    assert sorted(os.listdir(m.mnt / "p" / "q" / "r")) == sorted("own%d" % i for i in range(32))


def test_locks_are_exclusive(mount_factory):
    m = mount_factory()
    lock = m.mnt / "build.lock"
    lock.write_text("")
    counter = m.mnt / "counter"
    counter.write_text("0")

    def worker(i, lock, counter, kind):
        for _ in range(20):
            with open(lock, "r+") as lf:
                if kind == "flock":
                    fcntl.flock(lf, fcntl.LOCK_EX)
                else:
                    fcntl.lockf(lf, fcntl.LOCK_EX)
                v = int(open(counter).read())
                with open(counter, "w") as cf:
                    cf.write(str(v + 1))
        return True

    for kind in ("flock", "fcntl"):
        counter.write_text("0")
        assert run_parallel(8, worker, str(lock), str(counter), kind) == [True] * 8
        assert counter.read_text() == "160", kind


def test_renames_over_final_names_never_show_partial_files(mount_factory):
    m = mount_factory()
    d = m.mnt / "d"
    d.mkdir()
    payload = os.urandom(200000)

    def worker(i, d, payload):
        if i < 2:  # writers
            for n in range(40):
                tmp = os.path.join(d, ".tmp.%d.%d" % (i, n))
                with open(tmp, "wb") as f:
                    f.write(payload)
                os.rename(tmp, os.path.join(d, "final%d" % (n % 4)))
            return "w"
        bad = 0
        for _ in range(60):
            for name in os.listdir(d):
                if name.startswith("final"):
                    with open(os.path.join(d, name), "rb") as f:  # never ENOENT
                        if f.read() != payload:
                            bad += 1
        return bad

    results = run_parallel(6, worker, str(d), payload)
    assert results[:2] == ["w", "w"] and results[2:] == [0] * 4, results


def test_modes_are_the_clients_not_the_daemons_umask(mount_factory):
    """The kernel applies the caller's umask; the daemon must not apply its own again
    (a group-shared directory needs 0770 and 0660, not 0750 and 0640)."""
    m = mount_factory()
    old = os.umask(0)
    try:
        os.mkdir(m.mnt / "shared", 0o770)
        fd = os.open(m.mnt / "shared" / "f", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o660)
        os.close(fd)
        os.umask(0o027)
        os.mkdir(m.mnt / "private", 0o777)
    finally:
        os.umask(old)
    assert os.stat(m.mnt / "shared").st_mode & 0o7777 == 0o770
    assert os.stat(m.mnt / "shared" / "f").st_mode & 0o7777 == 0o660
    assert os.stat(m.mnt / "private").st_mode & 0o7777 == 0o750
    assert os.stat(m.backing / "shared" / "f").st_mode & 0o7777 == 0o660
