"""What the Triton cache manager (python/kcachefs_triton) believes of what is on disk: a
group index, the files it names, the lock file and the counters may be anything (written by
Triton's own manager, an older release, a tool, a crash, another user of a shared root), and
get_group returns the whole group as put_group published it, or a miss with a warning that
says why; it never raises, never blocks, and never opens a file outside the key directory.

Most tests need no mount: the manager is told it is on one (its coordination is the same
code); its regressions run through the calls of Triton's compile() on a real one.
The fuzz is seeded, so a failure is repeated by running it again."""
import copy
import fcntl
import json
import logging
import os
import random
import sys
import threading

import pytest

import triton_harness
from conftest import REPO

triton_harness.install_standin()
sys.path.insert(0, str(REPO / "python"))
from kcachefs_triton import manager, stats  # noqa: E402
from kcachefs_triton.manager import RECORD, KcachefsCacheManager  # noqa: E402

NAME, META = "add", "add.json"
KEY = "K" * 52
FUZZ_SEED, FUZZ_MUTATIONS, FUZZ_SHAPES = 20, 3000, 1500

_opened = []  # paths opened while _watching is set (an audit hook cannot be removed)
_watching = [False]


def _audit(event, args):
    if _watching[0] and event == "open" and isinstance(args[0], str):
        _opened.append(args[0])


sys.addaudithook(_audit)


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def warnings():
    log = logging.getLogger("kcachefs_triton")
    handler, propagate = Warnings(), log.propagate
    log.addHandler(handler)
    log.propagate = False  # thousands of expected warnings: not into pytest's report
    yield handler
    log.removeHandler(handler)
    log.propagate = propagate


class Cache:
    """A cache root with one kernel's group published by the manager (put, then put_group, as
    Triton's compile() does)."""

    def __init__(self, root):
        self.root = root
        os.environ["TRITON_CACHE_DIR"] = str(root)
        mgr = self.manager()
        self.dir = mgr.cache_dir
        self.state = os.path.join(str(root), stats.DIRNAME)
        self.files = dict(triton_harness.artifacts(NAME, triton_harness.source_of(NAME)))
        self.files[META] = json.dumps({"name": NAME, "source": "x"})
        self.good = {c: mgr.put(d, c) for c, d in self.files.items()}
        assert mgr.get_group(META) is None  # a miss: it takes the lock, as a compile does
        mgr.put_group(META, self.good)
        self.index = os.path.join(self.dir, "__grp__" + META)
        with open(self.index, "rb") as f:
            self.index_bytes = f.read()
        self.record = json.loads(self.index_bytes)

    def manager(self):
        mgr = KcachefsCacheManager(KEY)
        mgr._coordinated = True  # as on a kcachefs mount
        return mgr

    def write_index(self, data):
        tmp = self.index + ".new"
        with open(tmp, "wb") as f:
            f.write(data if isinstance(data, bytes) else json.dumps(data).encode())
        os.replace(tmp, self.index)

    def get(self, warnings):
        """get_group of a new manager (as each compile() makes one), watching what it opens:
        (group or None, the warnings it logged)."""
        before = len(warnings.messages)
        del _opened[:]
        _watching[0] = True
        try:
            group = self.manager().get_group(META)
        finally:
            _watching[0] = False
        for p in _opened:
            p = os.path.normpath(p)
            assert (p.startswith(self.dir + os.sep) or p in (self.state, stats.STATS) or
                    p.startswith(self.state + os.sep)), "opened %s, outside the key directory" % p
        return group, warnings.messages[before:]


@pytest.fixture
def cache(tmp_path, warnings):
    saved = dict(os.environ)
    os.environ.pop("TRITON_CACHE_MANAGER", None)
    yield Cache(tmp_path / "cache")
    os.environ.clear()
    os.environ.update(saved)


def check(cache, warnings, data, why=None):
    """get_group on the index data (bytes or a JSON value): a miss with a warning (that
    contains why), or a subset of the published group holding the metadata file, each path
    the file's own in the key directory (whose bytes are the published ones)."""
    cache.write_index(data)
    group, said = cache.get(warnings)
    if group is None:
        assert said, "a miss without a warning for %.300r" % (data,)
        if why:
            assert any(why in m for m in said), (why, said)
    else:
        assert why is None, "believed %.300r" % (data,)
        assert META in group and group.items() <= cache.good.items(), (data, group)
    return group


