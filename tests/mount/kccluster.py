"""The cluster-test library, without pytest: a Cluster of simulated nodes (daemons with
backing directories and mountpoints of their own on this machine) sharing one store, its
fast fake compiler, the Redis servers a store can be, and the scenarios that the dir:, Redis
and sshfs tests (tests/mount/test_remote*.py) and scripts/bench_cluster.py each run on
their own store.

Compiles are a fast fake compiler (a real cubin, marked with the source's SHA-256 and a
random nonce, so that identical bytes on two nodes prove they were shared, not compiled
twice); its dependency pass (the compile again into pass.cubin, traced, run after the
publish of a compile to be shared) reads a header of each -I directory. Every compile is logged in one file for the whole
cluster.
"""
import hashlib
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

from kcmount import NVCC, Mount, read_result, run_parallel, wait_until, write_script


def make_template(d):
    """A real cubin (sm_90a) in directory d, which the fake compiler copies; returns its
    path."""
    src = d / "t.cu"
    src.write_text('extern "C" __global__ void t(float *x) { x[0] = 1; }\n')
    out = d / "t.cubin"
    subprocess.run([str(NVCC), str(src), "-cubin", "-o", str(out), "-arch=sm_90a"], check=True,
                   capture_output=True)
    os.chmod(d, 0o755)
    os.chmod(out, 0o644)
    return out


KERNELS = 8

# The key of the cluster's record of the header lists its nodes stored last
# (src/cluster/remote_object.h, kc_object_lists_key): an index-kind object, which
# objects() leaves out (record() reads it).
LISTS_KEY = hashlib.sha256(b"kcachefs-header-lists-key-v1\n" + b"0\n\n").hexdigest()


INC_HEADER = "kc_cluster.h"


