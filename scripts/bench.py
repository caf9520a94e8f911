#!/usr/bin/env python3
"""kcachefs benchmarks: every figure side by side with its baseline, measured in
the same run, reported as medians, spreads and ratios. No figure is a pass/fail test; the
targets are printed beside them for a reader to judge.

usage: scripts/bench.sh [--reps N] [--only NAME,...] [--kernels K] [--quick]

Figures (NAME):
  read      open + fstat + read all + close of a published 1 MiB and 16 KiB cubin, through
            the mount and straight from the backing directory, page cache warm
  meta      stat of a published cubin; readdir of a directory of 10,000 entries
  cold      P=8 processes x K real kernels on a cold mount (native protocol; each process
            starts at its own K/P-th of the kernels, and again all in one order), against
            compiling the same K kernels once with the same jobs limit and no FUSE, and
            against every process compiling every kernel itself
  ahead     P=8 processes ask K=16 real kernels (CUB's headers and an include root of
            their own, through the nvcc shim) one at a time, each source's first line a
            comment naming its headers' hash as DeepGEMM's are, after the include root's
            bytes changed (a new image): a mount whose history holds the old image's
            kernels (compiled ahead) against a mount with none (-o ahead=0); the compile
            counts of each
  starve    stat latency (median, p99) of unrelated files while 64 openers wait on one slow
            compile and 8 other compiles run, through the mount and on the backing directory
  scale     a backing store of N published entries (--entries, default 100,000): start-up
            to a usable mount against an empty store, resident memory after opening and
            reading every cubin once, and the inode table (its sampled peak, kept under
            max_inodes by asking the kernel to forget, and after the kernel drops its caches)
  backend   compile seconds of nvcc against the NVRTC backend (build/kcachefs-nvrtc) on the
            sample kernels, the header-heavy CUB one among them; both cubins must expose
            the same kernel symbol
  nvrtcwarm N different kernels of one include set (block_sum's CUB headers, and the
            template-heavy tile_sort), compiled in turn through three mounts: NVRTC in a warm
            worker (the default for NVRTC), NVRTC in a process per compile (nvrtc_idle=0),
            and nvcc; open to last byte read of each cubin, the median of kernels 2..N
            (--kernels, at most 8), whose headers the warm worker has precompiled; also
            their CPU seconds (the worker's own; nvcc's and its tools', reaped by the daemon)
  store     a compile through a mount with a cluster store (dir:) against the same compile
            through a mount without one: real nvcc on CUB's block_sum (tests/kernels), open
            to last byte read on a cold mount, paired runs (order alternating), ratio of
            medians; each store run waits for its object before the next run
  ref       the same warm read through libfuse's own passthrough_ll example (cache=always),
            built from /usr/share/doc/libfuse3-dev/examples when present: what one FUSE
            round trip per open costs on this machine
  cluster   4 simulated nodes x 8 processes x K real kernels sharing a cluster store
            (--stores dir,redis): compiles, first node against one node alone, a joining
            node against the first and against its warm restart (scripts/bench_cluster.py)
  keys      5 joining nodes in turn (a round; --reps 7 per round, so --reps 21
            runs 3 rounds, medians over 15), each with a 500-header include tree at
            another prefix, 32 and 128 kernels staged as the nvcc shim stages them: their
            cold starts against their warm restarts (medians), bytes fetched per kernel
            against the cubin; the nodes on a fresh journalled ext4 of the run's own (a loop
            device, as root) (not in the default list: --only keys; scripts/bench_cluster.py)
  lag       2 simulated nodes sharing a store (--stores dir,redis): the waiting node's lag
            behind the compiling node per kernel (K kernels of a fake compiler), against one
            fetch of the same kernels by a third node in the same run (not in the default
            list: --only lag)
  triton    8 processes x 4 kernels through the calls of Triton's compile() (the test
            harness's stand-in of triton.runtime.cache): kcachefs_triton's managed cold on a
            mount against plain Triton cold on local disk, with real nvcc compiles and with a
            fixed-time compile that uses no core (as with a core per process), the latter
            also against plain Triton cold on a mount: the manager's own cost
            (scripts/bench_triton.py; --triton-compile-s)
  cluster64 64 simulated nodes x 2 processes x --kernels64 kernels of a fake compiler:
            compiles, store operations and bytes per node per kernel, lease waits
            (not in the default list: --only cluster,cluster64)
Each timed loop runs in build/bench_io (C), so that Python's own cost is not in the ratios.
The mounts are the built daemon on temp directories, always unmounted.
"""
import argparse
import hashlib
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "mount"))
from kcmount import (NVCC, Mount, elf_symbols, entry_name, open_to_compiles, run_parallel,  # noqa: E402
                     write_script)
