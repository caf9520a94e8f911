"""Faults found by trying to break the mount, each pinned by a test: nothing staged ever
changes in place, nothing corrupt is served, and failures with a passing cause are not
remembered."""
import errno
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import NVCC, run_parallel, elf_symbols, entry_name, read_result, sample, start_openers, write_script
from kcmount import wait_until

PART_A = b'extern "C" __global__ void part_a(float *x) { x[threadIdx.x] += 1.0f; }\n'
PART_B = b'extern "C" __global__ void part_b(float *x) { x[threadIdx.x] *= 2.0f; }\n'


def new_entry(m, name, src):
    entry = m.mnt / "cache" / entry_name(name, src)
    entry.mkdir(parents=True)
    (entry / "kernel.flags").write_bytes(b"-O3\n")
    return entry


def test_child_exec_while_writing_does_not_stage_half_a_source(mount_factory):
    """A child that exec()s closes its copy of the descriptor: not the writer's close."""
    m = mount_factory()
    entry = new_entry(m, "two", PART_A + PART_B)
    with open(entry / "kernel.cu", "wb", buffering=0) as f:
        f.write(PART_A)
        subprocess.run(["true"], check=True)
        f.write(PART_B)
    assert (entry / "kernel.cu").read_bytes() == PART_A + PART_B
    symbols = elf_symbols((entry / "kernel.cubin").read_bytes())
    assert {"part_a", "part_b"} <= symbols


def test_staged_source_cannot_change_through_a_dup(mount_factory):
    m = mount_factory()
    entry = new_entry(m, "dup", PART_A)
    fd = os.open(entry / "kernel.cu", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, PART_A)
    fd2 = os.dup(fd)
    os.close(fd)  # the writer's close: staged now
    assert (entry / "kernel.cu").read_bytes() == PART_A
    os.ftruncate(fd2, 0)  # a new version of the stage, refused at close
    with pytest.raises(OSError) as e:
        os.close(fd2)
    assert e.value.errno == errno.EEXIST
    assert (entry / "kernel.cu").read_bytes() == PART_A


