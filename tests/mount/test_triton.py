"""The Triton cache manager (python/kcachefs_triton) on a real mount, driven through
the calls of Triton's compile() by tests/mount/triton_harness.py (a stand-in of
triton.runtime.cache; no Triton here): each kernel compiled once per node by processes
released together, waiters that load only whole groups, holders that die, raise or stall,
the directory off the mount left as Triton's own manager leaves it, the counters, and two
users."""
import errno
import fcntl
import hashlib
import json
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

import triton_harness
from conftest import BUILD, REPO, run_parallel
from kcmount import as_user, wait_until

triton_harness.install_standin()
sys.path.insert(0, str(REPO / "python"))
from kcachefs_triton import stats  # noqa: E402
from kcachefs_triton.manager import KcachefsCacheManager  # noqa: E402

MANAGER = "kcachefs_triton:KcachefsCacheManager"
HARNESS = Path(triton_harness.__file__)
NAMES = ["add", "softmax", "matmul_cfg0", "matmul_cfg1"]


def use(root, manager=True, wait=None):
    os.environ["TRITON_CACHE_DIR"] = str(root)
    if manager:
        os.environ["TRITON_CACHE_MANAGER"] = MANAGER
    else:
        os.environ.pop("TRITON_CACHE_MANAGER", None)
    if wait is not None:
        os.environ["KCACHEFS_TRITON_WAIT"] = str(wait)


@pytest.fixture(autouse=True)
def restore_env():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def summary(root):
    return stats.summarise(stats.read(str(root / stats.DIRNAME / stats.STATS)))


def key_dirs(root):
    return sorted(p for p in root.iterdir() if p.name != stats.DIRNAME)


def check_groups(root, names):
    """Every key directory holds exactly one published group of a kernel of names, complete
    (every file the index lists, with the size recorded), and nothing else."""
    seen = []
    for d in key_dirs(root):
        index = [p for p in d.iterdir() if p.name.startswith("__grp__")]
        assert len(index) == 1, sorted(os.listdir(d))
        data = json.loads(index[0].read_text())
        name = index[0].name[len("__grp__"):-len(".json")]
        seen.append(name)
        want = {"%s.%s" % (name, e) for e in triton_harness.STAGES} | {name + ".json"}
        assert set(data["child_paths"]) == want
        assert set(os.listdir(d)) == want | {index[0].name}, "other files in the key directory"
        for child, path in data["child_paths"].items():
            assert os.path.getsize(path) == data["kcachefs"][child][0]
        assert triton_harness.load(data["child_paths"], name)
    assert sorted(seen) == sorted(names)


class Client:
    """One harness process (triton_harness.main) with the manager on root."""

    def __init__(self, root, counter, names, mode=None, wait=600, user=None, pythonpath=None):
        env = dict(os.environ, TRITON_CACHE_DIR=str(root), TRITON_CACHE_MANAGER=MANAGER,
                   KCACHEFS_TRITON_WAIT=str(wait),
                   PYTHONPATH=pythonpath or "%s:%s" % (REPO / "python", HARNESS.parent))
        harness = str(Path(pythonpath.split(":")[-1]) / HARNESS.name) if pythonpath else str(HARNESS)
        cmd = [sys.executable, harness] + ([mode] if mode else []) + [str(counter)] + names
        extra = dict(user=user[0], group=user[1], extra_groups=[], cwd="/") if user else {}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=env, **extra)
        self.fds = {"stdout": self.proc.stdout.fileno(), "stderr": self.proc.stderr.fileno()}
        self.out = {fd: b"" for fd in self.fds.values()}

    def wait_for(self, stream, text, timeout=120):
        """Read stream (stdout or stderr) until a line containing text; fails after timeout
        or if the process ends first."""
        fd = self.fds[stream]
        deadline = time.monotonic() + timeout
        while text.encode() not in self.out[fd]:
            left = deadline - time.monotonic()
            assert left > 0, "no %r from the client in %d s: %r" % (text, timeout, self.out)
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 65536)
                assert chunk, "client ended before %r: %r" % (text, self.out)
                self.out[fd] += chunk

    def send(self, line=b"go\n"):
        self.proc.stdin.write(line)
        self.proc.stdin.flush()

    def finish(self, timeout=120):
        """Close stdin and collect: (status, stdout, stderr)."""
        out, err = self.proc.communicate(timeout=timeout)
        return (self.proc.returncode, self.out[self.fds["stdout"]].decode() + out.decode(),
                self.out[self.fds["stderr"]].decode() + err.decode())

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