import bench_cluster  # noqa: E402
import bench_triton  # noqa: E402

BENCH_IO = REPO / "build" / "bench_io"
PAD_KERNEL = """__device__ char kc_pad[%d] = {1};
extern "C" __global__ void padded(char *out) { out[threadIdx.x] = kc_pad[threadIdx.x * 7]; }
"""
COLD_KERNEL = """// cold-start kernel %d
extern "C" __global__ void cold_%d(const float *a, float *out, int n)
{
	int i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i < n)
		out[i] = a[i] * %d.0f + 1.0f;
}
"""
ROWS = []


def io(mode, path, n):
    out = subprocess.run([str(BENCH_IO), mode, str(path), str(n)], check=True,
                         capture_output=True, text=True).stdout.split()
    return [float(x) for x in out[2:]]


def num(x):
    return "%.0f" % x if x >= 100 else "%.3g" % x


def spread(xs):
    return "%s-%s" % (num(min(xs)), num(max(xs)))


def row(figure, mount, base, unit, target, lower_is_better=True):
    """One line of the table: medians, spreads, ratio mount/base."""
    m, b = statistics.median(mount), statistics.median(base)
    ratio = m / b if b else float("inf")
    ROWS.append((figure, "%s %s (%s)" % (num(m), unit, spread(mount)),
                 "%s %s (%s)" % (num(b), unit, spread(base)), "%.2fx" % ratio, target))
    print("  %-34s mount %s  baseline %s  ratio %.2fx  target %s" % (
        figure, ROWS[-1][1], ROWS[-1][2], ratio, target), flush=True)


def compile_to(src_text, out, arch="sm_90a"):
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.cu"
        src.write_text(src_text)
        subprocess.run([str(NVCC), str(src), "-cubin", "-o", str(out), "-arch=" + arch],
                       check=True, capture_output=True)


def publish_padded(m, tmp, name, size):
    """A client publishes a cubin with size bytes of initialised data into a new entry of
    mount m; returns (entry path, cubin bytes)."""
    cubin = Path(tmp) / ("%s.cubin" % name)
    compile_to(PAD_KERNEL % size, cubin)
    data = cubin.read_bytes()
    entry = m.mnt / "cache" / entry_name(name, data)
    entry.mkdir(parents=True)
    (entry / "kernel.cubin").write_bytes(data)
    return entry, data


def fresh_mount(tmp, name, options=()):
    root = Path(tmp) / name
    root.mkdir()
    return Mount(root, options).start()


def bench_read(tmp, reps):
    print("read: open + fstat + read all + close, page cache warm", flush=True)
    m = fresh_mount(tmp, "read")
    try:
        for size, label, n, target in ((1 << 20, "1 MiB", 2000, "<= 1.25x"),
                                       (12000, "16 KiB", 20000, "<= 2.0x")):
            entry, data = publish_padded(m, tmp, "padded%d" % size, size)
            through = entry / "kernel.cubin"
            direct = m.backing / through.relative_to(m.mnt)
            io("read", through, 10)
            io("read", direct, 10)
            mount, base = [], []
            for _ in range(reps):
                mount.append(io("read", through, n)[0] / 1000)
                base.append(io("read", direct, n)[0] / 1000)
            row("warm read %s (%d bytes)" % (label, len(data)), mount, base, "us", target)
    finally:
        m.stop()


def bench_meta(tmp, reps):
    print("meta: stat of a published cubin, readdir of 10,000 entries", flush=True)
    root = Path(tmp) / "meta"
    root.mkdir()
    m = Mount(root)
    big = m.backing / "big"
    big.mkdir()
    for i in range(10000):
        (big / ("kernel.k%d.%s" % (i, "%032x" % i))).mkdir()
    m.start()
    try:
        entry, _ = publish_padded(m, tmp, "meta", 4096)
        through, direct = entry / "kernel.cubin", m.backing / entry.relative_to(m.mnt) / "kernel.cubin"
        io("stat", through, 10)
        mount, base = [], []
        for _ in range(reps):
            mount.append(io("stat", through, 50000)[0])
            base.append(io("stat", direct, 50000)[0])
        row("stat of a published cubin", mount, base, "ns", "<= 2.0x")
        io("readdir", m.mnt / "big", 2)
        mount, base = [], []
        for _ in range(reps):
            mount.append(io("readdir", m.mnt / "big", 20)[0] / 1000)
            base.append(io("readdir", big, 20)[0] / 1000)
        row("readdir of 10,000 entries", mount, base, "us", "<= 2.0x")
    finally:
        m.stop()


