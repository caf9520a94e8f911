"""The cluster store on Redis (-o remote=redis+unix://...): simulated nodes (several daemons,
each with its own backing directory and mountpoint) share redis-servers that each test
starts on Unix sockets in a temp directory and always stops. The nodes, the fake compiler
and the cluster-wide compile log are kccluster.py's Cluster, with Redis as the store;
the faults are the server's: stopped, SIGKILLed, restarted empty, paused, flushed, full.
"""
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from conftest import read_result, run_parallel
from kcmount import all_stopped, wait_until
from kccluster import (KERNELS, Cluster, FakeRedis, RedisCluster, RedisServer,
                       compiles_each_kernel_once, dead_holder_is_taken_over_within_seconds,
                       live_holder_keeps_its_lease, open_at, planted_record_is_ignored,
                       read_all_kernels, stage_all, total, waiter_lag)


@pytest.fixture
def redis_factory():
    """redis_factory(name) -> a started RedisServer; all are SIGKILLed at teardown. The
    sockets live in a short directory of their own (sun_path holds 107 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="kcr-", dir="/tmp"))
    with all_stopped(lambda name="redis": RedisServer(d, name)) as (start, _):
        yield start
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def redis_cluster(tmp_path, template, redis_factory):
    c = RedisCluster(tmp_path, template, [redis_factory("r0")])
    yield c
    c.stop()


def cold_run(cluster, nodes, per_node=8, kernels=range(KERNELS), shared=True):
    """per_node processes on each node read every kernel, all released together; returns
    {entry: result} of the first process after checking that every process of a node (of
    the cluster, when shared) read the same complete bytes."""
    paths = [stage_all(cluster, m, kernels) for m in nodes]
    results = run_parallel(per_node * len(nodes), read_all_kernels, paths, per_node, timeout=600)
    for entry in results[0]:
        for n in range(1 if shared else len(nodes)):
            group = results if shared else results[n * per_node:(n + 1) * per_node]
            seen = {r[entry] for r in group}
            assert len(seen) == 1 and next(iter(seen))[0] == "ok", (entry, seen)
    return results[0]


def test_redis_cluster_compiles_each_kernel_once(redis_cluster):
    """4 nodes x 8 processes x 8 kernels, cold: 8 compiles in the cluster (the dir: test,
    run on Redis), no lease left behind."""
    compiles_each_kernel_once(redis_cluster)
    server = redis_cluster.servers[0]
    # a holder releases once its index is stored
    wait_until(lambda: server.keys("kcachefs:lease:*") == [], "a lease outlived its compile")
    for k in server.keys("kcachefs:obj:*"):
        assert server.cli("PTTL", k) == b"-1", "objects carry no expiry (the server's LRU evicts)"


def test_redis_auth_user(redis_cluster, tmp_path):
    """An ACL user from remote_auth=: the store is used, the password is not logged; a wrong
    password is a store fault (logged, counted), never a client's error."""
    server = redis_cluster.servers[0]
    assert server.cli("ACL", "SETUSER", "kc", "on", ">kc-secret-pw", "~kcachefs:*", "+@all") == b"OK"
    assert server.cli("ACL", "SETUSER", "default", "off") == b"OK"
    auth = tmp_path / "redis.auth"
    auth.write_text("kc kc-secret-pw\n")
    os.chmod(auth, 0o600)
    a = redis_cluster.node("a", ["remote_auth=%s" % auth])
    first = {p.parent.name: read_result(p) for p in stage_all(redis_cluster, a)}
    b = redis_cluster.node("b", ["remote_auth=%s" % auth])
    assert {p.parent.name: read_result(p) for p in stage_all(redis_cluster, b)} == first
    assert b.stats()["remote_hits_total"] == KERNELS
    assert len(redis_cluster.compiles()) == KERNELS
    bad = tmp_path / "bad.auth"
    bad.write_text("kc wrong-pw-123\n")
    os.chmod(bad, 0o600)
    c = redis_cluster.node("c", ["remote_auth=%s" % bad])
    got = {p.parent.name: read_result(p) for p in stage_all(redis_cluster, c)}
    assert all(r[0] == "ok" for r in got.values()), got
    errors = sum(c.stats()[k] for k in ("remote_get_errors_total", "remote_put_errors_total",
                                         "remote_lease_errors_total"))
    assert c.stats()["remote_hits_total"] == 0 and errors > 0
    assert "WRONGPASS" in c.daemon_log()
    for m in (a, b, c):
        log = m.daemon_log()
        assert "kc-secret-pw" not in log and "wrong-pw-123" not in log
    os.chmod(auth, 0o644)
    with pytest.raises(RuntimeError, match="(?s)kcachefs exited 1: .*remote_auth"):
        redis_cluster.node("d", ["remote_auth=%s" % auth])
    redis_cluster.nodes.pop()