@pytest.fixture
def clients():
    started = []

    def make(*args, **kwargs):
        started.append(Client(*args, **kwargs))
        return started[-1]

    yield make
    for c in started:
        c.kill()


def digests(stdout):
    return {line.split()[1]: line.split()[2] for line in stdout.splitlines() if line.startswith("ok ")}


def work(name):
    """A compile's CPU time (about 0.1 s here), so that the processes' compiles overlap."""
    h = name.encode()
    for _ in range(100000):
        h = hashlib.sha256(h).digest()


def eight_processes(i, root, counter, manager=True):
    use(root, manager)
    return {n: triton_harness.compile(n, triton_harness.source_of(n), str(counter), work)
            for n in NAMES[i % len(NAMES):] + NAMES[:i % len(NAMES)]}


def test_eight_processes_compile_each_kernel_once(mount_factory, tmp_path):
    m = mount_factory()
    root, counter = m.mnt / "triton", tmp_path / "compiles"
    for run in ("cold", "warm"):
        results = run_parallel(8, eight_processes, root, counter)
        assert all(r == results[0] for r in results), results
        assert triton_harness.compiles(counter) == {n: 1 for n in NAMES}, run
    check_groups(root, NAMES)
    s = summary(root)
    assert (s["compiles"], s["timeouts"], s["nolock"], s["bad_lines"]) == (len(NAMES), 0, 0, 0), s
    assert s["waits"] == s["loaded"] + s["compiled_after_wait"], s
    locks = sorted(os.listdir(root / stats.DIRNAME / "locks"))
    assert len(locks) == len(NAMES) and all(n.endswith(".json") for n in locks), locks
    assert not [p for p in root.rglob("*") if "tmp.pid_" in p.name], "temp files left"


def holder_and_waiters(clients, root, counter, kernel, mode, n, **kw):
    """A holder (mode: --gate, --stall, --raise) that is compiling kernel, and n clients of
    the same kernel started after it; with parked=True (the default) each has found the
    lock taken and waits."""
    parked = kw.pop("parked", True)
    holder = clients(root, counter, [kernel], mode=mode)
    holder.wait_for("stdout", "compiling " + kernel)
    waiters = [clients(root, counter, [kernel], **kw) for _ in range(n)]
    for w in waiters if parked else ():
        w.wait_for("stderr", "waiting for")  # each found the lock taken
    return holder, waiters


def test_waiters_load_the_holders_group(mount_factory, tmp_path, clients):
    m = mount_factory()
    root, counter = m.mnt / "triton", tmp_path / "compiles"
    holder, waiters = holder_and_waiters(clients, root, counter, "add", "--gate", 3)
    holder.send()
    results = [c.finish() for c in [holder] + waiters]
    assert [r[0] for r in results] == [0] * 4, results
    assert len({digests(r[1])["add"] for r in results}) == 1
    assert triton_harness.compiles(counter) == {"add": 1}
    s = summary(root)
    assert (s["compiles"], s["waits"], s["loaded"], s["timeouts"]) == (1, 3, 3, 0), s
    assert s["wait_seconds"] > 0
    check_groups(root, ["add"])


def test_a_holder_killed_mid_compile_hands_over(mount_factory, tmp_path, clients):
    m = mount_factory()
    root, counter = m.mnt / "triton", tmp_path / "compiles"
    holder, waiters = holder_and_waiters(clients, root, counter, "softmax", "--stall", 3)
    holder.proc.send_signal(signal.SIGKILL)
    holder.proc.wait()
    results = [w.finish() for w in waiters]
    assert [r[0] for r in results] == [0] * 3, results
    assert len({digests(r[1])["softmax"] for r in results}) == 1
    # the killed holder's compile and one waiter's; the others loaded it
    assert triton_harness.compiles(counter) == {"softmax": 2}
    s = summary(root)
    assert (s["compiles"], s["compiled_after_wait"], s["loaded"], s["timeouts"]) == (2, 1, 2, 0), s
    check_groups(root, ["softmax"])


