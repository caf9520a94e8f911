"""The dir: cluster store on a real network filesystem: a directory exported over sshfs
(attribute, entry and negative-lookup caching on) between two network namespaces of the
test's own on a veth pair (sshfs_export.py), shared by simulated nodes (kccluster.py's
Cluster). The same test as on a local directory, then the server lost mid-run: sshd and its
sessions SIGKILLed (the mount returns errors) or SIGSTOPped (the mount hangs, and only
remote_timeout bounds each store operation). scripts/remote-sshfs.sh runs this file.
"""
import hashlib
import os
import signal
import subprocess

import pytest

from conftest import read_result
from kcmount import wait_until
from sshfs_export import SshfsExport, missing_prerequisite
from kccluster import (KERNELS, Cluster, compiles_each_kernel_once,
                       dead_holder_is_taken_over_within_seconds, live_holder_keeps_its_lease,
                       planted_record_is_ignored, source, stage_all, total)

MISSING = missing_prerequisite()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))


@pytest.fixture
def export(tmp_path):
    with SshfsExport(tmp_path / "net") as e:
        yield e


@pytest.fixture
def sshfs_cluster(tmp_path, template, export):
    c = Cluster(tmp_path, template, url="dir:%s" % export.mnt)
    yield c
    export.kill_server()  # a frozen server would hold the nodes' store calls
    c.stop()


def test_cluster_on_sshfs(sshfs_cluster, export):
    compiles_each_kernel_once(sshfs_cluster)
    print("\n4 nodes x 32 processes x %d kernels on sshfs: %d compiles, %d remote hits"
          % (KERNELS, len(sshfs_cluster.compiles()),
             total(sshfs_cluster.nodes, "remote_hits_total")))
    # the objects are on the server's disk, not only in sshfs's cache: a cubin and an index
    # each, the one header list every kernel's compile read (key v2), and the
    # record that names that list
    stored = [p for p in (export.export / "objects").glob("*/*") if not p.name.startswith(".")]
    assert len(stored) == 2 * KERNELS + 2, stored


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_server_lost_mid_run(sshfs_cluster, export, how):
    cluster = sshfs_cluster
    cluster.gate.write_text("")  # the first compile waits: its node holds the store's lease
    nodes = [cluster.node("a"), cluster.node("b")]
    paths = [stage_all(cluster, m) for m in nodes]
    readers = [subprocess.Popen(["sha256sum", str(p)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
               for node_paths in paths for p in node_paths for _ in range(2)]
    claim = cluster.gate.parent / (cluster.gate.name + ".claim")
    wait_until(lambda: claim.exists(), lambda: nodes[0].daemon_log() + nodes[1].daemon_log(), 120)
    pids = export.server_pids()
    assert pids, "no sshd in the server namespace"
    for pid in pids:
        os.kill(pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    cluster.gate.unlink()
    outs = [r.communicate(timeout=600) for r in readers]
    assert all(r.returncode == 0 for r in readers), outs
    for node_paths in paths:
        for k, p in enumerate(node_paths):
            r = read_result(p)
            assert r[0] == "ok", (p, r)
            data = p.read_bytes()
            assert b"KCFAKE" + hashlib.sha256(source(k)).hexdigest().encode() in data
    assert KERNELS <= len(cluster.compiles()) <= 2 * KERNELS, cluster.compiles()
    faults = sum(total(nodes, k) for k in ("remote_get_errors_total", "remote_put_errors_total",
                                           "remote_lease_errors_total"))
    assert faults > 0, "".join(m.daemon_log() for m in nodes) + str(cluster.compiles())
    print("\nsshd %s mid-compile: %d readers on 2 nodes all got cubins of %d kernels; "
          "%d compiles, %d store faults, %d remote hits"
          % (how, len(readers), KERNELS, len(cluster.compiles()), faults,
             total(nodes, "remote_hits_total")))
    logs = "".join(m.daemon_log() for m in nodes)
    if how == "frozen":  # the hung mount answered nothing: remote_timeout ended each call
        assert "Connection timed out" in logs, logs


SCENARIOS = {
    "live-holder": lambda c, tmp: live_holder_keeps_its_lease(c),
    "dead-holder": lambda c, tmp: dead_holder_is_taken_over_within_seconds(c),
    "planted-held": lambda c, tmp: planted_record_is_ignored(c, tmp, "held"),
}


@pytest.mark.parametrize("case", sorted(SCENARIOS))
def test_lease_liveness_on_sshfs(sshfs_cluster, tmp_path, case):
    """Through sshfs's 30 s attribute cache, which would hide a lease file's new mtime from
    the other nodes: a live holder of a long compile keeps its lease, a SIGKILLed one is
    taken over within seconds, a planted lease is ignored (the liveness counter is in the
    file's bytes, read fresh at each open)."""
    SCENARIOS[case](sshfs_cluster, tmp_path)
