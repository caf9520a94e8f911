"""KcachefsCacheManager: Triton's FileCacheManager with single-flight compiles on a kcachefs
mount.

Triton's compile() asks the manager for a kernel's group (get_group of "<name>.json"); on a
miss it compiles, put()s every artifact and then put_group()s the index "__grp__<name>.json",
which is therefore the commit point of a compile. This manager, for a cache directory on a
kcachefs mount:

- on a miss takes the kernel's lock: an exclusive flock of
  <cache root>/.kcachefs-triton/locks/<key>.<group file>, through the mount, so node-wide, and
  released by the kernel if the holder dies. If another process holds it, it waits for a
  shared flock, blocked in the kernel (woken the moment the holder lets go, not on a polling
  grid; all waiters at once), at most KCACHEFS_TRITON_WAIT seconds (default 120), then
  compiles without it; awake, it loads the holder's group, and only if there is none (the
  holder died or failed) takes the lock exclusively, one waiter at a time;
- once it has the lock exclusively it looks again: a group published meanwhile is loaded,
  otherwise it returns None and Triton compiles, holding the lock until put_group has written
  the index.
  A compile that raises never reaches put_group: the lock is released when Triton drops the
  manager (the compile's frame goes), at the next get_group of another kernel in the same
  thread, at exit, and in any case by the waiters' bounded wait;
- a waiter loads only a complete group, and believes only what it checks: the index (written
  last) a regular file of JSON that names the kernel's metadata file and only plain files of
  the key directory, at paths ending in <key>/<file> (only this manager's own path of each is
  opened: none is a symlink, FIFO or directory, or outside the directory), and a record that
  covers exactly those files, each with the size and SHA-256 it has now. Anything less (an
  index of Triton's own manager, which has no record, included) is a miss with a warning
  that says why, compiled again, never a partial group handed to Triton and never an
  exception out of get_group. put_group publishes only such a group.

The lock files live outside the key directories so that tools which copy a key directory
whole (Inductor's Triton bundler) never carry or replace them. A lock file may be opened only
by those who may write the cache root anyway (mode 0600, plus group/other bits where the root
is group/other writable), so no user can hold another user's kernels. Off a kcachefs mount,
and for Triton's dump and override managers, every method is FileCacheManager's.
"""
import errno
import fcntl
import hashlib
import io
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
RECORD = "kcachefs"  # the index's extra field: {child: [size, sha256 hex]}
INDEX_MAX = 1 << 20  # bytes; an index lists a few files, so a larger one is not an index
HEX = re.compile(r"[0-9a-f]{64}\Z")
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
            if not stat.S_ISDIR(os.lstat(d).st_mode):  # a symlink would lead the locks away
                raise OSError(errno.ENOTDIR, "not a directory", d) from None
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


def _let_go(fd):
    """Unlock and close a lock descriptor. The unlock is explicit: a process forked meanwhile
    holds a copy of the descriptor, and the lock (the open file's) would outlive this close."""
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError:
        pass
    finally:
        os.close(fd)


def _flock_within(fd, how, seconds):
    """flock(fd, how) (LOCK_SH or LOCK_EX), waiting at most seconds (0: not at all) for the
    other holders to let go; True once granted, False if not granted in time. The wait is a
    blocking flock in a thread of its own on a dup of fd (the same open file, so the same
    lock), so the kernel wakes it the moment the lock is free; a wait given up is left to that
    thread, which releases the lock if it is granted later and closes its dup. Raises OSError
    for any error but the lock being taken."""
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
    if seconds <= 0:
        return False
    dup = os.dup(fd)
    waiter = _Waiter()
    try:
        threading.Thread(target=waiter.block, args=(dup, how), name="kcachefs-triton-wait",
                         daemon=True).start()
    except BaseException:
        os.close(dup)
        raise
    try:
        return waiter.outcome(seconds)
    except BaseException:  # interrupted (KeyboardInterrupt), or the flock failed
        waiter.abandon(fd)
        raise