def test_a_holder_that_raises_lets_the_others_go(mount_factory, tmp_path, clients):
    m = mount_factory()
    root, counter = m.mnt / "triton", tmp_path / "compiles"
    holder, waiters = holder_and_waiters(clients, root, counter, "matmul_cfg0", "--raise", 2)
    holder.send()  # it raises now and stays alive
    holder.wait_for("stdout", "raised matmul_cfg0")
    results = [w.finish() for w in waiters]  # KCACHEFS_TRITON_WAIT=600: not by the timeout
    assert [r[0] for r in results] == [0, 0], results
    assert triton_harness.compiles(counter) == {"matmul_cfg0": 2}
    s = summary(root)
    assert (s["compiles"], s["loaded"], s["timeouts"]) == (2, 1, 0), s
    assert holder.proc.poll() is None, "the holder must still be alive"
    rc, _, err = holder.finish()
    assert rc == 0 and "the compile ended without put_group" in err, err
    check_groups(root, ["matmul_cfg0"])


def test_the_wait_is_bounded(mount_factory, tmp_path, clients):
    m = mount_factory()
    root, counter = m.mnt / "triton", tmp_path / "compiles"
    holder, waiters = holder_and_waiters(clients, root, counter, "add", "--stall", 2, wait=1,
                                         parked=False)
    results = [w.finish() for w in waiters]
    assert [r[0] for r in results] == [0, 0], results
    # each timed out and compiled, or loaded the group one that timed out published first
    timed_out = sum("compiling it here" in r[2] for r in results)
    assert timed_out >= 1, results
    assert triton_harness.compiles(counter) == {"add": 1 + timed_out}
    s = summary(root)
    assert (s["compiles"], s["timeouts"], s["loaded"], s["waits"]) == (1, timed_out, 2 - timed_out, 2), s
    assert s["max_wait_seconds"] >= 1
    holder.kill()
    check_groups(root, ["add"])


def test_an_incomplete_group_is_a_miss(mount_factory, tmp_path):
    m = mount_factory()
    root, counter = m.mnt / "triton", tmp_path / "compiles"
    use(root)
    src = triton_harness.source_of("add")
    good = triton_harness.compile("add", src, str(counter))
    (cubin,) = root.glob("*/add.cubin")
    cubin.write_bytes(cubin.read_bytes()[:4096])  # truncated behind the manager's back
    assert triton_harness.compile("add", src, str(counter)) == good
    cubin.unlink()
    assert triton_harness.compile("add", src, str(counter)) == good
    (index,) = root.glob("*/__grp__add.json")
    index.write_text("{not json")
    assert triton_harness.compile("add", src, str(counter)) == good
    assert triton_harness.compiles(counter) == {"add": 4}
    check_groups(root, ["add"])


def flock_from_another_process(path):
    """'free' if another process can take path's lock now, else 'held'."""
    code = ("import fcntl, os, sys\nfd = os.open(sys.argv[1], os.O_RDONLY)\ntry:\n"
            "    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); print('free')\n"
            "except BlockingIOError:\n    print('held')\n")
    return subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                          text=True, check=True).stdout.strip()


def holding(m, key, meta, wait=None):
    """Use the manager on m's triton directory, and miss group meta of key in this thread,
    which then holds that group's lock. Returns (root, the holding manager, the lock file)."""
    root = m.mnt / "triton"
    use(root, wait=wait)
    holder = KcachefsCacheManager(key)
    assert holder.get_group(meta) is None  # a miss: this thread holds the group's lock
    return root, holder, root / stats.DIRNAME / "locks" / (key + "." + meta)


def put_add(holder, meta):
    """Publish add's compiled files and group meta through holder; returns the group."""
    files = dict(triton_harness.artifacts("add", triton_harness.source_of("add")))
    files[meta] = json.dumps({"name": "add", "source": "x"})
    return {c: holder.put(d, c) for c, d in files.items()}