def bench_cold(tmp, reps, kernels, procs=8):
    jobs = os.cpu_count() or 1
    print("cold: P=%d processes x K=%d kernels, jobs=%d" % (procs, kernels, jobs), flush=True)
    sources = [(COLD_KERNEL % (k, k, k + 2)).encode() for k in range(kernels)]
    flags = b"-O3\n"

    def via_mount(rep, stagger=True):
        m = fresh_mount(tmp, "cold%d%s" % (rep, "s" if stagger else "l"), ["jobs=%d" % jobs])
        try:
            def proc(i):
                # each process starts its walk at its own K/P-th of the kernels (ranks that
                # load their layers in other orders): processes walking in the same order
                # would ask for one new kernel at a time, however many jobs there are
                start = i * kernels // procs if stagger else 0
                order = sources[start:] + sources[:start]
                for src in order:
                    entry = m.mnt / "cache" / entry_name("cold", src, flags)
                    entry.mkdir(parents=True, exist_ok=True)
                    (entry / "kernel.cu").write_bytes(src)
                    (entry / "kernel.flags").write_bytes(flags)
                    data = (entry / "kernel.cubin").read_bytes()
                    if data[:4] != b"\x7fELF":
                        raise RuntimeError("not a cubin")
                return True
            t0 = time.monotonic()
            results = run_parallel(procs, proc)
            wall = time.monotonic() - t0
            assert results == [True] * procs, results
            compiles = m.stats()["compiles_total"]
            assert compiles == kernels, "%d compiles for %d kernels" % (compiles, kernels)
            return wall
        finally:
            m.stop()

    def compile_one(src, d):
        h = hashlib.sha256(src).hexdigest()[:16]
        p = Path(d) / (h + ".cu")
        p.write_bytes(src)
        subprocess.run([str(NVCC), str(p), "-cubin", "-o", str(p) + ".cubin", "-O3",
                        "--gpu-architecture=sm_90a"], check=True, capture_output=True)

    def once_no_fuse():
        with tempfile.TemporaryDirectory(dir=tmp) as d:
            t0 = time.monotonic()
            with ThreadPoolExecutor(jobs) as ex:
                list(ex.map(lambda s: compile_one(s, d), sources))
            return time.monotonic() - t0

    def uncoordinated():
        with tempfile.TemporaryDirectory(dir=tmp) as d:
            def proc(i):
                sub = Path(d) / str(i)
                sub.mkdir()
                for src in sources:
                    compile_one(src, sub)
                return True
            t0 = time.monotonic()
            assert run_parallel(procs, proc, timeout=3600) == [True] * procs
            return time.monotonic() - t0

    mount, lockstep, base = [], [], []
    for rep in range(reps):
        mount.append(via_mount(rep))
        lockstep.append(via_mount(rep, stagger=False))
        base.append(once_no_fuse())
    row("cold start %dx%d (K compiles)" % (procs, kernels), mount, base, "s", "<= 1.15x")
    row("cold start, all in one order (K compiles, one at a time)", lockstep, base, "s",
        "(the clients' order)")
    unco = [uncoordinated()]
    row("uncoordinated %dx%d (P x K compiles)" % (procs, kernels), unco, base, "s",
        "(baseline of the field)")


AHEAD_KERNEL = """// Includes' hash value: %s
#include <cub/block/block_reduce.cuh>
#include <kc_bench/scale.cuh>

extern "C" __global__ void ahead_%d(const int *in, int *out)
{
	using Reduce = cub::BlockReduce<int, 128>;
	__shared__ typename Reduce::TempStorage tmp;
	int total = Reduce(tmp).Sum(in[blockIdx.x * 128 + threadIdx.x] * %d);
	if (threadIdx.x == 0)
		out[blockIdx.x] = kc_scale(total);
}
"""


