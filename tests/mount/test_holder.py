"""The holder (-o holder, fs/life/holder.h): a daemon killed (SIGKILL, a crash) with compiles in
flight costs the requests it had read, not the mount: the holder starts it again on the same
mount, which keeps working through its bind mount in another mount namespace; the dead
daemon's node ids are restored from the inode ledger (fs/life/ledger.h) or answered ESTALE,
its handles EBADF (fs/life/stale.h), never another file's bytes. A daemon that dies at once again and again is not restarted forever; a live
upgrade under a holder makes the new daemon the one it watches.
"""
import errno
import hashlib
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import KCACHEFS, Mount, elf_machine, elf_symbols, run_parallel
from kcmount import (CAP_DAC_READ_SEARCH, EM_CUDA, NS_HELPER, daemons_of, has_capability,
                     mounts_at, ns_read, open_all, slow_nvcc, variant, wait_until)

# The inode ledger is read back with open_by_handle_at (fs/life/ledger.h).
needs_ledger = pytest.mark.skipif(not has_capability(CAP_DAC_READ_SEARCH),
                                  reason="the inode ledger needs CAP_DAC_READ_SEARCH")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts in a namespace need root")

KERNELS = 6
PROCS = 6


def one_daemon(m):
    """The daemon's pid, once there is exactly one (a holder just forked is named
    kcachefs-holder a moment later)."""
    return wait_until(lambda: len(pids := daemons_of(m, "kcachefs")) == 1 and pids[0],
                      "one daemon serves %s" % m.mnt, timeout=120)


def holder_mount_with_a_cubin(tmp_path):
    """A mount with a holder (debug log) and a published cubin: (m, its daemon's pid, the
    entry, the cubin's bytes)."""
    (tmp_path / "m").mkdir()
    m = Mount(tmp_path / "m", ["holder", "log_level=debug"]).start()
    try:
        old = one_daemon(m)
        e = m.stage("vadd_up", *variant(1))
        cubin = (e / "kernel.cubin").read_bytes()
        assert right_cubin(cubin)
    except BaseException:
        m.stop()
        raise
    return m, old, e, cubin


def stop_all(m, new):
    """Kill the upgrade's process new (if it runs), stop m: the mount is gone, cleanly."""
    if new and new.poll() is None:
        new.kill()
        new.wait()
    rc = m.stop()
    assert rc == 0 and not os.path.ismount(m.mnt)


def kill_left(*procs):
    """Kill and reap each of procs (None: skipped) that still runs."""
    for p in procs:
        if p and p.poll() is None:
            p.kill()
            p.wait()


def start_upgrade(m):
    """kcachefs -f --upgrade of m's mount, logging to m's log: its Popen."""
    with open(m.log_path, "ab") as log:
        return subprocess.Popen([str(KCACHEFS), "-f", "--upgrade", str(m.mnt)], stdout=log,
                                stderr=subprocess.STDOUT)


def right_cubin(data):
    return elf_machine(data) == EM_CUDA and any("vector_add" in s for s in elf_symbols(data))