def test_a_failed_compile_retried_dropped_or_left_in_the_same_thread(mount_factory):
    m = mount_factory()
    root = m.mnt / "triton"
    locks = root / stats.DIRNAME / "locks"
    use(root)
    first = KcachefsCacheManager("A" * 52)
    assert first.get_group("add.json") is None  # a miss: it holds add's lock
    lock = locks / ("A" * 52 + ".add.json")
    assert flock_from_another_process(lock) == "held"
    # the compile raised (its manager kept alive by the exception); Triton retries the same
    # kernel in the same thread: no self-deadlock, and the retry owns the lock now
    retry = KcachefsCacheManager("A" * 52)
    assert retry.get_group("add.json") is None
    del first
    assert flock_from_another_process(lock) == "held"
    # the thread goes on to another kernel: the lock of the abandoned compile is released
    other = KcachefsCacheManager("B" * 52)
    assert other.get_group("softmax.json") is None
    assert flock_from_another_process(lock) == "free"
    other.put_group("softmax.json", {})
    assert flock_from_another_process(locks / ("B" * 52 + ".softmax.json")) == "free"
    # a manager dropped without put_group (Triton's compile raised): its lock goes with it
    dropped = KcachefsCacheManager("D" * 52)
    assert dropped.get_group("add.json") is None
    assert flock_from_another_process(locks / ("D" * 52 + ".add.json")) == "held"
    del dropped
    assert flock_from_another_process(locks / ("D" * 52 + ".add.json")) == "free"
    del retry


def tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def blocked_on(path):
    """How many flock requests wait for path's lock, from /proc/locks ("->" lines: a process
    blocked in the kernel, not one that polls)."""
    st = os.stat(path)
    ident = "%02x:%02x:%d" % (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    with open("/proc/locks") as f:
        return sum(1 for line in f if "->" in line.split() and ident in line.split())


def test_a_waiter_is_woken_by_the_release_not_a_polling_grid(mount_factory, tmp_path):
    """Waiters block in the kernel on the kernel's lock (seen in /proc/locks) and look for the
    group exactly once more, when the holder's put_group lets go: no look, no flock attempt
    on a grid while the holder compiles, whatever that takes."""
    key, meta = "E" * 52, "add.json"
    root, holder, lock = holding(mount_factory(), key, meta)
    looks, flocks, groups = [], [], []
    real_flock = fcntl.flock

    def counted_flock(fd, how):
        flocks.append(how)
        return real_flock(fd, how)

    def wait(i):
        mgr = KcachefsCacheManager(key)
        inner = mgr._complete_group
        mgr._complete_group = lambda f: looks.append(i) or inner(f)
        groups.append(mgr.get_group(meta))

    fcntl.flock = counted_flock
    threads = [threading.Thread(target=wait, args=(i,)) for i in range(3)]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: blocked_on(lock) == 3, "3 waiters blocked on the lock")
        assert sorted(looks) == [0, 1, 2], looks  # each looked once, before it blocked
        # each tried the lock exclusively (LOCK_NB), then shared (LOCK_NB, then blocking)
        tries = len(flocks)
        time.sleep(0.3)  # longer than any polling interval: nobody looks or tries meanwhile
        assert (sorted(looks), len(flocks), blocked_on(lock)) == ([0, 1, 2], tries, 3)
        group = put_add(holder, meta)
        holder.put_group(meta, group)  # lets go: every waiter wakes and loads it
        for t in threads:
            t.join(60)
    finally:
        fcntl.flock = real_flock
    assert groups == [group] * 3, groups
    assert sorted(looks) == [0, 0, 1, 1, 2, 2], looks  # one look each after the wake
    s = summary(root)
    assert (s["compiles"], s["loaded"], s["timeouts"], s["waits"]) == (1, 3, 0, 3), s


