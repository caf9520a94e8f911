"""The cluster store's benchmarks, run by scripts/bench.py (--only cluster,cluster64):
simulated nodes (daemons with backing directories and mountpoints of their own) sharing one
store, a dir: store in the run's temp directory or a redis-server the run starts on a Unix
socket there. The nodes, the counting compilers and the Redis server are the mount tests' library's
(tests/mount/kccluster.py's Cluster and RedisServer, which import no test module and no
pytest); every node and server is stopped on every way out.

cluster    4 nodes x 8 processes x 32 real nvcc kernels (the sample kernels, one symbol
           each), cold together: compiles in the cluster, the first node's cold time against
           one node alone with no store, then a node joining: its cold start against the
           first node's and against its own warm restart.
keys       K real nvcc kernels (32 and 128) staged as the nvcc shim stages them,
           each including an include tree of 500 headers: one node compiles them; 5
           joining nodes in turn, each with the same tree at another prefix (other mtimes),
           start cold with 8 processes: their times against their own warm restarts
           (medians over the 5), and the bytes each fetched per kernel against the cubin's.
           Every node of a run lives on a fresh journalled ext4 of its own (node_disk).
cluster64  64 nodes x 2 processes x K kernels of the tests' fast fake compiler, cold
           together: compiles, store operations and bytes per node per kernel from the
           daemons' counters (and, on Redis, the server's own command counts), lease waits;
           redis-benchmark GET/SET of cubin-sized values on the same server.
"""
import contextlib
import hashlib
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from kccluster import LISTS_KEY, Cluster, RedisServer, lags_behind, read_all_kernels, stage_all
from kcmount import KERNELS, NVCC, Mount, elf_symbols, run_parallel, write_script

UIDS = 0x7F000000  # cluster64's compile uid ranges: UIDS + node x 256
SAMPLES = ("saxpy", "vector_add")  # the cheap sample kernels (block_sum takes seconds)
COUNTERS = ("remote_hits_total", "remote_misses_total", "remote_puts_total",
            "remote_bytes_in_total", "remote_bytes_out_total", "remote_lease_waits_total",
            "remote_takeovers_total", "remote_hedged_total", "remote_rejected_total",
            "remote_get_errors_total", "remote_put_errors_total", "remote_lease_errors_total")


def load():
    return "load %.2f %.2f %.2f" % os.getloadavg()


def real_kernels(n):
    """n distinct real kernels: the sample kernels with the symbol renamed per variant."""
    out = []
    for k in range(n):
        name = SAMPLES[k % len(SAMPLES)]
        src = (KERNELS / (name + ".cu")).read_text().replace(
            "void %s(" % name, "void %s_%d(" % (name, k))
        out.append(("%s_%d" % (name, k), src.encode(), (KERNELS / (name + ".flags")).read_bytes()))
    return out


class Store:
    """The shared store of one run: dir:<tmp>/store, or a redis-server started here."""

    def __init__(self, kind, tmp):
        self.kind, self.server = kind, None
        if kind == "redis":
            d = Path(tmp) / "redis"
            d.mkdir(exist_ok=True)
            self.server = RedisServer(d, "r").start()
            self.url = self.server.url
        else:
            self.url = None  # the Cluster's own dir: store

    def commands(self):
        """{command: calls} from the server's INFO commandstats (Redis only)."""
        if self.server is None:
            return {}
        out = {}
        for m in re.finditer(rb"cmdstat_(\w+):calls=(\d+)", self.server.cli("INFO", "commandstats")):
            out[m.group(1).decode()] = int(m.group(2))
        return out

    def stop(self):
        if self.server is not None:
            self.server.stop()


def counting_nvcc(cluster):
    """Real nvcc behind a wrapper that logs each compile (not a dependency pass, whose output is
    pass.cubin) in the
    cluster's compile log."""
    return write_script(cluster.tmp / "nvcc-counting",
                        'case " $* " in *"/pass.cubin "*) ;; *-cubin*) sha256sum "$1" | cut -c1-64 >> %s;; esac\n'
                        'exec %s "$@"\n' % (cluster.log, NVCC))