class Cluster:
    """The fake compiler, a shared store (a dir: store in tmp_path unless url names
    another, e.g. a Redis server of the test's or a dir: on sshfs), and nodes mounted on it."""

    def __init__(self, tmp_path, template, url=None):
        self.tmp = tmp_path
        self.url = url or "dir:%s" % (tmp_path / "store")
        self.store = Path(self.url[4:]) if self.url.startswith("dir:") else None
        if self.store:
            self.store.mkdir(exist_ok=True)  # the operator's: kcachefs never makes it
        self.log = tmp_path / "compiles"
        self.log.write_text("")
        os.chmod(self.log, 0o666)  # compiles run as uids of their own
        self.inc = tmp_path / "inc"
        self.inc.mkdir()
        os.chmod(self.inc, 0o755)
        self.header = self.inc / INC_HEADER
        self.header.write_text("#define KC_CLUSTER 1\n")
        os.chmod(self.header, 0o644)
        self.gate = tmp_path / "gate"
        self.dep_gate = tmp_path / "dep-gate"  # while it exists, dependency passes wait
        self.dep_log = tmp_path / "dep-passes"
        self.dep_log.write_text("")
        os.chmod(self.dep_log, 0o666)
        self.nodes = []
        self.fake = self.compiler(template)

    def compiler(self, template):
        # While the gate file exists, the first compile to claim it waits for its removal
        # (one compiler for every node: its path is part of the compiler identity). A
        # source that says KC_REJECT is rejected (an error, as nvcc's).
        wait = ('[ -e %s ] && mkdir %s.claim 2>/dev/null && '
                'while [ -e %s ]; do sleep 0.05; done\n' % (self.gate, self.gate, self.gate))
        # The dependency pass (the compile again, into pass.cubin, under the daemon's
        # tracer) reads the header of each -I directory, so that the trace lists it, and
        # waits while dep_gate exists. What it appends to the logs is written, not read:
        # the trace leaves it out.
        return write_script(
            self.tmp / "nvcc-fake",
            'src="$1"; out="$4"\n'
            'case "$*" in *-cubin*) ;; *) exec %s "$@";; esac\n'
            'incs=""\n'
            'for a in "$@"; do\n'
            '  case "$a" in -I*) incs="$incs ${a#-I}/%s";; esac\n'
            'done\n'
            'case "$out" in */pass.cubin)\n'
            '  sha256sum "$src" | cut -c1-64 >> %s\n'
            '  while [ -e %s ]; do sleep 0.05; done\n'
            '  if grep -q KC_NODEPS "$src"; then echo "$src: error: no deps" >&2; exit 1; fi\n'
            '  for h in $incs; do cat "$h" > /dev/null; done\n'
            '  cat %s > "$out"; exit 0;;\n'
            'esac\n'
            'h=$(sha256sum "$src" | cut -c1-64); echo "$h" >> %s\n'
            '%s'
            'if grep -q KC_REJECT "$src"; then echo "$src: error: rejected" >&2; exit 1; fi\n'
            'cat %s > "$out"; printf "KCFAKE%%s-%%s" "$h" "$$$(od -An -N8 -tx8 /dev/urandom)" >> "$out"\n'
            % (NVCC, INC_HEADER, self.dep_log, self.dep_gate, template, self.log, wait, template))

    def node(self, name, extra=()):
        opts = ["remote=%s" % self.url, "nvcc=%s" % self.fake,
                "remote_timeout=5000"] + list(extra)
        root = self.tmp / name
        root.mkdir(exist_ok=True)
        m = Mount(root, opts)
        self.nodes.append(m)
        return m.start()

    def shared(self, node, n, leases=0, timeout=60):
        """Wait until node has stored n kernels (object and index each, logged once both
        are: the share runs after the opener is answered) and at most leases leases or
        notes are left."""
        wait_until(lambda: (node.daemon_log().count(" stored (") >= n and
                            len(self.lease_keys()) <= leases), node.daemon_log, timeout)

    def compiles(self):
        return [l for l in self.log.read_text().splitlines() if l.strip()]

    def stop(self):
        for gate in (self.gate, self.dep_gate):
            if gate.exists():
                gate.unlink()
        for m in self.nodes:
            if m.proc is not None:
                m.stop()
        for m in self.nodes:
            assert not os.path.ismount(m.mnt), "mount left behind"

    def lease_keys(self):
        """The keys that a lease or note stands on."""
        return [p.name for p in (self.store / "leases").glob("*/*") if not p.name.startswith(".")]

    def wipe(self):
        """Remove every object, lease and note from the store."""
        for area in ("objects", "leases"):
            for p in (self.store / area).glob("*/*"):
                if not p.name.startswith(".clock"):
                    p.unlink()

    def plant(self, key, record):
        """Write record as the lease file of key, as anyone who can write the store can,
        dated a day ahead (a file can claim any mtime)."""
        d = self.store / "leases" / key[:2]
        d.mkdir(parents=True, exist_ok=True)
        (d / key).write_text(record + "\n")
        os.utime(d / key, (time.time() + 86400, time.time() + 86400))

    def objects(self, kind):
        """Paths of the stored objects of kind (b"cubin" or b"index": the indexes and the
        header lists, not the lists record); dir: store only."""
        out = []
        for p in sorted((self.store / "objects").glob("*/*")):
            if p.name.startswith(".") or p.name == LISTS_KEY:
                continue
            if p.read_bytes()[19:19 + len(kind) + 1] == kind + b" ":
                out.append(p)
        return out

    def record(self):
        """The lists record's bytes, or None."""
        p = self.store / "objects" / LISTS_KEY[:2] / LISTS_KEY
        return p.read_bytes() if p.exists() else None


def source(k):
    return ('#include <%s>\nextern "C" __global__ void k%d(float *x) { x[0] = %d; }\n'
            % (INC_HEADER, k, k)).encode()


def stage_all(cluster, m, kernels=range(KERNELS)):
    flags = ("-O3\n-I%s\n" % cluster.inc).encode()
    return [m.stage("k%d" % k, source(k), flags) / "kernel.cubin" for k in kernels]


