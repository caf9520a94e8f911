"""The kernel's FUSE request timeout (Linux 6.14+: fs.fuse.default_request_timeout and
fs.fuse.max_request_timeout) never takes the mount down: a request kept past it makes the
kernel abort the whole connection, so a compile that would outlive it is stopped, and an
opener parked on one gets ETIMEDOUT or EIO of its own before it.

The sysctls are machine-wide: the test sets them only for the moment a mount is made (the
kernel fixes a connection's timeout when the daemon answers FUSE_INIT, so the mount keeps
it after they are restored), restores them on every path, and holds a lock on the sysctl
file meanwhile so that two such tests never overlap. The module is marked serial:
scripts/test.sh runs it alone, after the other mount tests (which run in parallel), so no
other test mounts inside the window.
"""
import errno
import fcntl
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import KCACHEFS, Mount, sample
from kcmount import wait_until

SYSCTL = Path("/proc/sys/fs/fuse")
DEFAULT = SYSCTL / "default_request_timeout"
MAXIMUM = SYSCTL / "max_request_timeout"
CHECK_PERIOD = 15  # s: FUSE_TIMEOUT_TIMER_FREQ, how often the kernel looks for old requests

pytestmark = [pytest.mark.serial, pytest.mark.skipif(
    not DEFAULT.exists() or os.geteuid() != 0,
    reason="needs root and a kernel with fs.fuse.*_request_timeout (Linux 6.14+)")]


@contextmanager
def request_timeout_window(default_s, max_s):
    """Set both sysctls; restore them when the block ends, however it ends. The lock on the
    sysctl file keeps out any other test doing the same."""
    with open(DEFAULT) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        saved = DEFAULT.read_text().strip(), MAXIMUM.read_text().strip()
        try:
            MAXIMUM.write_text("%d\n" % max_s)
            DEFAULT.write_text("%d\n" % default_s)
            yield
        finally:
            DEFAULT.write_text(saved[0] + "\n")
            MAXIMUM.write_text(saved[1] + "\n")
        assert (DEFAULT.read_text().strip(), MAXIMUM.read_text().strip()) == saved


OPEN_TIMED = """
import os, sys, time
t = time.monotonic()
try:
    os.close(os.open(sys.argv[1], os.O_RDONLY))
    print('ok', time.monotonic() - t)
except OSError as e:
    print('err', e.errno, time.monotonic() - t)
"""


def test_slow_compile_under_request_timeout(tmp_path, counting_nvcc):
    make, calls = counting_nvcc
    nvcc = make(delay=40)  # a compile of 40 s, far beyond the mount's 15 s timeout
    (tmp_path / "m").mkdir()
    m = Mount(tmp_path / "m", ["nvcc=%s" % nvcc, "jobs=1"])
    # default 20 capped by max 15: the mount lives under 15 s.
    with request_timeout_window(20, 15):
        m.start()
    try:
        log = m.daemon_log()
        assert ("kernel request timeout 15 s (fs.fuse.default_request_timeout=20, "
                "max_request_timeout=15): requests answered within 12 s") in log, log
        assert "compile_timeout 600 s is capped at 11 s" in log, log

        src_a, flags_a = sample("vector_add")
        src_b, flags_b = sample("saxpy")
        a = m.stage("vector_add", src_a, flags_a)
        b = m.stage("saxpy", src_b, flags_b)
        began = time.monotonic()
        pa = subprocess.Popen([sys.executable, "-c", OPEN_TIMED, str(a / "kernel.cubin")],
                              stdout=subprocess.PIPE, text=True)
        # jobs=1: B's compile queues behind A's, so B's opener waits for more than the
        # compile timeout and is answered by the daemon's own deadline.
        wait_until(lambda: calls() >= 1, "the first compile did not start", 30)
        pb = subprocess.Popen([sys.executable, "-c", OPEN_TIMED, str(b / "kernel.cubin")],
                              stdout=subprocess.PIPE, text=True)
        # A live upgrade now would hold the requests the kernel queues for as long as these
        # compiles run: it gives up within the request budget, and the daemon serves on.
        time.sleep(0.5)
        up = subprocess.run([str(KCACHEFS), "-f", "--upgrade", str(m.mnt)],
                            capture_output=True, text=True, timeout=60)
        assert up.returncode == 1 and "under the kernel's request timeout" in up.stderr, up
        assert m.proc.poll() is None
        ra = pa.communicate(timeout=60)[0].split()
        rb = pb.communicate(timeout=60)[0].split()
        # Each opener had its own error, before the kernel's timeout.
        assert ra[0] == "err" and int(ra[1]) in (errno.EIO, errno.ETIMEDOUT), ra
        assert rb[0] == "err" and int(rb[1]) == errno.ETIMEDOUT, rb
        assert float(ra[2]) < 15 and float(rb[2]) < 15, (ra, rb)

        log = m.daemon_log()
        assert "answered ETIMEDOUT" in log and "fs.fuse.default_request_timeout" in log, log
        if int(ra[1]) == errno.EIO:  # A's compile was stopped at the capped timeout
            klog = (a / "kernel.log").read_text()
            assert "fs.fuse.default_request_timeout" in klog and "at least 15" not in klog, klog

        # Past the timeout and one more pass of the kernel's checker: the connection was
        # not aborted, every other client still has the mount.
        time.sleep(max(0.0, began + 15 + CHECK_PERIOD + 2 - time.monotonic()))
        assert os.path.ismount(m.mnt)
        other = subprocess.run(
            [sys.executable, "-c", "import os,sys; print(sorted(os.listdir(sys.argv[1])))",
             str(m.mnt / "cache")], capture_output=True, text=True, timeout=30)
        assert other.returncode == 0 and a.name in other.stdout, other
        (m.mnt / "plain.txt").write_bytes(b"still here")
        assert (m.mnt / "plain.txt").read_bytes() == b"still here"
        assert "compiles" in (m.mnt / ".kcachefs" / "stats").read_text()
        assert m.proc.poll() is None
    finally:
        m.stop()
        assert not os.path.ismount(m.mnt)