def test_the_published_group_is_believed(cache, warnings):
    group, said = cache.get(warnings)
    assert group == cache.good and not said, said
    assert set(cache.record[RECORD]) == set(cache.good)


# ---------------------------------------------------------------- regressions

def with_entry(cache, child, entry):
    data = copy.deepcopy(cache.record)
    if entry is None:
        del data[RECORD][child]
    else:
        data[RECORD][child] = entry
    return data


def test_an_int_entry_is_a_miss(cache, warnings):
    check(cache, warnings, with_entry(cache, NAME + ".cubin", 5), "not [size, sha256]")


def test_a_one_element_entry_is_a_miss(cache, warnings):
    size = os.path.getsize(cache.good[NAME + ".cubin"])
    check(cache, warnings, with_entry(cache, NAME + ".cubin", [size]), "not [size, sha256]")


def test_a_file_left_out_of_the_record_is_a_miss(cache, warnings):
    cubin = cache.good[NAME + ".cubin"]
    with open(cubin, "r+b") as f:
        f.truncate(4096)
    check(cache, warnings, with_entry(cache, NAME + ".cubin", None), "the record covers")


def test_an_index_of_tritons_own_manager_is_a_miss(cache, warnings):
    """No record: the files could be anything (a truncated cubin was loaded), so the group is
    compiled again and published with one."""
    check(cache, warnings, {"child_paths": cache.good}, "not written by this manager")


def test_the_regressions_through_compile_on_the_mount(mount_factory, tmp_path):
    """As the client saw it: each lie costs one compile, never the compile's life
    or a truncated cubin loaded."""
    m = mount_factory()
    root, counter = m.mnt / "triton", str(tmp_path / "compiles")
    os.environ.update(TRITON_CACHE_DIR=str(root),
                      TRITON_CACHE_MANAGER="kcachefs_triton:KcachefsCacheManager")
    try:
        src = triton_harness.source_of(NAME)
        good = triton_harness.compile(NAME, src, counter)
        (index,) = root.glob("*/__grp__add.json")
        (cubin,) = root.glob("*/add.cubin")
        for lie in (5, "lie", [cubin.stat().st_size], None):
            data = json.loads(index.read_text())
            if lie is None:
                del data[RECORD][cubin.name]
                cubin.write_bytes(cubin.read_bytes()[:4096])
            else:
                data[RECORD][cubin.name] = lie
            index.write_text(json.dumps(data))
            assert triton_harness.compile(NAME, src, counter) == good, lie
        assert triton_harness.compile(NAME, src, counter) == good  # a hit on the new index
        assert triton_harness.compiles(counter) == {NAME: 5}
    finally:
        os.environ.pop("TRITON_CACHE_MANAGER")


# ---------------------------------------------------------------- every way an index lies