def timed_reads(i, paths, per_node):
    t0 = time.monotonic()
    r = read_all_kernels(i, paths, per_node)
    return t0, time.monotonic(), r


def cold_together(nodes_paths, per_node):
    """per_node processes on each node read all its kernels, released together; returns the
    wall seconds of each node (its first start to its last finish) after checking that every
    process of every node read the same complete bytes."""
    results = run_parallel(per_node * len(nodes_paths), timed_reads, nodes_paths, per_node,
                           timeout=3600)
    for r in results:
        if r[0] == "exception":
            raise RuntimeError("a reader failed: %s" % r[1])
    for entry in results[0][2]:
        seen = {r[2][entry] for r in results}
        if len(seen) != 1 or next(iter(seen))[0] != "ok":
            raise RuntimeError("%s: processes read %s" % (entry, seen))
    walls = []
    for n in range(len(nodes_paths)):
        mine = results[n * per_node:(n + 1) * per_node]
        walls.append(max(r[1] for r in mine) - min(r[0] for r in mine))
    return walls


def stage_real(m, kernels):
    return [m.stage(name, src, flags) / "kernel.cubin" for name, src, flags in kernels]


def check_cubins(paths, kernels):
    for p, (name, _, _) in zip(paths, kernels):
        data = p.read_bytes()
        if name not in elf_symbols(data):
            raise RuntimeError("%s: no symbol %s in the cubin" % (p, name))


def cluster_once(tmp, rep, kind, kernels, jobs, nodes=4, per_node=8):
    """One cold cluster run and one joining node; returns (compiles, first, join, warm)."""
    root = Path(tmp) / ("cluster-%s-%d" % (kind, rep))
    root.mkdir()
    store = Store(kind, root)
    cluster = None
    try:
        cluster = Cluster(root, Path("/dev/null"), store.url)
        cluster.fake = counting_nvcc(cluster)
        opts = ["jobs=%d" % jobs]
        members = [cluster.node("node%d" % i, opts) for i in range(nodes)]
        paths = [stage_real(m, kernels) for m in members]
        walls = cold_together(paths, per_node)
        check_cubins(paths[0], kernels)
        compiles = len(cluster.compiles())
        if len(set(cluster.compiles())) != compiles:
            raise RuntimeError("a kernel was compiled twice in the cluster")
        hits = sum(m.stats()["remote_hits_total"] for m in members)
        print("  %s rep %d: %d compiles, %d remote hits, node walls %s s; %s" % (
            kind, rep, compiles, hits, " ".join("%.1f" % w for w in walls), load()), flush=True)
        late = cluster.node("join", opts)
        join = cold_together([stage_real(late, kernels)], per_node)[0]
        s = late.stats()
        if s["compiles_total"] or s["remote_hits_total"] != len(kernels):
            raise RuntimeError("the joining node compiled %d, hit %d" % (
                s["compiles_total"], s["remote_hits_total"]))
        fetch_ms = s["remote_fetch_microseconds_total"] / max(1, s["remote_fetches_total"]) / 1e3
        late.stop()
        late.start()
        warm = cold_together([stage_real(late, kernels)], per_node)[0]
        if late.stats()["remote_hits_total"] or len(cluster.compiles()) != compiles:
            raise RuntimeError("the warm restart went to the store or compiled")
        print("  %s rep %d: joining node cold %.2f s (a fetch %.1f ms on average), warm restart "
              "%.2f s; %s" % (kind, rep, join, fetch_ms, warm, load()), flush=True)
        return compiles, walls[0], join, warm
    finally:
        if cluster is not None:
            cluster.stop()
        store.stop()


