"""KcachefsCacheManager: Triton's FileCacheManager with single-flight compiles on a kcachefs
mount.

Triton's compile() asks the manager for a kernel's group (get_group of "<name>.json"); on a
miss it compiles, put()s every artifact and then put_group()s the index "__grp__<name>.json",
which is therefore the commit point of a compile. This manager, for a cache directory on a
kcachefs mount:

- on a miss takes the kernel's lock: an exclusive flock of
  <cache root>/.kcachefs-triton/locks/<key>.<group file>, through the mount, so node-wide, and
  released by the kernel if the holder dies. It polls LOCK_NB (10 ms, growing to 100 ms) for at
  most KCACHEFS_TRITON_WAIT seconds (default 120), then compiles without it;
- once it has the lock it looks again: a group published meanwhile is loaded, otherwise it
  returns None and Triton compiles, holding the lock until put_group has written the index.
  A compile that raises never reaches put_group: the lock is released when Triton drops the
  manager (the compile's frame goes), at the next get_group of another kernel in the same
  thread, at exit, and in any case by the waiters' bounded wait;
- a waiter loads only a complete group: the index written last, every file it lists present,
  and (for indexes this manager wrote) each file's size and SHA-256 as recorded at put_group.
  Anything less is a miss, compiled again, never a partial group handed to Triton.

The lock files live outside the key directories so that tools which copy a key directory
whole (Inductor's Triton bundler) never carry or replace them. A lock file may be opened only
by those who may write the cache root anyway (mode 0600, plus group/other bits where the root
is group/other writable), so no user can hold another user's kernels. Off a kcachefs mount,
and for Triton's dump and override managers, every method is FileCacheManager's.
"""
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import stat
import threading
import time
import weakref

from triton.runtime.cache import FileCacheManager

from . import stats

log = logging.getLogger("kcachefs_triton")

FSTYPE = "fuse.kcachefs"
WAIT_ENV = "KCACHEFS_TRITON_WAIT"
DEFAULT_WAIT_S = 120.0  # longer than most compiles; a stuck holder costs at most this
POLL_FIRST_S, POLL_MAX_S = 0.01, 0.1
RECORD = "kcachefs"  # the index's extra field: {child: [size, sha256 hex]}
GROUP_PREFIX = "__grp__"  # Triton's name of a group index

_registry = threading.Lock()  # guards the three tables below
_mounts = {}  # st_dev -> on a kcachefs mount?
_state_dirs = {}  # cache root -> its .kcachefs-triton directory, made
_held = {}  # lock path -> _Hold of a lock this process holds


class _Hold:
    """A kernel lock held from a miss to put_group: its descriptor and the thread that
    compiles."""

    def __init__(self, path, fd, what, state_dir):
        self.path, self.fd, self.what, self.state_dir = path, fd, what, state_dir
        self.thread = threading.get_ident()
        self.owner = None  # the token of the manager whose compile holds it

    def own(self, manager):
        """Make manager the owner: when Triton drops it, a lock still held is released."""
        token = self.owner = object()
        weakref.finalize(manager, _release_if_owner, self, token)


def _release_if_owner(hold, token):
    if hold.owner is token:
        _unlock(hold, "the compile ended without put_group")


def _unescape(field):
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _detect(dev):
    """Whether device dev is a kcachefs mount, from /proc/self/mountinfo: the type the mount
    gives itself, or (another fuse type, e.g. a renamed binary) a whole mount with the
    .kcachefs/ control directory at its root."""
    want = "%d:%d" % (os.major(dev), os.minor(dev))
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    for line in lines:
        f = line.split()
        if len(f) < 9 or f[2] != want or "-" not in f[6:]:
            continue
        fstype = f[f.index("-", 6) + 1]
        if fstype == FSTYPE:
            return True
        if (fstype.startswith("fuse") and f[3] == "/" and
                os.path.isfile(os.path.join(_unescape(f[4]), ".kcachefs", "metrics.prom"))):
            return True
    return False


def on_kcachefs(path):
    """Whether path is on a kcachefs mount (one look at mountinfo per device and process)."""
    dev = os.stat(path).st_dev
    with _registry:
        known = _mounts.get(dev)
    if known is None:
        known = _detect(dev)
        with _registry:
            _mounts[dev] = known
    return known


def wait_seconds():
    value = os.environ.get(WAIT_ENV, "")
    if not value:
        return DEFAULT_WAIT_S
    try:
        s = float(value)
        if s >= 0:
            return s
    except ValueError:
        pass
    log.warning("%s=%r: not a number of seconds; waiting %g s", WAIT_ENV, value, DEFAULT_WAIT_S)
    return DEFAULT_WAIT_S


def _state_dir(root):
    """<root>/.kcachefs-triton with its locks/ directory, opened to the group and others only
    as far as root itself is writable by them."""
    with _registry:
        known = _state_dirs.get(root)
    if known:
        return known
    shared = os.stat(root).st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    mode = 0o700 | (0o070 if shared & stat.S_IWGRP else 0) | (0o007 if shared & stat.S_IWOTH else 0)
    path = os.path.join(root, stats.DIRNAME)
    for d in (path, os.path.join(path, "locks")):
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            pass
    with _registry:
        _state_dirs[root] = path
    return path


def _unlock(hold, why=None):
    """Release hold if it is still this process's lock of its path."""
    with _registry:
        if _held.get(hold.path) is not hold:
            return
        del _held[hold.path]
    if why:
        log.warning("released the lock of %s: %s", hold.what, why)
    try:
        fcntl.flock(hold.fd, fcntl.LOCK_UN)
    finally:
        os.close(hold.fd)


