"""The mount-test library, without pytest: the built binaries, sample kernels, ELF helpers,
a Mount that runs one daemon in the foreground, parallel runners. conftest.py adds the
pytest fixtures; scripts/bench.py and scripts/stress.py-style tools use it directly.

KCACHEFS_BIN overrides the daemon (default: <repo>/build/kcachefs), KCACHEFS_NVCC_BIN the
nvcc shim (default: <repo>/build/kcachefs-nvcc).
"""
import array
import atexit
import contextlib
import hashlib
import multiprocessing
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KCACHEFS = Path(os.environ.get("KCACHEFS_BIN", REPO / "build" / "kcachefs"))
SHIM = Path(os.environ.get("KCACHEFS_NVCC_BIN", REPO / "build" / "kcachefs-nvcc"))


KERNELS = REPO / "tests" / "kernels"
BUILD = KCACHEFS.parent  # the build directory, for meson install


def _reachable(path):
    """Whether every directory above path (which exists) may be searched by all."""
    return path.exists() and all(os.stat(p).st_mode & 0o001 for p in path.parents)


def _open_to_compiles():
    """A daemon run as root compiles as uids of its own (-o compile_uids), which run
    kcachefs-nvrtc from the daemon's directory and read the sample kernels' include
    directory; the two-user tests run the shim as another user. A tree in a private
    directory (a clone under /root) has its binaries and kernels copied to a directory all
    can reach, removed at exit."""
    if os.geteuid() != 0 or not KCACHEFS.exists() or all(
            _reachable(p) for p in (KCACHEFS, SHIM, KERNELS)):
        return KCACHEFS, SHIM, KERNELS
    copy = Path(tempfile.mkdtemp(prefix="kcachefs-bin-"))
    os.chmod(copy, 0o755)
    atexit.register(shutil.rmtree, copy, True)
    for name in (KCACHEFS.name, "kcachefs-nvrtc"):
        if (KCACHEFS.parent / name).exists():
            shutil.copy2(KCACHEFS.parent / name, copy / name)
    if SHIM.exists():
        shutil.copy2(SHIM, copy / SHIM.name)
    shutil.copytree(KERNELS, copy / "kernels")
    return copy / KCACHEFS.name, copy / SHIM.name, copy / "kernels"


KCACHEFS, SHIM, KERNELS = _open_to_compiles()


def open_to_compiles(path):
    """Compiles run as uids of their own (-o compile_uids): open path, a private temp
    directory (pytest's tmp_path, a benchmark's mkdtemp) where wrapper compilers and the
    files they use live, to them, as an operator's compiler directory would be: the
    directories between it and the temp root may be passed through (0711), path itself is
    written like /tmp (1777)."""
    top = Path(tempfile.gettempdir())
    for p in path.parents:
        if p == top or top not in p.parents:
            break
        os.chmod(p, 0o711)
    os.chmod(path, 0o1777)
    return path
NVCC = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc"
EM_CUDA = 190


def entry_name(kernel, source, flags=b""):
    """A DeepGEMM-style entry name: kernel.<name>.<32 hex of the recipe>."""
    return "kernel.%s.%s" % (kernel, hashlib.sha256(source + b"\0" + flags).hexdigest()[:32])


def sample(name):
    """(source bytes, flags bytes) of a sample kernel in tests/kernels."""
    return (KERNELS / (name + ".cu")).read_bytes(), (KERNELS / (name + ".flags")).read_bytes()


def elf_symbols(data):
    """Names in the ELF symbol table of a 64-bit little-endian ELF file."""
    assert data[:4] == b"\x7fELF", "not an ELF file"
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = set()
    for sh in sections:
        if sh[1] != 2:  # SHT_SYMTAB
            continue
        strtab = sections[sh[6]]
        for off in range(sh[4], sh[4] + sh[5], 24):
            name_off, = struct.unpack_from("<I", data, off)
            start = strtab[4] + name_off
            end = data.index(b"\0", start)
            if end > start:
                names.add(data[start:end].decode())
    return names


