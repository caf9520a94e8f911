#!/usr/bin/env python3
"""triton_gpu.py - the Triton cache manager (python/kcachefs_triton) on a GPU node, with real
Triton and PyTorch. Run through scripts/triton-gpu.sh (its header says how).

Mounts a fresh kcachefs (tests/mount/kcmount.py's Mount: the daemon in the foreground, always
unmounted), then runs rounds of P processes (default 8) released together by a barrier once
each has imported torch and triton and made its CUDA context:

  managed cold   TRITON_CACHE_DIR=<mnt>/managed, TRITON_CACHE_MANAGER=kcachefs_triton:...
  managed warm   the same again
  plain cold     TRITON_CACHE_DIR=<mnt>/plain, Triton's own manager
  plain warm     the same again
  local cold     TRITON_CACHE_DIR=<temp dir on the local disk>/local, Triton's own manager:
                 Triton as it runs without kcachefs, the target's baseline
  local warm     the same again
  then --pairs - 1 more cold pairs in fresh directories, local first (default: one more),
  so that the ratio does not rest on one round each

Each process compiles and runs a vector add, a row softmax and a matmul autotuned over two
configs (each config a kernel of its own), and checks every result against PyTorch. A
compile is counted where it ends: every compile() miss writes its group index
__grp__<name>.json through FileCacheManager.put (the manager inherits it), which each process
wraps to append "<round> <pid> <kernel> <key>" to a log outside the mount. The managed rounds
go first, so that anything warmed by the first round (ptxas and Triton in the page cache)
favours the plain ones. It prints per-process times and compiles per kernel and key, the
manager's counters, the line "ratio managed cold / local cold (median per process): R"
(all managed cold processes against all local cold ones; target <= 1.0x), and PASS only if
every result is right, every managed cold round compiled each key exactly once and the warm
rounds compiled nothing.
"""
import argparse
import json
import multiprocessing
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MANAGER = "kcachefs_triton:KcachefsCacheManager"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x + y, mask=mask)