def test_sigkill_with_compiles_in_flight_keeps_the_mount(tmp_path, counting_nvcc):
    make, calls = counting_nvcc
    nvcc = make(delay=3)
    (tmp_path / "m").mkdir()
    m = Mount(tmp_path / "m", ["nvcc=%s" % nvcc, "jobs=2", "holder", "log_level=debug"]).start()
    bind = tmp_path / "bind"
    bind.mkdir()
    helper = None
    held = notes = None
    try:
        holder = m.proc.pid
        dead = one_daemon(m)
        assert daemons_of(m, "kcachefs-holder") == [holder]
        # A published cubin, held open and looked up before the crash.
        e0 = m.stage("vadd_pub", *variant(0))
        held = open(e0 / "kernel.cubin", "rb")
        first = held.read()
        assert right_cubin(first)
        (m.mnt / "notes.txt").write_bytes(b"before the crash\n")
        notes = open(m.mnt / "notes.txt", "r+b")
        mnt_dev = os.stat(m.mnt).st_dev
        helper = subprocess.Popen(["unshare", "-m", sys.executable, "-c", NS_HELPER,
                                   str(m.mnt), str(bind)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert helper.stdout.readline().strip() == "ready"
        rel0 = os.path.relpath(e0 / "kernel.cubin", m.mnt)
        assert ns_read(helper, rel0)[:2] == ["ok", hashlib.sha256(first).hexdigest()]

        entries = [str(m.stage("vadd%d" % i, *variant(i))) for i in range(1, KERNELS + 1)]
        killed = {}

        def kill_when_compiling():
            wait_until(lambda: calls() >= 2, "compiles started", timeout=120)
            os.kill(dead, signal.SIGKILL)
            killed["at"] = time.monotonic()
            # New opens work again: the held name's node id is the dead daemon's (ESTALE,
            # then looked up again) and its cubin is published.
            def opens():
                try:
                    with open(e0 / "kernel.cubin", "rb") as f:
                        return f.read() == first
                except OSError:
                    return False
            wait_until(opens, "opens work again after the crash", timeout=60, step=0.02)
            killed["recovered"] = time.monotonic() - killed["at"]

        # Another client reads a published cubin and a plain file over and over meanwhile.
        reads = []

        def read_on():
            while "recovered" not in killed and len(reads) < 100000:
                for path, want in ((e0 / "kernel.cubin", first),
                                   (m.mnt / "notes.txt", b"before the crash\n")):
                    t = time.monotonic()
                    try:
                        with open(path, "rb") as f:
                            got = f.read()
                        reads.append((got == want, time.monotonic() - t))
                    except OSError as err:
                        reads.append((err.errno, time.monotonic() - t))

        th = threading.Thread(target=kill_when_compiling)
        reader = threading.Thread(target=read_on)
        th.start()
        reader.start()
        results = run_parallel(PROCS, open_all, entries, timeout=600)
        th.join(timeout=120)
        reader.join(timeout=120)
        assert not reader.is_alive(), "a read hung"
        # Each read gave the right bytes or an error (one in hand at the crash: a read
        # through a descriptor the dead daemon opened is EBADF, its node id being restored
        # from the ledger, or ESTALE), none other.
        assert all(r[0] is True or r[0] in (errno.ECONNABORTED, errno.ESTALE, errno.EBADF)
                   for r in reads), [r for r in reads if r[0] is not True]
        assert "recovered" in killed, (killed, m.daemon_log())

        # No client hung; each open got its cubin or an error (the requests the dead
        # daemon had read); every cubin right and the same in every client.
        flat = [r for res in results for r in res]
        assert all(r[0] != "exception" for r in flat), flat
        longest = max(r[3] for r in flat)
        assert longest < 300, flat
        errors = sorted({r[2] for r in flat if r[1] == "err"})
        assert set(errors) <= {errno.ECONNABORTED, errno.EIO, errno.ESTALE, errno.EINTR}, flat
        shas = {}
        for e, sha, size, _ in flat:
            if sha != "err":
                shas.setdefault(e, set()).add(sha)
        assert all(len(v) == 1 for v in shas.values()), shas
        for e in entries:  # through the restarted daemon: each opens, right
            data = open(os.path.join(e, "kernel.cubin"), "rb").read()
            assert right_cubin(data), e
            assert shas.get(e, {hashlib.sha256(data).hexdigest()}) == {hashlib.sha256(data).hexdigest()}

        # The same mount: st_dev, the holder; another daemon; the bind mount in the other
        # namespace reads through it.
        assert os.stat(m.mnt).st_dev == mnt_dev
        assert daemons_of(m, "kcachefs-holder") == [holder] and m.proc.poll() is None
        new = one_daemon(m)
        assert new != dead
        for rel in [rel0] + [os.path.relpath(os.path.join(e, "kernel.cubin"), m.mnt)
                             for e in entries]:
            r = ns_read(helper, rel)
            assert r[0] == "ok" and int(r[2]) == mnt_dev, r
        # Handles of the dead daemon: the cubin's reads are its own bytes (the kernel's
        # page cache) or an error, never another file's; a write is refused.
        try:
            assert os.pread(held.fileno(), len(first) + 1, 0) == first
        except OSError as err:
            assert err.errno in (errno.ESTALE, errno.EBADF), err
        with pytest.raises(OSError) as err:
            os.pwrite(notes.fileno(), b"after", 0)
        assert err.value.errno in (errno.ESTALE, errno.EBADF)
        assert (m.mnt / "notes.txt").read_bytes() == b"before the crash\n"
        # A new kernel compiles through the restarted daemon.
        e = m.stage("vadd_after", *variant(100))
        assert right_cubin((e / "kernel.cubin").read_bytes())

        log = m.daemon_log()
        assert "the daemon (pid %d) died" % dead in log, log
        assert "started again by the holder after the daemon died" in log, log
        # The dead daemon's node ids of published cubins are restored from the inode ledger
        # (fs/life/ledger.h); without it, requests on them are answered ESTALE.
        assert ("inode ledger: " if has_capability(CAP_DAC_READ_SEARCH) else
                "of a daemon that died: Stale file handle") in log, log
        parked = [r for r in flat if r[1] == "err"]
        print("\nholder: opens worked again %.2f s after the SIGKILL; %d of %d opens got an "
              "error (errnos %s), the others their cubin; longest open %.2f s; a reader "
              "alongside: %d reads, %d errors, longest %.2f s"
              % (killed["recovered"], len(parked), len(flat), errors, longest, len(reads),
                 sum(r[0] is not True for r in reads), max(r[1] for r in reads)))
    finally:
        for f in (held, notes):
            if f:
                try:
                    f.close()
                except OSError:
                    pass
        if helper:
            helper.stdin.close()
            helper.wait(timeout=30)
        rc = m.stop()
    assert rc == 0 and not os.path.ismount(m.mnt)
    assert not daemons_of(m, "kcachefs") and not daemons_of(m, "kcachefs-holder")


def test_a_daemon_that_keeps_dying_is_not_restarted_forever(tmp_path):
    (tmp_path / "m").mkdir()
    m = Mount(tmp_path / "m", ["holder"]).start()
    try:
        dead = one_daemon(m)
        # Every daemon started from here fails at once: its backing directory is gone.
        os.rename(m.backing, tmp_path / "m" / "moved")
        os.kill(dead, signal.SIGKILL)
        rc = m.proc.wait(timeout=120)
        log = m.daemon_log()
        assert rc == 1, log
        assert log.count("started the daemon again") == 5, log
        assert "after 5 restarts within 60 s: giving up" in log, log
        # The mount is let go as a crash without a holder leaves it: dead, not hanging.
        with pytest.raises(OSError) as err:
            os.stat(m.mnt / "cache")
        assert err.value.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    finally:
        m.stop()
        if (tmp_path / "m" / "moved").exists():
            os.rename(tmp_path / "m" / "moved", m.backing)


def test_an_upgrade_under_a_holder_makes_the_new_daemon_the_one_it_restarts(tmp_path):
    m, old, e, cubin = holder_mount_with_a_cubin(tmp_path)
    new = None
    try:
        new = start_upgrade(m)
        wait_until(lambda: "pid %d serves, epoch 0" % new.pid in m.daemon_log(),
                   "the upgrade's daemon serves", timeout=120)
        wait_until(lambda: old not in daemons_of(m, "kcachefs"), "the old daemon is gone",
                   timeout=120)
        assert daemons_of(m, "kcachefs") == [new.pid]
        log = m.daemon_log()
        assert "hands the mount to a new daemon" in log and "started the daemon again" not in log
        assert (e / "kernel.cubin").read_bytes() == cubin
        # The upgrade's daemon dies: the holder starts another.
        new.send_signal(signal.SIGKILL)
        new.wait(timeout=60)
        wait_until(lambda: "started the daemon again" in m.daemon_log(),
                   "a daemon is started again", timeout=120)
        restarted = one_daemon(m)
        assert restarted not in (old, new.pid)
        assert (e / "kernel.cubin").read_bytes() == cubin
        e2 = m.stage("vadd_up2", *variant(2))
        assert right_cubin((e2 / "kernel.cubin").read_bytes())
    finally:
        stop_all(m, new)


def test_an_upgrade_whose_new_daemon_dies_at_the_handover_is_restarted_at_once(tmp_path):
    """The new daemon of a live upgrade killed right after the old one handed the mount
    over (before it said it serves): the holder sees its connection close and starts a
    daemon at once, rather than waiting out KC_HOLDER_HANDOVER_WAIT with every client
    blocked."""
    m, old, e, cubin = holder_mount_with_a_cubin(tmp_path)
    new = None
    try:
        new = start_upgrade(m)
        wait_until(lambda: "hands the mount to a new daemon" in m.daemon_log(),
                   "the old daemon hands over", timeout=120, step=0.002)
        new.send_signal(signal.SIGKILL)
        new.wait(timeout=60)
        ends = ("is gone before it served", "the daemon (pid %d) died" % new.pid,
                "did not serve within the wait")
        wait_until(lambda: any(s in m.daemon_log() for s in ends), "the holder notices",
                   timeout=300)
        log = m.daemon_log()
        assert "did not serve within the wait" not in log, log
        restarted = one_daemon(m)
        assert restarted not in (old, new.pid)
        assert (e / "kernel.cubin").read_bytes() == cubin
    finally:
        stop_all(m, new)


def test_a_stop_of_the_holder_while_no_daemon_runs_unmounts(tmp_path):
    """SIGTERM to the holder in a restart's pause (no daemon runs: each one started fails
    at once, its backing directory gone): the holder exits 0 and the mount goes, rather
    than staying dead (Transport endpoint is not connected)."""
    (tmp_path / "m").mkdir()
    m = Mount(tmp_path / "m", ["holder"]).start()
    moved = tmp_path / "m" / "moved"
    try:
        dead = one_daemon(m)
        os.rename(m.backing, moved)
        os.kill(dead, signal.SIGKILL)
        wait_until(lambda: "starting another in 1.00 s" in m.daemon_log(),
                   "a restart's pause", timeout=120)
        m.proc.send_signal(signal.SIGTERM)
        rc = m.proc.wait(timeout=120)
        log = m.daemon_log()
        assert rc == 0, log
        assert "the mount goes" in log, log
        assert mounts_at(m.mnt) == 0, log  # dead, it would be listed (ismount says no)
    finally:
        m.stop()
        if moved.exists():
            os.rename(moved, m.backing)


def test_a_stop_of_the_holder_during_an_upgrade_stops_everything(tmp_path):
    """SIGTERM to the holder right after the old daemon handed the mount over, before the
    new one serves: the mount goes cleanly and every kcachefs process exits, the new
    daemon included. (The moment is hit when the new daemon is stopped before it says it
    serves: most runs, not all.)"""
    moment = "hands the mount to a new daemon"
    m, old, e, cubin = holder_mount_with_a_cubin(tmp_path)
    new = None
    try:
        new = start_upgrade(m)
        wait_until(lambda: moment in m.daemon_log(), "the upgrade reaches: " + moment,
                   timeout=120, step=0.002)
        # The new daemon held where it is (before it serves, most of the time) until the
        # holder took the stop in.
        new.send_signal(signal.SIGSTOP)
        m.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: "holder of %s: Terminated: " % m.mnt in m.daemon_log(),
                   "the holder takes the stop in", timeout=120)
        new.send_signal(signal.SIGCONT)
        rc = m.proc.wait(timeout=180)
        new.wait(timeout=180)
        log = m.daemon_log()
        assert rc == 0, log
        assert mounts_at(m.mnt) == 0, log
        assert not daemons_of(m, "kcachefs") and not daemons_of(m, "kcachefs-holder"), log
    finally:
        stop_all(m, new)


def test_names_made_after_a_crash_in_directories_the_kernel_held(tmp_path):
    """mkdir, create, rename and symlink in a directory whose dentry the kernel keeps from
    the dead daemon: the kernel retries ESTALE for an open, not for the lookup of the
    name a mkdir or a create makes, so the new daemon must answer the dead one's id of the
    directory (the inode ledger, fs/life/ledger.h) or have the kernel look it up again (one
    failed mkdir is a DeepGEMM or Triton job dead at start-up)."""
    m, old, e, cubin = holder_mount_with_a_cubin(tmp_path)
    try:
        d = m.mnt / "jit"
        d.mkdir()
        (d / "sub").mkdir()
        os.stat(d / "sub")  # the kernel now holds cache/ and cache/sub with this daemon's ids
        os.kill(old, signal.SIGKILL)
        wait_until(lambda: "started the daemon again" in m.daemon_log(),
                   "a daemon is started again", timeout=120)
        new = one_daemon(m)
        assert new != old
        if not has_capability(CAP_DAC_READ_SEARCH):
            # No ledger: the root's names are invalidated beside serving (a request may
            # hold the root's lock), which a mkdir then needs.
            wait_until(lambda: "the kernel looks the root's names up again" in m.daemon_log(),
                       "the new daemon has the kernel look the root's names up", timeout=120)
        (d / "made").mkdir()
        (d / "sub" / "made").mkdir()
        (d / "sub" / "f").write_bytes(b"x")
        os.rename(d / "sub" / "f", d / "sub" / "g")
        os.symlink("g", d / "sub" / "l")
        assert (d / "sub" / "l").read_bytes() == b"x"
        assert (e / "kernel.cubin").read_bytes() == cubin
        # The dead daemon's ids of jit/ and jit/sub/ were restored from the ledger (or,
        # without CAP_DAC_READ_SEARCH, the root's names were invalidated).
        assert ("inode ledger: " if has_capability(CAP_DAC_READ_SEARCH) else
                "the kernel looks the root's names up again") in m.daemon_log()
    finally:
        stop_all(m, None)


OPEN_ONE = """import sys
try:
    print("ok %d" % len(open(sys.argv[1], "rb").read()))
except OSError as err:
    print(err.errno)
"""


def test_a_stop_of_the_holder_while_an_upgrade_waits_for_a_compile(tmp_path, counting_nvcc):
    """SIGTERM to the holder while the old daemon, asked for a live upgrade, waits for the
    compile in hand before it hands over: the old daemon ends the upgrade at once (the new
    one is told no and exits), stops, and the mount goes. Before, it waited for the compile
    (here 600 s) with the mount's clients hanging."""
    make, calls = counting_nvcc
    nvcc = make(delay=600)
    (tmp_path / "m").mkdir()
    m = Mount(tmp_path / "m", ["nvcc=%s" % nvcc, "holder", "log_level=debug"]).start()
    new = opener = None
    try:
        one_daemon(m)
        e = m.stage("vadd_slow", *variant(1))
        opener = subprocess.Popen([sys.executable, "-c", OPEN_ONE, str(e / "kernel.cubin")],
                                  stdout=subprocess.PIPE, text=True)
        wait_until(lambda: calls() == 1, "the compile runs", timeout=120)
        new = start_upgrade(m)
        wait_until(lambda: "no new request is read; answering the" in m.daemon_log(),
                   "the old daemon waits for the requests in hand", timeout=120)
        m.proc.send_signal(signal.SIGTERM)
        rc = m.proc.wait(timeout=120)
        assert new.wait(timeout=120) != 0  # it took nothing over
        out, _ = opener.communicate(timeout=120)
        log = m.daemon_log()
        assert rc == 0, log
        assert "upgrade abandoned: the daemon is stopping" in log
        assert not out.startswith("ok"), out  # a compile of 600 s: stopped with the mount
        assert mounts_at(m.mnt) == 0, log
        assert not daemons_of(m, "kcachefs") and not daemons_of(m, "kcachefs-holder"), log
        wait_until(lambda: subprocess.run(["pgrep", "-f", str(nvcc)]).returncode == 1,
                   "the compile is gone", timeout=120)
    finally:
        if opener and opener.poll() is None:
            opener.kill()
            opener.wait()
        stop_all(m, new)


NS_DIR_HELPER = r"""
import errno, hashlib, os, subprocess, sys
src, bind = sys.argv[1], sys.argv[2]
subprocess.run(["mount", "--bind", src, bind], check=True)
print("ready", flush=True)
for line in sys.stdin:
    op, rel = line.split()
    path = os.path.join(bind, rel)
    try:
        if op == "read":
            with open(path, "rb") as f:
                print("ok", hashlib.sha256(f.read()).hexdigest(), flush=True)
        elif op == "mkdir":
            os.mkdir(path)
            print("ok", flush=True)
        elif op == "write":
            with open(path, "wb") as f:
                f.write(rel.encode())
            with open(path, "rb") as f:
                print("ok" if f.read() == rel.encode() else "bad", flush=True)
    except OSError as e:
        print("err", e.errno, flush=True)
"""

HOLD_LOCK = r"""
import fcntl, sys
f = open(sys.argv[1], "r+b")
fcntl.flock(f, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.readline()
"""

TRY_LOCK = r"""
import errno, fcntl, sys
f = open(sys.argv[1], "r+b")
try:
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print("got it")
except OSError as e:
    print("held" if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else "err %d" % e.errno)
"""


def ns_do(helper, op, rel):
    helper.stdin.write("%s %s\n" % (op, rel))
    helper.stdin.flush()
    return helper.stdout.readline().split()


def try_lock(path):
    return subprocess.run([sys.executable, "-c", TRY_LOCK, str(path)], capture_output=True,
                          text=True, timeout=120).stdout.strip()


@needs_ledger
def test_a_bind_mount_of_a_directory_inside_the_mount_and_its_locks_survive_a_crash(tmp_path):
    """A container's volume of a directory inside the mount (a bind mount of jit/, as a
    Kubernetes subPath makes) has a root dentry with no name to look up again: the restarted
    daemon answers the dead one's node id of jit/ from the inode ledger, so the bind mount
    reads, makes directories and files as before. And a lock held across the crash is still
    held: the lock file keeps its kernel inode (its node id is the same), so another process
    cannot take it."""
    m, old, e, cubin = holder_mount_with_a_cubin(tmp_path)
    bind = tmp_path / "bind"
    bind.mkdir()
    helper = holder = None
    try:
        d = m.mnt / "jit"
        d.mkdir()
        (d / "a.txt").write_bytes(b"before the crash")
        (d / "lock").write_bytes(b"")
        want = hashlib.sha256(b"before the crash").hexdigest()
        helper = subprocess.Popen(["unshare", "-m", sys.executable, "-c", NS_DIR_HELPER, str(d),
                                   str(bind)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)
        assert helper.stdout.readline().strip() == "ready"
        assert ns_do(helper, "read", "a.txt") == ["ok", want]
        holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(d / "lock")],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "locked"
        assert try_lock(d / "lock") == "held"

        os.kill(old, signal.SIGKILL)
        wait_until(lambda: "started the daemon again" in m.daemon_log(),
                   "a daemon is started again", timeout=120)
        new = one_daemon(m)
        assert new != old
        # Through the bind mount: the dead daemon's id of jit/ is answered.
        assert ns_do(helper, "read", "a.txt") == ["ok", want]
        assert ns_do(helper, "mkdir", "made") == ["ok"]
        assert ns_do(helper, "write", "after.txt") == ["ok"]
        assert (d / "after.txt").read_bytes() == b"after.txt" and (d / "made").is_dir()
        log = m.daemon_log()
        restored = [l for l in log.splitlines() if "inode ledger: " in l]
        assert restored and int(restored[-1].split("inode ledger: ")[1].split()[0]) >= 2, log
        # The lock is still the first process's; released, it can be taken.
        assert try_lock(d / "lock") == "held"
        holder.stdin.write("\n")
        holder.stdin.flush()
        holder.wait(timeout=120)
        assert try_lock(d / "lock") == "got it"
        assert (e / "kernel.cubin").read_bytes() == cubin
    finally:
        kill_left(helper, holder)
        stop_all(m, None)


NO_DAC_READ_SEARCH = r"""
import ctypes, os, sys
PR_CAPBSET_DROP, CAP_DAC_READ_SEARCH = 24, 2
if ctypes.CDLL(None, use_errno=True).prctl(PR_CAPBSET_DROP, CAP_DAC_READ_SEARCH, 0, 0, 0):
    sys.exit("prctl: %s" % os.strerror(ctypes.get_errno()))
os.execv(sys.argv[1], sys.argv[1:])
"""


def test_without_the_ledger_a_crash_still_leaves_directories_usable(tmp_path):
    """A daemon without CAP_DAC_READ_SEARCH cannot open the ledger's file handles: it says
    so, and has the kernel look the root's names up again instead, so a mkdir in a
    directory the kernel held works (the bind mount of a directory inside the mount does not
    survive then: the log line says the ids are answered ESTALE)."""
    wrapper = tmp_path / "kcachefs-no-dac-read-search"
    wrapper.write_text("#!%s\n%s" % (sys.executable, NO_DAC_READ_SEARCH))
    wrapper.chmod(0o755)
    launcher = tmp_path / "launch"
    launcher.write_text("#!/bin/sh\nexec %s %s \"$@\"\n" % (wrapper, KCACHEFS))
    launcher.chmod(0o755)
    (tmp_path / "m").mkdir()
    m = Mount(tmp_path / "m", ["holder", "log_level=debug"], bin=launcher).start()
    try:
        old = one_daemon(m)
        d = m.mnt / "jit"
        d.mkdir()
        (d / "sub").mkdir()
        os.stat(d / "sub")
        os.kill(old, signal.SIGKILL)
        wait_until(lambda: "started the daemon again" in m.daemon_log(),
                   "a daemon is started again", timeout=120)
        assert one_daemon(m) != old
        wait_until(lambda: "the kernel looks the root's names up again" in m.daemon_log(),
                   "the new daemon has the kernel look the root's names up", timeout=120)
        (d / "made").mkdir()
        (d / "sub" / "made").mkdir()
        log = m.daemon_log()
        assert "cannot be read back without CAP_DAC_READ_SEARCH" in log, log
    finally:
        stop_all(m, None)


# Holds files of the mount open and locked, as told on stdin: "open NAME PATH" opens PATH
# read-only, reads it, takes flock(LOCK_EX) and an fcntl read lock (F_SETLK, F_RDLCK: a
# cubin opens for reading only, and a write lock needs a descriptor open for writing), and
# prints "locked NAME SHA256"; "read NAME" reads the descriptor again from offset 0 (pread)
# and prints "read NAME SHA256" or "read NAME err ERRNO"; "unlock NAME" releases both locks
# and prints "unlocked NAME".
LOCKER = r"""
import fcntl, hashlib, os, sys
files = {}
for line in sys.stdin:
    op, name, *rest = line.split()
    if op == "open":
        f = files[name] = open(rest[0], "rb")
        data = f.read()
        fcntl.flock(f, fcntl.LOCK_EX)
        fcntl.lockf(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        print("locked", name, hashlib.sha256(data).hexdigest(), flush=True)
    elif op == "read":
        try:
            data = os.pread(files[name].fileno(), 1 << 24, 0)
            print("read", name, hashlib.sha256(data).hexdigest(), flush=True)
        except OSError as e:
            print("read", name, "err", e.errno, flush=True)
    elif op == "unlock":
        fcntl.lockf(files[name], fcntl.LOCK_UN)
        fcntl.flock(files[name], fcntl.LOCK_UN)
        print("unlocked", name, flush=True)
"""

# Another process's view of each path on the command line: "flock:held" when
# flock(LOCK_EX | LOCK_NB) fails with EWOULDBLOCK, "flock:got" when it is granted;
# "fcntl:held:PID" when F_GETLK says a write lock would conflict with PID's lock,
# "fcntl:free" when it would not; and the sha256 of what a new open reads.
PROBE = r"""
import errno, fcntl, hashlib, os, struct, sys
FLOCK = "hhxxxxqqixxxx"  # struct flock on x86_64 and aarch64
for path in sys.argv[1:]:
    with open(path, "rb") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fl = "flock:got"
        except OSError as e:
            fl = "flock:held" if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else "flock:err%d" % e.errno
        got = fcntl.fcntl(f, fcntl.F_GETLK, struct.pack(FLOCK, fcntl.F_WRLCK, 0, 0, 0, 0))
        kind, _, _, _, pid = struct.unpack(FLOCK, got)
        fc = "fcntl:free" if kind == fcntl.F_UNLCK else "fcntl:held:%d" % pid
        print(fl, fc, hashlib.sha256(f.read()).hexdigest(), flush=True)
"""


def probe(paths, pid, sums):
    """What another process sees of each file of paths (a dict: name to path) that process
    pid locked: {name: "flock held, fcntl held"} when pid's locks keep it out, "flock got,
    fcntl free" when they do not; "wrong bytes" added when it reads other bytes than
    sums[name] (a sha256)."""
    names = list(paths)
    r = subprocess.run([sys.executable, "-c", PROBE, *(str(paths[n]) for n in names)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    seen = {}
    for name, line in zip(names, r.stdout.splitlines()):
        fl, fc, sha = line.split()
        fc = "fcntl:held" if fc == "fcntl:held:%d" % pid else fc
        seen[name] = "%s, %s%s" % (fl.replace(":", " "), fc.replace(":", " "),
                                   "" if sha == sums[name] else ", wrong bytes")
    return seen


def locker_do(locker, line):
    locker.stdin.write(line + "\n")
    locker.stdin.flush()
    return locker.stdout.readline().split()


@needs_ledger
def test_locks_on_cubins_and_staged_files_survive_a_crash(tmp_path):
    """flock and fcntl locks on the files of kernel entries, held across a crash of the
    daemon (SIGKILL; the holder starts it again): a compiled kernel.cubin opened after it was
    published (by then the kernel's inode of it is the one an earlier opener was given while
    it compiled), one opened while it compiled (its kernel inode was pending at the lookup
    and became the published cubin), a client's own kernel.cubin, and an entry's kernel.cu,
    kernel.flags and kernel.log. Each keeps its kernel inode (the restarted daemon answers
    the dead one's node id, restored from the inode ledger), so a second process opening
    the path cannot take a lock the first still holds, and can once it is released. The
    first process's descriptor of a cubin still reads the cubin's bytes (its pages were
    cached); a new open reads every file's right bytes. Before, the cubins and staged files
    got new kernel inodes after a crash, and a second process took their locks; and a cubin
    opened while it compiled never kept a later opener out, crash or not (the later
    lookup answered another inode)."""
    release = tmp_path / "release"
    nvcc = slow_nvcc(tmp_path, release)
    (tmp_path / "m").mkdir()
    m = Mount(tmp_path / "m", ["nvcc=%s" % nvcc, "holder", "log_level=debug"]).start()
    locker = trigger = None
    try:
        old = one_daemon(m)
        after = m.stage("vadd_after", *variant(1))   # opened once published
        during = m.stage("vadd_during", *variant(2))  # opened while it compiles
        locker = subprocess.Popen([sys.executable, "-c", LOCKER], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        locker.stdin.write("open during %s\n" % (during / "kernel.cubin"))
        locker.stdin.flush()
        # The first open of the other kernel: its compile, waited for by another process.
        trigger = subprocess.Popen([sys.executable, "-c", "open(%r, 'rb').read()"
                                    % str(after / "kernel.cubin")])
        wait_until(lambda: m.stats()["parked_requests"] >= 2, m.stats, timeout=120)
        release.write_text("")
        assert trigger.wait(timeout=300) == 0
        got = locker.stdout.readline().split()
        want = {}
        want["during"] = (during / "kernel.cubin").read_bytes()
        assert right_cubin(want["during"]) and got == [
            "locked", "during", hashlib.sha256(want["during"]).hexdigest()]
        want["after"] = (after / "kernel.cubin").read_bytes()
        # A client's own cubin, published by writing it (an entry with no flags).
        client = m.stage("vadd_client", variant(3)[0], flags=None)
        (client / "kernel.cubin").write_bytes(want["after"])
        want["client"] = want["after"]
        paths = {"during": during / "kernel.cubin", "after": after / "kernel.cubin",
                 "client": client / "kernel.cubin", "cu": after / "kernel.cu",
                 "flags": after / "kernel.flags", "log": after / "kernel.log"}
        (m.mnt / "jit").mkdir()
        paths["plain"] = m.mnt / "jit" / "lock"
        paths["plain"].write_bytes(b"")
        for name in ("cu", "flags", "log", "plain"):
            want[name] = paths[name].read_bytes()
        for name in ("after", "client", "cu", "flags", "log", "plain"):
            assert locker_do(locker, "open %s %s" % (name, paths[name])) == [
                "locked", name, hashlib.sha256(want[name]).hexdigest()]
        names = list(paths)
        sums = {n: hashlib.sha256(want[n]).hexdigest() for n in names}
        seen = {"before the crash": probe(paths, locker.pid, sums)}

        os.kill(old, signal.SIGKILL)
        wait_until(lambda: "started the daemon again" in m.daemon_log(),
                   "a daemon is started again", timeout=120)
        assert one_daemon(m) != old
        seen["after the crash"] = probe(paths, locker.pid, sums)
        # Every file's locks keep the other process out, before and after the crash.
        held = {n: "flock held, fcntl held" for n in names}
        assert seen == {"before the crash": held, "after the crash": held}, "\n".join(
            "%s, %s: %s" % (when, n, v) for when in seen for n, v in seen[when].items())
        # The locker's own descriptors of the cubins still read their bytes (the kernel's
        # cached pages; doc/operating.md).
        for name in ("during", "after", "client"):
            assert locker_do(locker, "read " + name) == ["read", name, sums[name]]
        restored = [l for l in m.daemon_log().splitlines() if "inode ledger: " in l]
        assert restored and int(restored[-1].split("inode ledger: ")[1].split()[0]) >= 9

        for name in names:
            assert locker_do(locker, "unlock " + name) == ["unlocked", name]
        assert probe(paths, locker.pid, sums) == {n: "flock got, fcntl free" for n in names}
    finally:
        kill_left(locker, trigger)
        stop_all(m, None)