def bench_ahead(tmp, reps, kernels=16, procs=8):
    jobs = os.cpu_count() or 1
    print("ahead: P=%d processes x K=%d kernels asked one at a time after a header change, "
          "jobs=%d" % (procs, kernels, jobs), flush=True)
    shim = REPO / "build" / "kcachefs-nvcc"

    def image(d, scale):
        inc = Path(d) / "include"
        (inc / "kc_bench").mkdir(parents=True)
        (inc / "kc_bench" / "scale.cuh").write_text(
            "#pragma once\n__device__ inline int kc_scale(int x) { return %s; }\n" % scale)
        digest = hashlib.sha256((inc / "kc_bench" / "scale.cuh").read_bytes()).hexdigest()
        return inc, digest

    def ask_all(m, inc, digest, tag, procs_, spread=False):
        """procs_ processes ask every kernel in turn; with spread, process i asks kernel i."""
        def proc(i):
            for k in [i] if spread else range(kernels):
                d = Path(tmp) / ("%s-%d-%d" % (tag, i, k))
                d.mkdir()
                (d / "k.cu").write_text(AHEAD_KERNEL % (digest, k, k + 2))
                r = subprocess.run([str(shim), str(d / "k.cu"), "-cubin", "-o", str(d / "k.cubin"),
                                    "-arch=sm_90a", "-O3", "-I", str(inc)],
                                   env=dict(os.environ, KCACHEFS_MOUNT=str(m.mnt)),
                                   capture_output=True, text=True)
                if r.returncode != 0 or r.stderr or (d / "k.cubin").read_bytes()[:4] != b"\x7fELF":
                    raise RuntimeError("kernel %d: %s" % (k, r.stderr))
            return True
        t0 = time.monotonic()
        assert run_parallel(procs_, proc, timeout=3600) == [True] * procs_
        return time.monotonic() - t0

    with_history, without, counts = [], [], []
    for rep in range(reps):
        old, old_digest = image(Path(tmp) / ("old%d" % rep), "x")
        new, new_digest = image(Path(tmp) / ("new%d" % rep), "x + 1")
        m = fresh_mount(tmp, "ahead%d" % rep, ["jobs=%d" % jobs])
        try:  # the old image's history: its kernels asked once (not timed)
            ask_all(m, old, old_digest, "o%d" % rep, kernels, spread=True)
            before = m.stats()
            with_history.append(ask_all(m, new, new_digest, "n%d" % rep, procs))
            after = m.stats()
            counts.append((after["ahead_compiles_total"] - before["ahead_compiles_total"],
                           after["ahead_used_total"] - before["ahead_used_total"],
                           after["compiles_total"] - before["compiles_total"]))
        finally:
            m.stop()
        m = fresh_mount(tmp, "plain%d" % rep, ["jobs=%d" % jobs, "ahead=0"])
        try:
            without.append(ask_all(m, new, new_digest, "p%d" % rep, procs))
            assert m.stats()["compiles_total"] == kernels
        finally:
            m.stop()
    row("new image %dx%d, one at a time" % (procs, kernels), with_history, without, "s",
        "<= 0.6x (history / none)")
    for ahead, used, compiles in counts:
        print("  with the history: %d compiled ahead, %d of them used, %d compiles in all "
              "(%d kernels)" % (ahead, used, compiles, kernels), flush=True)


