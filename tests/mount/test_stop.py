"""A stop finishes the cluster's part: the shares to the cluster store of the compiles just
published (their dependency pass, the puts, the lease's release, which run after the openers
were answered) end before the daemon exits, within -o stop_timeout, whether the stop is an
unmount, a SIGTERM to the daemon, one to its holder, or the unit's stop under a service
manager that keeps the mount. The mount goes first: nothing a client waits for waits for the
shares. Past the bound each share still in hand is named in the log and its lease released.

The dependency passes are held at the cluster's dep_gate while the stop begins, 0.1 s after
the last open returned, and released a moment later: before, the stop killed them and those
kernels never reached the store.
"""
import os
import signal
import subprocess
import time

import pytest

from kcmount import KCACHEFS, FakeManager, Mount, daemons_of, read_result, wait_until
from kccluster import KERNELS, Cluster, stage_all

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts with allow_other need root")


@pytest.fixture
def cluster(tmp_path, template):
    c = Cluster(tmp_path, template)
    yield c
    c.stop()


def fd_store_built():
    out = subprocess.run([str(KCACHEFS), "--version"], capture_output=True, text=True).stdout
    return "file descriptor store: yes" in out


def open_all_with_shares_held(cluster, node):
    """Open every kernel on node (each compiled, its opener answered) while the dependency
    passes wait at the gate: every share is in hand. Returns the results."""
    cluster.dep_gate.write_text("")
    results = [read_result(p) for p in stage_all(cluster, node)]
    assert all(r[0] == "ok" for r in results), results
    wait_until(lambda: cluster.dep_log.read_text(), node.daemon_log)
    assert cluster.objects(b"cubin") == [], "a share passed the gate"
    return results


def stop(node, how):
    """Stop node as an operator would; returns the daemon's pid."""
    daemon = daemons_of(node, "kcachefs")[0]
    if how == "unmount":
        r = subprocess.run(["fusermount3", "-u", str(node.mnt)], capture_output=True, text=True)
        assert r.returncode == 0, r
    elif how == "sigterm":
        os.kill(daemon, signal.SIGTERM)
    else:  # SIGTERM to the holder, the process started (systemd's stop)
        node.proc.send_signal(signal.SIGTERM)
    return daemon


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open("/proc/%d/stat" % pid) as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def later_node_compiles_none(cluster, results):
    b = cluster.node("b")
    got = [read_result(p) for p in stage_all(cluster, b)]
    assert got == results  # a's bytes, fetched
    s = b.stats()
    assert s["compiles_total"] == 0 and s["remote_hits_total"] == KERNELS, s
    assert len(cluster.compiles()) == KERNELS


@pytest.mark.parametrize("how", ["unmount", "sigterm", "holder"])
def test_a_stop_stores_what_was_just_compiled(cluster, how):
    a = cluster.node("a", ["holder"] if how == "holder" else [])
    results = open_all_with_shares_held(cluster, a)
    time.sleep(0.1)
    t0 = time.monotonic()
    daemon = stop(a, how)
    # The mount goes at once; the daemon stays for its shares, which wait at the gate.
    wait_until(lambda: not os.path.ismount(a.mnt), a.daemon_log, timeout=30)
    unmounted = time.monotonic() - t0
    time.sleep(0.5)
    assert alive(daemon), "the daemon did not wait for its shares:\n" + a.daemon_log()
    cluster.dep_gate.unlink()
    assert a.proc.wait(timeout=60) == 0, a.daemon_log()
    print("\n%s: unmounted %.2f s after the stop; %d of %d kernels stored, %d leases left"
          % (how, unmounted, len(cluster.objects(b"cubin")), KERNELS, len(cluster.lease_keys())))
    log = a.daemon_log()
    assert len(cluster.objects(b"cubin")) == KERNELS, log
    assert cluster.lease_keys() == [], log
    assert "stop: %d shares to the cluster store in hand" % KERNELS in log, log
    assert "not shared" not in log, log
    later_node_compiles_none(cluster, results)


def test_a_stop_drops_the_shares_past_its_bound(cluster):
    """stop_timeout=1 with the dependency passes held: the daemon exits about 1 s after the
    stop, names each share it dropped, and releases their leases, so the next node compiles
    at once instead of waiting for leases to expire."""
    a = cluster.node("a", ["stop_timeout=1"])
    open_all_with_shares_held(cluster, a)
    t0 = time.monotonic()
    stop(a, "sigterm")
    assert a.proc.wait(timeout=60) == 0, a.daemon_log()
    took = time.monotonic() - t0
    log = a.daemon_log()
    assert "of %d shares to the cluster store still in hand after" % KERNELS in log, log
    dropped = [l for l in log.splitlines() if "not shared: the daemon stopped before" in l]
    assert sorted(l.split("kernel.")[1].split(".")[0] for l in dropped) == \
        ["k%d" % k for k in range(KERNELS)], log
    assert took < 30, took
    assert cluster.lease_keys() == [] and cluster.objects(b"cubin") == []
    cluster.dep_gate.unlink()
    b = cluster.node("b", ["remote_wait=120"])
    t0 = time.monotonic()
    assert all(read_result(p)[0] == "ok" for p in stage_all(cluster, b))
    assert b.stats()["compiles_total"] == KERNELS and b.stats()["remote_lease_waits_total"] == 0
    assert time.monotonic() - t0 < 60


