"""Warm NVRTC workers: NVRTC compiles run in kcachefs-nvrtc --serve processes
that keep their automatic PCH from one compile to the next, one per compile uid, compiler,
architecture, options and include set, in the compile's sandbox, bounded in idle time, and
replaced after a crash or a timeout. Real NVRTC, real mounts."""
import errno
import os
import re
import threading

import pytest

from conftest import KCACHEFS, KERNELS, read_result, sample
from kcmount import open_to_compiles, wait_until

NVRTC = KCACHEFS.parent / "kcachefs-nvrtc"
pytestmark = pytest.mark.skipif(not NVRTC.exists(), reason="built without libnvrtc")

WORKER = re.compile(r"warm NVRTC worker pid (\d+), its compile (\d+)")
SM90 = b"--gpu-architecture=sm_90a\n"


def worker_of(entry):
    """(pid, its compile number) of the warm worker that compiled entry, from kernel.log."""
    m = WORKER.search((entry / "kernel.log").read_text())
    assert m, (entry / "kernel.log").read_text()
    return int(m.group(1)), int(m.group(2))


def compiled(m, n):
    """Stage kernel k<n> (a one-liner, sm_90a) on m and check that it compiles; its entry."""
    e = m.stage("k%d" % n, b'extern "C" __global__ void k%d(int *o) { *o = %d; }\n' % (n, n),
                SM90)
    assert read_result(e / "kernel.cubin")[0] == "ok"
    return e


def stage_hang(m, header):
    """Stage a kernel that includes header, a FIFO (fifo_header): its compile blocks there."""
    return m.stage("hang", b'#include "%s"\nextern "C" __global__ void h() {}\n' % bytes(header),
                   SM90)


def kernel(n, name="block_sum"):
    """block_sum's source as kernel number n of one include set (the same CUB headers)."""
    return sample(name)[0].replace(name.encode(), b"%s_%d" % (name.encode(), n))


def proc_uid(pid):
    for line in open("/proc/%d/status" % pid):
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError("no Uid line")


def alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def workers(m):
    """pids of the warm workers of mount m: kcachefs-nvrtc --serve whose working directory
    is in m's backing store."""
    found = []
    for p in os.listdir("/proc"):
        try:
            cmd = open("/proc/%s/cmdline" % p, "rb").read()
            cwd = os.readlink("/proc/%s/cwd" % p)
        except OSError:
            continue
        if cmd.endswith(b"kcachefs-nvrtc\0--serve\0") and cwd.startswith(str(m.backing)):
            found.append(int(p))
    return found


def in_fifo(pid):
    """pid waits in the open of a FIFO (for a writer)."""
    try:
        return open("/proc/%d/wchan" % pid).read() == "wait_for_partner"
    except OSError:
        return False


@pytest.fixture
def fifo_header(tmp_path):
    """A FIFO a source includes: NVRTC's open of it blocks until a writer comes, so a
    compile that includes it is mid-compile for as long as the test wants. Returns
    (path, release) where release() lets a blocked compile go on."""
    d = tmp_path / "fifo"
    d.mkdir()
    open_to_compiles(d)
    path = d / "hang.h"
    os.mkfifo(path)
    os.chmod(path, 0o666)

    def release():
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # no reader (ENXIO): nothing blocked
            return
        os.close(fd)
    yield path, release
    release()


def test_a_warm_workers_cubins_are_a_fresh_processs_bytes(mount_factory):
    flags = sample("block_sum")[1]
    warm = mount_factory(["compiler=nvrtc"], name="warm")
    fresh = mount_factory(["compiler=nvrtc", "nvrtc_idle=0"], name="fresh")
    pids = []
    for n in range(3):
        a = warm.stage("block_sum_%d" % n, kernel(n), flags)
        b = fresh.stage("block_sum_%d" % n, kernel(n), flags)
        data = (a / "kernel.cubin").read_bytes()
        assert data == (b / "kernel.cubin").read_bytes(), "kernel %d differs" % n
        pids.append(worker_of(a))
        assert not WORKER.search((b / "kernel.log").read_text()), "nvrtc_idle=0: no worker"
        if n:  # the second kernel of the include set on: the worker's PCH served it
            assert "using precompiled header file" in (a / "kernel.log").read_text()
    # One worker compiled all three, in turn: the second compile reused it.
    assert [p for p, _ in pids] == [pids[0][0]] * 3 and [c for _, c in pids] == [1, 2, 3]