def test_a_wait_given_up_leaves_no_lock_behind(mount_factory):
    """A waiter that gives up (KCACHEFS_TRITON_WAIT) compiles; its blocked flock, granted
    once the holder lets go, is released at once, so it never holds up the next process."""
    key, meta = "F" * 52, "add.json"
    root, holder, lock = holding(mount_factory(), key, meta, wait=0.2)
    got = []
    t = threading.Thread(target=lambda: got.append(KcachefsCacheManager(key).get_group(meta)))
    t.start()  # another thread: this one holds the lock
    t.join(60)
    assert got == [None]  # gave up: it compiles without the lock
    assert blocked_on(lock) == 1, "the abandoned wait is still queued on the lock"
    holder.put_group(meta, {})  # publishes nothing (no metadata file), releases the lock
    wait_until(lambda: blocked_on(lock) == 0 and flock_from_another_process(lock) == "free",
               "the lock free once the holder let go")
    s = summary(root)
    assert (s["compiles"], s["timeouts"], s["loaded"]) == (1, 1, 0), s


def test_a_waiter_lets_go_of_the_lock_even_if_a_fork_holds_its_descriptor(mount_factory):
    """A process that forks while one of its threads waits (a multiprocessing pool started
    meanwhile) gives the child copies of the lock's descriptors; the waiter unlocks
    explicitly when it has loaded the group, so the lock is free with the child alive."""
    key, meta = "G" * 52, "add.json"
    _, holder, lock = holding(mount_factory(), key, meta)
    groups = []
    t = threading.Thread(target=lambda: groups.append(KcachefsCacheManager(key).get_group(meta)))
    t.start()
    wait_until(lambda: blocked_on(lock) == 1, "the waiter blocked on the lock")
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # holds copies of every descriptor until the test is done with it
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    try:
        group = put_add(holder, meta)
        holder.put_group(meta, group)
        t.join(60)
        assert groups == [group]
        assert flock_from_another_process(lock) == "free"
    finally:
        os.close(w)
        os.waitpid(child, 0)