def alone_once(tmp, rep, kernels, jobs, per_node=8):
    """One node with no store, cold: its wall seconds (the baseline of the first node)."""
    root = Path(tmp) / ("alone-%d" % rep)
    root.mkdir()
    log = root / "compiles"
    log.write_text("")
    os.chmod(log, 0o666)
    nvcc = write_script(root / "nvcc-counting",
                        'case "$*" in *-cubin*) echo x >> %s;; esac\nexec %s "$@"\n' % (log, NVCC))
    m = Mount(root, ["jobs=%d" % jobs, "nvcc=%s" % nvcc]).start()
    try:
        wall = cold_together([stage_real(m, kernels)], per_node)[0]
        n = len(log.read_text().split())
        if n != len(kernels):
            raise RuntimeError("one node alone compiled %d of %d kernels" % (n, len(kernels)))
        print("  alone rep %d: %.1f s; %s" % (rep, wall, load()), flush=True)
        return wall
    finally:
        m.stop()


def bench_cluster(tmp, reps, kernels, stores, row):
    jobs = os.cpu_count() or 1
    ks = real_kernels(kernels)
    print("cluster: 4 nodes x 8 processes x %d real kernels, jobs=%d per node, stores %s; %s" % (
        kernels, jobs, ",".join(stores), load()), flush=True)
    alone = [alone_once(tmp, rep, ks, jobs) for rep in range(reps)]
    for kind in stores:
        runs = [cluster_once(tmp, rep, kind, ks, jobs) for rep in range(reps)]
        compiles, first, join, warm = ([r[i] for r in runs] for i in range(4))
        row("%s: compiles in the cluster (4x8x%d)" % (kind, kernels), compiles, [kernels],
            "compiles", "= %d (1.00x)" % kernels)
        row("%s: first node cold / one node alone" % kind, first, alone, "s",
            "(CPUs shared by the nodes)")
        row("%s: joining node cold / first node cold" % kind, join, first, "s", "(small)")
        row("%s: joining node cold / its warm restart" % kind, join, warm, "s", "<= 1.5x")


def per_kernel(x, n):
    return "%.3g" % (x / n)


def cluster64_once(tmp, kind, nodes, per_node, kernels):
    """One cold run of nodes x per_node processes x kernels; returns the table's lines."""
    root = Path(tmp) / ("cluster64-%s" % kind)
    root.mkdir()
    store = Store(kind, root)
    cluster = None
    try:
        template = root / "template.cubin"
        src = root / "t.cu"
        src.write_text('extern "C" __global__ void t(float *x) { x[0] = 1; }\n')
        subprocess.run([str(NVCC), str(src), "-cubin", "-o", str(template), "-arch=sm_90a"],
                       check=True, capture_output=True)
        os.chmod(root, 0o755)
        os.chmod(template, 0o644)
        cluster = Cluster(root, template, store.url)
        t0 = time.monotonic()
        # uid ranges of their own, below the 64 default ones (which other daemons hold)
        members = [cluster.node("n%02d" % i, ["jobs=2", "compile_uids=%d" % (UIDS + i * 256)])
                   for i in range(nodes)]
        up = time.monotonic() - t0
        paths = [stage_all(cluster, m, range(kernels)) for m in members]
        before = store.commands()
        t0 = time.monotonic()
        walls = cold_together(paths, per_node)
        wall = time.monotonic() - t0
        after = store.commands()
        compiles = len(cluster.compiles())
        if len(set(cluster.compiles())) != compiles:
            raise RuntimeError("a kernel was compiled twice in the cluster")
        sums = {k: sum(m.stats().get(k, 0) for m in members) for k in COUNTERS}
        nk = nodes * kernels
        cubin = template.stat().st_size
        print("  %s: %d nodes up in %.1f s; cold run %.1f s (slowest node %.1f s), %d compiles; %s"
              % (kind, nodes, up, wall, max(walls), compiles, load()), flush=True)
        lines = [("compiles in the cluster (= K = %d)" % kernels, "%d" % compiles, "")]
        for k in COUNTERS:
            lines.append((k, "%d" % sums[k], per_kernel(sums[k], nk)))
        calls = {c: after.get(c, 0) - before.get(c, 0) for c in after}
        for c in sorted(calls, key=lambda c: -calls[c]):
            if calls[c] and c not in ("info", "ping"):
                lines.append(("redis %s calls" % c.upper(), "%d" % calls[c], per_kernel(calls[c], nk)))
        if calls:
            tot = sum(v for c, v in calls.items() if c not in ("info", "ping"))
            lines.append(("redis calls, all", "%d" % tot, per_kernel(tot, nk)))
        lines.append(("cubin size (fake compiler's)", "%d B" % cubin, ""))
        if store.server is not None:
            lines += redis_benchmark(store.server)
        return lines
    finally:
        if cluster is not None:
            cluster.stop()
        store.stop()