class _Waiter:
    """One blocking flock in a thread (_flock_within) and its outcome."""

    def __init__(self):
        self.mutex = threading.Lock()
        self.done = threading.Event()
        self.result = None  # True (granted) or the OSError, once the flock returned
        self.abandoned = False

    def block(self, dup, how):
        try:
            try:
                fcntl.flock(dup, how)  # retried by Python on EINTR
                result = True
            except OSError as e:
                result = e
            with self.mutex:
                if self.abandoned:
                    if result is True:
                        fcntl.flock(dup, fcntl.LOCK_UN)  # nobody waits for it any more
                else:
                    self.result = result
        finally:
            os.close(dup)
            self.done.set()

    def abandon(self, fd):
        """Nobody waits any more: a lock granted later is released by the thread, one
        granted already is released here."""
        with self.mutex:
            self.abandoned = True
            granted = self.result is True
        if granted:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def outcome(self, seconds):
        self.done.wait(seconds)
        with self.mutex:
            if self.result is None:  # not granted in time
                self.abandoned = True
                return False
        if self.result is True:
            return True
        raise self.result


class _Lie(ValueError):
    """Why an index, or a file it names, is not believed (the message says what is wrong)."""


def _open_regular(path):
    """A read descriptor of path, which must be a regular file itself: not a symlink (never
    followed out of the key directory), a directory, or a FIFO (never blocked on). Raises
    OSError, or _Lie for another kind of file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _Lie("%s is a symlink" % path) from None
        raise
    if stat.S_ISREG(os.fstat(fd).st_mode):
        return fd
    os.close(fd)
    raise _Lie("%s is not a regular file" % path)


def _read_index(path):
    """The bytes of the index at path: a regular file of at most INDEX_MAX bytes."""
    fd = _open_regular(path)
    try:
        data = b""
        while len(data) <= INDEX_MAX:
            block = os.read(fd, INDEX_MAX + 1 - len(data))
            if not block:
                return data
            data += block
    finally:
        os.close(fd)
    raise _Lie("%s is over %d bytes, not an index" % (path, INDEX_MAX))


def _measure(path, want_size=None):
    """(size in bytes, SHA-256 hex) of the regular file at path, read once through one
    descriptor; ("" for the digest) without reading it when its size is not want_size, and
    never more than want_size + 1 bytes of it, so that a huge or growing file planted in a
    group costs no hashing. Raises OSError or _Lie
    (_open_regular)."""
    fd = _open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if want_size is not None and size != want_size:
            return size, ""
        h, size = hashlib.sha256(), 0
        for block in iter(lambda: os.read(fd, 1 << 20), b""):
            h.update(block)
            size += len(block)
            if want_size is not None and size > want_size:
                break  # growing as it is read: not the file recorded, however long it gets
    finally:
        os.close(fd)
    return size, h.hexdigest()


def _put_bytes(data):
    """The bytes FileCacheManager.put writes for data: bytes as they are; anything else as
    str(data) written through a text file of Python's default encoding, as its open(path,
    "w") writes it (the same TextIOWrapper defaults: encoding, newline translation)."""
    if isinstance(data, bytes):
        return data
    buf = io.BytesIO()
    text = io.TextIOWrapper(buf)
    text.write(str(data))
    text.flush()
    raw = buf.getvalue()
    text.detach()
    return raw


def _no_duplicates(pairs):
    obj = {}
    for k, v in pairs:
        if k in obj:
            raise _Lie("the key %r appears twice" % k)
        obj[k] = v
    return obj


def _no_constant(name):
    raise _Lie("%s is not a JSON number" % name)


def _parse(data):
    """The JSON value of an index's bytes: strict UTF-8, no duplicate key, no NaN/Infinity.
    Raises _Lie."""
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates,
                          parse_constant=_no_constant)
    except _Lie:
        raise
    except RecursionError:
        raise _Lie("nested too deeply") from None
    except ValueError as e:  # not UTF-8, not JSON, an integer of too many digits
        raise _Lie("not JSON (%s)" % e) from None


def _plain_name(child):
    """Whether child names a file of the key directory itself."""
    return (isinstance(child, str) and child not in ("", ".", "..") and "/" not in child and
            "\0" not in child)


def _recorded(child, entry):
    """(size, SHA-256 hex) of a record entry, which must be [size, digest] as put_group
    writes it: size an int >= 0 (not a bool), digest 64 lower-case hex digits."""
    if not isinstance(entry, list) or len(entry) != 2:
        raise _Lie("the record of %s is %.60r, not [size, sha256]" % (child, entry))
    size, digest = entry
    if type(size) is not int or size < 0:
        raise _Lie("the recorded size of %s is %.60r, not a byte count" % (child, size))
    if not isinstance(digest, str) or not HEX.match(digest):
        raise _Lie("the recorded sha256 of %s is %.80r, not 64 lower-case hex digits" %
                   (child, digest))
    return size, digest


class KcachefsCacheManager(FileCacheManager):
    """TRITON_CACHE_MANAGER=kcachefs_triton:KcachefsCacheManager (module docstring)."""

    def __init__(self, key, override=False, dump=False):
        super().__init__(key, override=override, dump=dump)
        self._coordinated = False
        self._written = {}  # filename -> (path, (size, sha256 hex)) of what put wrote
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

    def put(self, data, filename, binary=True):
        path = super().put(data, filename, binary)
        if self._coordinated:
            raw = _put_bytes(data)
            self._written[filename] = (path, (len(raw), hashlib.sha256(raw).hexdigest()))
        return path

    def put_group(self, filename, group):
        if not self._coordinated:
            return super().put_group(filename, group)
        try:
            record = self._record(filename, group)
            if record is None:
                return None  # no index: the next process misses and compiles it again
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

    def _own_path(self, child, listed):
        """The path of child in this key directory, the only one ever opened or returned;
        raises _Lie unless child is a plain file name and listed (the group's path of it) ends
        in <key>/<child>. The root before the key may differ: the writer may have reached the
        same directory another way (a bind mount in a container, a symlink)."""
        if not _plain_name(child):
            raise _Lie("%.80r is not a file name of the key directory" % (child,))
        tail = os.sep + os.path.join(os.path.basename(self.cache_dir), child)
        if not isinstance(listed, str) or not os.path.normpath(listed).endswith(tail):
            raise _Lie("%s is listed at %.200r, not in this key directory" % (child, listed))
        return self._make_path(child)

    def _record(self, filename, group):
        """put_group's record {child: [size, sha256 hex]} of every file of group, each a
        regular file of this key directory; None (with a warning) if one is not, so that no
        index is published that readers would reject."""
        try:
            if not isinstance(group, dict):
                raise _Lie("the group is %.60r, not a dict" % (group,))
            record = {}
            for child, path in group.items():
                record[child] = list(self._size_and_digest(self._own_path(child, path), child))
            return record
        except OSError as e:
            why = "%s: %s" % (e.filename, e.strerror)
        except _Lie as e:
            why = str(e)
        log.warning("not publishing the group %s (%s): the next process compiles it again",
                    self._what(filename), why)
        return None

    def _size_and_digest(self, path, child):
        """(size, SHA-256 hex) of the file at path for put_group's record: those of the bytes
        this manager's put wrote there if it is still a regular file of that size (one lstat,
        not a read back through the mount), else measured from the file. Raises OSError or
        _Lie (_measure). A file replaced since by other bytes of the same size gets a record
        it does not match, so readers refuse the group (a miss), never believe it."""
        written = self._written.get(child)
        if written is not None and written[0] == path:
            size, digest = written[1]
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_size == size:
                return size, digest
        return _measure(path)

    def _complete_group(self, filename):
        """The group of filename if its index is published and believed; otherwise None (a
        miss), with a warning that says why unless there is no index at all."""
        index = self._make_path(GROUP_PREFIX + filename)
        try:
            return self._verified_group(filename, index)
        except FileNotFoundError as e:
            if e.filename == index:
                return None  # not published (yet)
            log.warning("group index %s: %s is missing; compiling the kernel again", index,
                        e.filename)
        except OSError as e:
            log.warning("group index %s: %s: %s; compiling the kernel again", index,
                        e.filename, e.strerror)
        except _Lie as e:
            log.warning("group index %s: %s; compiling the kernel again", index, e)
        return None

    def _verified_group(self, filename, index):
        """The group the index at path index publishes, believed only as far as it is
        checked: a JSON object whose child_paths names filename itself and only files of this
        key directory, and whose record (RECORD) holds exactly those files, each with the
        size and SHA-256 it has on disk now. An index without the record (written by Triton's
        own manager) is not believed: its files could be anything. Returns {child: path}, the
        paths this manager checked; raises OSError or _Lie."""
        data = _parse(_read_index(index))
        if not isinstance(data, dict):
            raise _Lie("not a JSON object")
        children, record = data.get("child_paths"), data.get(RECORD)
        if not isinstance(children, dict):
            raise _Lie("child_paths is %.60r, not an object" % (children,))
        if filename not in children:
            raise _Lie("the group does not list %s itself" % filename)
        if not isinstance(record, dict):
            raise _Lie("the %r record of sizes and digests is %.60r (not written by this "
                       "manager)" % (RECORD, record))
        if set(record) != set(children):
            raise _Lie("the record covers %s but the group names %s" %
                       (sorted(record), sorted(children)))
        want = {self._own_path(c, p): _recorded(c, record[c]) for c, p in children.items()}
        for path, (size, digest) in want.items():
            got = _measure(path, size)
            if got != (size, digest):
                raise _Lie("%s is not what was published (%d bytes, recorded %d; sha256 %s, "
                           "recorded %s)" % (path, got[0], size, got[1][:16], digest[:16]))
        return {c: self._make_path(c) for c in children}

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
        try:
            if _flock_within(fd, fcntl.LOCK_EX, 0.0):  # nobody compiles it now
                return self._locked(filename, path, fd, state_dir, None)
            # Another process compiles it. Wait for its release, woken by the kernel the
            # moment the holder's put_group lets go (no polling grid), all waiters at once
            # (a shared lock), and load its group; only if there is none (the holder died or
            # its compile raised) take the lock exclusively, one waiter at a time, to look
            # once more and compile.
            log.debug("waiting for %s: another process compiles it", what)
            if _flock_within(fd, fcntl.LOCK_SH, deadline - time.monotonic()):
                group = self._complete_group(filename)
                if group is not None:
                    _let_go(fd)
                    stats.record(state_dir, "loaded", time.monotonic() - start, what)
                    return group
                if _flock_within(fd, fcntl.LOCK_EX, deadline - time.monotonic()):
                    return self._locked(filename, path, fd, state_dir, start)
        except OSError as e:
            os.close(fd)
            log.warning("flock %s: %s; compiling %s without it", path, e.strerror, what)
            stats.record(state_dir, "nolock", 0.0, what)
            return None
        _let_go(fd)
        waited = time.monotonic() - start
        log.warning("waited %.0f s for another process's compile of %s; compiling it here (%s)",
                    waited, what, WAIT_ENV)
        stats.record(state_dir, "timeout", waited, what)
        return None

    def _locked(self, filename, path, fd, state_dir, start):
        """fd holds the kernel's lock exclusively (after waiting since start, or at once if
        start is None): a group published meanwhile is loaded, else the lock is held for this
        compile (None: Triton compiles)."""
        what = self._what(filename)
        group = self._complete_group(filename)
        if group is not None:
            _let_go(fd)
            if start is not None:
                stats.record(state_dir, "loaded", time.monotonic() - start, what)
            return group
        hold = _Hold(path, fd, what, state_dir)
        with _registry:
            _held[path] = hold
        # Triton drops the manager when compile() returns or raises: a lock still held then
        # belongs to a compile that never reached put_group.
        hold.own(self)
        stats.record(state_dir, "compile", 0.0 if start is None else time.monotonic() - start,
                     what)
        return None

    def _open_lock(self, path):
        """The lock file's descriptor. Created 0600 plus the group/other write bits of the
        cache root, so only those who may write the root (and its compiled kernels) can lock
        it; an existing one of another user in a shared root is opened read-only. A symlink, or
        anything but a regular file, is refused (OSError): it is no lock of ours."""
        root_mode = os.stat(os.path.dirname(self.cache_dir)).st_mode
        mode = 0o600 | (0o060 if root_mode & stat.S_IWGRP else 0) | (
            0o006 if root_mode & stat.S_IWOTH else 0)
        flags = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK  # never a FIFO's open to block
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | flags, mode)
        except PermissionError:
            fd = os.open(path, os.O_RDONLY | flags)
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", path)