def elf_machine(data):
    return struct.unpack_from("<H", data, 18)[0]


CAP_DAC_READ_SEARCH = 2


def has_capability(bit):
    """Whether this process has capability bit in its effective set (/proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> bit & 1)
    return False


def write_script(path, body):
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def mounts_at(path):
    """How many mounts /proc/self/mountinfo lists on path (stacked ones count apart)."""
    with open("/proc/self/mountinfo") as f:
        return sum(1 for line in f if line.split()[4] == str(path))


class Mount:
    """One kcachefs daemon in the foreground (-f) serving backing on mnt."""

    def __init__(self, root, options=(), bin=None, env=None):
        self.root = root
        self.env = env  # the daemon's environment (None: the test's)
        self.backing = root / "backing"
        self.mnt = root / "mnt"
        self.options = list(options)
        self.bin = bin or KCACHEFS  # the daemon to run
        self.log_path = root / "daemon.log"
        self.proc = None
        self.backing.mkdir(exist_ok=True)
        self.mnt.mkdir(exist_ok=True)

    def start(self, timeout=15):
        cmd = [str(self.bin), "-f"]
        if self.options:
            cmd += ["-o", ",".join(self.options)]
        cmd += [str(self.backing), str(self.mnt)]
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + timeout
        while not os.path.ismount(self.mnt):
            if self.proc.poll() is not None:
                raise RuntimeError("kcachefs exited %s: %s" % (self.proc.returncode, self.daemon_log()))
            if time.monotonic() > deadline:
                raise RuntimeError("kcachefs did not mount: " + self.daemon_log())
            time.sleep(0.02)
        return self

    def daemon_log(self):
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self):
        """Unmount and wait for the daemon; returns its exit status."""
        if self.proc is None:
            return None
        if os.path.ismount(self.mnt):
            # fusermount3 where it is installed; plain umount (as root) elsewhere
            unmount = ["fusermount3", "-u"] if shutil.which("fusermount3") else ["umount"]
            r = subprocess.run(unmount + [str(self.mnt)], capture_output=True)
            if r.returncode != 0 and self.proc.poll() is None:
                # Busy (a process waits on a compile): stop the daemon as systemd would;
                # it kills its compilers, answers the waiters and unmounts.
                self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # its compilers may outlive it, as after any crash
            rc = self.proc.wait()
        subprocess.run(["umount", "-l", str(self.mnt)], capture_output=True)
        self.proc = None
        self.log.close()
        return rc

    def kill(self):
        """SIGKILL the daemon (a crash) and detach the dead mount."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        subprocess.run(["umount", "-l", str(self.mnt)], capture_output=True)
        self.proc = None
        self.log.close()

    def stats(self):
        out = {}
        for line in (self.mnt / ".kcachefs" / "metrics.prom").read_text().splitlines():
            if line and not line.startswith("#") and "{" not in line:
                k, v = line.split()
                out[k.replace("kcachefs_", "")] = float(v)
        return out

    def stage(self, kernel, source, flags=b"-O3\n", parent="cache"):
        """Stage a recipe (kernel.cu + kernel.flags) into a new entry; returns its path."""
        entry = self.mnt / parent / entry_name(kernel, source, flags or b"")
        entry.mkdir(parents=True, exist_ok=True)
        (entry / "kernel.cu").write_bytes(source)
        if flags is not None:
            (entry / "kernel.flags").write_bytes(flags)
        return entry