def test_directory_renamed_into_an_entry_makes_its_files_staged(mount_factory):
    """DeepGEMM's rename of tmp/<id> into cache/: what is inside is staged from then on."""
    m = mount_factory()
    src, flags = sample("vector_add")
    tmp = m.mnt / "tmp" / "123-abc"
    tmp.mkdir(parents=True)
    (tmp / "kernel.flags").write_bytes(flags)
    fd = os.open(tmp / "kernel.cu", os.O_CREAT | os.O_RDWR, 0o644)
    os.write(fd, src)
    entry = m.mnt / "cache" / entry_name("dr", src, flags)
    entry.parent.mkdir()
    os.rename(tmp, entry)
    cubin = (entry / "kernel.cubin").read_bytes()
    with pytest.raises(OSError) as e:
        os.truncate(entry / "kernel.cu", 10)
    assert e.value.errno == errno.EPERM
    os.lseek(fd, 0, 0)
    with pytest.raises(OSError) as e:  # the descriptor names no stage
        os.write(fd, b"garbage!")
    assert e.value.errno == errno.EBADF
    os.close(fd)
    assert (entry / "kernel.cu").read_bytes() == src
    assert (entry / "kernel.cubin").read_bytes() == cubin


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_cubin_damaged_on_disk_is_never_served(mount_factory, damage):
    """The kernel keeps the entry for an hour; the open checks the record anyway."""
    m = mount_factory()
    entry = m.stage("vector_add", *sample("vector_add"))
    good = (entry / "kernel.cubin").read_bytes()
    os.stat(entry / "kernel.cubin")
    backing = m.backing / entry.relative_to(m.mnt) / "kernel.cubin"
    os.chmod(backing, 0o644)
    with open(backing, "r+b") as f:
        if damage == "flip":
            f.seek(100)
            c = f.read(1)
            f.seek(100)
            f.write(bytes([c[0] ^ 0xFF]))
        else:
            f.truncate(len(good) // 2)
    for _ in range(3):
        r = read_result(entry / "kernel.cubin")
        assert r == ("err", errno.EIO) or r[1:3] == (read_result(backing)[1], len(good)), r
    assert m.stats()["corrupt_cubins_total"] >= 1
    # Rebuilt from the recipe once the kernel has dropped its entry (sent right after the
    # failed open): the bytes on disk and through the mount are a good cubin again.
    wait_until(lambda: read_result(entry / "kernel.cubin")[0] == "ok", "not rebuilt", 10)
    assert (entry / "kernel.cubin").read_bytes() == backing.read_bytes() == good


def test_compiler_failing_without_an_error_message_is_not_remembered(mount_factory, tmp_path):
    """Exit status 1 and no diagnostics (a full disk can do that): a passing failure."""
    marker = tmp_path / "failed-once"
    nvcc = write_script(tmp_path / "nvcc-silent-fail",
                        'case "$*" in *-cubin*) [ -e %s ] || { touch %s; exit 1; };; esac\n'
                        'exec /usr/local/cuda/bin/nvcc "$@"\n' % (marker, marker))
    m = mount_factory(["nvcc=%s" % nvcc])
    entry = m.stage("vector_add", *sample("vector_add"))
    assert read_result(entry / "kernel.cubin") == ("err", errno.EIO)
    assert "without reporting an error" in (entry / "kernel.log").read_text()
    time.sleep(2.2)  # the hold-off after a passing failure
    assert read_result(entry / "kernel.cubin")[0] == "ok"


def tagged(tag):
    """Pids of the live processes (no zombies) whose command line holds tag."""
    out = subprocess.run(["ps", "ax", "-o", "pid=,stat=,args="], capture_output=True,
                         text=True).stdout
    return [int(l.split(None, 2)[0]) for l in out.splitlines()
            if tag in l and l.split(None, 2)[1][0] != "Z"]


def watcher_of(m, at_most_one=False):
    """The pid of the live watcher of m's daemon, as ps shows it (at_most_one: None when
    there is none)."""
    title = "kcachefs-watch of pid %d" % m.proc.pid
    out = subprocess.run(["ps", "ax", "-o", "pid=,stat=,args="], capture_output=True,
                         text=True).stdout
    pids = [int(l.split()[0]) for l in out.splitlines()
            if l.split(None, 2)[2] == title and l.split(None, 2)[1][0] != "Z"]
    if at_most_one and not pids:
        return None
    assert len(pids) == 1, out
    return pids[0]


def hanging_compile(m, tag):
    """Open a staged kernel on m (its compiler hangs): returns the reader, once tag runs."""
    entry = m.stage("vector_add", *sample("vector_add"))
    reader = subprocess.Popen(["cat", str(entry / "kernel.cubin")], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    wait_until(lambda: tagged(tag), "compiler did not start", 30)
    return reader


@pytest.mark.parametrize("uids", ["own", "daemon"])
def test_compiler_of_a_killed_daemon_is_killed_at_restart(mount_factory, tmp_path, uids):
    """The daemon and its watcher both SIGKILLed (systemd kills the whole unit so): a tool
    of the compile outlives them, and the restart that claims the range kills it. As the
    daemon's uid, no kill of a uid range can find it: only its group, recorded in scratch,
    whose leader (the compiler) died with the daemon."""
    # this run's own sleep: another suite on the machine may run the same test
    tag = "sleep 1000.%d%d" % (os.getpid(), time.monotonic_ns() % 1000000)
    # a tool of the compiler's: the compiler itself dies with the thread that started it
    nvcc = write_script(tmp_path / "nvcc-hangs", 'case "$*" in *-cubin*) %s & wait;; esac\n'
                        'exec /usr/local/cuda/bin/nvcc "$@"\n' % tag)
    opts = ["compile_uids=daemon"] if uids == "daemon" else []
    m = mount_factory(["nvcc=%s" % nvcc] + opts)
    try:
        reader = hanging_compile(m, tag)
        m.proc.send_signal(signal.SIGSTOP)  # so that it starts no watcher in place of this one
        os.kill(watcher_of(m), signal.SIGKILL)
        m.kill()
        reader.wait(timeout=30)
        assert tagged(tag)
        m2 = mount_factory(opts, name="m")
        wait_until(lambda: not tagged(tag), "orphaned compiler survived the restart", 10)
    finally:
        for pid in tagged(tag):
            os.kill(pid, signal.SIGKILL)
    if uids == "daemon":  # the group is the only way: the restart must say it killed it
        assert "left by a previous daemon" in m2.daemon_log()
        return
    # The restart that claims the dead daemon's range of compile uids says it killed what
    # ran there (another suite's daemon on this machine may claim that range first).
    ranges = re.findall(r"compiles run as uids (\d+)\+", m.daemon_log() + m2.daemon_log())
    if len(set(ranges)) == 1:
        assert "left by a previous daemon" in m2.daemon_log()


def test_a_killed_watcher_is_replaced(mount_factory, tmp_path):
    """The watcher SIGKILLed alone (by hand, the OOM killer) while a compile runs as the
    daemon's uid (which no restart can tell from the daemon's own): the daemon starts
    another, and the compile's tools still end with a daemon SIGKILLed later."""
    tag = "sleep 1000.%d%d" % (os.getpid(), time.monotonic_ns() % 1000000)
    nvcc = write_script(tmp_path / "nvcc-hangs", 'case "$*" in *-cubin*) %s & wait;; esac\n'
                        'exec /usr/local/cuda/bin/nvcc "$@"\n' % tag)
    m = mount_factory(["nvcc=%s" % nvcc, "compile_uids=daemon"])
    try:
        reader = hanging_compile(m, tag)
        first = watcher_of(m)
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: watcher_of(m, at_most_one=True) not in (None, first),
                   "no watcher took the killed one's place", 10)
        m.kill()
        reader.wait(timeout=30)
        wait_until(lambda: not tagged(tag), "a tool of a dead daemon's compile runs on", 30)
    finally:
        for pid in tagged(tag):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("uids", ["own", "daemon"])
def test_compile_of_a_killed_daemon_ends_with_it(mount_factory, tmp_path, uids):
    """A SIGKILLed daemon's compile ends with it, not at the next start: nvcc's own process
    and the tools it started (a child, a grandchild), and, under a uid of its own, one that
    left the process group; the dead mount answers its reader and is unmounted."""
    tag = "sleep 1000.%d%d" % (os.getpid(), time.monotonic_ns() % 1000000)
    left = "setsid %s &" % tag if uids == "own" else ""  # with the daemon's uid: by group
    nvcc = write_script(tmp_path / "nvcc-hangs",
                        'case "$*" in *-cubin*) %s & sh -c "%s & wait" & %s exec %s;; esac\n'
                        'exec /usr/local/cuda/bin/nvcc "$@"\n' % (tag, tag, left, tag))
    m = mount_factory(["nvcc=%s" % nvcc] + (["compile_uids=daemon"] if uids == "daemon" else []))
    try:
        reader = hanging_compile(m, tag)
        want = 5 if uids == "own" else 4  # nvcc, its sleep, sh and its sleep (, setsid's)
        wait_until(lambda: len(tagged(tag)) >= want, "the compiler's tools did not start", 30)
        m.kill()  # and the dead mount unmounted
        assert not os.path.ismount(m.mnt)
        reader.wait(timeout=30)  # the mount went with the daemon: nothing kept /dev/fuse
        wait_until(lambda: not tagged(tag), "a compiler process of a dead daemon runs on", 30)
    finally:
        for pid in tagged(tag):
            os.kill(pid, signal.SIGKILL)


def test_real_nvccs_tools_end_with_a_killed_daemon(mount_factory, tmp_path):
    """Real nvcc, whose host compiler (a gcc that hangs in its preprocessing, with a child)
    runs when the daemon is SIGKILLed: nvcc, that gcc and its child all end with it."""
    ccbin = tmp_path / "ccbin"  # in nvcc's and the gcc's command lines: this run's own
    ccbin.mkdir()
    tag = "sleep 1000.%d%d" % (os.getpid(), time.monotonic_ns() % 1000000)
    write_script(ccbin / "gcc", 'case "$*" in *__CUDA_ARCH__*) %s & wait;; esac\n'
                 'exec /usr/bin/gcc "$@"\n' % tag)
    nvcc = write_script(tmp_path / "nvcc-ccbin", 'exec %s -ccbin %s "$@"\n' % (NVCC, ccbin))
    m = mount_factory(["nvcc=%s" % nvcc])
    try:
        hanging_compile(m, tag)
        assert len(tagged(str(ccbin))) >= 2  # nvcc and the gcc
        m.kill()
        wait_until(lambda: not tagged(tag) and not tagged(str(ccbin)),
                   "a tool of a dead daemon's nvcc runs on", 30)
    finally:
        for pid in tagged(tag) + tagged(str(ccbin)):
            os.kill(pid, signal.SIGKILL)


def test_only_staged_files_carry_staged_names(mount_factory):
    m = mount_factory()
    entry = new_entry(m, "names", PART_A)
    for make in (lambda p: os.symlink("/etc/passwd", p), lambda p: os.mkdir(p)):
        with pytest.raises(OSError) as e:
            make(entry / "kernel.cubin")
        assert e.value.errno == errno.EPERM
    assert sorted(os.listdir(entry)) == ["kernel.flags"]


def test_new_flags_replace_an_autocompiled_cubin(mount_factory):
    """Staging kernel.flags after an autocompile is a new recipe: the old cubin goes, also
    from the kernel's caches, and the next open compiles with the flags."""
    m = mount_factory(["autocompile"])
    src = sample("vector_add")[0]
    entry = m.mnt / "cache" / entry_name("auto", src)
    entry.mkdir(parents=True)
    (entry / "kernel.cu").write_bytes(src)
    plain = (entry / "kernel.cubin").read_bytes()
    os.stat(entry / "kernel.cubin")  # cached by the kernel for an hour
    (entry / "kernel.flags").write_bytes(b"-lineinfo\n")
    wait_until(lambda: (entry / "kernel.cubin").read_bytes() != plain,
               "the cubin of the old recipe is still served", 10)
    assert m.stats()["compiles_total"] == 2
    assert "-lineinfo" in open(m.backing / entry.relative_to(m.mnt) / "kernel.flags").read()


def test_sigterm_during_compile_gives_every_waiter_eio(mount_factory, tmp_path):
    release = tmp_path / "never"
    nvcc = write_script(tmp_path / "nvcc-gated",
                        'case "$*" in *-cubin*) while [ ! -e %s ]; do sleep 0.05; done;; esac\n'
                        'exec /usr/local/cuda/bin/nvcc "$@"\n' % release)
    m = mount_factory(["nvcc=%s" % nvcc])
    entry = m.stage("vector_add", *sample("vector_add"))
    openers = start_openers(entry / "kernel.cubin", 4)
    wait_until(lambda: m.stats()["waits_total"] >= 4, m.stats, 30)
    m.proc.send_signal(signal.SIGTERM)
    outs = [p.communicate(timeout=60)[0].split() for p in openers]
    assert outs == [["err", str(errno.EIO)]] * 4, outs
    assert m.proc.wait(timeout=30) == 0


def test_nothing_in_the_backing_or_in_flags_can_stall_request_threads(mount_factory, tmp_path):
    """A FIFO put in the backing directory where kernel.flags goes, and include directories
    that point into the mount itself at a compiling cubin: lookups, stages and other
    requests still answer (found by a break-it pass: both used to hold FUSE threads)."""
    # compile_uids=daemon: the compile must reach a FIFO in this test's private directory
    m = mount_factory(["compile_timeout=20", "compile_uids=daemon"])
    src = sample("vector_add")[0]
    fifo_entry = m.mnt / "cache" / entry_name("fifo", src)
    fifo_entry.mkdir(parents=True)
    (fifo_entry / "kernel.cu").write_bytes(src)
    os.mkfifo(m.backing / fifo_entry.relative_to(m.mnt) / "kernel.flags")
    assert read_result(fifo_entry / "kernel.cubin") == ("err", errno.ENOENT)
    # A compile that blocks (its source includes a FIFO nobody writes) ...
    blocker = tmp_path / "never"
    os.mkfifo(blocker)
    s = m.stage("blocked", b'#include "%s"\n' % bytes(blocker))
    opener = subprocess.Popen(["cat", str(s / "kernel.cubin")], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    # ... and 12 stagers whose include directory is that compiling cubin, through the mount.
    def stage(i):
        e = m.mnt / "cache" / entry_name("inc%d" % i, src)
        e.mkdir(parents=True, exist_ok=True)
        (e / "kernel.cu").write_bytes(src)
        try:
            (e / "kernel.flags").write_bytes(b"-I%s\n" % bytes(s / "kernel.cubin"))
            return "staged"
        except OSError as err:
            return errno.errorcode[err.errno]
    results = run_parallel(12, stage, timeout=60)
    assert set(results) <= {"staged"}, results
    listed = []
    t = threading.Thread(target=lambda: listed.append(os.listdir(m.mnt / "cache")))
    t.start()
    t.join(timeout=10)
    assert listed, "the mount stopped answering"
    opener.kill()
    opener.wait()
    with open(blocker, "wb"):  # let the blocked compile finish, if it still runs
        pass


@pytest.mark.parametrize("script", [
    '{ cat "$1"; cat "$2"; } > "$3/kernel.cu"',
    'exec 8> "$3/kernel.cu"; cat "$1" >&8; cat "$2" >&8; exec 8>&-',
], ids=["group", "exec-fd"])
def test_sibling_writers_of_an_inherited_descriptor_stage_the_whole_file(mount_factory, tmp_path,
                                                                         script):
    """Two commands writing in turn through a descriptor their shell created and still
    holds: the first one's exit is a writer's close, but the shell's copy says a sibling may
    write next, so it does not commit (it staged PART_A alone, and the whole file then got
    EEXIST). The stage is committed at the last close, whole."""
    m = mount_factory()
    entry = new_entry(m, "siblings", PART_A + PART_B)
    (tmp_path / "a.cu").write_bytes(PART_A)
    (tmp_path / "b.cu").write_bytes(PART_B)
    r = subprocess.run(["bash", "-c", script, "bash", str(tmp_path / "a.cu"),
                        str(tmp_path / "b.cu"), str(entry)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    # the last close is the shell's, whose release the kernel sends the daemon after the
    # close returns (FUSE's RELEASE is asynchronous): the commit may come just after bash
    wait_until(lambda: (entry / "kernel.cu").exists(), m.daemon_log)
    assert (entry / "kernel.cu").read_bytes() == PART_A + PART_B
    assert {"part_a", "part_b"} <= elf_symbols((entry / "kernel.cubin").read_bytes())


def test_a_killed_sibling_writer_stages_nothing(mount_factory, tmp_path):
    """The same, with the writer killed by a signal while its shell holds the descriptor:
    its bytes are not a whole source, so the stage is discarded, not committed at the last
    close."""
    m = mount_factory()
    entry = new_entry(m, "killed", PART_A)
    (tmp_path / "a.cu").write_bytes(PART_A)
    writer = ("import os, signal, sys; os.write(8, open(sys.argv[1], 'rb').read()); "
              "os.kill(os.getpid(), signal.SIGKILL)")
    script = 'exec 8> "$2/kernel.cu"; "$3" -c "$4" "$1"; exec 8>&-'
    r = subprocess.run(["bash", "-c", script, "bash", str(tmp_path / "a.cu"), str(entry),
                        sys.executable, writer], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert not (entry / "kernel.cu").exists() or (entry / "kernel.cu").stat().st_size == 0
    assert not (entry / "kernel.cubin").exists()
