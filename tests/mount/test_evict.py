"""The bounded cache: -o max_entries and -o max_size evict the least recently used published
entries (last use = the mount's own opens and lookups) down to 90 % of the bound, never
one being staged or compiled, without disturbing a process that has an evicted cubin open
or mapped, and without the kernel showing an evicted entry afterwards. An evicted entry
goes whole, with its source: the next client stages it again."""
import errno
import hashlib
import mmap
import os
import struct
import time

import pytest

from conftest import EM_CUDA, sample, start_openers
from kcmount import slow_nvcc, wait_for_flight, wait_until

GRACE = 2.2  # seconds: KC_EVICT_GRACE (2) and a margin; entries used since are kept


def compile_variant(m, i):
    """Publish a real compile of vector_add built with -DVARIANT=i; returns its entry."""
    src, _ = sample("vector_add")
    e = m.stage("vector_add", src, b"-O3\n-DVARIANT=%d\n" % i)
    assert (e / "kernel.cubin").read_bytes()[:4] == b"\x7fELF"
    return e


def client_cubin(size, i):
    """A cubin-shaped file of size bytes (the mount checks a client cubin's ELF header)."""
    ident = b"\x7fELF\x02\x01\x01" + bytes(9)
    head = ident + struct.pack("<HHIQQQIHHHHHH", 2, EM_CUDA, 1, 0, 0, 0, 0, 64, 0, 0, 0, 0, 0)
    body = hashlib.sha256(b"%d" % i).digest() * (size // 32 + 1)
    return (head + body)[:size]


def touch(entry):
    """Use an entry as a client does: open and read its cubin."""
    (entry / "kernel.cubin").read_bytes()
    time.sleep(0.02)  # distinct last-use times


def wait_evictions(m, n, timeout=60):
    wait_until(lambda: m.stats()["evictions_total"] >= n,
               lambda: "only %d evictions" % m.stats()["evictions_total"], timeout)
    time.sleep(0.3)  # let the pass finish, then check nothing more goes
    return m.stats()


def test_max_entries_evicts_the_least_recently_used(mount_factory):
    m = mount_factory(["max_entries=6"])
    entries = [compile_variant(m, i) for i in range(6)]
    assert m.stats()["entries"] == 6 and m.stats()["evictions_total"] == 0
    # A reader opens e1's cubin (not read yet) and maps it; then the others are used, so
    # e1 and e2 are the two least recently used.
    expected = (m.backing / entries[1].relative_to(m.mnt) / "kernel.cubin").read_bytes()
    held = open(entries[1] / "kernel.cubin", "rb")
    mapped_file = open(entries[1] / "kernel.cubin", "rb")
    mapped = mmap.mmap(mapped_file.fileno(), 0, prot=mmap.PROT_READ)
    for i in (2, 3, 0, 4, 5):
        touch(entries[i])
    time.sleep(GRACE)
    touch(entries[0])
    entries += [compile_variant(m, i) for i in (6, 7)]
    try:
        st = wait_evictions(m, 2)
        # The 7th entry passed 6: down to 90 % of 6, so 5 stayed; the 8th made 6 again.
        assert st["evictions_total"] == 2 and st["entries"] == 6
        gone = [i for i, e in enumerate(entries) if not e.exists()]
        assert gone == [1, 2]
        assert sorted(os.listdir(m.mnt / "cache")) == sorted(
            entries[i].name for i in (0, 3, 4, 5, 6, 7))
        assert not (m.backing / entries[1].relative_to(m.mnt)).exists()
        # The kernel's caches do not keep showing it (its cubin's dentry lives an hour).
        assert not os.path.exists(entries[1] / "kernel.cubin")
        with pytest.raises(FileNotFoundError):
            open(entries[2] / "kernel.cubin", "rb")
        # The process that has it open or mapped reads every byte, from the daemon too.
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        assert held.read() == expected
        assert mapped[:] == expected
    finally:
        mapped.close()
        mapped_file.close()
        held.close()
    assert st["evicted_bytes_total"] > 2 * len(expected)
    log = m.daemon_log()
    assert log.count(": evicted (") == 2 and entries[1].name in log
    # Gone with its source: a client stages it again and it compiles again.
    before = m.stats()["compiles_total"]
    again = compile_variant(m, 1)
    assert again == entries[1] and m.stats()["compiles_total"] == before + 1


def test_max_size_bounds_the_bytes_stored(mount_factory):
    size = 100 * 1024
    m = mount_factory(["max_size=1M"])
    for i in range(12):
        e = m.mnt / "cache" / ("kernel.c%d.%032x" % (i, i))
        e.mkdir(parents=True)
        (e / "kernel.cubin").write_bytes(client_cubin(size, i))
        time.sleep(0.02)
        if i == 8:
            time.sleep(GRACE)  # the first 9 may go, the last 3 are too new
    st = wait_evictions(m, 2)
    # The 11th entry passed 1 MiB: down to 90 % of it (9 entries); the 12th made 10.
    assert st["stored_bytes"] == 10 * size <= 1 << 20
    assert st["entries"] == 10 and st["evictions_total"] == 2
    assert st["evicted_bytes_total"] == 2 * size
    left = sorted(int(p.name.split(".")[1][1:]) for p in (m.mnt / "cache").iterdir())
    assert left == list(range(2, 12))
    for i in left:
        path = m.mnt / "cache" / ("kernel.c%d.%032x" % (i, i)) / "kernel.cubin"
        assert path.read_bytes() == client_cubin(size, i)


def test_entries_being_staged_or_compiled_are_not_evicted(mount_factory, tmp_path):
    release = tmp_path / "release"  # holds the compiles of sources built with -DKC_GATE
    m = mount_factory(["nvcc=%s" % slow_nvcc(tmp_path, release, "*-DKC_GATE*"),
                       "max_entries=2"])
    oldest = compile_variant(m, 0)
    second = compile_variant(m, 1)
    # A client re-stages the oldest entry: its kernel.cu is open for writing.
    writer = open(oldest / "kernel.cu", "r+b")
    compiling = m.stage("saxpy", sample("saxpy")[0], b"-O3\n-DKC_GATE\n")
    openers = start_openers(compiling / "kernel.cubin", 2)
    try:
        wait_for_flight(m)
        time.sleep(GRACE)
        for i in (2, 3):  # a third and a fourth entry: over the bound
            compile_variant(m, i)
        st = wait_evictions(m, 1)
        # Over 2: the oldest (being staged) stays; the next oldest went instead. Third and
        # fourth may go too once older than the grace period (a compile can take longer
        # than that on busy cores): what never goes is being staged or compiled.
        assert oldest.exists() and not second.exists()
        assert (oldest / "kernel.cubin").exists()
        assert compiling.exists() and m.stats()["flights"] == 1, "saxpy is still compiling"
    finally:
        release.write_text("open")
        outs = [p.communicate(timeout=120)[0].split() for p in openers]
        writer.close()
    assert all(o[0] == "ok" for o in outs), outs
    assert st["entries"] <= 4


def test_the_index_and_last_use_survive_a_remount(mount_factory):
    m = mount_factory(["max_entries=100"], name="first")
    entries = [compile_variant(m, i) for i in range(3)]
    touch(entries[0])  # its first use, within the hour of its publish: its cubin's mtime stands
    time.sleep(1.1)
    touch(entries[1])
    time.sleep(1.1)
    before = time.time()
    touch(entries[0])  # used again within the hour: written at the clean stop
    after = time.time()
    assert m.stats()["entries"] == 3
    rel = [e.relative_to(m.mnt) for e in entries]
    m.stop()
    used = [int(os.getxattr(m.backing / r, "user.kcachefs.used")) for r in rel[:2]]
    assert int(before) <= used[0] <= after and used[0] > used[1], (before, used, after)
    m.start()
    wait_until(lambda: m.stats()["entries"] == 3, m.stats)
    assert m.stats()["stored_bytes"] == sum(
        f.stat().st_size for r in rel for f in (m.backing / r).iterdir())


def test_reset_zeroes_the_counters_for_the_daemon_user_only(mount_factory):
    m = mount_factory()
    compile_variant(m, 0)
    assert m.stats()["compiles_total"] == 1 and m.stats()["entries"] == 1
    os.truncate(m.mnt / ".kcachefs" / "stats", 0)
    st = m.stats()
    assert st["compiles_total"] == 0 and st["misses_total"] == 0
    assert st["compile_duration_seconds_count"] == 0
    assert st["entries"] == 1  # a gauge: what is stored, not a count of events
    compile_variant(m, 1)
    assert m.stats()["compiles_total"] == 1
    fd = os.open(m.mnt / ".kcachefs" / "stats", os.O_WRONLY | os.O_TRUNC)  # ": > stats"
    try:
        assert m.stats()["compiles_total"] == 0
        with pytest.raises(OSError) as e:
            os.write(fd, b"1")  # only truncation means something
        assert e.value.errno == errno.EINVAL
    finally:
        os.close(fd)
    compile_variant(m, 2)
    assert m.stats()["compiles_total"] == 1
    with open(m.mnt / ".kcachefs" / "stats", "w") as f:  # echo 0 > stats
        f.write("0\n")
    assert m.stats()["compiles_total"] == 0
    with pytest.raises(OSError) as e:
        os.truncate(m.mnt / ".kcachefs" / "stats", 10)
    assert e.value.errno == errno.EPERM
    with pytest.raises(PermissionError):
        os.truncate(m.mnt / ".kcachefs" / "metrics.prom", 0)
    assert "statistics reset" in m.daemon_log()