def test_lies_of_shape(cache, warnings):
    good = cache.record
    children = good["child_paths"]
    cubin = NAME + ".cubin"
    outside = str(cache.root / "outside.cubin")
    with open(outside, "wb") as f:
        f.write(cache.files[cubin])
    entry = good[RECORD][cubin]
    lies = [
        (b"", "not JSON"), (b"{not json", "not JSON"), (b"\xff\xfe{}", "not JSON"),
        (json.dumps(good).encode("utf-16"), "not JSON"), (b"[" * 100000, "nested too deeply"),
        (b'{"a": ' * 100000, "nested too deeply"), (b"1" * 5000, "not JSON"),
        (b" " * (manager.INDEX_MAX + 1), "over"), ([], "not a JSON object"),
        ("x", "not a JSON object"), (None, "not a JSON object"), (3, "not a JSON object"),
        ({}, "child_paths is None"), (dict(good, child_paths=[cubin]), "not an object"),
        (dict(good, child_paths="x"), "not an object"),
        (dict(good, child_paths={}), "does not list add.json"),
        ({"child_paths": children, RECORD: None}, "not written by this manager"),
        ({"child_paths": children, RECORD: [1, 2]}, "not written by this manager"),
        (dict(good, **{RECORD: dict(good[RECORD], **{"add.extra": entry})}), "the record covers"),
        (json.dumps(good).replace('{"child_paths": ', '{"child_paths": {}, "child_paths": ', 1)
         .encode(), "appears twice"),
        (json.dumps(good).replace('"add.ttir"', '"add.ttir": "x", "add.ttir"', 1).encode(),
         "appears twice"),
        (json.dumps(with_entry(cache, cubin, [float("nan"), entry[1]])).encode(),
         "not a JSON number"),
        (json.dumps(with_entry(cache, cubin, [entry[0], float("inf")])).encode(),
         "not a JSON number"),
        (json.dumps(good).replace(str(entry[0]), "9" * 5000, 1).encode(), "not JSON"),
    ]
    for size in (-1, True, False, float(entry[0]), "%d" % entry[0], None, 10 ** 30, [entry[0]]):
        lies.append((with_entry(cache, cubin, [size, entry[1]]),
                     "not a byte count" if size != 10 ** 30 else "not what was published"))
    for digest in (entry[1].upper(), entry[1][:-1], entry[1] + "0", "g" * 64, 5, None,
                   entry[1][:63] + "\n"):
        lies.append((with_entry(cache, cubin, [entry[0], digest]), "not 64 lower-case hex"))
    for e in (5, "x", [], [entry[0]], entry + [0], {"size": entry[0]}, None, True):
        lies.append((dict(good, **{RECORD: dict(good[RECORD], **{cubin: e})}),
                     "not [size, sha256]"))
    lies.append((with_entry(cache, cubin, [entry[0] + 1, entry[1]]), "not what was published"))
    for path in (outside, "/etc/passwd", cubin, os.path.join(cache.dir, "..", cubin),
                 os.path.join(cache.dir, "sub", cubin), 5, None, [outside]):
        lies.append((dict(good, child_paths=dict(children, **{cubin: path})),
                     "not in this key directory"))
    for bad in ("../outside.cubin", "/etc/passwd", "", ".", "..", "sub/x", "a\0b"):
        lies.append((dict(good, child_paths=dict(children, **{bad: outside}),
                          **{RECORD: dict(good[RECORD], **{bad: entry})}),
                     "not a file name of the key directory"))
    for data, why in lies:
        check(cache, warnings, data, why)
    lies = [(dict(good, child_paths=dict(children, **{cubin: "/x/%s/%s" % ("L" * 52, cubin)})),
             "not in this key directory")]  # another kernel's file
    for data, why in lies:
        check(cache, warnings, data, why)
    # a path that names the same file another way (a bind mount elsewhere, a symlink of the
    # root) is that file: only the manager's own path of it is opened and returned
    for same in (os.path.join(cache.dir, ".", cubin), "/elsewhere/triton/%s/%s" % (KEY, cubin)):
        assert check(cache, warnings, dict(good, child_paths=dict(children, **{cubin: same}))) \
            == cache.good


def test_lies_of_the_files_on_disk(cache, warnings):
    cubin = cache.good[NAME + ".cubin"]
    outside = str(cache.root / "outside.cubin")
    os.rename(cubin, outside)
    os.symlink(outside, cubin)  # the same bytes, outside: never followed
    check(cache, warnings, cache.index_bytes, "is a symlink")
    os.unlink(cubin)
    os.mkdir(cubin)
    check(cache, warnings, cache.index_bytes, "not a regular file")
    os.rmdir(cubin)
    os.mkfifo(cubin)  # an open that would block: never waited on
    check(cache, warnings, cache.index_bytes, "not a regular file")
    os.unlink(cubin)
    check(cache, warnings, cache.index_bytes, "is missing")
    os.rename(outside, cubin)
    assert check(cache, warnings, cache.index_bytes) == cache.good
    real = cache.index + ".real"
    with open(real, "wb") as f:
        f.write(cache.index_bytes)
    for make in (lambda p: os.symlink(real, p), os.mkdir, os.mkfifo):
        os.unlink(cache.index)
        make(cache.index)
        group, said = cache.get(warnings)
        assert group is None and any("symlink" in m or "not a regular file" in m
                                     for m in said), said
        (os.rmdir if os.path.isdir(cache.index) and not os.path.islink(cache.index)
         else os.unlink)(cache.index)
        os.link(real, cache.index)


