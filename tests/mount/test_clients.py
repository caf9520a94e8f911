"""Misbehaving and racing clients: a stager killed mid-write, empty and unwritten stages,
refusals a shell ignores, nine stagers of one entry, locks on a file that is unlinked and
recreated."""
import errno
import fcntl
import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from conftest import (KERNELS, elf_symbols, entry_name, read_result, run_parallel, sample,
                      write_script)

SLOW_STAGER = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
os.write(fd, b'extern "C" __global__ void half(float *x) {')
sys.stdout.write('written\\n'); sys.stdout.flush()
time.sleep(60)
os.write(fd, b' x[0] = 1.0f; }\\n')
os.close(fd)
"""


def test_stager_killed_mid_write_stages_nothing(mount_factory):
    m = mount_factory()
    entry = m.mnt / "cache" / entry_name("half", b"x")
    entry.mkdir(parents=True)
    (entry / "kernel.flags").write_bytes(b"-O3\n")
    p = subprocess.Popen([sys.executable, "-c", SLOW_STAGER, str(entry / "kernel.cu")],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "written\n"
    p.send_signal(signal.SIGKILL)
    p.wait()
    time.sleep(0.3)  # the kernel releases the dead process's file
    assert not (entry / "kernel.cu").exists()
    assert read_result(entry / "kernel.cubin") == ("err", errno.ENOENT)
    assert os.listdir(m.backing / ".kcachefs" / "tmp") == []
    # The entry is still usable: a complete source stages and compiles.
    src = sample("vector_add")[0]
    (entry / "kernel.cu").write_bytes(src)
    assert "vector_add" in elf_symbols((entry / "kernel.cubin").read_bytes())


def test_stager_killed_before_its_first_write_stages_nothing(mount_factory):
    """Created, then killed before writing a byte: no empty kernel.cu is committed (it
    would hold the entry's name against the real source for good)."""
    m = mount_factory()
    entry = m.mnt / "cache" / entry_name("empty", b"x")
    entry.mkdir(parents=True)
    for name in ("kernel.cu", "kernel.flags"):
        p = subprocess.Popen([sys.executable, "-c",
                              "import os, signal, sys\n"
                              "os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)\n"
                              "os.kill(os.getpid(), signal.SIGKILL)\n", str(entry / name)])
        p.wait()
        assert p.returncode == -signal.SIGKILL
    time.sleep(0.3)
    assert os.listdir(entry) == []
    assert os.listdir(m.backing / ".kcachefs" / "tmp") == []
    # An empty kernel.flags made on purpose (touch) still stages, when its close returns.
    (entry / "kernel.flags").touch()
    assert os.listdir(entry) == ["kernel.flags"]


def test_a_write_cut_by_the_file_size_limit_stages_nothing(mount_factory):
    """The kernel cuts a write at the writer's RLIMIT_FSIZE and fails the next with EFBIG
    before the daemon sees it: the stage of what got through is not committed, and close()
    says EFBIG. The same bytes from a writer with no limit stage."""
    m = mount_factory()
    src, flags = sample("saxpy")
    entry = m.mnt / "cache" / entry_name("saxpy", src, flags)
    entry.mkdir(parents=True)
    r = subprocess.run([sys.executable, "-c",
                        "import os, resource, signal, sys\n"
                        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
                        "resource.setrlimit(resource.RLIMIT_FSIZE, (100, 100))\n"
                        "fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)\n"
                        "assert os.write(fd, sys.stdin.buffer.read()) == 100\n"
                        "try:\n    os.close(fd)\nexcept OSError as e:\n    sys.exit(e.errno)\n",
                        str(entry / "kernel.cu")], input=src, capture_output=True)
    assert r.returncode == errno.EFBIG, r.stderr
    assert os.listdir(entry) == []
    (entry / "kernel.cu").write_bytes(src)
    (entry / "kernel.flags").write_bytes(flags)
    assert "saxpy" in elf_symbols((entry / "kernel.cubin").read_bytes())


def test_every_stage_is_committed_when_its_close_returns(mount_factory, tmp_path):
    """An empty or never-written kernel.flags or kernel.cu, made by
    open(O_CREAT|O_TRUNC), open(O_CREAT), mknod or a shell's "> file", is staged by the
    time close() (or mknod) returns: the next open of kernel.cubin sees the recipe. The
    compiler here rejects every compile, so that open answers EIO (recipe seen) at once
    instead of ENOENT (recipe missed). Before the fix, 26-55 of 100 empty kernel.flags were
    missed."""
    nvcc = write_script(tmp_path / "nvcc-rejects",
                        'case "$*" in *-cubin*) echo "error: rejected by the test" >&2; exit 1;; esac\n'
                        'exec /usr/local/cuda/bin/nvcc "$@"\n')
    m = mount_factory(["nvcc=%s" % nvcc])
    src = sample("vector_add")[0]
    ways = {
        "O_CREAT|O_TRUNC": lambda p: open(p, "wb").close(),
        "O_CREAT, never written": lambda p: os.close(os.open(p, os.O_CREAT | os.O_WRONLY, 0o644)),
        "mknod": lambda p: os.mknod(p, 0o644 | stat.S_IFREG),
        "sh >": lambda p: subprocess.run(["sh", "-c", ': > "$1"', "sh", str(p)], check=True),
    }
    missed = {}
    for way, make in ways.items():
        for role, other, data in (("kernel.flags", "kernel.cu", src),
                                  ("kernel.cu", "kernel.flags", b"-O3\n")):
            tries = 100 if (way, role) == ("O_CREAT|O_TRUNC", "kernel.flags") else 10
            for i in range(tries):
                entry = m.mnt / "cache" / entry_name("e", ("%s %s %d" % (way, role, i)).encode())
                entry.mkdir(parents=True)
                (entry / other).write_bytes(data)
                try:
                    make(entry / role)
                    got = read_result(entry / "kernel.cubin")
                except OSError as e:
                    got = ("err", e.errno)
                if got != ("err", errno.EIO):
                    missed.setdefault("%s %s" % (way, role), []).append(got)
    assert not missed, {k: "%d: %s" % (len(v), v[0]) for k, v in missed.items()}
    # mknod gives no staged name to anything but a regular file, nor to an empty cubin
    entry = m.mnt / "cache" / entry_name("mknod", b"x")
    entry.mkdir()
    with pytest.raises(OSError) as e:
        os.mknod(entry / "kernel.cu", 0o644 | stat.S_IFIFO)
    assert e.value.errno == errno.EPERM
    with pytest.raises(OSError) as e:
        os.mknod(entry / "kernel.cubin", 0o644 | stat.S_IFREG)
    assert e.value.errno == errno.EINVAL
    os.mkfifo(entry / "fifo")  # other names: as on any filesystem
    assert stat.S_ISFIFO(os.lstat(entry / "fifo").st_mode)


def sh(entry, script):
    """Run script in entry with sh, which ignores close()'s status of a redirection."""
    r = subprocess.run(["sh", "-c", script], cwd=entry, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_a_refusal_a_shell_ignored_is_told_by_the_entry(mount_factory):
    """A staged file refused at close by a writer that ignores close's
    status leaves kernel.log saying what was refused and why, and kernel.cubin answers EIO
    (not ENOENT) while that refusal is the entry's latest event; a valid stage clears it."""
    m = mount_factory()
    src, flags = sample("vector_add")
    entry = m.mnt / "cache" / entry_name("refused", src)
    entry.mkdir(parents=True)
    (entry / "kernel.cu").write_bytes(src)
    sh(entry, "echo -ccbin=/bin/sh > kernel.flags")
    assert read_result(entry / "kernel.cubin") == ("err", errno.EIO)
    log = (entry / "kernel.log").read_text()
    assert "kernel.flags refused" in log and "-ccbin" in log, log
    sh(entry, "echo '// other bytes' > kernel.cu")
    assert read_result(entry / "kernel.cubin") == ("err", errno.EIO)
    assert "kernel.cu refused: other bytes are already staged" in (entry / "kernel.log").read_text()
    assert (entry / "kernel.cu").read_bytes() == src, "what was stored stays"
    sh(entry, "printf -- '-O3\\n' > kernel.flags")  # a valid stage: the refusal is over
    assert "vector_add" in elf_symbols((entry / "kernel.cubin").read_bytes())
    # after a remount too, until a stage succeeds
    other = m.mnt / "cache" / entry_name("other", src)
    other.mkdir()
    (other / "kernel.cu").write_bytes(src)
    sh(other, "echo --run > kernel.flags")
    m.stop()
    m.start()
    assert read_result(other / "kernel.cubin") == ("err", errno.EIO)
    # A client's cubin refused, in an entry that has none: the log says why, and the name
    # stays free for the client's next try.
    client = m.mnt / "cache" / entry_name("notelf", b"x")
    client.mkdir()
    sh(client, "echo not an ELF file > kernel.cubin")
    assert "kernel.cubin refused" in (client / "kernel.log").read_text()
    assert read_result(client / "kernel.cubin") == ("err", errno.ENOENT)


def test_a_shell_redirection_stages_the_whole_file(mount_factory):
    """sh's "> kernel.cu" opens the file, dup2()s it to 1 and closes the first descriptor
    before it writes: that close must not commit an empty stage."""
    m = mount_factory()
    src, flags = sample("vector_add")
    entry = m.mnt / "cache" / entry_name("redir", src)
    entry.mkdir(parents=True)
    r = subprocess.run(["sh", "-c", 'cat "$1" > "$2/kernel.cu" && printf -- "-O3\\n" > "$2/kernel.flags"',
                        "sh", str(KERNELS / "vector_add.cu"), str(entry)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (entry / "kernel.cu").read_bytes() == src
    assert (entry / "kernel.flags").read_bytes() == b"-O3\n"
    assert "vector_add" in elf_symbols((entry / "kernel.cubin").read_bytes())


def stage_and_open(i, entry, src, flags, other):
    """Stager i: stage (the 9th stages other bytes, if given) and read kernel.cubin."""
    mine = other if (i == 8 and other) else src
    out = []
    for name, data in (("kernel.cu", mine), ("kernel.flags", flags)):
        try:
            with open(os.path.join(entry, name), "wb") as f:
                f.write(data)
            out.append("staged")
        except OSError as e:
            out.append(errno.errorcode[e.errno])
    return out, read_result(os.path.join(entry, "kernel.cubin"))


def test_nine_stagers_same_bytes_one_compile(mount_factory):
    m = mount_factory()
    src, flags = sample("saxpy")
    entry = m.mnt / "cache" / entry_name("saxpy", src, flags)
    entry.mkdir(parents=True)
    results = run_parallel(9, stage_and_open, str(entry), src, flags, None)
    assert all(r[0] == ["staged", "staged"] for r in results), results
    assert len({r[1] for r in results}) == 1 and results[0][1][0] == "ok", results
    assert m.stats()["compiles_total"] == 1


def test_ninth_stager_with_other_bytes_is_refused(mount_factory):
    m = mount_factory()
    src, flags = sample("saxpy")
    other = sample("vector_add")[0]
    entry = m.mnt / "cache" / entry_name("saxpy", src, flags)
    entry.mkdir(parents=True)
    results = run_parallel(9, stage_and_open, str(entry), src, flags, other)
    staged = (entry / "kernel.cu").read_bytes()
    assert staged in (src, other)
    loser = other if staged == src else src
    for i, (outcome, cubin) in enumerate(results):
        mine = other if i == 8 else src
        assert outcome == (["staged", "staged"] if mine == staged else ["EEXIST", "staged"])
        assert cubin[0] == "ok"
    # One cubin for everyone, compiled from the source that is staged, never the other.
    assert len({r[1] for r in results}) == 1
    symbols = elf_symbols((entry / "kernel.cubin").read_bytes())
    want = "saxpy" if staged == src else "vector_add"
    assert want in symbols and ("vector_add" if want == "saxpy" else "saxpy") not in symbols
    assert m.stats()["compiles_total"] == 1 and loser != staged


def test_an_empty_file_unlinked_between_lookup_and_open_still_opens(mount_factory):
    """A name looked up just before another process unlinks it: the open that follows (here
    a reopen of an O_PATH descriptor, which holds the looked-up inode as a racing open does)
    opens the unlinked empty file, as on a local filesystem, and its lock works. A file with
    data is let go of at once to free its space (test_backing.py), so there it is ESTALE."""
    m = mount_factory()
    for name, data, want in (("empty.lock", b"", "ok"), ("data", b"d" * 8192, "ESTALE")):
        p = m.mnt / name
        p.write_bytes(data)
        pinned = os.open(p, os.O_PATH)
        try:
            p.unlink()
            try:
                with open(f"/proc/self/fd/{pinned}", "a+") as f:
                    fcntl.flock(f, fcntl.LOCK_EX)
                    got = "ok"
            except OSError as e:
                got = errno.errorcode[e.errno]
            assert got == want, name
        finally:
            os.close(pinned)


def test_locks_while_the_lock_file_is_unlinked_and_recreated(mount_factory):
    """16 processes lock a lock file (flock and fcntl) while one unlinks and recreates it:
    exactly the semantics of a local filesystem (a lock is on the file, not the name)."""
    m = mount_factory()
    lock = m.mnt / "build.lock"
    lock.write_text("")

    def worker(i, lock):
        if i == 16:
            for _ in range(100):
                try:
                    os.unlink(lock)
                except FileNotFoundError:
                    pass
                open(lock, "a").close()
            return "recreator"
        held = 0
        for n in range(30):
            with open(lock, "a+") as f:
                if i % 2:
                    fcntl.flock(f, fcntl.LOCK_EX)
                else:
                    fcntl.lockf(f, fcntl.LOCK_EX)
                held += 1
        return held

    results = run_parallel(17, worker, str(lock))
    assert results[16] == "recreator"
    assert results[:16] == [30] * 16, results