def _forget_after_fork():
    """In a forked child: the locks are the parent's (the same open file descriptions), so
    close the copies without unlocking."""
    for hold in list(_held.values()):
        try:
            os.close(hold.fd)
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def _digest(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class KcachefsCacheManager(FileCacheManager):
    """TRITON_CACHE_MANAGER=kcachefs_triton:KcachefsCacheManager (module docstring)."""

    def __init__(self, key, override=False, dump=False):
        super().__init__(key, override=override, dump=dump)
        self._coordinated = False
        if override or dump or not getattr(self, "cache_dir", None):
            return
        try:
            self._coordinated = on_kcachefs(self.cache_dir)
        except OSError:
            return

    # ------------------------------------------------------------------ Triton's interface

    def get_group(self, filename):
        if not self._coordinated:
            return super().get_group(filename)
        group = self._complete_group(filename)
        if group is not None:
            return group
        return self._miss(filename)

    def put_group(self, filename, group):
        if not self._coordinated:
            return super().put_group(filename, group)
        try:
            record = {}
            for child, path in group.items():
                try:
                    record[child] = [os.stat(path).st_size, _digest(path)]
                except OSError:
                    pass  # not recorded: a reader finds it missing and compiles again
            contents = json.dumps({"child_paths": group, RECORD: record})
            return self.put(contents, GROUP_PREFIX + filename, binary=False)
        finally:
            hold = _held.get(self._lock_path(filename))
            if hold is not None and hold.thread == threading.get_ident():
                _unlock(hold)

    # ------------------------------------------------------------------ the single flight

    def _lock_path(self, filename):
        root, key = os.path.split(self.cache_dir)
        return os.path.join(root, stats.DIRNAME, "locks", "%s.%s" % (key, filename))

    def _what(self, filename):
        return "%s/%s" % (os.path.basename(self.cache_dir), filename)

    def _complete_group(self, filename):
        """The group of filename if its index is published and every file it lists is there
        whole; otherwise None (a miss)."""
        index = self._make_path(GROUP_PREFIX + filename)
        try:
            with open(index, "rb") as f:
                data = json.loads(f.read())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("group index %s unreadable (%s); compiling the kernel again", index, e)
            return None
        children = data.get("child_paths") if isinstance(data, dict) else None
        if not isinstance(children, dict):
            return None
        record = data.get(RECORD)
        record = record if isinstance(record, dict) else {}
        for child, path in children.items():
            try:
                size = os.stat(path).st_size
                want = record.get(child)
                if want is not None and (size != want[0] or _digest(path) != want[1]):
                    log.warning("%s of group %s is not what was published; compiling again",
                                path, index)
                    return None
            except OSError:
                log.warning("%s of group %s is missing; compiling the kernel again", path, index)
                return None
        return dict(children)

    def _miss(self, filename):
        what = self._what(filename)
        path = self._lock_path(filename)
        me = threading.get_ident()
        with _registry:
            mine = _held.get(path)
            stale = [h for h in _held.values() if h.thread == me and h.path != path]
        for hold in stale:  # this thread moved on: that compile raised before put_group
            _unlock(hold, "its compile ended without put_group")
        if mine is not None and mine.thread == me:
            mine.own(self)  # a compile of ours that raised, retried: it keeps the lock
            return None
        try:
            state_dir = _state_dir(os.path.dirname(self.cache_dir))
            fd = self._open_lock(path)
        except OSError as e:
            log.warning("cannot open the lock %s (%s); compiling %s without it", path,
                        e.strerror, what)
            stats.record(os.path.join(os.path.dirname(self.cache_dir), stats.DIRNAME),
                         "nolock", 0.0, what)
            return None
        start = time.monotonic()
        deadline = start + wait_seconds()
        delay = POLL_FIRST_S
        waited = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    os.close(fd)
                    log.warning("flock %s: %s; compiling %s without it", path, e.strerror, what)
                    stats.record(state_dir, "nolock", 0.0, what)
                    return None
                locked = False
            seconds = time.monotonic() - start if waited else 0.0
            group = self._complete_group(filename) if locked or waited else None
            if group is not None:
                os.close(fd)  # also unlocks
                if waited:
                    stats.record(state_dir, "loaded", seconds, what)
                return group
            if locked:
                hold = _Hold(path, fd, what, state_dir)
                with _registry:
                    _held[path] = hold
                # Triton drops the manager when compile() returns or raises: a lock still
                # held then belongs to a compile that never reached put_group.
                hold.own(self)
                stats.record(state_dir, "compile", seconds, what)
                return None
            if not waited:
                log.debug("waiting for %s: another process compiles it", what)
                waited = True
            now = time.monotonic()
            if now >= deadline:
                os.close(fd)
                log.warning("waited %.0f s for another process's compile of %s; compiling it "
                            "here (%s)", now - start, what, WAIT_ENV)
                stats.record(state_dir, "timeout", now - start, what)
                return None
            time.sleep(min(delay, deadline - now))
            delay = min(delay * 1.5, POLL_MAX_S)

    def _open_lock(self, path):
        """The lock file's descriptor. Created 0600 plus the group/other write bits of the
        cache root, so only those who may write the root (and its compiled kernels) can lock
        it; an existing one of another user in a shared root is opened read-only."""
        root_mode = os.stat(os.path.dirname(self.cache_dir)).st_mode
        mode = 0o600 | (0o060 if root_mode & stat.S_IWGRP else 0) | (
            0o006 if root_mode & stat.S_IWOTH else 0)
        flags = os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | flags, mode)
        except PermissionError:
            return os.open(path, os.O_RDONLY | flags)
