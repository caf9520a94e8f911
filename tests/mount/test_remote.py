"""The cluster store (-o remote=dir:PATH): several daemons on this machine, each with its
own backing directory and mountpoint (simulated nodes), share one store directory.

Compiles are a fast fake compiler (a real cubin, marked with the source's SHA-256 and a
random nonce, so that identical bytes on two nodes prove they were shared, not compiled
twice); its dependency pass (the compile again into pass.cubin, traced, run after the
publish of a compile to be shared) reads a header of each -I directory. Every compile is logged in one file for the whole cluster.
"""
import hashlib
import os
import subprocess
import time

import pytest

from conftest import KERNELS as SAMPLES, Mount, read_result, sample
from kcmount import wait_until
from kccluster import (INC_HEADER, KERNELS, LISTS_KEY, Cluster, compiles_each_kernel_once,
                       dead_holder_is_taken_over_within_seconds, holding_and_waiting,
                       live_holder_keeps_its_lease, planted_record_is_ignored,
                       run_parallel_background, source, stage_all, start_holding, waiter_lag)


@pytest.fixture
def cluster(tmp_path, template):
    c = Cluster(tmp_path, template)
    yield c
    c.stop()


def test_cluster_compiles_each_kernel_once(cluster):
    compiles_each_kernel_once(cluster)