def test_a_changed_header_is_read_again_not_taken_from_the_pch(mount_factory, tmp_path):
    inc = tmp_path / "inc"
    inc.mkdir()
    open_to_compiles(inc)
    header = inc / "value.cuh"
    text = ("#include <cub/block/block_reduce.cuh>\n#define VALUE %d\n"
            '#if __has_include("extra.cuh")\n#define EXTRA 7\n#else\n#define EXTRA 0\n#endif\n')
    header.write_text(text % 1)
    os.chmod(header, 0o644)
    src = (b'#include "value.cuh"\n'
           b'extern "C" __global__ void k%d(int *o) { *o = VALUE + EXTRA; }\n')
    flags = b"-I%s\n" % bytes(inc)
    warm = mount_factory(["compiler=nvrtc"], name="warm")
    fresh = mount_factory(["compiler=nvrtc", "nvrtc_idle=0"], name="fresh")

    def both(n):
        w = warm.stage("k%d" % n, src % n, flags)
        f = fresh.stage("k%d" % n, src % n, flags)
        assert (w / "kernel.cubin").read_bytes() == (f / "kernel.cubin").read_bytes(), n
        return w, (w / "kernel.log").read_text()
    first, _ = both(1)
    header.write_text(text % 2)  # the same size: only its times and bytes change
    second, log = both(2)
    assert "value.cuh changed since it was read" in log, log
    # A header that was looked for and not there (__has_include) appears.
    (inc / "extra.cuh").write_text("// there now\n")
    os.chmod(inc / "extra.cuh", 0o644)
    third, log = both(3)
    assert "extra.cuh changed since it was read" in log, log
    # the same worker (pid), started afresh in place each time
    assert worker_of(first)[0] == worker_of(second)[0] == worker_of(third)[0]


def test_a_worker_killed_mid_compile_fails_that_compile_and_the_next_gets_a_new_one(
        mount_factory, fifo_header):
    path, release = fifo_header
    m = mount_factory(["compiler=nvrtc"])
    pid0, _ = worker_of(compiled(m, 0))
    hang = stage_hang(m, path)
    result = {}
    openers = [threading.Thread(target=lambda i=i: result.__setitem__(
        i, read_result(hang / "kernel.cubin"))) for i in range(3)]
    for t in openers:
        t.start()
    # The worker of k0 (the same flags) compiles it, and waits in the FIFO: mid-compile.
    wait_until(lambda: in_fifo(pid0), "the worker never reached the header")
    os.kill(pid0, 9)
    for t in openers:
        t.join(120)
    assert all(result[i] == ("err", errno.EIO) for i in range(3)), result
    log = (hang / "kernel.log").read_text()
    assert "killed by signal 9" in log and "failed" in log.splitlines()[0], log
    # The next compile of the same flags gets a new worker, and compiles.
    pid1, count = worker_of(compiled(m, 1))
    assert pid1 != pid0 and count == 1


def test_a_hung_worker_is_killed_at_compile_timeout(mount_factory, fifo_header):
    path, _ = fifo_header
    # long enough for the next, real compile on a loaded machine (beside two busy loops,
    # a compile at nice 10 gets a tenth of a core)
    m = mount_factory(["compiler=nvrtc", "compile_timeout=15"])
    hang = stage_hang(m, path)
    assert read_result(hang / "kernel.cubin") == ("err", errno.EIO)
    log = (hang / "kernel.log").read_text()
    assert "timed out after 15 s" in log, log
    hung, _ = worker_of(hang)
    assert not alive(hung), "the hung worker was killed"
    assert m.stats()["compile_timeouts_total"] == 1
    assert worker_of(compiled(m, 1))[0] != hung


def test_idle_workers_exit_after_the_idle_time(mount_factory):
    m = mount_factory(["compiler=nvrtc", "nvrtc_idle=1"])
    pid, _ = worker_of(compiled(m, 1))
    wait_until(lambda: not alive(pid), "the idle worker still runs")
    # the daemon says why once it has reaped the worker, a moment after the worker is gone
    wait_until(lambda: "idle for 1 s" in m.daemon_log(), "no log line says the worker was idle")
    wait_until(lambda: not [d for d in (m.backing / ".kcachefs" / "scratch").iterdir()],
               "its scratch directory is left")


@pytest.mark.skipif(os.geteuid() != 0, reason="compiles run as uids of their own as root")
def test_two_compiles_at_once_never_share_a_worker_nor_a_uid(mount_factory, fifo_header):
    path, release = fifo_header
    m = mount_factory(["compiler=nvrtc", "jobs=2"])
    hang = stage_hang(m, path)
    result = {}
    t = threading.Thread(target=lambda: result.__setitem__(0, read_result(
        hang / "kernel.cubin")))
    t.start()
    wait_until(lambda: any(in_fifo(p) for p in workers(m)), "the first worker never started")
    # The first compile holds its worker (blocked in the FIFO): the same flags get another.
    second, _ = worker_of(compiled(m, 1))
    second_uid = proc_uid(second)
    release()
    t.join(120)
    assert result[0] == ("err", errno.EIO)  # the FIFO is not a regular file: rejected
    first, _ = worker_of(hang)
    assert first != second
    assert proc_uid(first) != second_uid and 0 not in (proc_uid(first), second_uid)



@pytest.mark.parametrize("uids", [[], ["compile_uids=daemon"]])
def test_a_daemon_that_dies_takes_its_idle_workers_with_it(mount_factory, uids):
    m = mount_factory(["compiler=nvrtc"] + uids)
    pid, _ = worker_of(compiled(m, 1))
    assert alive(pid), "idle, it waits for the next compile"
    m.kill()  # SIGKILL: nothing of the daemon's runs its clean-up
    wait_until(lambda: not alive(pid), "the worker outlived its daemon")