@pytest.mark.skipif(not fd_store_built(), reason="built without libsystemd")
def test_the_units_stop_stores_what_was_just_compiled(cluster, tmp_path):
    """Under a service manager that keeps the mount (its file descriptor store), the unit's
    stop is SIGTERM to the holder, which stops the daemon without an unmount (SIGUSR1): the
    shares end first, then the holder exits 0 and the mount stays for a restart."""
    manager = FakeManager(tmp_path)
    a = cluster.node("a", ["holder"])
    try:
        # Started again under the manager: the holder stores the mount's descriptors.
        a.stop()
        log = open(a.log_path, "ab")
        argv = [str(a.bin), "-f", "-o", ",".join(a.options), str(a.backing), str(a.mnt)]
        a.proc = manager.run(argv, log)
        a.log = log
        wait_until(lambda: os.path.ismount(a.mnt), a.daemon_log)
        manager.wait_stored(["kcachefs-fuse", "kcachefs-init"])
        results = open_all_with_shares_held(cluster, a)
        time.sleep(0.1)
        daemon = stop(a, "holder")
        wait_until(lambda: "stopping without unmounting" in a.daemon_log(), a.daemon_log)
        time.sleep(0.5)
        assert alive(daemon), "the daemon did not wait for its shares:\n" + a.daemon_log()
        cluster.dep_gate.unlink()
        assert a.proc.wait(timeout=60) == 0, a.daemon_log()
        assert not alive(daemon)
        assert str(a.mnt) in open("/proc/self/mounts").read()  # the store keeps it
        log = a.daemon_log()
        assert len(cluster.objects(b"cubin")) == KERNELS and cluster.lease_keys() == [], log
        assert "not shared" not in log, log
        later_node_compiles_none(cluster, results)
    finally:
        manager.release()
        subprocess.run(["umount", "-l", str(a.mnt)], capture_output=True)


def test_a_new_daemon_waits_for_the_one_that_ends_its_shares(cluster):
    """The stopped daemon holds the backing directory while its shares end: a daemon started
    on it meanwhile (a pod's replacement, a remount) waits for it rather than failing, and
    then serves what it published."""
    a = cluster.node("a")
    results = open_all_with_shares_held(cluster, a)
    daemon = stop(a, "sigterm")
    wait_until(lambda: not os.path.ismount(a.mnt), a.daemon_log, timeout=30)
    again = Mount(a.root, a.options)
    again.log_path = a.root / "again.log"
    try:
        cmd = [str(KCACHEFS), "-f", "-o", ",".join(a.options), str(a.backing), str(a.mnt)]
        log = open(again.log_path, "ab")
        again.log = log
        again.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        wait_until(lambda: "has stopped and ends its shares" in again.daemon_log(),
                   again.daemon_log)
        assert again.proc.poll() is None and not os.path.ismount(a.mnt)
        assert alive(daemon)
        cluster.dep_gate.unlink()
        assert a.proc.wait(timeout=60) == 0
        wait_until(lambda: os.path.ismount(a.mnt), again.daemon_log)
        assert [read_result(p) for p in stage_all(cluster, again)] == results
        assert len(cluster.objects(b"cubin")) == KERNELS
    finally:
        again.stop()


def test_a_stop_during_an_upgrade_s_wait_for_shares_ends_it_at_once(cluster):
    """A live upgrade waits for the running daemon's shares before it hands over; a stop
    then (SIGTERM to the running daemon) ends the upgrade and the daemon stops at once,
    without waiting for those shares first: the mount goes, the new process exits 1."""
    a = cluster.node("a")
    open_all_with_shares_held(cluster, a)
    new = subprocess.Popen([str(KCACHEFS), "-f", "--upgrade", str(a.mnt)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: "handing the mount to pid" in a.daemon_log(), a.daemon_log)
        time.sleep(0.5)  # in the wait for the shares, which the gate holds
        t0 = time.monotonic()
        a.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: not os.path.ismount(a.mnt), a.daemon_log, timeout=30)
        took = time.monotonic() - t0
        print("\nunmounted %.2f s after the stop, the shares still held" % took)
        assert took < 5, a.daemon_log()
        assert new.wait(timeout=60) == 1
        assert "upgrade abandoned: the daemon is stopping" in a.daemon_log()
        cluster.dep_gate.unlink()
        assert a.proc.wait(timeout=60) == 0
    finally:
        if new.poll() is None:
            new.kill()
            new.wait()