def bench_starve(tmp, reps):
    print("starve: stat latency while 64 openers wait and 8 compiles run", flush=True)
    # the gated compiler runs as the compiles' uid: it and its gate live where it can reach
    cdir = Path(tmp) / "starve-compiler"
    cdir.mkdir()
    open_to_compiles(cdir)
    gate = cdir / "gate"
    slow = write_script(cdir / "nvcc-gated",
                        'case "$*" in *slowkernel*) while [ ! -e %s ]; do sleep 0.05; done;; esac\n'
                        'exec %s "$@"\n' % (gate, NVCC))
    m = fresh_mount(tmp, "starve", ["nvcc=%s" % slow, "jobs=10"])
    procs = []
    try:
        # unrelated files: a published cubin (kernel-cached) and a kernel.log (always asks
        # the daemon: timeout 0)
        pub, _ = publish_padded(m, tmp, "pub", 4096)
        (pub / "kernel.log").write_text("x")
        targets = {"published cubin": pub / "kernel.cubin", "kernel.log (uncached)": pub / "kernel.log"}
        idle = {k: io("statlat", p, 300) for k, p in targets.items()}
        # the load: one gated compile with 64 waiters, 8 real compiles of a CUB kernel
        src = b'// slowkernel\nextern "C" __global__ void slowkernel(int *x) { x[0] = 1; }\n'
        slow_entry = m.stage("slowkernel", src)
        procs = [subprocess.Popen(["cat", str(slow_entry / "kernel.cubin")],
                                  stdout=subprocess.DEVNULL) for _ in range(64)]
        block = (REPO / "tests" / "kernels" / "block_sum.cu").read_bytes()
        others = []
        for i in range(8):
            e = m.stage("block_sum", block + b"// %d\n" % i,
                        (REPO / "tests" / "kernels" / "block_sum.flags").read_bytes())
            others.append(subprocess.Popen(["cat", str(e / "kernel.cubin")], stdout=subprocess.DEVNULL))
        time.sleep(1)
        st = m.stats()
        print("  under load: flights %d, compiles in flight %d, parked requests %d" % (
            st["flights"], st["compiles_in_flight"], st["parked_requests"]), flush=True)
        for label, p in targets.items():
            direct = m.backing / p.relative_to(m.mnt)
            loaded = io("statlat", p, 300)
            base = io("statlat", direct, 300)
            ROWS.append(("stat p99 under load: " + label,
                         "p50 %.0f us, p99 %.0f us" % (loaded[0] / 1000, loaded[1] / 1000),
                         "backing p99 %.0f us; idle mount p99 %.0f us" % (base[1] / 1000, idle[label][1] / 1000),
                         "%.2fx" % (loaded[1] / base[1]), "p99 <= 5 ms"))
            print("  %-34s mount %s  baseline %s  target p99 <= 5 ms" % (
                ROWS[-1][0], ROWS[-1][1], ROWS[-1][2]), flush=True)
        gate.touch()
        for p in procs + others:
            p.wait(timeout=300)
    finally:
        gate.touch()
        for p in procs:
            if p.poll() is None:
                p.kill()
        m.stop()


def bench_backend(tmp, reps):
    nvrtc = REPO / "build" / "kcachefs-nvrtc"
    if not nvrtc.exists():
        print("backend: %s was not built (no libnvrtc); skipped" % nvrtc, flush=True)
        return
    print("backend: nvcc against NVRTC, same flags, no FUSE", flush=True)
    for name in ("vector_add", "block_sum"):
        src = REPO / "tests" / "kernels" / (name + ".cu")
        flags = (REPO / "tests" / "kernels" / (name + ".flags")).read_text().split()
        flags.append("--gpu-architecture=sm_90a")
        times = {"nvcc": [], "nvrtc": []}
        syms = {}
        for _ in range(reps):
            for label, exe in (("nvcc", NVCC), ("nvrtc", nvrtc)):
                out = Path(tmp) / ("%s.%s.cubin" % (name, label))
                t0 = time.monotonic()
                subprocess.run([str(exe), str(src), "-cubin", "-o", str(out)] + flags,
                               check=True, capture_output=True)
                times[label].append(time.monotonic() - t0)
                syms[label] = name in elf_symbols(out.read_bytes())
        assert syms == {"nvcc": True, "nvrtc": True}, syms
        row("compile seconds, %s: NVRTC (nvcc is baseline)" % name, times["nvrtc"],
            times["nvcc"], "s", ">= 3x fewer (ratio <= 0.33x)")