def test_off_the_mount_it_is_tritons_own_manager(tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    counter = str(tmp_path / "compiles")
    for root, manager in ((ours, True), (theirs, False)):
        use(root, manager)
        for n in NAMES[:2]:
            triton_harness.compile(n, triton_harness.source_of(n), counter)
            triton_harness.compile(n, triton_harness.source_of(n), counter)  # a hit
    assert tree(ours) == tree(theirs) and not (ours / stats.DIRNAME).exists()
    for index in ours.glob("*/__grp__*"):
        assert index.read_text() == (theirs / index.relative_to(ours)).read_text().replace(
            str(theirs), str(ours))
    # a group missing a file: both give the same partial group
    for root in (ours, theirs):
        next(root.glob("*/add.ptx")).unlink()
    key = next(ours.glob("*/add.ptx.json".replace(".ptx", ""))).parent.name
    use(ours, True)
    got = KcachefsCacheManager(key).get_group("add.json")
    use(theirs, False)
    want = triton_harness.FileCacheManager(key).get_group("add.json")
    assert got == {c: p.replace(str(theirs), str(ours)) for c, p in want.items()}
    assert "add.ptx" not in got


def test_stats_command(mount_factory, tmp_path):
    m = mount_factory()
    root = m.mnt / "triton"
    counter = tmp_path / "compiles"
    for sub in ("u1", "u2"):
        use(root / sub)
        triton_harness.compile("add", triton_harness.source_of("add"), str(counter))
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    r = subprocess.run([sys.executable, "-m", "kcachefs_triton", "stats", str(root)], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("compiles granted      1") == 2 and "total" in r.stdout, r.stdout
    assert "compiles granted      2" in r.stdout, r.stdout
    r = subprocess.run([sys.executable, "-m", "kcachefs_triton", "stats", str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "no .kcachefs-triton/stats" in r.stderr, r


def test_two_users_do_not_block_each_other(public_mount_factory, two_users, clients):  # noqa: F811
    alice, bob = two_users
    m = public_mount_factory(["allow_other"])
    # The code, where both users can read it (the tree may be in a private directory).
    code = Path(tempfile.mkdtemp(prefix="kcachefs-triton-code-"))
    try:
        os.chmod(code, 0o755)
        shutil.copytree(REPO / "python" / "kcachefs_triton", code / "kcachefs_triton",
                        ignore=shutil.ignore_patterns("__pycache__"))
        for f in (HARNESS, HARNESS.parent / "triton_cache.py"):
            shutil.copy(f, code / f.name)
        counter = code / "compiles"
        counter.touch(mode=0o666)
        os.chmod(counter, 0o666)
        top = m.mnt / "triton"
        top.mkdir()
        dirs = {}
        for name, user in (("alice", alice), ("bob", bob)):
            dirs[name] = top / name
            dirs[name].mkdir()
            os.chown(dirs[name], *user)
            os.chmod(dirs[name], 0o755)  # others may look, as with a umask of 022
        path = "%s:%s" % (code, code)
        a = clients(dirs["alice"], counter, ["add"], mode="--gate", user=alice, pythonpath=path)
        a.wait_for("stdout", "compiling add")  # alice holds add's lock in her directory
        b = clients(dirs["bob"], counter, ["add"], user=bob, pythonpath=path)
        rc, out, err = b.finish()  # bob compiles his own: not blocked by alice
        assert rc == 0 and "ok add" in out and "waiting" not in err, (out, err)
        (lock,) = (dirs["alice"] / stats.DIRNAME / "locks").iterdir()
        st = lock.stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (alice[0], 0o600)
        assert stat.S_IMODE((dirs["alice"] / stats.DIRNAME).stat().st_mode) == 0o700
        opened = as_user(bob, "import os, sys\ntry:\n    os.open(sys.argv[1], os.O_RDONLY)\n"
                         "    print('opened')\nexcept OSError as e:\n    print(e.errno)\n", lock)
        assert opened == [str(errno.EACCES)], opened
        a.send()
        rc, out, err = a.finish()
        assert rc == 0 and "ok add" in out, err
        assert triton_harness.compiles(str(counter)) == {"add": 2}
        assert digests(out)["add"]
    finally:
        shutil.rmtree(code)


def test_the_lock_file_is_only_for_who_may_write_the_root(mount_factory):
    """Who may open (and so flock) a lock file: its owner, and the group or others only
    where they may write the cache root anyway. (The mount creates files with the daemon's
    umask too, 022 here, so write bits for the group and others never reach it; read, which
    flock needs, does.)"""
    m = mount_factory()
    for mode, readable in ((0o755, 0), (0o775, stat.S_IRGRP), (0o777, stat.S_IRGRP | stat.S_IROTH)):
        root = m.mnt / ("root%o" % mode)
        root.mkdir()
        os.chmod(root, mode)
        use(root)
        mgr = KcachefsCacheManager("C" * 52)
        assert mgr.get_group("k.json") is None
        mgr.put_group("k.json", {})
        (lock,) = (root / stats.DIRNAME / "locks").iterdir()
        got = stat.S_IMODE(lock.stat().st_mode)
        assert got & 0o077 & ~(stat.S_IWGRP | stat.S_IWOTH) == readable, (oct(mode), oct(got))


def test_meson_install_puts_it_where_python_finds_it(tmp_path):
    r = subprocess.run(["meson", "install", "-C", str(BUILD), "--destdir", str(tmp_path / "d"),
                        "--no-rebuild", "--quiet"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    (init,) = (tmp_path / "d").rglob("kcachefs_triton/__init__.py")
    assert {p.name for p in init.parent.iterdir()} >= {"__init__.py", "__main__.py",
                                                        "manager.py", "stats.py"}
    # the installed copy, with the stand-in Triton, loads the class as Triton does
    code = ("import sys; sys.path.insert(0, sys.argv[2]); import triton_harness\n"
            "triton_harness.install_standin(); sys.path.insert(0, sys.argv[1])\n"
            "import importlib; m = importlib.import_module('kcachefs_triton')\n"
            "cls = getattr(m, 'KcachefsCacheManager')\n"
            "print(m.__file__, issubclass(cls, sys.modules['triton.runtime.cache'].FileCacheManager))\n")
    r = subprocess.run([sys.executable, "-c", code, str(init.parent.parent), str(HARNESS.parent)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(init), "True"], r.stdout