def test_redis_not_answering_at_start(tmp_path, template):
    """A store address nobody answers on (a typo, or the server not up yet): the mount
    comes up, says at once that the store does not answer, shows remote_up 0 before any
    compile, and every read gets its cubin, compiled here."""
    cluster = Cluster(tmp_path, template, "redis+unix://%s" % (tmp_path / "nobody.sock"))
    try:
        m = cluster.node("a")
        assert "does not answer at start" in m.daemon_log()
        assert m.stats()["remote_up"] == 0
        assert all(read_result(p)[0] == "ok" for p in stage_all(cluster, m))
        s = m.stats()
        assert s["compiles_total"] == KERNELS and s["remote_hits_total"] == 0, s
        assert s["remote_get_errors_total"] >= 1, s
    finally:
        cluster.stop()


def test_redis_two_shards_one_stopped(tmp_path, template, redis_factory):
    """Objects spread over two shards; one is SIGKILLed half-way: every read still gets
    its cubin (from the other shard, or compiled here), and the fault is logged."""
    shards = [redis_factory("s0"), redis_factory("s1")]
    cluster = RedisCluster(tmp_path, template, shards)
    try:
        first = cold_run(cluster, [cluster.node("a"), cluster.node("b")], per_node=4)
        assert len(cluster.compiles()) == KERNELS
        held = [len(s.keys("kcachefs:obj:*")) for s in shards]
        # a cubin and an index each, the one header list that all their compiles read,
        # and the record that names it
        assert sum(held) == 2 * KERNELS + 2 and all(held), held
        shards[1].stop()
        late = cluster.node("late")
        got = cold_run(cluster, [late], per_node=4)
        s = late.stats()
        hits = [e for e in got if got[e] == first[e]]
        assert s["remote_hits_total"] == len(hits)
        assert s["compiles_total"] == KERNELS - len(hits)
        assert len(cluster.compiles()) == 2 * KERNELS - len(hits)
        assert s["remote_get_errors_total"] + s["remote_lease_errors_total"] > 0
        assert "s1.sock" in late.daemon_log()
        assert shards[0].cli("PING") == b"PONG"
    finally:
        cluster.stop()


def test_redis_killed_mid_cold_run(redis_cluster):
    """4 nodes x 8 processes x 8 kernels, cold, with one compile held at the gate while the
    other nodes wait on its lease; the Redis server is SIGKILLed then: every process still
    gets its cubin (the waiters compile locally), each node compiles a kernel at most once."""
    redis_cluster.gate.write_text("")
    nodes = [redis_cluster.node("n%d" % i) for i in range(4)]
    paths = [stage_all(redis_cluster, m) for m in nodes]
    out = {}
    runner = threading.Thread(target=lambda: out.update(
        r=run_parallel(32, read_all_kernels, paths, 8, timeout=600)))
    runner.start()
    try:
        wait_until(lambda: redis_cluster.compiles() and
                   total(nodes, "remote_lease_waits_total") >= 1,
                   lambda: (redis_cluster.compiles(), nodes[0].daemon_log()), 120)
        redis_cluster.servers[0].stop()
    finally:
        redis_cluster.gate.unlink()
        runner.join()
    results = out["r"]
    for i, r in enumerate(results):
        assert all(v[0] == "ok" for v in r.values()), (i, r)
        assert r == results[i - i % 8], "two processes of one node read different bytes"
    assert KERNELS < len(redis_cluster.compiles()) <= 4 * KERNELS
    assert all(m.stats()["compiles_total"] <= KERNELS for m in nodes)
    errors = sum(total(nodes, k) for k in ("remote_get_errors_total", "remote_put_errors_total",
                                           "remote_lease_errors_total"))
    assert errors > 0