def run_parallel(n, fn, *args, timeout=300):
    """Run fn(index, *args) in n forked processes released together by a barrier; returns
    the list of their return values (exceptions come back as ('exception', repr))."""
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(n)
    queue = ctx.Queue()

    def child(i):
        try:
            barrier.wait(timeout=60)
            queue.put((i, fn(i, *args)))
        except BaseException as e:  # reported to the parent, not raised in the child
            queue.put((i, ("exception", repr(e))))

    procs = [ctx.Process(target=child, args=(i,)) for i in range(n)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < n:
            left = deadline - time.monotonic()
            assert left > 0, "parallel workers did not finish in %s s" % timeout
            i, r = queue.get(timeout=left)
            results[i] = r
    finally:
        join_or_kill(procs, 5)
    return [results[i] for i in range(n)]


def join_or_kill(procs, timeout):
    """Join each multiprocessing process, waiting up to timeout seconds for each; one still
    alive then is killed (SIGKILL) and reaped."""
    for p in procs:
        p.join(timeout=timeout)
        if p.is_alive():
            p.kill()
            p.join()


@contextlib.contextmanager
def all_stopped(build):
    """Yields (start, started): start(*args, **kw) starts build(*args, **kw) (a Mount, a
    server: start() returns it started, stop() stops it) and keeps it in the list started;
    on leaving, even by an exception, every one started is stopped."""
    started = []

    def start(*args, **kw):
        thing = build(*args, **kw)
        started.append(thing)
        return thing.start()

    try:
        yield start, started
    finally:
        for thing in started:
            thing.stop()


# A process that opens and reads a file and prints "ok <bytes>" or "err <errno>".
OPENER = """
import os, sys
%s
try:
    with open(sys.argv[1], 'rb') as f:
        data = f.read()
    print('ok', len(data))
except OSError as e:
    print('err', e.errno)
"""


def start_openers(path, n, prelude="", **popen):
    """Start n OPENER processes on path; prelude runs first in each (e.g. a handler)."""
    return [subprocess.Popen([sys.executable, "-c", OPENER % prelude, str(path)],
                             stdout=subprocess.PIPE, text=True, **popen) for _ in range(n)]


def read_result(path):
    """Open + read a file; ('ok', sha256, size, fstat size) or ('err', errno)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
            st = os.fstat(f.fileno())
        return ("ok", hashlib.sha256(data).hexdigest(), len(data), st.st_size)
    except OSError as e:
        return ("err", e.errno)


def wait_until(cond, what, timeout=60, step=0.05):
    """Poll cond() every step seconds until it returns something true, and return that.
    Past timeout seconds (generous: tests run beside busy loops), fail with an
    AssertionError saying what: a string, or a callable called then (the daemon's log, its
    counters: what was seen when the wait gave up)."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(step)


def wait_for_flight(m, timeout=60):
    """Return once a compile is in flight on mount m."""
    wait_until(lambda: m.stats()["flights"] >= 1, "compile never started", timeout)


def slow_nvcc(tmp_path, release, gated="*-cubin*"):
    """A compiler that blocks compiles whose arguments match the shell pattern gated (by
    default every compile) until the file `release` exists, then runs nvcc."""
    return write_script(tmp_path / "nvcc-gated",
                        'case "$*" in %s) while [ ! -e %s ]; do sleep 0.05; done;; esac\n'
                        'exec /usr/local/cuda/bin/nvcc "$@"\n' % (gated, release))


def as_user(user, code, *args):
    """Run Python code as user ((uid, gid)); returns its stdout's words (code prints
    results)."""
    uid, gid = user
    r = subprocess.run([sys.executable, "-c", code, *map(str, args)], user=uid, group=gid,
                       extra_groups=[], cwd="/", capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


# Clients of a mount whose daemon is replaced (a live upgrade) or dies (a holder's restart).

# Runs in a mount namespace of its own (unshare -m, as a container's): bind-mounts the
# mountpoint, then reads the files named on stdin through the bind mount.
NS_HELPER = r"""
import hashlib, os, subprocess, sys
mnt, bind = sys.argv[1], sys.argv[2]
subprocess.run(["mount", "--bind", mnt, bind], check=True)
print("ready", flush=True)
for line in sys.stdin:
    path = os.path.join(bind, line.strip())
    try:
        with open(path, "rb") as f:
            data = f.read()
        print("ok", hashlib.sha256(data).hexdigest(), os.stat(path).st_dev, flush=True)
    except OSError as e:
        print("err", e.errno, flush=True)
"""


def variant(i):
    src, flags = sample("vector_add")
    return src + b"\n// variant %d\n" % i, flags


def open_all(index, entries):
    """One client: opens every kernel.cubin in its own order; (name, sha256, size, seconds)
    or (name, 'err', errno, seconds) for each."""
    order = list(entries)
    random.Random(index).shuffle(order)
    out = []
    for e in order:
        t = time.monotonic()
        try:
            with open(os.path.join(e, "kernel.cubin"), "rb") as f:
                data = f.read()
            out.append((e, hashlib.sha256(data).hexdigest(), len(data), time.monotonic() - t))
        except OSError as err:
            out.append((e, "err", err.errno, time.monotonic() - t))
    return out


def daemons_of(m, comm=None):
    """Pids of the kcachefs processes whose command line names m's mountpoint and that hold
    /dev/fuse: its daemons (a watcher, forked from a daemon, closes it at once), and its
    holder (-o holder); only those named comm (/proc/PID/comm: "kcachefs" for daemons,
    "kcachefs-holder") when it is given."""
    pids = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = open("/proc/%s/cmdline" % d, "rb").read().split(b"\0")
            if not (argv[0].endswith(b"kcachefs") and str(m.mnt).encode() in argv):
                continue
            if comm and open("/proc/%s/comm" % d).read().strip() != comm:
                continue
            fds = os.listdir("/proc/%s/fd" % d)
            if any(os.readlink("/proc/%s/fd/%s" % (d, f)) == "/dev/fuse" for f in fds):
                pids.append(int(d))
        except OSError:
            continue
    return pids


def ns_read(helper, rel):
    helper.stdin.write(rel + "\n")
    helper.stdin.flush()
    return helper.stdout.readline().split()


class FakeManager:
    """The part of systemd the unit's holder relies on, by the documented protocol: a
    NOTIFY_SOCKET whose FDSTORE=1 messages (sd_notify(3), FDNAME=, descriptors in
    SCM_RIGHTS) it keeps, FDSTOREREMOVE=1 drops, and a start that hands them back as
    descriptors 3... with LISTEN_FDS, LISTEN_PID and LISTEN_FDNAMES (sd_listen_fds(3))."""

    def __init__(self, tmp_path):
        self.path = str(tmp_path / "notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.store = {}

    def receive(self):
        while True:
            try:
                data, anc, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(64 * 4),
                                                    socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            fds = array.array("i")
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
            fields = dict(l.split("=", 1) for l in data.decode().splitlines() if "=" in l)
            name = fields.get("FDNAME", "stored")
            if fields.get("FDSTORE") == "1" and fds:
                self.drop(name)
                self.store[name] = fds[0]
                for fd in fds[1:]:
                    os.close(fd)
            else:
                for fd in fds:
                    os.close(fd)
            if fields.get("FDSTOREREMOVE") == "1":
                self.drop(name)

    def drop(self, name):
        if name in self.store:
            os.close(self.store.pop(name))

    def run(self, argv, log):
        self.receive()
        env = dict(os.environ, NOTIFY_SOCKET=self.path)
        names = list(self.store)
        fds = [self.store[n] for n in names]
        # Descriptors 3... as systemd passes them; LISTEN_PID is the process's own pid.

        def move():
            high = [os.dup(fd) for fd in fds]
            for i, fd in enumerate(high):
                os.dup2(fd, 3 + i)
                os.close(fd)

        script = ('export LISTEN_FDS=%d LISTEN_PID=$$ LISTEN_FDNAMES=%s; exec "$@"'
                  % (len(fds), ":".join(names))) if fds else 'exec "$@"'
        return subprocess.Popen(["/bin/sh", "-c", script, "sh"] + argv, env=env,
                                preexec_fn=move, pass_fds=range(3, 3 + len(fds)),
                                stdout=log, stderr=subprocess.STDOUT)

    def wait_stored(self, names, timeout=30):
        def stored():
            self.receive()
            return set(names) <= set(self.store)
        wait_until(stored, lambda: ("not stored", names, list(self.store)), timeout=timeout)

    def release(self):
        """A stop: the store is closed."""
        if self.sock.fileno() < 0:
            return
        self.receive()
        for name in list(self.store):
            self.drop(name)
        self.sock.close()