def read_all_kernels(i, paths_by_node, per_node):
    paths = list(paths_by_node[i // per_node])
    random.Random(i).shuffle(paths)
    return {str(p).rsplit("/", 2)[-2]: read_result(p) for p in paths}


def total(nodes, key):
    return sum(m.stats().get(key, 0) for m in nodes)


def start_holding(cluster, a, path, **popen):
    """Open path on node a, whose compile waits at the gate holding the lease; returns
    the opener once the compile has started."""
    opener = subprocess.Popen(["cat", str(path)], **popen)
    wait_until(cluster.compiles, a.daemon_log)
    return opener


def holding_and_waiting(cluster, opts=(), readers=4):
    """Node a holds kernel 0's lease, its compile stopped at the gate; node b's readers
    wait on it. Returns a, b, a's opener and b's readers."""
    cluster.gate.write_text("")
    a = cluster.node("a", opts)
    b = cluster.node("b", opts)
    pa = stage_all(cluster, a, [0])[0]
    pb = stage_all(cluster, b, [0])[0]
    opener_a = start_holding(cluster, a, pa, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    waiting = run_parallel_background(pb, readers)
    wait_until(lambda: b.stats()["remote_lease_waits_total"] >= 1, b.daemon_log)
    return a, b, opener_a, waiting


def run_parallel_background(path, n):
    return [subprocess.Popen(["sh", "-c", 'sha256sum "$1" >/dev/null && echo ok $?', "_",
                              str(path)], stdout=subprocess.PIPE, text=True) for _ in range(n)]


def key_opts(tmp_path):
    key = tmp_path / "cluster.key"
    key.write_bytes(os.urandom(32))
    os.chmod(key, 0o600)
    return ["remote_key=%s" % key]


def manifest_key_of_kernel0(cluster, opts):
    """The store key kernel 0's lease stands on: a node holds it at the gate and the store
    names it; then the store is wiped, so that the kernel is nobody's again (later
    compiles pass the gate, which only the first one waits at)."""
    cluster.gate.write_text("")
    a = cluster.node("discover", opts)
    opener = start_holding(cluster, a, stage_all(cluster, a, [0])[0], stdout=subprocess.DEVNULL)
    wait_until(cluster.lease_keys, a.daemon_log)
    key = cluster.lease_keys()[0]
    cluster.gate.unlink()
    opener.wait(timeout=60)
    a.stop()
    cluster.wipe()
    return key


def planted_record_is_ignored(cluster, tmp_path, kind):
    """Someone who can write the store but has not the key plants an unsigned lease or
    failure note on a kernel's key, claiming no expiry (a huge ttl, a Redis key without a
    TTL, a dir: file dated ahead): racing nodes with the key ignore it, and exactly one of
    them compiles at once, far under remote_wait; the others get its object."""
    opts = key_opts(tmp_path) + ["remote_wait=20"]
    key = manifest_key_of_kernel0(cluster, opts)
    cluster.plant(key, "%s %s 2000000000 -" % (kind, os.urandom(16).hex()))
    nodes = [cluster.node("n%d" % i, opts) for i in range(3)]
    paths = [stage_all(cluster, m, [0]) for m in nodes]
    t0 = time.monotonic()
    results = run_parallel(6, read_all_kernels, paths, 2, timeout=120)
    took = time.monotonic() - t0
    print("\nplanted %s: %.1f s to read the kernel on 3 nodes" % (kind, took))
    assert took < 10, "the nodes waited on a planted %s (remote_wait=20)" % kind
    assert len(cluster.compiles()) == 2, cluster.compiles()  # the discovery's and one
    assert all(r == results[0] and next(iter(r.values()))[0] == "ok" for r in results), results
    assert total(nodes, "compiles_total") == 1 and total(nodes, "remote_hits_total") == 2


def dead_holder_is_taken_over_within_seconds(cluster):
    """The lease holder is SIGKILLed mid-compile, with the default remote_lease: the node
    waiting on it learns within seconds that it died (its renewals stop proving that it
    lives) and takes over, not after the lease's 60 s."""
    a, b, opener_a, readers = holding_and_waiting(cluster)
    time.sleep(1.5)  # b has seen a renewal or two
    killed = time.monotonic()
    a.kill()
    while len(cluster.compiles()) < 2 and time.monotonic() < killed + 120:
        time.sleep(0.05)
    took = time.monotonic() - killed
    print("\ntakeover %.1f s after the holder's SIGKILL" % took)
    opener_a.wait(timeout=60)
    results = [r.communicate(timeout=120)[0] for r in readers]
    assert all(r.startswith("ok ") for r in results), results
    assert took < 15, "took over %.1f s after the holder died" % took
    s = b.stats()
    assert s["remote_takeovers_total"] == 1 and s["compiles_total"] == 1, s
    assert len(cluster.compiles()) == 2  # a's (killed) and b's


def live_holder_keeps_its_lease(cluster, hold_s=10):
    """A live holder whose compile lasts several times KC_REMOTE_ALIVE_MS keeps its lease:
    the waiting node takes nothing over and gets the holder's object."""
    a, b, opener_a, readers = holding_and_waiting(cluster, readers=2)
    time.sleep(hold_s)
    assert len(cluster.compiles()) == 1, "b compiled while a's compile ran"
    cluster.gate.unlink()
    assert opener_a.wait(timeout=120) == 0
    results = [r.communicate(timeout=120)[0] for r in readers]
    assert all(r.startswith("ok ") for r in results), results
    s = b.stats()
    assert s["remote_takeovers_total"] == 0 and s["compiles_total"] == 0, s
    assert s["remote_hits_total"] == 1 and len(cluster.compiles()) == 1


OPEN_AT = ('import sys, time\nwith open(sys.argv[1], "rb") as f:\n    f.read()\n'
           'print(time.monotonic())\n')


def open_at(path):
    """A process that reads path and prints the CLOCK_MONOTONIC second its read ended."""
    return subprocess.Popen(["/usr/bin/python3", "-c", OPEN_AT, str(path)],
                            stdout=subprocess.PIPE, text=True)


def lags_behind(cluster, a, b, kernels, hold_s):
    """Node b waits on node a's compile of each kernel of kernels, which ends hold_s(k)
    seconds after b began to wait; returns b's lag behind a per kernel (seconds from a's
    reader's return, once a has stored the kernel, to b's)."""
    claim = Path(str(cluster.gate) + ".claim")
    lags = []
    for n, k in enumerate(kernels):
        if claim.exists():
            claim.rmdir()
        cluster.gate.write_text("")
        pa = stage_all(cluster, a, [k])[0]
        pb = stage_all(cluster, b, [k])[0]
        compiled, waits = len(cluster.compiles()), b.stats()["remote_lease_waits_total"]
        holder = open_at(pa)
        wait_until(lambda: len(cluster.compiles()) > compiled, a.daemon_log, step=0.02)
        waiter = open_at(pb)
        wait_until(lambda: b.stats()["remote_lease_waits_total"] > waits, b.daemon_log,
                   step=0.02)
        time.sleep(hold_s(n))
        cluster.gate.unlink()
        stored = float(holder.communicate(timeout=120)[0])
        served = float(waiter.communicate(timeout=120)[0])
        assert holder.returncode == 0 and waiter.returncode == 0
        lags.append(served - stored)
    return lags


def waiter_lag(cluster, kernels=3, after_s=2.6, bound_s=0.5):
    """Node b waits on node a's compile of each kernel: b's reader gets the kernel within
    bound_s of a's (a's reader returns once a has stored it), told by the store and not on
    a polling grid. Each compile ends after_s after b began to wait: a grid of polls 50 ms
    growing to 1 s would have looked last 0.05 s before and looks next ~0.95 s after.
    Returns the lags (seconds)."""
    a = cluster.node("a")
    b = cluster.node("b")
    lags = lags_behind(cluster, a, b, range(kernels), lambda n: after_s)
    print("\nwaiter's lag behind the holder per kernel: %s s"
          % " ".join("%.3f" % x for x in lags))
    s = b.stats()
    assert s["compiles_total"] == 0 and s["remote_hits_total"] == kernels, s
    assert len(cluster.compiles()) == kernels
    assert max(lags) < bound_s, "the waiter learned of the object late: %s" % lags
    return lags


READY_WAIT = 30  # seconds for a redis-server to answer on a busy machine


class RedisServer:
    """One redis-server in the foreground on a Unix socket (no TCP, no persistence)."""

    def __init__(self, directory, name):
        self.dir = directory
        self.sock = directory / (name + ".sock")
        self.log = directory / (name + ".log")
        self.proc = None

    @property
    def url(self):
        return "redis+unix://%s" % self.sock

    def start(self):
        if self.sock.exists():
            self.sock.unlink()
        self.proc = subprocess.Popen(
            ["redis-server", "--port", "0", "--unixsocket", str(self.sock), "--unixsocketperm",
             "700", "--save", "", "--appendonly", "no", "--daemonize", "no", "--dir",
             str(self.dir), "--logfile", str(self.log), "--enable-debug-command", "local"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def answers():
            try:
                if self.cli("PING", timeout=5) == b"PONG":
                    return True
            except subprocess.TimeoutExpired:
                pass
            assert self.proc.poll() is None, "redis-server exited: " + self.log.read_text()
            return False
        wait_until(answers, "redis-server did not answer", READY_WAIT)
        return self

    def cli(self, *args, timeout=30):
        """redis-cli's raw answer, without its final newline."""
        r = subprocess.run(["redis-cli", "-s", str(self.sock), "--raw"] + list(args),
                           capture_output=True, timeout=timeout)
        return r.stdout[:-1] if r.stdout.endswith(b"\n") else r.stdout

    def keys(self, pattern):
        return [k for k in self.cli("--scan", "--pattern", pattern).split(b"\n") if k]

    def stop(self, sig=signal.SIGKILL):
        if self.proc is not None:
            self.proc.send_signal(sig)
            self.proc.wait()
            self.proc = None


class RedisCluster(Cluster):
    """The Cluster with Redis shards as its store."""

    def __init__(self, tmp_path, template, servers):
        super().__init__(tmp_path, template, "|".join(s.url for s in servers))
        self.servers = servers

    def lease_keys(self):
        return [k.decode()[len("kcachefs:lease:"):] for s in self.servers if s.proc
                for k in s.keys("kcachefs:lease:*")]

    def wipe(self):
        for s in self.servers:
            if s.proc is not None:
                assert s.cli("FLUSHALL") == b"OK"

    def plant(self, key, record):
        """SET the lease key with record and no TTL, on every shard (so on key's)."""
        for s in self.servers:
            assert s.cli("SET", "kcachefs:lease:" + key, record) == b"OK"

    def objects(self, kind):
        """Names of the stored objects of kind (b"cubin" or b"index", not the lists
        record), on every live shard."""
        out = []
        for s in self.servers:
            if s.proc is None:
                continue
            for k in s.keys("kcachefs:obj:*"):
                if k.endswith(LISTS_KEY.encode() if isinstance(k, bytes) else LISTS_KEY):
                    continue
                if s.cli("GETRANGE", k, "19", str(19 + len(kind)))[:len(kind) + 1] == kind + b" ":
                    out.append(k)
        return out

    def record(self):
        """The lists record's bytes (from the first live shard that has it), or None."""
        for s in self.servers:
            if s.proc is not None:
                got = s.cli("GET", "kcachefs:obj:" + LISTS_KEY)
                if got:
                    return got
        return None


class FakeRedis:
    """A Unix socket where a Redis server should be, which accepts connections and then
    either never answers (hang) or answers every command with bytes that are no reply of
    the command (garbage: a reply of the wrong type, a malformed one, an absurd array, a
    half reply and a close). Runs in a thread until stop()."""

    GARBAGE = [b"+OK\r\n", b"*2000000000\r\n", b"$5\r\nab", b":1\r\n:2\r\n", b"%%garbage\r\n",
               b"$-7\r\n", b"-ERR unknown\r\n"]

    def __init__(self, directory, how):
        import socket
        self.how = how
        self.sock = directory / ("fake-%s.sock" % how)
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(str(self.sock))
        self.srv.listen(64)
        self.srv.settimeout(0.2)
        self.conns = []
        self.accepted = 0
        self.stopping = False
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    @property
    def url(self):
        return "redis+unix://%s" % self.sock

    def serve(self):
        import select
        n = 0
        while not self.stopping:
            try:
                c, _ = self.srv.accept()
                self.conns.append(c)
                self.accepted += 1
            except OSError:
                pass
            live = [c for c in self.conns if c.fileno() >= 0]
            if not live:
                continue
            ready, _, _ = select.select(live, [], [], 0)
            for c in ready:
                try:
                    data = c.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    c.close()
                    continue
                if self.how == "garbage":
                    n += 1
                    try:
                        c.sendall(self.GARBAGE[n % len(self.GARBAGE)])
                        if n % 3 == 0:
                            c.close()
                    except OSError:
                        c.close()

    def stop(self):
        self.stopping = True
        self.thread.join()
        for c in self.conns:
            c.close()
        self.srv.close()
        self.sock.unlink()


def compiles_each_kernel_once(cluster):
    """4 nodes x 8 processes read every kernel, cold together: each kernel compiled once in
    the cluster, the others' reads hits, the same bytes everywhere; a node mounted later
    compiles nothing."""
    nodes = [cluster.node("node%d" % i) for i in range(4)]
    assert "without remote_key" in nodes[0].daemon_log()
    paths = [stage_all(cluster, m) for m in nodes]
    results = run_parallel(32, read_all_kernels, paths, 8, timeout=600)
    assert len(cluster.compiles()) == KERNELS, cluster.compiles()
    assert len(set(cluster.compiles())) == KERNELS
    for entry in results[0]:
        seen = {r[entry] for r in results}
        assert len(seen) == 1 and next(iter(seen))[0] == "ok", (entry, seen)
    assert total(nodes, "compiles_total") == KERNELS
    assert total(nodes, "remote_hits_total") == 3 * KERNELS
    assert total(nodes, "remote_misses_total") == KERNELS
    # a cubin and an index each, the one header list every kernel's compile read, and the
    # record that names it for nodes that start later
    assert total(nodes, "remote_puts_total") == 2 * KERNELS + 2
    assert total(nodes, "remote_rejected_total") == 0
    assert total(nodes, "remote_get_errors_total") == 0
    assert all(m.stats()["remote_up"] == 1 for m in nodes)
    # the stats for people show the store's group, with this node's hits under it
    text = (nodes[1].mnt / ".kcachefs" / "stats").read_text()
    group = text[text.index("\ncluster store:\n"):]
    assert "\n  up                 1\n" in group, text
    assert "\n  hits               %d\n" % nodes[1].stats()["remote_hits_total"] in group, text
    assert len(cluster.objects(b"cubin")) == KERNELS
    assert len(cluster.objects(b"index")) == KERNELS + 1
    assert cluster.record() is not None and b" @headers\n" in cluster.record()
    # a hit's kernel.log says where it came from
    logs = [(p.parent / "kernel.log").read_text() for m in nodes for p in stage_all(cluster, m)]
    assert sum("from the cluster store" in l for l in logs) == 3 * KERNELS

    late = cluster.node("late")
    late_paths = stage_all(cluster, late)
    for p in late_paths:
        r = read_result(p)
        assert r == results[0][str(p).rsplit("/", 2)[-2]]
    assert len(cluster.compiles()) == KERNELS, "a node mounted later compiled"
    assert late.stats()["remote_hits_total"] == KERNELS
    # each lookup waited for its fetch and was answered with the fetched cubin (one inode,
    # as on a warm node), not with a pending inode; the first fetch (the index, the header
    # list, the first hash of this node's headers) may outlast a parked lookup's 0.2 s on a
    # loaded machine, and a store over sshfs
    assert KERNELS - 1 <= late.stats()["remote_lookups_total"] <= KERNELS, late.stats()
