"""The manager's counters: one line appended per event to <cache root>/.kcachefs-triton/stats,
under an exclusive flock of that file, so processes of the whole node (the mount's flock is
node-wide) never interleave lines. Nothing here imports Triton.

A line is: "<unix time> <pid> <uid> <event> <seconds waited> <key>/<group file>".
Events:
  compile  the process took the kernel's lock and compiled (seconds waited: before the lock)
  loaded   it waited for another process's compile and loaded that group
  timeout  it waited KCACHEFS_TRITON_WAIT seconds and compiled without the lock
  nolock   the lock file could not be opened (permissions): it compiled without the lock
A hit needs no lock and is not recorded.
"""
import errno
import fcntl
import math
import os
import stat
import sys
import time

DIRNAME = ".kcachefs-triton"
STATS = "stats"
EVENTS = ("compile", "loaded", "timeout", "nolock")
LOCK_WAIT_S = 2.0  # longest wait for the stats file's flock (an append takes microseconds)


def record(state_dir, event, waited_s, what):
    """Append one event line; a failure (a read-only or foreign directory, a state directory
    or stats file that is a symlink or not what it should be, the file's flock held past
    LOCK_WAIT_S) is returned as the OSError, never raised: the counters must not break or
    stall a compile."""
    line = "%.3f %d %d %s %.3f %s\n" % (time.time(), os.getpid(), os.getuid(), event, waited_s,
                                        what)
    try:
        fd = _open_stats(state_dir)
    except OSError as e:
        return e
    try:
        _lock(fd, fcntl.LOCK_EX)
        os.write(fd, line.encode())
    except OSError as e:
        return e
    finally:
        os.close(fd)  # releases the flock
    return None


def _open_stats(state_dir):
    """The stats file of state_dir opened to append: neither a symlink, and the file a
    regular one (a FIFO would block the open, a directory take no line)."""
    nofollow = os.O_CLOEXEC | os.O_NOFOLLOW
    dfd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY | nofollow)
    try:
        fd = os.open(STATS, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | nofollow,
                     0o644, dir_fd=dfd)
    finally:
        os.close(dfd)
    if stat.S_ISREG(os.fstat(fd).st_mode):
        return fd
    os.close(fd)
    raise OSError(errno.EINVAL, "not a regular file", os.path.join(state_dir, STATS))


def _lock(fd, how):
    """flock fd, waiting at most LOCK_WAIT_S (whoever may read the file may hold it)."""
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            return fcntl.flock(fd, how | fcntl.LOCK_NB)
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise OSError(errno.EWOULDBLOCK, "its flock is held by another process") from None
            time.sleep(0.01)


def summarise(lines):
    """Totals over event lines: a dict of counters and seconds. Lines that do not parse are
    counted in 'bad_lines' (a file someone edited), not fatal."""
    s = {"compiles": 0, "waits": 0, "loaded": 0, "timeouts": 0, "compiled_after_wait": 0,
         "nolock": 0, "wait_seconds": 0.0, "max_wait_seconds": 0.0, "bad_lines": 0}
    for line in lines:
        f = line.split()
        if len(f) < 6 or f[3] not in EVENTS:
            s["bad_lines"] += 1
            continue
        try:
            waited = float(f[4])
        except ValueError:
            waited = -1.0
        if not 0 <= waited < math.inf:  # also NaN
            s["bad_lines"] += 1
            continue
        event = f[3]
        if event == "compile":
            s["compiles"] += 1
        elif event == "loaded":
            s["loaded"] += 1
        elif event == "timeout":
            s["timeouts"] += 1
        else:
            s["nolock"] += 1
        if event in ("loaded", "timeout") or (event == "compile" and waited > 0):
            s["waits"] += 1
            if event == "compile":
                s["compiled_after_wait"] += 1
        s["wait_seconds"] += waited
        s["max_wait_seconds"] = max(s["max_wait_seconds"], waited)
    return s


def stats_files(paths):
    """The stats files of cache roots: each path is a stats file, a cache root (its
    .kcachefs-triton/stats), or a directory whose subdirectories are cache roots (one per
    user, e.g. /mnt/kcache/triton)."""
    found = []
    for p in paths:
        if os.path.isfile(p):
            found.append(p)
            continue
        own = os.path.join(p, DIRNAME, STATS)
        if os.path.isfile(own):
            found.append(own)
        try:
            subs = sorted(os.listdir(p))
        except OSError:
            continue
        for d in subs:
            f = os.path.join(p, d, DIRNAME, STATS)
            if os.path.isfile(f):
                found.append(f)
    return found


def read(path):
    """The lines of one stats file, read under a shared flock (no half-appended line); bytes
    that are not UTF-8 (a file someone edited) are replaced, so such a line is a bad one."""
    with open(path, "rb") as f:
        _lock(f.fileno(), fcntl.LOCK_SH)
        return f.read().decode("utf-8", "replace").splitlines()


def main(argv):
    if len(argv) < 2 or argv[0] != "stats":
        sys.stderr.write("usage: python3 -m kcachefs_triton stats DIR...\n"
                         "  DIR: a TRITON_CACHE_DIR, the directory above several of them, "
                         "or a stats file\n")
        return 2
    files = stats_files(argv[1:])
    if not files:
        sys.stderr.write("kcachefs_triton: no %s/%s under %s\n" % (DIRNAME, STATS,
                                                                 " ".join(argv[1:])))
        return 1
    total = []
    for path in files:
        try:
            lines = read(path)
        except OSError as e:
            sys.stderr.write("kcachefs_triton: %s: %s\n" % (path, e.strerror))
            return 1
        total += lines
        if len(files) > 1:
            print_summary(path, summarise(lines))
    print_summary("total" if len(files) > 1 else files[0], summarise(total))
    return 0


def print_summary(title, s):
    print(title)
    print("  compiles granted      %d" % s["compiles"])
    print("  waits                 %d" % s["waits"])
    print("    loaded the group    %d" % s["loaded"])
    print("    got the lock, compiled (holder died or failed) %d" % s["compiled_after_wait"])
    print("    timed out, compiled anyway %d" % s["timeouts"])
    print("  compiled without lock (lock file not openable) %d" % s["nolock"])
    print("  seconds waiting       %.3f (longest %.3f)" % (s["wait_seconds"],
                                                        s["max_wait_seconds"]))
    if s["bad_lines"]:
        print("  lines not understood  %d" % s["bad_lines"])