def poison_one(cluster, how):
    """Spoil the stored cubin object of kernel 0 (found by its manifest key's index)."""
    cubins = cluster.objects(b"cubin")
    target = next(p for p in cubins if b"KCFAKE" + hashlib.sha256(source(0)).hexdigest().encode()
                  in p.read_bytes())
    other = next(p for p in cubins if p != target)
    data = target.read_bytes()
    target.unlink()
    if how == "garbage":
        new = os.urandom(len(data))
    elif how == "other-kernel":
        new = other.read_bytes()
    elif how == "truncated":
        new = data[:len(data) // 2]
    elif how == "signature":
        new = data[:-10] + bytes([data[-10] ^ 1]) + data[-9:]
    elif how == "cubin-byte":
        i = data.index(b"KCFAKE")
        new = data[:i] + b"X" + data[i + 1:]
    elif how == "half-written":
        (target.parent / (".%s.tmp.0.1" % target.name)).write_bytes(data[:100])
        return target
    target.write_bytes(new)
    return target


@pytest.mark.parametrize("how", ["garbage", "other-kernel", "truncated", "signature",
                                 "cubin-byte", "half-written", "header"])
def test_poisoned_objects_are_refused(cluster, tmp_path, how):
    key = tmp_path / "cluster.key"
    key.write_bytes(os.urandom(32))
    os.chmod(key, 0o600)
    opts = ["remote_key=%s" % key]
    a = cluster.node("a", opts)
    first = {p.parent.name: read_result(p) for p in stage_all(cluster, a, range(2))}
    assert len(cluster.compiles()) == 2
    cluster.shared(a, 2)
    a.stop()
    if how == "header":  # node B's copy of the -I header differs from node A's
        cluster.header.write_text("#define KC_CLUSTER 2\n")
    else:
        poison_one(cluster, how)
    b = cluster.node("b", opts)
    got = {p.parent.name: read_result(p) for p in stage_all(cluster, b, range(2))}
    k0 = next(n for n in got if n.startswith("kernel.k0."))
    k1 = next(n for n in got if n.startswith("kernel.k1."))
    assert got[k0][0] == "ok" and got[k0] != first[k0], "a poisoned object was served"
    data = (b.mnt / "cache" / k0 / "kernel.cubin").read_bytes()
    assert b"KCFAKE" + hashlib.sha256(source(0)).hexdigest().encode() in data
    assert len(cluster.compiles()) == (4 if how == "header" else 3)
    s = b.stats()
    if how == "header":
        assert s["remote_hits_total"] == 0 and s["remote_rejected_total"] == 0
    else:
        assert got[k1] == first[k1], "the intact object was not used"
        assert s["remote_hits_total"] == 1
        assert s["remote_rejected_total"] == (0 if how == "half-written" else 1)
        if how != "half-written":
            assert "refused" in b.daemon_log()


def test_key_file_must_be_root_only(cluster, tmp_path):
    key = tmp_path / "open.key"
    key.write_bytes(os.urandom(32))
    os.chmod(key, 0o644)
    with pytest.raises(RuntimeError, match="(?s)kcachefs exited 1: .*remote_key"):
        cluster.node("n", ["remote_key=%s" % key])
    cluster.nodes.pop()


@pytest.mark.parametrize("url, says", [
    ("ftp://store", "unknown store"), ("dir:relative/store", "absolute"),
    ("redis://host/notadb", "database number"), ("redis://host:99999", "port")])
def test_malformed_remote_is_a_usage_error(cluster, url, says):
    """A remote= the daemon cannot parse is a usage error (exit 2, as the man page says
    of option values), told before anything is mounted."""
    (cluster.tmp / "bad").mkdir()
    m = Mount(cluster.tmp / "bad", ["remote=%s" % url, "nvcc=%s" % cluster.fake])
    with pytest.raises(RuntimeError, match="kcachefs exited 2: ") as e:
        m.start()
    assert says in str(e.value), str(e.value)
    assert not os.path.ismount(m.mnt)


def test_waiting_for_another_node_takes_no_job_slot(cluster):
    """A node with one job slot whose compile waits for another node's lease still
    compiles a kernel nobody holds at once: waiting holds no slot (and no lease is taken
    without one), so one slow kernel elsewhere does not stall a node's other kernels until
    remote_wait."""
    cluster.gate.write_text("")
    a = cluster.node("a")
    b = cluster.node("b", ["jobs=1", "remote_wait=120"])
    pa = stage_all(cluster, a, [0])[0]
    pb0, pb1 = stage_all(cluster, b, [0, 1])
    opener_a = start_holding(cluster, a, pa, stdout=subprocess.DEVNULL)
    waiter = run_parallel_background(pb0, 1)[0]
    wait_until(lambda: b.stats()["remote_lease_waits_total"] >= 1, b.daemon_log)
    assert read_result(pb1)[0] == "ok"  # compiled by b while its k0 waits
    s = b.stats()
    assert s["compiles_total"] == 1 and s["remote_hedged_total"] == 0, s
    assert waiter.poll() is None, "b's k0 did not wait for a's compile"
    cluster.gate.unlink()
    assert waiter.communicate(timeout=120)[0].startswith("ok ")
    opener_a.wait(timeout=120)
    s = b.stats()
    assert s["remote_hits_total"] == 1 and s["compiles_total"] == 1, s  # k0 came from a
    assert len(cluster.compiles()) == 2


def test_lease_holder_killed_mid_compile(cluster):
    a, b, opener_a, readers = holding_and_waiting(cluster, ["remote_lease=2"])
    a.kill()
    opener_a.wait(timeout=60)
    results = [r.communicate(timeout=120)[0] for r in readers]
    assert all(r.startswith("ok ") for r in results), results
    s = b.stats()
    assert s["remote_takeovers_total"] == 1
    assert s["compiles_total"] == 1
    assert len(cluster.compiles()) == 2  # a's (killed) and b's


def test_read_only_node_never_writes(cluster):
    rw = cluster.node("rw")
    stage_all(cluster, rw, [0])[0].read_bytes()
    cluster.shared(rw, 1)
    before = sorted(str(p) for p in cluster.store.rglob("*") if not p.name.startswith(".clock"))
    ro = cluster.node("ro", ["remote_mode=ro"])
    paths = stage_all(cluster, ro, range(3))
    for p in paths:
        assert read_result(p)[0] == "ok"
    after = sorted(str(p) for p in cluster.store.rglob("*") if not p.name.startswith(".clock"))
    assert before == after, "a read-only node wrote the store"
    s = ro.stats()
    assert s["remote_hits_total"] == 1 and s["remote_puts_total"] == 0
    assert len(cluster.compiles()) == 3


def test_store_gone_mid_run(cluster):
    m = cluster.node("n")
    paths = stage_all(cluster, m)
    assert read_result(paths[0])[0] == "ok"
    subprocess.run(["rm", "-rf", str(cluster.store)], check=True)
    cluster.store.write_text("not a directory\n")  # every operation fails now
    for p in paths[1:]:
        assert read_result(p)[0] == "ok"
    s = m.stats()
    assert s["compiles_total"] == KERNELS
    assert s["remote_lease_errors_total"] + s["remote_put_errors_total"] > 0
    assert s["remote_misses_total"] == KERNELS and s["remote_hits_total"] == 0
    assert "faults in a row" in m.daemon_log()  # the breaker opened, and said so
    assert s["remote_up"] == 0


def test_store_missing_is_down_and_never_made(cluster):
    """A dir: store that is not there (the shared filesystem not mounted yet) is a store
    that is down: the mount says so at start, compiles locally, and never makes the
    directory, which would be a private store that shares nothing."""
    cluster.store.rmdir()
    m = cluster.node("n")
    assert "the store counts as down" in m.daemon_log()
    assert "does not answer at start" in m.daemon_log()
    assert m.stats()["remote_up"] == 0
    for p in stage_all(cluster, m):
        assert read_result(p)[0] == "ok"
    assert not cluster.store.exists()
    s = m.stats()
    assert s["compiles_total"] == KERNELS and s["remote_hits_total"] == 0
    assert s["remote_get_errors_total"] >= 1  # the probe at start; then the breaker is open


def test_waiter_hedges_after_remote_wait(cluster):
    """A holder that stays alive but does not finish: the waiter compiles itself after
    remote_wait; the holder's later object does not replace the first one stored."""
    cluster.gate.write_text("")
    a = cluster.node("a")
    b = cluster.node("b", ["remote_wait=1"])
    pa = stage_all(cluster, a, [0])[0]
    pb = stage_all(cluster, b, [0])[0]
    opener_a = start_holding(cluster, a, pa, stdout=subprocess.PIPE)
    rb = read_result(pb)
    assert rb[0] == "ok"
    s = b.stats()
    assert s["remote_lease_waits_total"] == 1 and s["remote_hedged_total"] == 1
    assert s["compiles_total"] == 1
    cluster.gate.unlink()
    assert opener_a.wait(timeout=120) == 0
    assert read_result(pa)[0] == "ok"
    assert len(cluster.compiles()) == 2
    # The shares run after the openers are answered: b's object is stored, and a's share
    # has ended (its lease released) before the objects are counted.
    cluster.shared(b, 1)
    assert len(cluster.objects(b"cubin")) == 1  # the first stored won


def test_real_nvcc_shares_with_its_header_manifest(mount_factory, tmp_path, counting_nvcc):
    """Real nvcc in the compile sandbox: its traced dependency pass gives the -I header,
    the toolkit's files and the lookups that found nothing, and the second node fetches
    instead of compiling."""
    make, calls = counting_nvcc
    (tmp_path / "store").mkdir()
    opts = ["remote=dir:%s" % (tmp_path / "store"), "nvcc=%s" % make()]
    a, b = mount_factory(opts, name="a"), mount_factory(opts, name="b")
    src = b'#include <kc_test/scale.cuh>\nextern "C" __global__ void k(float *x) { x[0] = 1; }\n'
    flags = ("-O3\n-I%s\n" % (SAMPLES / "include")).encode()
    ra = read_result(a.stage("k", src, flags) / "kernel.cubin")
    rb = read_result(b.stage("k", src, flags) / "kernel.cubin")
    assert ra[0] == "ok" and ra == rb
    assert calls() == 1
    assert b.stats()["remote_hits_total"] == 1
    index = [p.read_bytes() for p in (tmp_path / "store" / "objects").glob("*/*")
             if p.read_bytes()[19:25] == b"index " and p.name != LISTS_KEY]
    # the index (its compact manifest names the header list) and the header list
    assert len(index) == 2 and sum(b" @headers\n" in i for i in index) == 1
    index = [i for i in index if b" @headers\n" not in i]
    assert b"/kc_test/scale.cuh\n" in index[0]
    # what the toolchain looked up: the toolkit's headers and programs, and the lookups that
    # found nothing (the -I directory is searched first for every system header)
    for name in (b"/cuda_runtime.h\n", b"/cicc\n", b"/ptxas\n", b"/nvcc.profile\n"):
        assert name in index[0], name
    absent = b"3e144f3ec7178ebad4c924e5d523e6f4bb43b02860e4bb9ef1ac958f6e2b0075 "
    assert absent + (b"%s/stdlib.h\n" % str(SAMPLES / "include").encode()) in index[0]


def test_real_nvcc_shares_a_cub_kernel(mount_factory, tmp_path, counting_nvcc):
    """A CUB kernel (block_sum: its trace lists a path at each of about 22,000 lookups, 4,326
    paths) is shared: the second node fetches it. Before, its list passed the cap on
    headers and it was never stored ("not shared: more than 20000 headers")."""
    make, calls = counting_nvcc
    (tmp_path / "store").mkdir()
    opts = ["remote=dir:%s" % (tmp_path / "store"), "nvcc=%s" % make()]
    a, b = mount_factory(opts, name="a"), mount_factory(opts, name="b")
    src, flags = sample("block_sum")
    ra = read_result(a.stage("block_sum", src, flags) / "kernel.cubin")
    assert ra[0] == "ok", a.daemon_log()
    wait_until(lambda: " stored (" in a.daemon_log() or "not shared" in a.daemon_log(),
               a.daemon_log, 120)
    assert "not shared" not in a.daemon_log(), a.daemon_log()
    rb = read_result(b.stage("block_sum", src, flags) / "kernel.cubin")
    assert rb == ra and calls() == 1 and b.stats()["remote_hits_total"] == 1


def test_real_nvcc_manifest_has_nested_headers(mount_factory, tmp_path, counting_nvcc):
    """The dependency pass of real nvcc, after the publish, lists a header included by a
    header: a node whose copy of that nested header differs compiles instead of fetching."""
    make, calls = counting_nvcc
    (tmp_path / "store").mkdir()
    inc = tmp_path / "inc"
    (inc / "kc_nest").mkdir(parents=True)
    (inc / "kc_nest" / "outer.cuh").write_text('#pragma once\n#include "inner.cuh"\n')
    inner = inc / "kc_nest" / "inner.cuh"
    inner.write_text("#pragma once\n#define KC_INNER 2\n")
    for p in (tmp_path, inc, inc / "kc_nest"):
        os.chmod(p, 0o755)
    for p in (inner, inc / "kc_nest" / "outer.cuh"):
        os.chmod(p, 0o644)
    opts = ["remote=dir:%s" % (tmp_path / "store"), "nvcc=%s" % make()]
    a, b = mount_factory(opts, name="a"), mount_factory(opts, name="b")
    src = (b'#include <kc_nest/outer.cuh>\n'
           b'extern "C" __global__ void k(float *x) { x[0] = KC_INNER; }\n')
    flags = ("-O3\n-I%s\n" % inc).encode()
    ra = read_result(a.stage("k", src, flags) / "kernel.cubin")
    assert ra[0] == "ok", a.daemon_log()
    wait_until(lambda: " stored (" in a.daemon_log(), a.daemon_log, 120)
    index = [p.read_bytes() for p in (tmp_path / "store" / "objects").glob("*/*")
             if p.read_bytes()[19:25] == b"index " and b" @headers\n" not in p.read_bytes()]
    assert len(index) == 1 and b"/kc_nest/inner.cuh\n" in index[0], index  # the header list
    inner.write_text("#pragma once\n#define KC_INNER 3\n")  # b's copy of it differs
    rb = read_result(b.stage("k", src, flags) / "kernel.cubin")
    assert rb[0] == "ok" and rb != ra
    assert calls() == 2 and b.stats()["remote_hits_total"] == 0


def test_opener_answered_before_the_cluster_put(cluster):
    """The compiling node's opener has its cubin when the compiler exits: the header list
    (the dependency pass, stopped here at dep_gate), the object and the index come after
    the local publish, with the lease held until the index is stored. A second node then
    fetches the complete object."""
    cluster.dep_gate.write_text("")
    a = cluster.node("a")
    b = cluster.node("b", ["remote_wait=120"])
    pa = stage_all(cluster, a, [0])[0]
    pb = stage_all(cluster, b, [0])[0]
    try:
        got = subprocess.run(["cat", str(pa)], capture_output=True, timeout=60).stdout
    except subprocess.TimeoutExpired:
        pytest.fail("the opener waited for the cluster put:\n" + a.daemon_log())
    assert got[:4] == b"\x7fELF", got[:200]
    wait_until(lambda: cluster.dep_log.read_text(), a.daemon_log)
    assert cluster.objects(b"cubin") == [] and cluster.objects(b"index") == []
    assert len(cluster.lease_keys()) == 1, "the lease was not held for the put"
    waiter = run_parallel_background(pb, 1)[0]
    wait_until(lambda: b.stats()["remote_lease_waits_total"] >= 1, b.daemon_log)
    assert waiter.poll() is None, "b did not wait for a's put"
    cluster.dep_gate.unlink()
    out = waiter.communicate(timeout=120)[0]
    assert out.startswith("ok "), out
    assert read_result(pb) == read_result(pa)  # the bytes a compiled, verified by b
    s = b.stats()
    assert s["remote_hits_total"] == 1 and s["compiles_total"] == 0, s
    assert len(cluster.compiles()) == 1
    # the index and the header list it names
    assert len(cluster.objects(b"cubin")) == 1 and len(cluster.objects(b"index")) == 2
    log = a.daemon_log()
    assert log.index(": published (ok)") < log.index(" stored ("), log


def test_failed_dependency_pass_only_means_not_shared(cluster):
    """A dependency pass that fails leaves the published cubin as it is, stores nothing,
    says so in the log and releases the lease: the next node compiles at once."""
    a = cluster.node("a")
    b = cluster.node("b", ["remote_wait=120"])
    src = b'// KC_NODEPS\n' + source(0)
    flags = ("-O3\n-I%s\n" % cluster.inc).encode()
    pa = a.stage("k0", src, flags) / "kernel.cubin"
    ra = read_result(pa)
    assert ra[0] == "ok", ra
    wait_until(lambda: "not shared: its dependency pass" in a.daemon_log(), a.daemon_log)
    wait_until(lambda: cluster.lease_keys() == [], lambda: str(cluster.lease_keys()))
    assert cluster.objects(b"cubin") == [] and cluster.objects(b"index") == []
    assert read_result(pa) == ra  # still served from the node's own store
    t0 = time.monotonic()
    rb = read_result(b.stage("k0", src, flags) / "kernel.cubin")
    assert rb[0] == "ok" and rb != ra and time.monotonic() - t0 < 60
    assert b.stats()["remote_lease_waits_total"] == 0
    assert len(cluster.compiles()) == 2


def test_rejected_compile_note_frees_waiters(cluster):
    """A holder whose compile is rejected leaves a failure note: the node waiting on its
    lease compiles for itself at once (no hedge after remote_wait), both clients get the
    error a mount without the store gives, and nothing is stored under the kernel's key
    that a third node would serve, even when someone puts an object there."""
    cluster.gate.write_text("")
    bad = b'#include <%s>\nKC_REJECT\n' % INC_HEADER.encode()
    flags = ("-O3\n-I%s\n" % cluster.inc).encode()
    a = cluster.node("a", ["remote_wait=600"])
    b = cluster.node("b", ["remote_wait=600"])
    pa = a.stage("bad", bad, flags) / "kernel.cubin"
    pb = b.stage("bad", bad, flags) / "kernel.cubin"
    opener_a = start_holding(cluster, a, pa, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    opener_b = subprocess.Popen(["cat", str(pb)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
    wait_until(lambda: b.stats()["remote_lease_waits_total"] >= 1, b.daemon_log)
    cluster.gate.unlink()
    for o in (opener_a, opener_b):
        _, err = o.communicate(timeout=300)  # far below remote_wait
        assert o.returncode != 0 and "Input/output error" in err, err
    assert len(cluster.compiles()) == 2, "b did not compile for itself"
    s = b.stats()
    assert s["remote_hedged_total"] == 0 and s["compiles_total"] == 0
    assert "rejected" in (pb.parent / "kernel.log").read_text()
    assert cluster.objects(b"cubin") == [] and cluster.objects(b"index") == []
    # poison the rejected kernel's key (named by its lease file) with another kernel's
    # valid index: a node whose compile of it is rejected serves nothing
    assert read_result(stage_all(cluster, a, [0])[0])[0] == "ok"
    cluster.shared(a, 1, leases=1)  # the rejected kernel's note stays
    leases = [p for p in (cluster.store / "leases").glob("*/*") if not p.name.startswith(".")]
    assert len(leases) == 1, leases
    spot = cluster.store / "objects" / leases[0].parent.name / leases[0].name
    spot.parent.mkdir(exist_ok=True)
    spot.write_bytes(cluster.objects(b"index")[0].read_bytes())
    c = cluster.node("c")
    assert read_result(c.stage("bad", bad, flags) / "kernel.cubin")[0] == "err"
    assert len(cluster.compiles()) == 4
    s = c.stats()
    assert s["remote_hits_total"] == 0 and s["remote_rejected_total"] == 1


def test_stop_while_waiting_for_another_node(cluster):
    """A daemon stopped while its compile waits for another node's lease stops at once:
    the waiting opener gets EIO, nothing hangs."""
    cluster.gate.write_text("")
    a = cluster.node("a")
    b = cluster.node("b")
    pa = stage_all(cluster, a, [0])[0]
    pb = stage_all(cluster, b, [0])[0]
    opener_a = start_holding(cluster, a, pa, stdout=subprocess.DEVNULL)
    reader = subprocess.Popen(["cat", str(pb)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE)
    wait_until(lambda: b.stats()["remote_lease_waits_total"] >= 1, b.daemon_log)
    b.proc.terminate()
    assert b.proc.wait(timeout=60) == 0
    assert reader.wait(timeout=60) != 0
    assert len(cluster.compiles()) == 1  # b compiled nothing on its way out
    b.stop()
    cluster.gate.unlink()
    opener_a.wait(timeout=120)
    assert read_result(pa)[0] == "ok"


@pytest.mark.parametrize("kind", ["held", "failed"])
def test_planted_lease_or_note_is_ignored(cluster, tmp_path, kind):
    planted_record_is_ignored(cluster, tmp_path, kind)


def test_dead_holder_taken_over_within_seconds(cluster):
    dead_holder_is_taken_over_within_seconds(cluster)


def test_live_holder_of_a_long_compile_keeps_its_lease(cluster):
    live_holder_keeps_its_lease(cluster)


def test_waiter_is_told_not_polled(cluster):
    waiter_lag(cluster)


def test_header_changed_between_fetches_is_seen(cluster):
    """A node that has fetched kernels of a header list, and may now take its
    manifest of that list on the watch's word (src/cluster/remote_watch.h), fetches no more
    of them once one of its listed headers has other bytes (the same size, the mtime kept):
    its next kernel is compiled, as the index's headers are not this node's."""
    a = cluster.node("a")
    for r in [read_result(p) for p in stage_all(cluster, a, range(5))]:
        assert r[0] == "ok", a.daemon_log()
    cluster.shared(a, 5)
    b = cluster.node("b")
    pb = stage_all(cluster, b, range(5))
    for p in pb[:4]:  # the first rehashes read the header; the later fetches may take them
        assert read_result(p)[0] == "ok", b.daemon_log()
    assert b.stats()["remote_hits_total"] == 4 and len(cluster.compiles()) == 5
    keep_size_and_mtime(cluster.header, "#define KC_CLUSTER 2\n")
    assert read_result(pb[4])[0] == "ok", b.daemon_log()
    s = b.stats()
    assert s["remote_hits_total"] == 4 and s["compiles_total"] == 1, b.daemon_log()
    assert len(cluster.compiles()) == 6


def keep_size_and_mtime(header, text):
    """Give header other bytes of the same length, its mtime kept (as rsync -t does)."""
    st = os.stat(header)
    header.write_text(text)
    os.utime(header, ns=(st.st_atime_ns, st.st_mtime_ns))


def read_kernels(cluster, node, kernels):
    """Stage kernels on node and read each cubin: {entry name: read_result}."""
    return {p.parent.name: read_result(p) for p in stage_all(cluster, node, kernels)}


def drop_indexes(cluster):
    """Remove every kernel's index from the store (the header lists and the lists record
    stay): only the record can lead a node to the objects then."""
    for p in cluster.objects(b"index"):
        if b" @headers\n" in p.read_bytes():
            p.unlink()


def checked_at_start(node):
    """Wait until node's check of the cluster's header lists at start has ended; its log."""
    wait_until(lambda: " the cluster stored last" in node.daemon_log(), node.daemon_log)
    return node.daemon_log()


def test_a_node_started_later_needs_no_index(cluster):
    """A node that starts after the cluster stored kernels checks, at start, the
    header lists that the cluster's lists record names against its own headers. Its first
    fetches then ask for their objects directly: with every kernel's index gone from the
    store, it still fetches them all (without the check its first look reads the index,
    finds none, and compiles)."""
    a = cluster.node("a")
    first = read_kernels(cluster, a, range(3))
    cluster.shared(a, 3)
    indexes = [p for p in cluster.objects(b"index") if b" @headers\n" in p.read_bytes()]
    assert len(indexes) == 3 and b" @headers\n" in cluster.record()
    drop_indexes(cluster)
    b = cluster.node("b")
    assert "1 of the 1 the cluster stored last, is this node's headers" in checked_at_start(b)
    assert read_kernels(cluster, b, range(3)) == first
    s = b.stats()
    assert s["remote_hits_total"] == 3 and s["compiles_total"] == 0, b.daemon_log()
    assert len(cluster.compiles()) == 3


def test_the_start_check_finds_an_older_image_s_list(cluster):
    """The lists record names image 2's list first (the newest) and image 1's after it: a
    node of image 1 that starts later checks both, matches the second, and fetches image
    1's cubins directly (every index gone), compiling nothing."""
    got = {}
    for n in (1, 2):
        keep_size_and_mtime(cluster.header, "#define KC_CLUSTER %d\n" % n)
        node = cluster.node("img%d" % n)
        got[n] = read_kernels(cluster, node, range(2))
        cluster.shared(node, 2)
    assert got[1] != got[2] and len(cluster.compiles()) == 4
    assert cluster.record().count(b" @headers\n") == 2
    drop_indexes(cluster)
    keep_size_and_mtime(cluster.header, "#define KC_CLUSTER 1\n")
    b = cluster.node("b")
    assert "2 of the 2 the cluster stored last, is this node's headers" in checked_at_start(b)
    assert read_kernels(cluster, b, range(2)) == got[1]
    s = b.stats()
    assert s["remote_hits_total"] == 2 and s["compiles_total"] == 0, b.daemon_log()
    assert len(cluster.compiles()) == 4


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_header_changed_around_the_start_check_is_seen(cluster, when):
    """A listed header given other bytes (its size and mtime kept) before the node starts,
    or after its check at start matched: the node compiles, never serving the cubin of the
    headers it checked (the watch armed behind that check, or a rehash, sees the change)."""
    a = cluster.node("a")
    ra = read_result(stage_all(cluster, a, [0])[0])
    cluster.shared(a, 1)
    if when == "before":
        keep_size_and_mtime(cluster.header, "#define KC_CLUSTER 2\n")
    b = cluster.node("b")
    matched = "stored last, is this node's headers" in checked_at_start(b)
    assert matched == (when == "after"), b.daemon_log()
    if when == "after":
        keep_size_and_mtime(cluster.header, "#define KC_CLUSTER 2\n")
    rb = read_result(stage_all(cluster, b, [0])[0])
    assert rb[0] == "ok" and rb != ra
    s = b.stats()
    assert s["remote_hits_total"] == 0 and s["compiles_total"] == 1, b.daemon_log()


@pytest.mark.parametrize("how", ["signature", "garbage"])
def test_a_refused_lists_record_costs_only_the_check(cluster, tmp_path, how):
    """A lists record that does not verify (a flipped byte under remote_key, or garbage) is
    refused, counted and logged at start; the node's fetches read the index as before."""
    key = tmp_path / "cluster.key"
    key.write_bytes(os.urandom(32))
    os.chmod(key, 0o600)
    a = cluster.node("a", ["remote_key=%s" % key])
    first = read_kernels(cluster, a, range(2))
    cluster.shared(a, 2)
    record = cluster.store / "objects" / LISTS_KEY[:2] / LISTS_KEY
    data = record.read_bytes()
    record.write_bytes(data[:-10] + bytes([data[-10] ^ 1]) + data[-9:] if how == "signature"
                       else os.urandom(len(data)))
    b = cluster.node("b", ["remote_key=%s" % key])
    wait_until(lambda: "header lists' record %s refused" % LISTS_KEY[:16] in b.daemon_log(),
               b.daemon_log)
    assert read_kernels(cluster, b, range(2)) == first
    s = b.stats()
    assert s["remote_rejected_total"] == 1 and s["remote_hits_total"] == 2, b.daemon_log()
    assert len(cluster.compiles()) == 2


def test_nodes_of_two_images_alternating_each_compile_once(cluster):
    """An index lists several manifests (one per image whose nodes compiled the
    kernel), so nodes of two images that take turns each fetch their own image's cubins:
    each image compiles each kernel once. Past KC_MANIFEST_PER_KEY (4) images the oldest
    is dropped first."""
    def image(n):  # the header of image n, as its nodes have it
        cluster.header.write_text("#define KC_CLUSTER %d\n" % n)

    def settled(node):  # every compile of node's is stored (a node whose headers are not
        # the index's compiles without a lease: shared() cannot see its put)
        wait_until(lambda: node.daemon_log().count(" stored (") >= node.stats()["compiles_total"],
              node.daemon_log)

    kernels = range(3)
    got = {}
    for turn, n in enumerate([1, 2, 1, 2, 1]):
        image(n)
        node = cluster.node("img%d-%d" % (n, turn))
        res = {p.parent.name: read_result(p) for p in stage_all(cluster, node, kernels)}
        assert got.setdefault(n, res) == res, "image %d got another image's cubins" % n
        settled(node)
        if turn >= 2:
            assert node.stats()["remote_hits_total"] == len(kernels), node.daemon_log()
    assert len(cluster.compiles()) == 2 * len(kernels)
    assert got[1] != got[2]
    for n in (3, 4, 5):  # three more images: image 1's manifest is now the oldest of five
        image(n)
        node = cluster.node("img%d" % n)
        assert all(read_result(p)[0] == "ok" for p in stage_all(cluster, node, kernels))
        settled(node)
    assert len(cluster.compiles()) == 5 * len(kernels)
    for n, hits in ((2, len(kernels)), (1, 0)):
        image(n)
        node = cluster.node("again%d" % n)
        assert all(read_result(p)[0] == "ok" for p in stage_all(cluster, node, kernels))
        assert node.stats()["remote_hits_total"] == hits, node.daemon_log()