def redis_benchmark(server):
    """GET/SET throughput of cubin-sized values on this server (redis-benchmark, 8 clients)."""
    out = []
    for size, n in ((16384, 20000), (262144, 4000), (1048576, 1000)):
        r = subprocess.run(["redis-benchmark", "-s", str(server.sock), "-t", "set,get", "-d",
                            str(size), "-n", str(n), "-c", "8", "-q"],
                           capture_output=True, text=True, timeout=600)
        for m in re.finditer(r"(SET|GET): ([\d.]+) requests per second", r.stdout):
            rps = float(m.group(2))
            out.append(("redis-benchmark %s %d KiB (8 clients)" % (m.group(1), size // 1024),
                        "%.0f req/s" % rps, "%.0f MB/s" % (rps * size / 1e6)))
    server.cli("FLUSHALL")
    return out


def bench_cluster64(tmp, kernels, stores, nodes=64, per_node=2):
    print("cluster64: %d nodes x %d processes x %d kernels, fake compiler, stores %s; %s" % (
        nodes, per_node, kernels, ",".join(stores), load()), flush=True)
    table = []
    for kind in stores:
        lines = cluster64_once(tmp, kind, nodes, per_node, kernels)
        table.append("\n%s store, %d nodes x %d processes x %d kernels (%s)" % (
            kind, nodes, per_node, kernels, load()))
        table.append("| figure | cluster total | per node per kernel |")
        table.append("|---|---|---|")
        table += ["| %s |" % " | ".join(l) for l in lines]
    return table


def bench_lag(tmp, kernels, stores, row):
    """lag: 2 nodes; node b waits on node a's compile of each of K kernels (the tests' fake
    compiler, held for 0.3 to 3 s after b began to wait, so that the holds fall at every
    phase of a polling grid): b's lag behind a per kernel, against one fetch of the same
    kernels by a third node, cold, from the same store in the same run."""
    print("lag: a waiting node behind the compiling node, %d kernels, stores %s; %s" % (
        kernels, ",".join(stores), load()), flush=True)
    for kind in stores:
        root = Path(tmp) / ("lag-%s" % kind)
        root.mkdir()
        os.chmod(root, 0o1777)  # as the tests' tmp_path: the fake's gate is claimed by uids
        template = root / "t.cubin"
        (root / "t.cu").write_text('extern "C" __global__ void t(float *x) { x[0] = 1; }\n')
        subprocess.run([str(NVCC), str(root / "t.cu"), "-cubin", "-o", str(template),
                        "-arch=sm_90a"], check=True, capture_output=True)
        os.chmod(template, 0o644)
        store = Store(kind, root)
        cluster = Cluster(root, template, store.url)
        try:
            a, b, c = cluster.node("a"), cluster.node("b"), cluster.node("c")
            lags = lags_behind(cluster, a, b, range(kernels),
                               lambda n: 0.3 + (n * 0.618 % 1) * 2.7)
            fetches = []
            for p in stage_all(cluster, c, range(kernels)):
                t0 = time.monotonic()
                p.read_bytes()
                fetches.append(time.monotonic() - t0)
            if c.stats()["remote_hits_total"] != kernels or b.stats()["compiles_total"]:
                raise RuntimeError("lag: the kernels were not all shared: %s %s"
                                   % (b.stats(), c.stats()))
        finally:
            cluster.stop()
            store.stop()
        row("%s: waiter's lag / one fetch" % kind, lags, fetches, "s",
            "<= 0.1 s + one fetch (%s s)" % ("%.3g" % (0.1 + statistics.median(fetches))))


KEYS_HEADERS = 500  # the include tree of the keys figure, about DeepGEMM's 587


def header_tree(inc):
    """An include tree of KEYS_HEADERS headers under inc, all read by kc_tree/all.cuh,
    readable by all (compiles run as uids of their own)."""
    (inc / "kc_tree").mkdir(parents=True)
    for i in range(KEYS_HEADERS - 1):
        (inc / "kc_tree" / ("h%03d.cuh" % i)).write_text(
            "#pragma once\n// header %d of a DeepGEMM-sized tree\n"
            "__device__ __forceinline__ float kc_h%d(float x) { return x + %d.0f; }\n" % (i, i, i))
    (inc / "kc_tree" / "all.cuh").write_text("#pragma once\n" + "".join(
        "#include <kc_tree/h%03d.cuh>\n" % i for i in range(KEYS_HEADERS - 1)))
    for p in [inc.parent] + list(inc.parent.rglob("*")):
        os.chmod(p, 0o755 if p.is_dir() else 0o644)


def tree_digest(inc):
    """src/entry/tree.h's digest of the tree under inc (the shim's # include-root line)."""
    def field(b):
        return b"%d\n" % len(b) + b + b"\n"
    h = hashlib.sha256(b"kcachefs-tree-v1\n")
    for f in sorted((str(p)[len(str(inc)):] for p in inc.rglob("*") if p.is_file())):
        h.update(field(f.encode()))
        h.update(field(hashlib.sha256((inc / f.lstrip("/")).read_bytes()).hexdigest().encode()))
    return h.hexdigest()


def keys_kernels(n, inc):
    """n kernels that read the whole tree, staged with the shim's kernel.flags for inc."""
    flags = ("# include-root %s %s\n--kcachefs-compiler=nvcc\n-O3\n-I%s\n-arch=sm_90a\n" % (
        tree_digest(inc), inc, inc)).encode()
    return [("keys_%d" % k, ("#include <kc_tree/all.cuh>\n"
                             "extern \"C\" __global__ void keys_%d(float *x) "
                             "{ x[threadIdx.x] = kc_h%d(x[threadIdx.x]) * %d.0f; }\n" % (
                                 k, k % (KEYS_HEADERS - 1), k)).encode(), flags)
            for k in range(n)]


@contextlib.contextmanager
def node_disk(tmp, size="4G"):
    """A fresh ext4 filesystem with a journal (mkfs.ext4's default, as on a GPU node's local
    disk), mounted through a loop device under tmp; yields its directory, or None where it
    cannot be made (not root, no loop device, no mkfs.ext4). The nodes of the keys figure
    live on it, not on the machine's own /tmp: this build machine's root is an ext4 without
    a journal, where a new inode's allocation passes over every inode freed in the minutes
    before (ext4's recently_deleted), so a join's file creations cost what the runs before
    it happened to delete (the same build measured 1.6x and then 3.9x, minutes apart).
    Unmounted, and its loop device released (mount's autoclear), on every way out."""
    image, mnt = Path(tmp) / "node-disk.img", Path(tmp) / "node-disk"
    mounted = False
    try:
        mnt.mkdir()
        with open(image, "wb") as f:
            f.truncate(int(size.rstrip("G")) << 30)
        made = os.geteuid() == 0 and subprocess.run(
            ["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0",
             str(image)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0
        mounted = made and subprocess.run(["mount", "-o", "loop", str(image), str(mnt)],
                                          stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL).returncode == 0
        if mounted:
            mnt.chmod(0o755)
        yield mnt if mounted else None
    finally:
        if mounted:
            for _ in range(50):  # a node's daemon may still let go of a file
                if subprocess.run(["umount", str(mnt)], stderr=subprocess.DEVNULL).returncode == 0:
                    break
                time.sleep(0.1)
            else:
                subprocess.run(["umount", "-l", str(mnt)])
        image.unlink(missing_ok=True)
        if mnt.exists():
            mnt.rmdir()


def keys_once(tmp, kind, n, jobs, joins=5, per_node=8):
    """One compiling node, then joins joining nodes in turn (each a node of its own, cold)
    whose tree lies at another prefix, each restarted once; returns a list of (join s, warm
    s, bytes fetched per kernel, cubin bytes per kernel), one per joining node."""
    root = Path(tempfile.mkdtemp(prefix="keys-%s-%d-" % (kind, n), dir=tmp))  # one per rep
    root.chmod(0o755)  # the compile users run the counting nvcc in it (compile_uids)
    store = Store(kind, root)
    cluster = None
    try:
        cluster = Cluster(root, Path("/dev/null"), store.url)
        cluster.fake = counting_nvcc(cluster)
        ia, ib = root / "opt-a" / "include", root / "home-b" / "venv" / "include"
        header_tree(ia)
        shutil.copytree(ia.parent, ib.parent)  # the same bytes, other mtimes
        for p in [ib.parent.parent] + list(ib.parent.rglob("*")):
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        first = cluster.node("first", ["jobs=%d" % jobs])
        ka, kb = keys_kernels(n, ia), keys_kernels(n, ib)
        cold_together([stage_real(first, ka)], per_node)
        deadline = time.monotonic() + 600
        while first.daemon_log().count(" stored (") < n:
            if time.monotonic() > deadline:
                raise RuntimeError("the first node did not store its kernels")
            time.sleep(0.1)
        index = max(p.stat().st_size for p in (root / "store" / "objects").glob("*/*")
                    if p.read_bytes()[19:25] == b"index " and b" @headers\n" in p.read_bytes()
                    and p.name != LISTS_KEY) \
            if cluster.store else 0
        out = []
        for j in range(joins):
            late = cluster.node("join%d" % j, ["jobs=%d" % jobs])
            paths = stage_real(late, kb)
            join = cold_together([paths], per_node)[0]
            check_cubins(paths, kb)
            s = late.stats()
            if s["compiles_total"] or s["remote_hits_total"] != n or len(cluster.compiles()) != n:
                raise RuntimeError("the joining node compiled %d, hit %d" % (
                    s["compiles_total"], s["remote_hits_total"]))
            cubin = sum(p.stat().st_size for p in paths) / n
            fetched = s["remote_bytes_in_total"] / n
            late.stop()
            late.start()
            warm = cold_together([stage_real(late, kb)], per_node)[0]
            if late.stats()["remote_hits_total"] or len(cluster.compiles()) != n:
                raise RuntimeError("the warm restart went to the store or compiled")
            late.stop()
            print("  keys %s %d, joining node %d: cold %.3f s, warm restart %.3f s, %.0f B "
                  "fetched per kernel for %.0f B of cubin, largest index %d B; %s" % (
                      kind, n, j, join, warm, fetched, cubin, index, load()), flush=True)
            out.append((join, warm, fetched, cubin))
        return out
    finally:
        if cluster is not None:
            cluster.stop()
        store.stop()


def bench_keys(tmp, reps, counts, stores, row):
    jobs = os.cpu_count() or 1
    print("keys: %d-header include tree at another prefix on the joining node, kernels %s, "
          "stores %s; %s" % (KEYS_HEADERS, counts, ",".join(stores), load()), flush=True)
    for kind in stores:
        for n in counts:
            runs = []
            for _ in range(reps):
                with node_disk(tmp) as disk:
                    print("  keys %s %d: nodes on %s" % (
                        kind, n, "a fresh ext4 with a journal (loop device)" if disk else
                        "%s (no loop device: figures depend on what was freed before)" % tmp),
                          flush=True)
                    runs += keys_once(disk or tmp, kind, n, jobs)
            row("%s: %d kernels, tree elsewhere: joining node cold / its warm restart" % (
                kind, n), [r[0] for r in runs], [r[1] for r in runs], "s", "<= 1.5x")
            row("%s: %d kernels: bytes fetched per kernel / cubin bytes" % (kind, n),
                [r[2] for r in runs], [r[3] for r in runs], "B", "<= 1.2x")