@triton.jit
def softmax_kernel(out_ptr, in_ptr, in_stride, out_stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(in_ptr + row * in_stride + cols, mask=mask, other=-float("inf"))
    x = x - tl.max(x, axis=0)
    num = tl.exp(x)
    tl.store(out_ptr + row * out_stride + cols, num / tl.sum(num, axis=0), mask=mask)


@triton.autotune(configs=[
    triton.Config({"BM": 64, "BN": 64, "BK": 32}, num_warps=4, num_stages=3),
    triton.Config({"BM": 128, "BN": 64, "BK": 32}, num_warps=4, num_stages=3),
], key=["M", "N", "K"])
@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, sam, sak, sbk, sbn, scm, scn,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        kk = k * BK + rk
        a = tl.load(a_ptr + rm[:, None] * sam + kk[None, :] * sak,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + kk[:, None] * sbk + rn[None, :] * sbn,
                    mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc += tl.dot(a, b)
    tl.store(c_ptr + rm[:, None] * scm + rn[None, :] * scn, acc.to(tl.float16),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def count_compiles(log, round_name):
    """Wrap FileCacheManager.put: a group index written is a compile that ended."""
    from triton.runtime import cache
    put = cache.FileCacheManager.put

    def counting_put(self, data, filename, binary=True):
        path = put(self, data, filename, binary)
        if filename.startswith("__grp__"):
            line = "%s %d %s %s\n" % (round_name, os.getpid(), filename[len("__grp__"):-len(".json")],
                                      os.path.basename(os.path.dirname(path)))
            fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        return path

    cache.FileCacheManager.put = counting_put


def run_kernels():
    """Compile and run the three kernels; returns a list of failed checks."""
    failed = []
    dev = "cuda"
    torch.manual_seed(0)
    n = 98432
    x, y = torch.rand(n, device=dev), torch.rand(n, device=dev)
    out = torch.empty_like(x)
    add_kernel[(triton.cdiv(n, 1024),)](x, y, out, n, BLOCK=1024)
    if not torch.allclose(out, x + y):
        failed.append("add: max error %g" % (out - (x + y)).abs().max().item())
    s = torch.randn(512, 1000, device=dev)
    so = torch.empty_like(s)
    softmax_kernel[(s.shape[0],)](so, s, s.stride(0), so.stride(0), s.shape[1],
                                  BLOCK=triton.next_power_of_2(s.shape[1]))
    if not torch.allclose(so, torch.softmax(s, dim=1), atol=1e-5, rtol=1e-4):
        failed.append("softmax: max error %g" % (so - torch.softmax(s, dim=1)).abs().max().item())
    M, N, K = 512, 512, 512
    a = (0.1 * torch.randn(M, K, device=dev)).half()
    b = (0.1 * torch.randn(K, N, device=dev)).half()
    c = torch.empty(M, N, device=dev, dtype=torch.float16)
    matmul_kernel[lambda meta: (triton.cdiv(M, meta["BM"]), triton.cdiv(N, meta["BN"]))](
        a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0),
        c.stride(1))
    want = (a.float() @ b.float()).half()
    if not torch.allclose(c, want, atol=1e-2, rtol=1e-2):
        failed.append("matmul: max error %g" % (c.float() - want.float()).abs().max().item())
    torch.cuda.synchronize()
    return failed


def worker(index, round_name, log, barrier, queue):
    try:
        count_compiles(log, round_name)
        torch.zeros(1, device="cuda")  # the CUDA context, before the clock starts
        torch.cuda.synchronize()
        barrier.wait(timeout=100)
        t0 = time.monotonic()
        failed = run_kernels()
        queue.put((index, {"pid": os.getpid(), "seconds": time.monotonic() - t0,
                           "failed": failed}))
    except BaseException:
        queue.put((index, {"pid": os.getpid(), "seconds": None,
                           "failed": ["exception: " + traceback.format_exc()]}))


def run_round(round_name, procs, log, timeout):
    from kcmount import join_or_kill  # main puts tests/mount on sys.path (not the workers)
    ctx = multiprocessing.get_context("spawn")
    barrier, queue = ctx.Barrier(procs), ctx.Queue()
    ps = [ctx.Process(target=worker, args=(i, round_name, log, barrier, queue)) for i in range(procs)]
    for p in ps:
        p.start()
    results, deadline = {}, time.monotonic() + timeout
    try:
        while len(results) < procs:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                i, r = queue.get(timeout=min(left, 5))
                results[i] = r
            except Exception:
                if not any(p.is_alive() for p in ps) and queue.empty():
                    break
    finally:
        join_or_kill(ps, 10)
    for i in range(procs):
        results.setdefault(i, {"pid": None, "seconds": None,
                               "failed": ["no result (died or timed out; exit code %s)" % ps[i].exitcode]})
    return [results[i] for i in range(procs)]


def compiles_of(log, round_name):
    """{kernel: {key: compiles}} of a round, from the log."""
    out = {}
    if os.path.exists(log):
        for line in open(log):
            r, _, name, key = line.split()
            if r == round_name:
                out.setdefault(name, {}).setdefault(key, 0)
                out[name][key] += 1
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--round-timeout", type=int, default=110)
    ap.add_argument("--pairs", type=int, default=2,
                    help="managed cold / local cold pairs (the first in the fixed order)")
    ap.add_argument("--options", default=os.environ.get("KCACHEFS_OPTS", ""))
    args = ap.parse_args()

    signal.signal(signal.SIGTERM, lambda *_: sys.exit("interrupted (SIGTERM)"))
    sys.path[:0] = [str(REPO / "tests" / "mount")]
    from kcmount import KCACHEFS, Mount
    print("== node: %s, torch %s, triton %s, GPU %s, python %s" % (
        os.uname().nodename, torch.__version__, triton.__version__,
        torch.cuda.get_device_name(0), sys.version.split()[0]), flush=True)
    print("daemon %s" % KCACHEFS, flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="kcachefs-triton-gpu-"))
    os.chmod(tmp, 0o755)
    m = Mount(tmp, [o for o in args.options.split(",") if o])
    log = str(tmp / "compiles.log")
    ok = True
    rows = []
    try:
        m.start()
        print("mounted %s" % m.mnt, flush=True)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(REPO / "python")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
        sys.path.insert(0, str(REPO / "python"))
        os.environ.setdefault("KCACHEFS_TRITON_WAIT", "120")
        local = tmp / "local-disk"  # beside the mount, not under it
        local.mkdir()
        print("local disk: %s (%s)" % (local, subprocess.run(
            ["stat", "-f", "-c", "%T", str(local)], capture_output=True, text=True).stdout.strip()))
        # A first round not counted: plain Triton on the local disk, so that every counted
        # round finds Triton's, the toolkit's and PyTorch's files in the page cache (the
        # first round of a run paid most of 0.8 s for reading them, whichever it was).
        plan = [("local", local / "cache-warmup", "warmup"),
                ("managed", m.mnt / "managed", "cold"), ("managed", m.mnt / "managed", "warm"),
                ("plain", m.mnt / "plain", "cold"), ("plain", m.mnt / "plain", "warm"),
                ("local", local / "cache", "cold"), ("local", local / "cache", "warm")]
        for pair in range(2, args.pairs + 1):
            plan += [("local", local / ("cache%d" % pair), "cold-%d" % pair),
                     ("managed", m.mnt / ("managed%d" % pair), "cold-%d" % pair)]
        for mode, cache_dir, temp in plan:
            os.environ["TRITON_CACHE_DIR"] = str(cache_dir)
            if mode == "managed":
                os.environ["TRITON_CACHE_MANAGER"] = MANAGER
            else:
                os.environ.pop("TRITON_CACHE_MANAGER", None)
            name = "%s-%s" % (mode, temp)
            print("\n== %s: %d processes, TRITON_CACHE_DIR=%s%s" % (
                name, args.procs, os.environ["TRITON_CACHE_DIR"],
                ", TRITON_CACHE_MANAGER=" + MANAGER if mode == "managed" else ""), flush=True)
            t0 = time.monotonic()
            res = run_round(name, args.procs, log, args.round_timeout)
            wall = time.monotonic() - t0
            for i, r in enumerate(res):
                print("  process %d pid %s: %s s %s" % (
                    i, r["pid"], "%.2f" % r["seconds"] if r["seconds"] is not None else "-",
                    "ok (add, softmax, matmul checked against torch)" if not r["failed"]
                    else "FAILED: " + "; ".join(r["failed"])), flush=True)
            comp = compiles_of(log, name)
            for kernel in sorted(comp):
                print("  %s: %d compile(s) over %d key(s): %s" % (
                    kernel, sum(comp[kernel].values()), len(comp[kernel]),
                    " ".join("%s..=%d" % (k[:8], v) for k, v in sorted(comp[kernel].items()))))
            good = [r for r in res if not r["failed"]]
            secs = [r["seconds"] for r in good]
            rows.append((name, len(good), args.procs, secs, comp, wall))
            if len(good) != args.procs:
                ok = False
                print("FAIL  %s: %d of %d processes failed" % (name, args.procs - len(good), args.procs))
            if temp == "warm" and comp:
                ok = False
                print("FAIL  %s: the warm round compiled" % name)
            if mode == "managed" and temp.startswith("cold"):
                keys = [v for kernel in comp.values() for v in kernel.values()]
                want = {"add_kernel": 1, "softmax_kernel": 1, "matmul_kernel": 2}
                got = {k: len(v) for k, v in comp.items()}
                if any(v != 1 for v in keys) or got != want:
                    ok = False
                    print("FAIL  %s: want one compile per key and keys %s, got %s" % (name, want, comp))
        print("\n== kcachefs_triton stats %s (every managed round)" % m.mnt, flush=True)
        subprocess.run([sys.executable, "-m", "kcachefs_triton", "stats", str(m.mnt)])
        print("\n== summary (seconds per process from the barrier: compile + run + check)")
        print("%-14s %-6s %-8s %-8s %-8s %-8s %s" % ("round", "ok", "min", "median", "max", "wall",
                                                   "compiles: add / softmax / matmul (keys)"))
        for name, good, procs, secs, comp, wall in rows:
            c = lambda k: "%d(%d)" % (sum(comp.get(k, {}).values()), len(comp.get(k, {})))
            print("%-14s %-6s %-8s %-8s %-8s %-8.2f %s / %s / %s" % (
                name, "%d/%d" % (good, procs),
                "%.2f" % min(secs) if secs else "-", "%.2f" % statistics.median(secs) if secs else "-",
                "%.2f" % max(secs) if secs else "-", wall,
                c("add_kernel"), c("softmax_kernel"), c("matmul_kernel")))
        cold = {mode: [x for name, _, _, secs, _, _ in rows for x in secs
                       if name.startswith(mode + "-cold")] for mode in ("managed", "plain", "local")}
        if cold["managed"] and cold["local"]:
            print("ratio managed cold / local cold (median per process): %.3f  (%.2f s over %d "
                  "processes / %.2f s over %d; target <= 1.0x)" % (
                      statistics.median(cold["managed"]) / statistics.median(cold["local"]),
                      statistics.median(cold["managed"]), len(cold["managed"]),
                      statistics.median(cold["local"]), len(cold["local"])))
        if cold["managed"] and cold["plain"]:
            print("ratio managed cold / plain cold on the mount (median per process): %.3f" % (
                statistics.median(cold["managed"]) / statistics.median(cold["plain"])))
        metrics = (m.mnt / ".kcachefs" / "metrics.prom").read_text()
        print("mount: " + ", ".join(l for l in metrics.splitlines()
                                     if l.startswith(("kcachefs_compiles_total", "kcachefs_misses_total"))))
    except BaseException:
        ok = False
        traceback.print_exc()
    finally:
        rc = m.stop()
        mounted = os.path.ismount(m.mnt)
        print("unmounted, daemon exit status %s%s" % (rc, "; STILL MOUNTED" if mounted else ""))
        if rc not in (0, None) or mounted:
            ok = False
            print(m.daemon_log()[-4000:])
        if not mounted:
            shutil.rmtree(tmp, ignore_errors=True)
    print("\nPASS: triton-gpu" if ok else "\nFAIL: triton-gpu")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
