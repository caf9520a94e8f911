"""Live upgrade (kcachefs --upgrade MOUNTPOINT, fs/life/upgrade.h): a new daemon takes the mount
from the running one without unmounting, while clients open kernels whose compiles are in
flight; with a cluster store, the old daemon's shares end before it hands over; and an upgrade
to a build whose handover state has another format is refused while the running daemon
serves on.
"""
import hashlib
import os
import random
import subprocess
import sys
import threading
import time

import pytest

from conftest import BUILD, KCACHEFS, Mount, elf_machine, elf_symbols, run_parallel, sample
from kcmount import EM_CUDA, NS_HELPER, daemons_of, ns_read, open_all, variant, wait_until

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts in a namespace need root")

KERNELS = 8
PROCS = 8


def gone_after_unmount(pids):
    """Detached daemons (an upgrade without -f) are gone once their mount is unmounted;
    one that is not is killed, and the test fails."""
    for pid in pids:
        try:
            wait_until(lambda: not os.path.exists("/proc/%d" % pid),
                       "the detached daemon %d outlived its unmount" % pid, 20)
        except AssertionError:
            os.kill(pid, 9)
            raise

def test_upgrade_with_compiles_in_flight(tmp_path, counting_nvcc):
    make, calls = counting_nvcc
    nvcc = make(delay=1)
    (tmp_path / "m").mkdir()
    m = Mount(tmp_path / "m", ["nvcc=%s" % nvcc, "jobs=2"]).start()
    bind = tmp_path / "bind"
    bind.mkdir()
    helper = new = None
    held = []
    upgrade = {}
    try:
        old_pid = m.proc.pid
        entries = [str(m.stage("vadd%d" % i, *variant(i))) for i in range(KERNELS)]
        # Held across the upgrade: a published cubin, a plain file, a directory.
        first = open(os.path.join(entries[0], "kernel.cubin"), "rb")
        held.append(first)
        first_bytes = first.read()
        assert elf_machine(first_bytes) == EM_CUDA
        (m.mnt / "notes.txt").write_bytes(b"kept across the upgrade\n")
        plain = open(m.mnt / "notes.txt", "rb")
        held.append(plain)
        dir_fd = os.open(m.mnt / "cache", os.O_RDONLY | os.O_DIRECTORY)
        before = {f.name: os.fstat(f.fileno()) for f in held}
        mnt_dev = os.stat(m.mnt).st_dev

        helper = subprocess.Popen(["unshare", "-m", sys.executable, "-c", NS_HELPER,
                                   str(m.mnt), str(bind)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert helper.stdout.readline().strip() == "ready"
        rel0 = os.path.relpath(os.path.join(entries[0], "kernel.cubin"), m.mnt)
        r = ns_read(helper, rel0)
        assert r[:2] == ["ok", hashlib.sha256(first_bytes).hexdigest()], r
        assert int(r[2]) == mnt_dev

        # 8 clients open the other 7 kernels (compiles of 1 s each, 2 at a time) while the
        # daemon is replaced: the upgrade starts once 3 compilers have run.

        def run_upgrade():
            wait_until(lambda: calls() >= 3, "compiles did not start", 120)
            log = open(m.log_path, "ab")
            t = time.monotonic()
            upgrade["proc"] = subprocess.Popen([str(KCACHEFS), "-f", "--upgrade", str(m.mnt)],
                                               stdout=log, stderr=subprocess.STDOUT)
            upgrade["log"] = log
            upgrade["old_rc"] = m.proc.wait(timeout=300)
            upgrade["seconds"] = time.monotonic() - t

        th = threading.Thread(target=run_upgrade)
        th.start()
        results = run_parallel(PROCS, open_all, entries[1:], timeout=600)
        th.join(timeout=600)
        new = upgrade.get("proc")
        assert new is not None and upgrade.get("old_rc") == 0, (upgrade, m.daemon_log())
        m.proc = new  # stopped (unmounted) by m.stop()

        # 0 client errors, every cubin right: the same bytes in every process, a CUDA ELF
        # with the kernel's symbol.
        errors = [r for res in results for r in (res if isinstance(res, list) else [res])
                  if r[1] == "err" or r[0] == "exception"]
        assert not errors, errors
        by_entry = {}
        for res in results:
            for e, sha, size, _ in res:
                by_entry.setdefault(e, set()).add((sha, size))
        assert len(by_entry) == KERNELS - 1 and all(len(v) == 1 for v in by_entry.values())
        for e in entries[1:]:
            data = open(os.path.join(e, "kernel.cubin"), "rb").read()
            assert (hashlib.sha256(data).hexdigest(), len(data)) in by_entry[e]
            assert elf_machine(data) == EM_CUDA and any("vector_add" in s for s in elf_symbols(data))
        longest = max(r[3] for res in results for r in res)

        # The new daemon serves the same mount: st_dev, inode numbers, open descriptors.
        assert new.poll() is None and new.pid != old_pid
        assert os.stat(m.mnt).st_dev == mnt_dev
        for f in held:
            st = os.fstat(f.fileno())
            assert (st.st_dev, st.st_ino) == (before[f.name].st_dev, before[f.name].st_ino)
        assert os.pread(first.fileno(), len(first_bytes) + 1, 0) == first_bytes
        assert os.pread(plain.fileno(), 100, 0) == b"kept across the upgrade\n"
        assert sorted(os.listdir(dir_fd)) == sorted(os.path.basename(e) for e in entries)
        os.close(dir_fd)
        for e in entries:
            st = os.stat(os.path.join(e, "kernel.cubin"))
            assert st.st_dev == mnt_dev
        # The container's bind mount works after the upgrade as before.
        r = ns_read(helper, rel0)
        assert r[:2] == ["ok", hashlib.sha256(first_bytes).hexdigest()] and int(r[2]) == mnt_dev, r
        rel7 = os.path.relpath(os.path.join(entries[-1], "kernel.cubin"), m.mnt)
        r = ns_read(helper, rel7)
        assert r[0] == "ok" and (r[1], ) == (list(by_entry[entries[-1]])[0][0], ), r
        # And a new kernel compiles through the new daemon.
        e = m.stage("vadd_after", *variant(100))
        assert elf_machine((e / "kernel.cubin").read_bytes()) == EM_CUDA

        log = m.daemon_log()
        assert "upgrade: the mount is pid %d's now" % new.pid in log, log
        assert "taken over from the running daemon" in log, log
        answered = log.split("requests answered during the handover")[0].rsplit("(", 1)[1]
        print("\nupgrade: %s requests answered during the handover, the handover took %.2f s "
              "end to end, longest open seen by a client %.2f s"
              % (answered, upgrade["seconds"], longest))
    finally:
        for f in held:
            f.close()
        if helper:
            helper.stdin.close()
            helper.wait(timeout=30)
        if new and m.proc is not new and new.poll() is None:
            m.proc = new
        m.stop()
        if upgrade.get("log"):
            upgrade["log"].close()
        assert not os.path.ismount(m.mnt)


def test_upgrade_to_another_format_is_refused(tmp_path, counting_nvcc):
    make, _ = counting_nvcc
    other = BUILD / "tests" / "kcachefs-format-test"
    assert other.exists(), "built by tests/meson.build"
    (tmp_path / "m").mkdir()
    m = Mount(tmp_path / "m", ["nvcc=%s" % make()]).start()
    new_pid = None
    try:
        pid = m.proc.pid
        e = m.stage("vadd", *variant(0))
        first = (e / "kernel.cubin").read_bytes()
        r = subprocess.run([str(other), "-f", "--upgrade", str(m.mnt)], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 1, r
        assert "refused" in r.stderr and "state of format 99, this daemon's is 1" in r.stderr, r
        # The running daemon serves on, as before.
        assert m.proc.poll() is None and m.proc.pid == pid
        assert (e / "kernel.cubin").read_bytes() == first
        e2 = m.stage("vadd2", *variant(1))
        assert elf_machine((e2 / "kernel.cubin").read_bytes()) == EM_CUDA
        assert "upgrade refused" in m.daemon_log()
        # No daemon there: a clear message.
        r = subprocess.run([str(KCACHEFS), "-f", "--upgrade", str(tmp_path)], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 1 and "no kcachefs daemon of uid 0 serves" in r.stderr, r
        # A file being staged (its stage temporary is the store's): refused until closed.
        src, flags = variant(2)
        entry = m.mnt / "cache" / ("kernel.vadd3." + "0" * 32)
        entry.mkdir()
        with open(entry / "kernel.cu", "wb") as staging:
            staging.write(src)
            r = subprocess.run([str(KCACHEFS), "-f", "--upgrade", str(m.mnt)],
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 1 and "is being staged" in r.stderr, r
            assert m.proc.poll() is None
        (entry / "kernel.flags").write_bytes(flags)
        # Closed: the same upgrade goes through (without -f: the new daemon detaches, the
        # command returns once it serves), and the new daemon compiles what was staged.
        r = subprocess.run([str(KCACHEFS), "--upgrade", str(m.mnt)], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r
        assert m.proc.wait(timeout=60) == 0
        def one_daemon():  # a watcher just forked has the daemon's descriptors a moment
            d = daemons_of(m)
            return d if len(d) == 1 else None

        serving = wait_until(one_daemon, lambda: "not one daemon: %s" % daemons_of(m), 10)
        assert pid not in serving, serving
        new_pid = serving[0]
        assert elf_machine((entry / "kernel.cubin").read_bytes()) == EM_CUDA
        assert (e / "kernel.cubin").read_bytes() == first
    finally:
        m.stop()
        gone_after_unmount([new_pid] if new_pid else [])


def test_upgrade_with_a_cluster_store_hands_over_its_shares(tmp_path, counting_nvcc):
    """With a cluster store each compile is shared after its openers are answered (the
    dependency pass, the puts, the lease's release). An upgrade in the middle of the
    compiles ends (the old daemon exits within a compile's bound, never waiting for work that
    no request stands for), the clients see no error, and every kernel ends up in the store:
    a node mounted later on it compiles nothing."""
    make, calls = counting_nvcc
    nvcc = make(delay=1)
    store = tmp_path / "store"
    store.mkdir()
    key = tmp_path / "cluster.key"
    key.write_bytes(os.urandom(32))
    os.chmod(key, 0o600)
    timeout = 60
    opts = ["remote=dir:%s" % store, "remote_key=%s" % key, "nvcc=%s" % nvcc, "jobs=2",
            "compile_timeout=%d" % timeout]
    (tmp_path / "a").mkdir()
    m = Mount(tmp_path / "a", opts).start()
    later = None
    upgrade = {}
    try:
        entries = [str(m.stage("vadd%d" % i, *variant(i))) for i in range(KERNELS)]

        def run_upgrade():
            wait_until(lambda: calls() >= 3, "compiles did not start", 120)
            log = open(m.log_path, "ab")
            upgrade["log"] = log
            upgrade["proc"] = subprocess.Popen([str(KCACHEFS), "-f", "--upgrade", str(m.mnt)],
                                               stdout=log, stderr=subprocess.STDOUT)
            try:  # the bound of the handover: the compiles in hand, then the state
                upgrade["old_rc"] = m.proc.wait(timeout=timeout + 30)
            except subprocess.TimeoutExpired:
                upgrade["old_rc"] = "still running after %d s" % (timeout + 30)

        th = threading.Thread(target=run_upgrade)
        th.start()
        results = run_parallel(PROCS, open_all, entries, timeout=600)
        th.join(timeout=600)
        new = upgrade.get("proc")
        assert new is not None and upgrade.get("old_rc") == 0, (upgrade, m.daemon_log())
        m.proc = new

        errors = [r for res in results for r in (res if isinstance(res, list) else [res])
                  if r[1] == "err" or r[0] == "exception"]
        assert not errors, errors
        by_entry = {}
        for res in results:
            for e, sha, size, _ in res:
                by_entry.setdefault(e, set()).add((sha, size))
        assert len(by_entry) == KERNELS and all(len(v) == 1 for v in by_entry.values())
        assert calls() == KERNELS

        # Every kernel is in the store: the new daemon shares what it compiled, and the old
        # one's shares were finished before it handed over. Wait for the new daemon's
        # shares (they run after the openers are answered).
        wait_until(lambda: not [p for p in (store / "leases").glob("*/*")
                                if not p.name.startswith(".")], m.daemon_log, 120)
        (tmp_path / "b").mkdir()
        later = Mount(tmp_path / "b", opts).start()
        for i in range(KERNELS):
            e = later.stage("vadd%d" % i, *variant(i))
            data = (e / "kernel.cubin").read_bytes()
            assert (hashlib.sha256(data).hexdigest(), len(data)) in by_entry[entries[i]]
        assert calls() == KERNELS, "a node mounted later compiled %d kernels again: %s" % (
            calls() - KERNELS, m.daemon_log())
        assert later.stats()["compiles_total"] == 0
        log = m.daemon_log()
        assert "upgrade: the mount is pid %d's now" % new.pid in log, log
        assert "still running after" not in log, log
        assert "lease renewal failed" not in log, log
    finally:
        if later:
            later.stop()
        new = upgrade.get("proc")
        if new and m.proc is not new and new.poll() is None:
            if m.proc.poll() is None:
                m.proc.kill()
                m.proc.wait()
            m.proc = new
        m.stop()
        if upgrade.get("log"):
            upgrade["log"].close()
        assert not os.path.ismount(m.mnt)


def test_upgrade_while_a_client_stages(tmp_path, counting_nvcc):
    """A client that stages recipes one after another (kernel.cu held open 0.5 s each, 0.1 s
    apart, as a JIT writing its sources): the upgrade waits for an instant when no stage is open, and a
    stage begun while the old daemon closes its gate is let through (the gate opens until it
    is closed) instead of the upgrade being given up with the old daemon serving on."""
    make, _ = counting_nvcc
    (tmp_path / "m").mkdir()
    m = Mount(tmp_path / "m", ["nvcc=%s" % make()]).start()
    stop = threading.Event()
    staged, failed = [], []
    upgrade = {}

    def stager():
        i = 0
        while not stop.is_set():
            src, flags = variant(1000 + i)
            entry = m.mnt / "cache" / ("kernel.vstage%d.%032x" % (i, i))
            try:
                entry.mkdir(parents=True)
                with open(entry / "kernel.cu", "wb") as f:
                    f.write(src)
                    time.sleep(0.5)
                (entry / "kernel.flags").write_bytes(flags)
                staged.append((entry, src))
            except OSError as e:
                failed.append((str(entry), e))
            i += 1
            time.sleep(0.1)  # a moment with no stage open

    th = threading.Thread(target=stager)
    try:
        th.start()
        time.sleep(1)
        log = open(m.log_path, "ab")
        upgrade["log"] = log
        new = subprocess.Popen([str(KCACHEFS), "-f", "--upgrade", str(m.mnt)], stdout=log,
                               stderr=subprocess.STDOUT)
        upgrade["proc"] = new
        try:
            upgrade["old_rc"] = m.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            upgrade["old_rc"] = None
        time.sleep(1)  # the stager goes on against the new daemon
        stop.set()
        th.join(timeout=60)
        assert upgrade["old_rc"] == 0 and new.poll() is None, (upgrade, m.daemon_log())
        m.proc = new
        assert not failed, failed
        assert len(staged) >= 3, staged
        for entry, src in staged:
            assert (entry / "kernel.cu").read_bytes() == src
        entry, _ = staged[-1]
        assert elf_machine((entry / "kernel.cubin").read_bytes()) == EM_CUDA
        log = m.daemon_log()
        assert "upgrade: the mount is pid %d's now" % new.pid in log, log
        assert "abandoned" not in log and "upgrade refused" not in log, log
    finally:
        stop.set()
        th.join(timeout=60)
        new = upgrade.get("proc")
        if new and m.proc is not new and new.poll() is None:
            if m.proc.poll() is None:
                m.proc.kill()
                m.proc.wait()
            m.proc = new
        m.stop()
        if upgrade.get("log"):
            upgrade["log"].close()
        assert not os.path.ismount(m.mnt)


def test_upgrade_while_deepgemm_ranks_compile_through_the_shim(tmp_path, counting_nvcc):
    """8 DeepGEMM ranks (tests/mount/deepgemm.py) compile kernels through the nvcc shim on a
    mount with a cluster store, and the mount is upgraded after 6 of 16 compiles: the old
    daemon hands over and exits 0, and no rank sees an error (scripts/gpu_deepgemm.py
    --upgrade-after 6 on a GPU node). The many concurrent requests are what the count of
    unanswered requests must keep exact: it lost increments, fell below 0, and the handover
    was abandoned at once ("-1 requests still unanswered") with the old daemon serving on."""
    import deepgemm
    from conftest import SHIM
    from test_shim import TEMPLATE
    make, calls = counting_nvcc
    nvcc = make()
    store = tmp_path / "store"
    store.mkdir()
    key = tmp_path / "cluster.key"
    key.write_bytes(os.urandom(32))
    os.chmod(key, 0o600)
    timeout = 60
    opts = ["remote=dir:%s" % store, "remote_key=%s" % key, "nvcc=%s" % nvcc,
            "compile_timeout=%d" % timeout]
    (tmp_path / "a").mkdir()
    m = Mount(tmp_path / "a", opts).start()
    kernels = {"scale_%d" % k: (TEMPLATE % (k, k + 2)).encode() for k in range(16)}
    upgrade = {}

    def rank(i):
        os.environ["DG_JIT_NVCC_COMPILER"] = str(SHIM)
        os.environ["KCACHEFS_NVCC"] = str(nvcc)
        return {name: hashlib.sha256(deepgemm.current(str(m.mnt / "dg"), name, src)).hexdigest()
                for name, src in kernels.items()}

    def run_upgrade():
        wait_until(lambda: calls() >= 6, "compiles did not start", 120)
        log = open(m.log_path, "ab")
        upgrade["log"] = log
        upgrade["proc"] = subprocess.Popen([str(KCACHEFS), "-f", "--upgrade", str(m.mnt)],
                                           stdout=log, stderr=subprocess.STDOUT)
        try:
            upgrade["old_rc"] = m.proc.wait(timeout=timeout + 30)
        except subprocess.TimeoutExpired:
            upgrade["old_rc"] = "still running after %d s" % (timeout + 30)

    th = threading.Thread(target=run_upgrade)
    try:
        th.start()
        results = run_parallel(PROCS, rank, timeout=600)
        th.join(timeout=600)
        new = upgrade.get("proc")
        assert new is not None and upgrade.get("old_rc") == 0 and new.poll() is None, (
            upgrade, m.daemon_log())
        m.proc = new
        assert all(isinstance(r, dict) for r in results), results
        assert all(r == results[0] for r in results), "ranks loaded different bytes"
        log = m.daemon_log()
        assert "upgrade: the mount is pid %d's now" % new.pid in log, log
        assert "abandoned" not in log and "upgrade refused" not in log, log
    finally:
        th.join(timeout=600)
        new = upgrade.get("proc")
        if new and m.proc is not new and new.poll() is None:
            if m.proc.poll() is None:
                m.proc.kill()
                m.proc.wait()
            m.proc = new
        m.stop()
        if upgrade.get("log"):
            upgrade["log"].close()
        assert not os.path.ismount(m.mnt)


def test_an_upgrade_whose_new_process_is_killed_while_compiles_run(tmp_path, counting_nvcc):
    """The new process killed (a service manager's reload timeout, a hand) while the old
    daemon drains the compiles in hand: the old daemon opens its gate again at once, not
    when those compiles end (here 600 s), so the mount's other clients do not hang."""
    make, calls = counting_nvcc
    nvcc = make(delay=600)
    (tmp_path / "m").mkdir()
    m = Mount(tmp_path / "m", ["nvcc=%s" % nvcc, "log_level=debug"]).start()
    new = opener = None
    try:
        fast = m.stage("vadd_fast", *variant(2))
        slow = m.stage("vadd_slow", *variant(1))
        opener = subprocess.Popen([sys.executable, "-c", "import sys; open(sys.argv[1], 'rb')",
                                   str(slow / "kernel.cubin")])
        wait_until(lambda: calls() == 1, "the slow compile runs", timeout=120)
        with open(m.log_path, "ab") as log:
            new = subprocess.Popen([str(KCACHEFS), "-f", "--upgrade", str(m.mnt)], stdout=log,
                                   stderr=subprocess.STDOUT)
        wait_until(lambda: "no new request is read; answering the" in m.daemon_log(),
                   "the old daemon drains the requests in hand", timeout=120)
        new.kill()
        new.wait()
        wait_until(lambda: "upgrade abandoned: the new process is gone" in m.daemon_log(),
                   "the old daemon sees the new process gone", timeout=120)
        # Served again (the gate is open): a new file made and read back, in a process of
        # its own so that a closed gate fails the test instead of hanging it.
        made = m.mnt / "after-the-upgrade.txt"
        subprocess.run([sys.executable, "-c", "import sys, pathlib; p = pathlib.Path(sys.argv[1]); "
                        "p.write_bytes(b'x'); assert p.read_bytes() == b'x'", str(made)],
                       check=True, timeout=120)
        assert "kernel.cu" in os.listdir(fast)
        assert m.proc.poll() is None and opener.poll() is None  # the slow open still waits
        assert "serving on" in m.daemon_log().split("upgrade abandoned")[-1].splitlines()[0]
    finally:
        if opener and opener.poll() is None:
            opener.kill()
            opener.wait()
        if new and new.poll() is None:
            new.kill()
            new.wait()
        m.stop()


def test_upgrades_follow_each_other(tmp_path, counting_nvcc):
    """kcachefs --upgrade (detached) exits 0 only once the new daemon serves and takes
    upgrades: four upgrades run back to back each go through, and the mount serves the same
    cubin afterwards. Before, the command returned when the new daemon forked, and an upgrade
    started at once was refused (no daemon listened yet: "Connection refused"). The
    upgrades run with a descriptor of a cubin open, which no new daemon keeps."""
    make, _ = counting_nvcc
    (tmp_path / "m").mkdir()
    m = Mount(tmp_path / "m", ["nvcc=%s" % make()]).start()
    pids = []
    try:
        e = m.stage("vadd", *variant(0))
        first = (e / "kernel.cubin").read_bytes()
        # Run from a process that holds a file of the mount open (a shell that has one):
        # the new daemons must not keep it, or the mount stays busy after it is closed.
        held = open(e / "kernel.cubin", "rb")
        for i in range(4):  # each at once after the last: nothing in between
            r = subprocess.run([str(KCACHEFS), "--upgrade", str(m.mnt)], capture_output=True,
                               text=True, timeout=120, pass_fds=(held.fileno(),))
            assert r.returncode == 0, (i, r, m.daemon_log())
        pids = daemons_of(m)
        assert (e / "kernel.cubin").read_bytes() == first
        held.close()
        r = subprocess.run(["fusermount3", "-u", str(m.mnt)], capture_output=True, text=True)
        assert r.returncode == 0, r  # not busy: no daemon kept the descriptor
        assert m.proc.wait(timeout=60) == 0  # the first daemon handed over and exited
        assert m.daemon_log().count("upgrade refused") == 0
    finally:
        m.stop()
        gone_after_unmount(pids)