def test_a_huge_file_is_a_miss_without_reading_it(cache, warnings):
    """A file of the group replaced by a sparse terabyte (anyone who may write the key
    directory can): its size is not the recorded one, so get_group misses at once instead of
    hashing it for hours while the compile waits."""
    with open(cache.good[NAME + ".cubin"], "r+b") as f:
        f.truncate(1 << 40)
    got = []
    getter = threading.Thread(target=lambda: got.append(cache.get(warnings)), daemon=True)
    getter.start()
    getter.join(20)  # instant when the size is compared first; hours when hashed
    assert not getter.is_alive(), "get_group still reads a terabyte after 20 s"
    group, said = got[0]
    assert group is None and any("is not what was published" in m for m in said), said


# ---------------------------------------------------------------- the fuzz

BAD_NAMES = ["../add.cubin", "/etc/passwd", "", ".", "..", "a/b", "add.cubin/", "x\0y",
             "__grp__add.json", "add.extra", "ADD.CUBIN"]
BAD_PATHS = ["/etc/passwd", "add.cubin", "../add.cubin", "", "/", ".", "\0", "x" * 5000]


def shape(rng, depth=0):
    """A random JSON value."""
    kinds = ["null", "bool", "int", "bigint", "float", "str", "list", "dict"]
    kind = rng.choice(kinds if depth < 4 else kinds[:6])
    if kind == "null":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.randint(-2, 70000)
    if kind == "bigint":
        return rng.choice([1, -1]) * 10 ** rng.randint(18, 400)
    if kind == "float":
        return rng.choice([0.5, -0.0, 1e308, 65536.0, float("nan"), float("inf")])
    if kind == "str":
        return rng.choice(BAD_NAMES + BAD_PATHS + ["0" * 64, "f" * 64, "kcachefs",
                                                   "child_paths", "add.json"])
    if kind == "list":
        return [shape(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    keys = ["child_paths", RECORD, "add.json", "add.cubin"] + BAD_NAMES
    return {rng.choice(keys): shape(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def mutate(rng, data, cache):
    """One lie in the parsed good index data (changed in place, or a new value returned)."""
    if not isinstance(data, dict):
        return shape(rng)
    children = data.get("child_paths")
    record = data.get(RECORD)
    where = rng.randint(0, 9)
    if where == 0:
        return shape(rng)
    if where == 1:
        data[rng.choice(["child_paths", RECORD])] = shape(rng)
    elif where == 2:
        data.pop(rng.choice(["child_paths", RECORD]), None)
    elif where in (3, 4) and isinstance(children, dict) and children:
        child = rng.choice(sorted(children))
        how = rng.randint(0, 3)
        if how == 0:
            del children[child]
        elif how == 1:
            children[child] = rng.choice(BAD_PATHS + [shape(rng), str(cache.root / child)])
        elif how == 2:
            children[rng.choice(BAD_NAMES)] = children.pop(child)
        else:
            children[rng.choice(BAD_NAMES)] = rng.choice(BAD_PATHS)
    elif isinstance(record, dict) and record:
        child = rng.choice(sorted(record))
        how = rng.randint(0, 4)
        entry = record[child]
        if how == 0:
            del record[child]
        elif how == 1:
            record[rng.choice(BAD_NAMES)] = entry
        elif how == 2:
            record[child] = shape(rng)
        elif how == 3 and isinstance(entry, list) and len(entry) == 2:
            entry[0] = rng.choice([-1, True, False, entry[0] + 1, float(entry[0]), str(entry[0]),
                                   None, 10 ** 30, shape(rng)]) if isinstance(entry[0], int) else 0
        elif isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], str):
            h = entry[1]
            entry[1] = rng.choice([h.upper(), h[:-1], h + "a", "g" + h[1:], h[::-1], 0, None,
                                   shape(rng)])
        else:
            record[child] = rng.choice([5, [], [0], [0, 0, 0], "x"])
    return data


def garble(rng, text):
    """A lie in the index's bytes rather than its JSON value."""
    how = rng.randint(0, 6)
    if how == 0:
        return text[:rng.randint(0, len(text) - 1)]
    if how == 1:
        i = rng.randint(0, len(text))
        return text[:i] + bytes([rng.choice([0x80, 0xc3, 0xff, 0xfe, 0x00])]) + text[i:]
    if how == 2:
        return text.replace(b'"child_paths": ', b'"child_paths": {}, "child_paths": ', 1)
    if how == 3:
        return b"[" * rng.randint(1000, 200000) + text
    if how == 4:
        return text.replace(b", ", b", \"" + RECORD.encode() + b"\": {}, ", 1)
    if how == 5:
        return b"\xef\xbb\xbf" + text
    return text.decode().encode(rng.choice(["utf-16", "utf-32", "latin-1"]))


def test_fuzz_the_index(cache, warnings):
    rng = random.Random(FUZZ_SEED)
    believed = missed = 0
    for i in range(FUZZ_MUTATIONS + FUZZ_SHAPES):
        if i < FUZZ_MUTATIONS:
            data = copy.deepcopy(cache.record)
            for _ in range(rng.randint(1, 3)):
                data = mutate(rng, data, cache)
        else:
            data = shape(rng)
        text = json.dumps(data).encode()
        if rng.random() < 0.15:
            text = garble(rng, text)
        if check(cache, warnings, text) is None:
            missed += 1
        else:
            believed += 1
    # most are lies; the few believed were mutations that left a consistent group
    assert missed > 0.9 * (FUZZ_MUTATIONS + FUZZ_SHAPES), (missed, believed)
    cache.write_index(cache.index_bytes)
    assert cache.get(warnings)[0] == cache.good  # and the good index is still believed


# ---------------------------------------------------------------- the put path

def test_put_group_publishes_only_files_of_its_key_directory(cache, warnings):
    mgr = cache.manager()
    outside = str(cache.root / "outside.cubin")
    with open(outside, "wb") as f:
        f.write(b"\x7fELF")
    os.unlink(cache.index)
    for group, why in ((dict(cache.good, **{NAME + ".cubin": outside}), "not in this key"),
                       (dict(cache.good, **{"../x": outside}), "not a file name"),
                       (dict(cache.good, **{"add.gone": os.path.join(cache.dir, "add.gone")}),
                        "No such file"),
                       ("not a group", "not a dict")):
        before = len(warnings.messages)
        del _opened[:]
        _watching[0] = True
        try:
            assert mgr.put_group(META, group) is None
        finally:
            _watching[0] = False
        assert outside not in _opened and not os.path.exists(cache.index), group
        assert any(why in m and "not publishing" in m for m in warnings.messages[before:]), \
            warnings.messages[before:]
    fifo = os.path.join(cache.dir, "add.fifo")
    os.mkfifo(fifo)  # never blocked on
    assert mgr.put_group(META, dict(cache.good, **{"add.fifo": fifo})) is None
    assert "not a regular file" in warnings.messages[-1]
    assert mgr.put_group(META, cache.good) == cache.index
    assert cache.get(warnings)[0] == cache.good


def test_put_group_records_what_put_wrote_without_reading_it_back(cache, warnings):
    """The record of a file this manager put is that of the bytes put wrote (text too, in
    Python's default encoding, as Triton's put writes it), checked by an lstat but not read
    back through the mount; a file replaced since by other bytes of the same size gets a
    record it fails (readers miss it), one of another size is measured from disk, and one
    that is no regular file is refused, as before."""
    mgr = cache.manager()
    os.unlink(cache.index)
    group = {c: mgr.put(d, c) for c, d in cache.files.items()}
    group[NAME + ".ptx"] = mgr.put("ptx of add: caf\u00e9 \u4e2d\u6587\n" * 3, NAME + ".ptx")
    del _opened[:]
    _watching[0] = True
    try:
        assert mgr.put_group(META, group) == cache.index
    finally:
        _watching[0] = False
    assert not set(map(os.path.normpath, _opened)) & set(group.values()), _opened
    assert cache.get(warnings)[0] == group  # the record is the bytes on disk
    cubin = group[NAME + ".cubin"]
    with open(cubin, "rb") as f:
        size = len(f.read())
    for replacement, believed in ((bytes(size), False), (bytes(size + 1), True)):
        mgr = cache.manager()
        os.unlink(cache.index)
        group = {c: mgr.put(d, c) for c, d in cache.files.items()}
        with open(cubin + ".new", "wb") as f:  # another writer, between put and put_group
            f.write(replacement)
        os.replace(cubin + ".new", cubin)
        assert mgr.put_group(META, group) == cache.index
        got, said = cache.get(warnings)
        if believed:
            assert got == group, said
        else:
            assert got is None and any("not what was published" in m for m in said), said
    mgr = cache.manager()
    os.unlink(cache.index)
    group = {c: mgr.put(d, c) for c, d in cache.files.items()}
    os.unlink(cubin)
    os.symlink(cache.good[META], cubin)
    assert mgr.put_group(META, group) is None
    assert "symlink" in warnings.messages[-1] and not os.path.exists(cache.index)


# ---------------------------------------------------------------- the lock file, the counters

def test_a_lock_file_that_is_no_lock_is_refused(cache, warnings):
    os.unlink(cache.index)
    lock = os.path.join(cache.state, "locks", KEY + "." + META)
    os.unlink(lock)
    os.mkfifo(lock)  # an open O_RDONLY would wait for a writer
    group, said = cache.get(warnings)
    assert group is None and any("cannot open the lock" in m and "not a regular file" in m
                                 for m in said), said
    os.unlink(lock)
    elsewhere = cache.root / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, lock)
    group, said = cache.get(warnings)
    assert group is None and any("cannot open the lock" in m for m in said), said
    os.unlink(lock)
    locks = os.path.join(cache.state, "locks")
    os.rename(locks, locks + ".old")
    os.symlink(elsewhere, locks)  # the locks directory led elsewhere
    manager._state_dirs.clear()
    group, said = cache.get(warnings)
    assert group is None and any("not a directory" in m for m in said), said
    assert os.listdir(elsewhere) == []


@pytest.mark.parametrize("granted", [True, False])
def test_an_interrupted_wait_lets_go_of_the_lock(tmp_path, monkeypatch, granted):
    """A wait for the kernel's lock interrupted (KeyboardInterrupt) after or before the lock
    was granted leaves it free: released at once, or by the waiting thread when granted."""
    path = str(tmp_path / "lock")
    holder = os.open(path, os.O_RDWR | os.O_CREAT)
    mine = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        threads = []

        def interrupted(self, seconds):
            threads.extend(t for t in threading.enumerate() if t.name == "kcachefs-triton-wait")
            if granted:
                fcntl.flock(holder, fcntl.LOCK_UN)  # the holder lets go, the wait is granted
                assert self.done.wait(60)
            raise KeyboardInterrupt  # and Ctrl-C lands before the caller sees it

        monkeypatch.setattr(manager._Waiter, "outcome", interrupted)
        with pytest.raises(KeyboardInterrupt):
            manager._flock_within(mine, fcntl.LOCK_SH, 60)
        if not granted:
            fcntl.flock(holder, fcntl.LOCK_UN)  # granted to the abandoned thread now
        for t in threads:
            t.join(60)
        assert threads and not any(t.is_alive() for t in threads)
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: nobody holds it shared
    finally:
        os.close(holder)
        os.close(mine)


def test_the_counters_believe_only_what_parses(tmp_path):
    line = "1.000 1 0 %s %s k/add.json"
    lines = [line % ("compile", "0.500"), line % ("loaded", "nan"), line % ("loaded", "inf"),
             line % ("loaded", "-1"), line % ("loaded", "1e400"), line % ("bogus", "1"), "x"]
    s = stats.summarise(lines)
    assert (s["compiles"], s["loaded"], s["bad_lines"], s["wait_seconds"]) == (1, 0, 6, 0.5), s
    path = tmp_path / "stats"
    path.write_bytes((line % ("compile", "1.000")).encode() + b"\xff\n")
    assert stats.summarise(stats.read(str(path)))["compiles"] == 1


def test_the_counters_never_block_or_follow(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    os.mkfifo(state / stats.STATS)
    assert isinstance(stats.record(str(state), "compile", 0.0, "k/a.json"), OSError)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, tmp_path / "link")
    assert isinstance(stats.record(str(tmp_path / "link"), "compile", 0.0, "k/a.json"), OSError)
    assert os.listdir(elsewhere) == []
    os.unlink(state / stats.STATS)
    assert stats.record(str(state), "compile", 0.0, "k/a.json") is None
    holder = os.open(state / stats.STATS, os.O_RDONLY)  # anyone who may read it may flock it
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        got = []
        t = threading.Thread(target=lambda: got.append(
            stats.record(str(state), "compile", 0.0, "k/a.json")), daemon=True)
        t.start()
        t.join(60)
        assert not t.is_alive(), "stats.record waits for a flock held forever"
        assert isinstance(got[0], OSError), got
    finally:
        os.close(holder)
    t.join(60)