def cpu_ticks(pid, children):
    """CPU time of pid (utime + stime), or of its reaped children (cutime + cstime), in
    seconds."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    i = 13 if children else 11  # fields 16-17 or 14-15 of proc(5), counted from field 3
    return (int(fields[i]) + int(fields[i + 1])) / os.sysconf("SC_CLK_TCK")


def bench_nvrtcwarm(tmp, kernels):
    if not (REPO / "build" / "kcachefs-nvrtc").exists():
        print("nvrtcwarm: kcachefs-nvrtc was not built (no libnvrtc); skipped", flush=True)
        return
    n = max(2, min(kernels, 8))
    print("nvrtcwarm: %d kernels of one include set each, through mounts: NVRTC warm worker, "
          "NVRTC process per compile, nvcc" % n, flush=True)
    setups = (("warm", ["compiler=nvrtc"]), ("fresh", ["compiler=nvrtc", "nvrtc_idle=0"]),
              ("nvcc", []))
    worker_re = re.compile(r"warm NVRTC worker pid (\d+), its compile")
    for name in ("block_sum", "tile_sort"):
        src = (REPO / "tests" / "kernels" / (name + ".cu")).read_bytes()
        flags = (REPO / "tests" / "kernels" / (name + ".flags")).read_bytes()
        flags += b"--gpu-architecture=sm_90a\n"
        mounts = {label: fresh_mount(tmp, "%s-%s" % (name, label), opts)
                  for label, opts in setups}
        times = {label: [] for label, _ in setups}
        cpu = {label: [] for label, _ in setups}
        worker = {}  # pid -> its CPU seconds at the last look
        try:
            for i in range(n):
                kernel = name + "_%d" % i
                body = src.replace(name.encode(), kernel.encode())
                order = setups if i % 2 == 0 else setups[::-1]  # spread the machine's noise
                for label, _ in order:
                    m = mounts[label]
                    cubin = m.stage(kernel, body, flags) / "kernel.cubin"
                    before = cpu_ticks(m.proc.pid, True)
                    t0 = time.monotonic()
                    data = cubin.read_bytes()
                    times[label].append(time.monotonic() - t0)
                    assert kernel in elf_symbols(data), (label, kernel)
                    log = (cubin.parent / "kernel.log").read_text()
                    if label == "warm":  # its CPU: the worker's own, it is not reaped
                        assert i == 0 or "using precompiled header" in log, log
                        pid = int(worker_re.search(log).group(1))
                        now = cpu_ticks(pid, False)
                        cpu[label].append(now - worker.get(pid, 0))
                        worker[pid] = now
                    else:  # nvcc's and its tools', or NVRTC's process: reaped children
                        cpu[label].append(cpu_ticks(m.proc.pid, True) - before)
            print("  %s: first kernel %s s warm, %s s fresh NVRTC, %s s nvcc" % (
                name, num(times["warm"][0]), num(times["fresh"][0]), num(times["nvcc"][0])),
                flush=True)
        finally:
            for m in mounts.values():
                m.stop()
        row("compile %s, kernels 2..%d: NVRTC warm worker (nvcc is baseline)" % (name, n),
            times["warm"][1:], times["nvcc"][1:], "s", "<= 0.33x")
        row("CPU of %s, kernels 2..%d: NVRTC warm worker (nvcc is baseline)" % (name, n),
            cpu["warm"][1:], cpu["nvcc"][1:], "s", "<= 0.33x")
        row("compile %s, kernels 2..%d: NVRTC process per compile (nvcc is baseline)" % (
            name, n), times["fresh"][1:], times["nvcc"][1:], "s", "(what the PCH adds)")


def rss_kib(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def startup(m):
    """Milliseconds from exec to a usable mount (the stats file reads)."""
    t0 = time.monotonic()
    m.start(timeout=120)
    while True:
        try:
            (m.mnt / ".kcachefs" / "stats").read_text()
            return (time.monotonic() - t0) * 1000
        except OSError:
            time.sleep(0.001)


def bench_scale(tmp, reps, entries):
    import resource
    n = entries
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    print("scale: %d published entries (open-file limit %d: the mount keeps at most %d inodes)"
          % (n, hard, hard // 4), flush=True)
    cubin = Path(tmp) / "scale.cubin"
    compile_to(PAD_KERNEL % 64, cubin)
    data = cubin.read_bytes()
    empty_root, root = Path(tmp) / "scale-empty", Path(tmp) / "scale"
    empty_root.mkdir()
    root.mkdir()
    m0, m = Mount(empty_root), Mount(root)
    t0 = time.monotonic()
    paths = []
    for i in range(n):
        d = m.backing / "cache" / ("%03d" % (i // 1000)) / ("kernel.s%d.%032x" % (i, i))
        d.mkdir(parents=True)
        (d / "kernel.cubin").write_bytes(data)  # a client's cubin, as DeepGEMM leaves them
        paths.append(d.relative_to(m.backing) / "kernel.cubin")
    print("  created in %.1f s" % (time.monotonic() - t0), flush=True)
    base, full = [], []
    for _ in range(reps):
        base.append(startup(m0))
        m0.stop()
        full.append(startup(m))
        m.stop()
    row("start-up to a usable mount (%d entries)" % n, full, base, "ms", "<= 2 s")
    m.start()
    try:
        rss0 = rss_kib(m.proc.pid)
        t0 = time.monotonic()
        peak = 0
        for i, p in enumerate(paths):
            with open(m.mnt / p, "rb") as f:  # touched: looked up, opened and read
                if f.read() != data:
                    raise SystemExit("scale: wrong bytes from %s" % p)
            if i % 1000 == 999:
                peak = max(peak, m.stats()["inodes"])
        touched = time.monotonic() - t0
        rss1 = rss_kib(m.proc.pid)
        st = m.stats()
        inodes1 = st["inodes"]
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("2\n")
        time.sleep(1)
        inodes2 = m.stats()["inodes"]
        ROWS.append(("resident memory after touching %d entries" % n,
                     "%.1f MiB" % (rss1 / 1024), "%.1f MiB before" % (rss0 / 1024), "-",
                     "<= 64 MiB at 100,000"))
        ROWS.append(("inode table: peak (sampled) / after touching / after drop_caches",
                     "%d / %d / %d inodes" % (peak, inodes1, inodes2),
                     "max_inodes %d; %d reliefs" % (st["inodes_max"], st["inode_reliefs_total"]),
                     "-", "bounded (forget honoured)"))
        print("  touched in %.1f s; RSS %.1f -> %.1f MiB; inodes peak %d, after %d, after "
              "drop_caches %d; %d reliefs" % (touched, rss0 / 1024, rss1 / 1024, peak, inodes1,
                                              inodes2, st["inode_reliefs_total"]), flush=True)
    finally:
        m.stop()


def bench_ref(tmp, reps):
    example = Path("/usr/share/doc/libfuse3-dev/examples/passthrough_ll.c")
    if not example.exists():
        print("ref: %s is not installed; skipped" % example, flush=True)
        return
    print("ref: libfuse's passthrough_ll -o cache=always", flush=True)
    exe = Path(tmp) / "passthrough_ll"
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"], check=True,
                           capture_output=True, text=True).stdout.split()
    subprocess.run(["cc", "-O2", "-w", str(example), "-o", str(exe)] + flags, check=True)
    src, mnt = Path(tmp) / "ref-src", Path(tmp) / "ref-mnt"
    src.mkdir()
    mnt.mkdir()
    proc = subprocess.Popen([str(exe), "-f", "-o", "source=%s,cache=always" % src, str(mnt)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not os.path.ismount(mnt):
            assert time.monotonic() < deadline, "passthrough_ll did not mount"
            time.sleep(0.02)
        for size, label, n in ((1 << 20, "1 MiB", 2000), (12000, "16 KiB", 20000)):
            cubin = src / ("pad%d.cubin" % size)
            compile_to(PAD_KERNEL % size, cubin)
            io("read", mnt / cubin.name, 10)
            mount, base = [], []
            for _ in range(reps):
                mount.append(io("read", mnt / cubin.name, n)[0] / 1000)
                base.append(io("read", cubin, n)[0] / 1000)
            row("reference: passthrough_ll read %s" % label, mount, base, "us", "(libfuse example)")
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True)
        proc.wait(timeout=20)


def bench_store(tmp, reps, kernel=None):
    """kernel: a directory with kernel.cu and kernel.flags to compile instead of block_sum
    (say, a DeepGEMM kernel with -I to its headers, which the compile uids must read)."""
    if kernel:
        kname = Path(kernel).name.replace(".", "_")
        src = (Path(kernel) / "kernel.cu").read_bytes()
        flags = (Path(kernel) / "kernel.flags").read_bytes()
    else:
        kname = "block_sum"
        src = (REPO / "tests" / "kernels" / "block_sum.cu").read_bytes()
        flags = (REPO / "tests" / "kernels" / "block_sum.flags").read_bytes()
    print("store: %s through a mount with a dir: store / without one, real nvcc" % kname,
          flush=True)
    times = {True: [], False: []}
    for rep in range(reps):
        for with_store in ((True, False) if rep % 2 == 0 else (False, True)):
            name = "store-%d-%d" % (rep, with_store)
            store = Path(tmp) / (name + "-objects")
            store.mkdir()
            os.chmod(store, 0o755)
            m = fresh_mount(tmp, name, ["remote=dir:%s" % store] if with_store else [])
            try:
                cubin = m.stage(kname, src, flags) / "kernel.cubin"
                t0 = time.monotonic()
                data = cubin.read_bytes()
                times[with_store].append(time.monotonic() - t0)
                assert data[:4] == b"\x7fELF", data[:100]
                deadline = time.monotonic() + 300  # the share ends before the next compile
                while with_store and not [p for p in (store / "objects").glob("*/*")
                                          if p.read_bytes()[19:25] == b"index "]:
                    assert time.monotonic() < deadline, m.daemon_log()
                    time.sleep(0.05)
            finally:
                m.stop()
    row("compile %s: with a store (without is baseline)" % kname, times[True], times[False],
        "s", "<= 1.02x")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7, help="repetitions of each timed loop")
    ap.add_argument("--only",
                    default="read,ref,meta,cold,ahead,starve,scale,backend,store,triton,"
                    "nvrtcwarm")
    ap.add_argument("--entries", type=int, default=100000, help="N of the scale figure")
    ap.add_argument("--kernels", type=int, default=32, help="K of the cold start")
    ap.add_argument("--stores", default="dir,redis", help="stores of cluster and cluster64")
    ap.add_argument("--kernels64", type=int, default=16, help="K of cluster64")
    ap.add_argument("--triton-compile-s", type=float, default=0.5,
                    help="seconds of the triton figure's fixed-time compile")
    ap.add_argument("--quick", action="store_true", help="3 repetitions, K=8")
    ap.add_argument("--store-kernel", metavar="DIR", help="the store figure compiles DIR's "
                    "kernel.cu with its kernel.flags instead of block_sum")
    args = ap.parse_args()
    for sig in (signal.SIGTERM, signal.SIGHUP):  # unwind: every mount and server is stopped
        signal.signal(sig, lambda n, f: sys.exit(128 + n))
    if args.quick:
        args.reps, args.kernels, args.entries = 3, 8, 5000
    if not BENCH_IO.exists() and set(args.only.split(",")) & {"read", "ref", "meta", "starve"}:
        sys.exit("bench: %s is missing; run scripts/bench.sh (it builds)" % BENCH_IO)
    print("bench: %s, %d CPUs, kernel %s, commit %s" % (
        os.uname().nodename, os.cpu_count(), os.uname().release,
        subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                       capture_output=True, text=True).stdout.strip()), flush=True)
    tmp = tempfile.mkdtemp(prefix="kcachefs-bench.")
    os.chmod(tmp, 0o755)  # compiles run as uids of their own (-o compile_uids)
    stores = args.stores.split(",")
    tables = []
    try:
        for name in args.only.split(","):
            {"read": lambda: bench_read(tmp, args.reps),
             "meta": lambda: bench_meta(tmp, args.reps),
             "cold": lambda: bench_cold(tmp, max(1, args.reps // 2), args.kernels),
             "ahead": lambda: bench_ahead(tmp, max(1, args.reps // 7),
                                          8 if args.quick else 16),
             "starve": lambda: bench_starve(tmp, args.reps),
             "scale": lambda: bench_scale(tmp, 3, args.entries),
             "ref": lambda: bench_ref(tmp, args.reps),
             "backend": lambda: bench_backend(tmp, args.reps),
             "store": lambda: bench_store(tmp, args.reps, args.store_kernel),
             "triton": lambda: bench_triton.bench_triton(tmp, max(3, args.reps), row,
                                                         args.triton_compile_s),
             "nvrtcwarm": lambda: bench_nvrtcwarm(tmp, args.kernels),
             "cluster": lambda: bench_cluster.bench_cluster(
                 tmp, max(1, args.reps // 4), args.kernels, stores, row),
             "keys": lambda: bench_cluster.bench_keys(
                 tmp, max(1, args.reps // 7), [8] if args.quick else [32, 128], stores, row),
             "lag": lambda: bench_cluster.bench_lag(tmp, min(args.kernels, 12), stores, row),
             "cluster64": lambda: tables.extend(bench_cluster.bench_cluster64(
                 tmp, args.kernels64, stores))}[name]()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("\n| figure | kcachefs: median (spread) | baseline | ratio | target |")
    print("|---|---|---|---|---|")
    for r in ROWS:
        print("| %s |" % " | ".join(r))
    for line in tables:
        print(line)


if __name__ == "__main__":
    main()