def test_redis_restarted_empty(redis_cluster):
    """A restart loses every object: the next node misses cleanly (no error counted) and
    publishes again; the one after it hits."""
    a = redis_cluster.node("a")
    first = cold_run(redis_cluster, [a], per_node=2)
    redis_cluster.shared(a, KERNELS)  # the puts follow the publish: all in before the restart
    server = redis_cluster.servers[0]
    server.stop()
    server.start()
    b = redis_cluster.node("b")
    second = cold_run(redis_cluster, [b], per_node=2)
    redis_cluster.shared(b, KERNELS)
    assert len(redis_cluster.compiles()) == 2 * KERNELS
    assert all(second[e] != first[e] for e in first), "an object survived the restart"
    s = b.stats()
    assert s["remote_misses_total"] == KERNELS and s["remote_hits_total"] == 0
    assert s["remote_get_errors_total"] == 0
    c = redis_cluster.node("c")
    assert cold_run(redis_cluster, [c], per_node=2) == second
    assert c.stats()["remote_hits_total"] == KERNELS


@pytest.mark.parametrize("how", ["client-pause", "debug-sleep"])
def test_redis_paused_longer_than_timeout(redis_cluster, how):
    """A server that stops answering for far longer than remote_timeout: the node compiles
    locally, every read succeeds before the server answers again."""
    a = redis_cluster.node("a")
    first = cold_run(redis_cluster, [a], per_node=2, kernels=range(2))
    server = redis_cluster.servers[0]
    b = redis_cluster.node("b", ["remote_timeout=300"])
    paths = stage_all(redis_cluster, b)
    sleeper = None
    if how == "client-pause":
        assert server.cli("CLIENT", "PAUSE", "120000", "ALL") == b"OK"
    else:
        sleeper = subprocess.Popen(["redis-cli", "-s", str(server.sock), "DEBUG", "SLEEP", "120"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def asleep():  # once a PING goes unanswered
            try:
                server.cli("PING", timeout=0.5)
            except subprocess.TimeoutExpired:
                return True
            return False
        wait_until(asleep, "DEBUG SLEEP did not start", 30, step=0)
    try:
        got = {p.parent.name: read_result(p) for p in paths}
        assert all(r[0] == "ok" for r in got.values()), got
        # the server is still not answering: nothing waited for it
        with pytest.raises(subprocess.TimeoutExpired):
            server.cli("PING", timeout=0.5)
        s = b.stats()
        assert s["remote_hits_total"] == 0 and s["compiles_total"] == KERNELS
        assert "timed out" in b.daemon_log().lower()
        for e in first:
            assert got[e] != first[e]
    finally:
        server.stop()  # neither a pause nor a DEBUG SLEEP can be ended early
        if sleeper is not None:
            sleeper.wait()


def test_redis_back_at_once_is_used_again_within_seconds(redis_cluster):
    """The server stopped (SIGSTOP) just long enough for the breaker to open (5 faults of
    300 ms timeouts), then continued at once: the open breaker probes it after 1 s and the
    node uses the store again within seconds, not after the 30 s cap."""
    server = redis_cluster.servers[0]
    b = redis_cluster.node("b", ["remote_timeout=300"])
    paths = iter(stage_all(redis_cluster, b, range(100, 300)))  # fresh kernels: each asks
    assert read_result(next(paths))[0] == "ok"
    redis_cluster.shared(b, 1)  # the store in use (the put follows the publish)
    server.proc.send_signal(signal.SIGSTOP)
    try:
        while "faults in a row" not in b.daemon_log():
            assert read_result(next(paths))[0] == "ok"
    finally:
        server.proc.send_signal(signal.SIGCONT)
    back = time.monotonic()
    s = b.stats()
    assert s["remote_up"] == 0, s
    puts = s["remote_puts_total"]
    while True:
        assert read_result(next(paths))[0] == "ok"
        s = b.stats()
        took = time.monotonic() - back
        if s["remote_up"] == 1 and s["remote_puts_total"] > puts:
            break
        # generous for a busy machine; the cap it replaces kept the node off for 30 s
        assert took < 20, "store not used again %.1f s after it answered: %s" % (took, s)
        time.sleep(0.25)
    print("store used again %.2f s after it answered" % took)
    assert "answers again" in b.daemon_log()


def test_redis_flushall(redis_cluster):
    a = redis_cluster.node("a")
    cold_run(redis_cluster, [a], per_node=2)
    redis_cluster.shared(a, KERNELS)  # the puts follow the publish: all in before the flush
    assert redis_cluster.servers[0].cli("FLUSHALL") == b"OK"
    b = redis_cluster.node("b")
    cold_run(redis_cluster, [b], per_node=2)
    s = b.stats()
    assert s["remote_misses_total"] == KERNELS and s["remote_hits_total"] == 0
    assert s["remote_get_errors_total"] == 0 and s["remote_rejected_total"] == 0
    assert len(redis_cluster.compiles()) == 2 * KERNELS


def test_redis_tiny_maxmemory(redis_cluster):
    """A full server that refuses writes (noeviction): puts and leases fail with OOM, every
    node compiles for itself, nothing is refused to a client."""
    server = redis_cluster.servers[0]
    assert server.cli("CONFIG", "SET", "maxmemory-policy", "noeviction") == b"OK"
    assert server.cli("CONFIG", "SET", "maxmemory", "1") == b"OK"
    nodes = [redis_cluster.node("n%d" % i) for i in range(2)]
    cold_run(redis_cluster, nodes, per_node=4, shared=False)
    assert len(redis_cluster.compiles()) == 2 * KERNELS
    assert server.keys("kcachefs:*") == []
    assert total(nodes, "remote_put_errors_total") + total(nodes, "remote_lease_errors_total") > 0
    assert any("No space left" in m.daemon_log() or "OOM" in m.daemon_log() for m in nodes)


@pytest.mark.parametrize("how", ["hang", "garbage"])
def test_store_that_hangs_or_answers_garbage(tmp_path, template, how):
    """A store that accepts and never answers, or answers garbage: every read gets its
    cubin, compiled here (each node compiles each kernel once), each fault is counted,
    and the delay it adds is bounded by a few remote_timeouts (a generous bound)."""
    d = Path(tempfile.mkdtemp(prefix="kcf-", dir="/tmp"))
    fake = FakeRedis(d, how)
    cluster = Cluster(tmp_path, template, fake.url)
    try:
        nodes = [cluster.node("a", ["remote_timeout=200"]), cluster.node("b", ["remote_timeout=200"])]
        t0 = time.monotonic()
        got = cold_run(cluster, nodes, per_node=4, shared=False)
        elapsed = time.monotonic() - t0
        assert all(r[0] == "ok" for r in got.values()), got
        assert fake.accepted > 0, "the store was never asked"
        for m in nodes:
            s = m.stats()
            assert s["compiles_total"] == KERNELS and s["remote_hits_total"] == 0, s
            assert s["remote_get_errors_total"] + s["remote_lease_errors_total"] > 0, s
            assert "sock" in m.daemon_log()
        assert len(cluster.compiles()) == 2 * KERNELS
        # 8 kernels, each compile asks the store at most a few times before the breaker
        # opens: far below this, however busy the machine
        assert elapsed < 30 * KERNELS, elapsed
    finally:
        cluster.stop()
        fake.stop()
        shutil.rmtree(d, ignore_errors=True)


def test_holder_loses_store_mid_compile(redis_cluster):
    """The lease holder's store dies while it compiles (its renewals fail): it still
    publishes locally and every waiter of its node gets those bytes; the node waiting on
    its lease compiles for itself."""
    redis_cluster.gate.write_text("")
    a = redis_cluster.node("a", ["remote_lease=3", "remote_timeout=300"])
    b = redis_cluster.node("b", ["remote_lease=3", "remote_timeout=300"])
    pa = stage_all(redis_cluster, a, [0])[0]
    pb = stage_all(redis_cluster, b, [0])[0]
    out = {}
    runners = [threading.Thread(target=lambda n=n, p=p: out.update(
        {n: run_parallel(4, read_all_kernels, [[p]], 4, timeout=600)})) for n, p in
        (("a", pa), ("b", pb))]
    runners[0].start()
    try:
        # a's compile has started: a holds the lease
        wait_until(redis_cluster.compiles, a.daemon_log, 120)
        runners[1].start()
        wait_until(lambda: b.stats()["remote_lease_waits_total"] >= 1, b.daemon_log, 120)
        redis_cluster.servers[0].stop()
        # a renewal failed
        wait_until(lambda: a.stats()["remote_lease_errors_total"] >= 1, a.daemon_log, 120)
    finally:
        redis_cluster.gate.unlink()
        for r in runners:
            if r.ident is not None:  # started
                r.join()
    results = out["a"] + out["b"]
    assert all(v[0] == "ok" for r in results for v in r.values()), results
    assert all(r == results[0] for r in results[:4]), "a's waiters read different bytes"
    assert all(r == results[4] for r in results[4:]), "b's waiters read different bytes"
    assert results[0] != results[4], "b compiled for itself"
    assert a.stats()["compiles_total"] == 1 and b.stats()["compiles_total"] == 1
    assert len(redis_cluster.compiles()) == 2


@pytest.mark.parametrize("case", ["planted-held", "planted-failed", "dead-holder"])
def test_redis_lease_records_and_holders(redis_cluster, tmp_path, case):
    """The planted lease and note, and the SIGKILLed holder (kccluster.py), on Redis."""
    if case == "dead-holder":
        dead_holder_is_taken_over_within_seconds(redis_cluster)
    else:
        planted_record_is_ignored(redis_cluster, tmp_path, case[len("planted-"):])


def test_redis_live_holder_of_a_long_compile_keeps_its_lease(redis_cluster):
    live_holder_keeps_its_lease(redis_cluster)


def test_redis_waiter_is_told_not_polled(redis_cluster):
    """The waiter lag (kccluster.py), on Redis: the holder's PUBLISH wakes the waiter."""
    waiter_lag(redis_cluster)


def test_redis_planted_notice_serves_nothing(redis_cluster):
    """Anyone who can reach the store can PUBLISH on a key's channel: the waiter woken by
    it looks, finds no object and goes on waiting (no compile, no error, nothing served),
    and still gets the holder's object when it is stored."""
    redis_cluster.gate.write_text("")
    a = redis_cluster.node("a")
    b = redis_cluster.node("b")
    pa = stage_all(redis_cluster, a, [0])[0]
    pb = stage_all(redis_cluster, b, [0])[0]
    holder = open_at(pa)
    wait_until(redis_cluster.compiles, a.daemon_log)
    waiter = open_at(pb)
    server = redis_cluster.servers[0]
    wait_until(lambda: server.cli("PUBSUB", "CHANNELS", "kcachefs:stored:*"), b.daemon_log)
    channel = server.cli("PUBSUB", "CHANNELS", "kcachefs:stored:*").decode()
    for _ in range(20):
        assert int(server.cli("PUBLISH", channel, "planted")) >= 1
        time.sleep(0.05)
    time.sleep(1)
    assert waiter.poll() is None, "a planted notice ended the wait"
    s = b.stats()
    assert s["compiles_total"] == 0 and s["remote_hits_total"] == 0, s
    assert s["remote_hedged_total"] == 0 and s["remote_takeovers_total"] == 0, s
    redis_cluster.gate.unlink()
    stored = float(holder.communicate(timeout=120)[0])
    served = float(waiter.communicate(timeout=120)[0])
    assert waiter.returncode == 0 and served - stored < 0.5, (stored, served)
    s = b.stats()
    assert s["compiles_total"] == 0 and s["remote_hits_total"] == 1, s
    assert len(redis_cluster.compiles()) == 1


def test_a_stop_is_bounded_when_the_store_hangs(redis_cluster):
    """A stop's wait for the shares in hand ends at stop_timeout even when the store stops
    answering mid-share (SIGSTOP): past the bound, the dependency passes are killed and the
    shares still waiting on the store (each of its operations up to remote_timeout, 5 s
    here) are named and not waited for; their leases expire. Before, each share's put,
    renewal and release waited remote_timeout in turn: 15 s and more for a 2 s bound."""
    server = redis_cluster.servers[0]
    a = redis_cluster.node("a", ["stop_timeout=1"])
    paths = stage_all(redis_cluster, a)
    redis_cluster.dep_gate.write_text("")
    assert all(read_result(p)[0] == "ok" for p in paths)
    wait_until(lambda: redis_cluster.dep_log.read_text(), a.daemon_log)
    server.proc.send_signal(signal.SIGSTOP)
    try:
        redis_cluster.dep_gate.unlink()  # the passes end; their puts wait on the store
        time.sleep(0.5)
        t0 = time.monotonic()
        a.proc.send_signal(signal.SIGTERM)
        assert a.proc.wait(timeout=120) == 0, a.daemon_log()
        took = time.monotonic() - t0
    finally:
        server.proc.send_signal(signal.SIGCONT)
    log = a.daemon_log()
    print("\nstore stopped: the daemon exited %.1f s after the SIGTERM (stop_timeout=1)" % took)
    assert took < 12, log
    named = {l.split("kernel.")[1].split(".")[0] for l in log.splitlines()
             if "not shared: " in l and "kernel." in l}
    stored = {l.split("kernel.")[1].split(".")[0] for l in log.splitlines()
              if " stored (" in l and "kernel." in l}
    assert named == {"k%d" % k for k in range(KERNELS)} and not stored, log
    assert "are dropped (each is named)" in log, log
    assert "exiting without the shares that wait on the cluster store" in log, log
