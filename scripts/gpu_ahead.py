#!/usr/bin/env python3
"""gpu_ahead.py - compile ahead with real DeepGEMM on a GPU node: a new image's first node,
and two nodes of a new image started together, against DeepGEMM on local disk with no cache.
Run through scripts/gpu-deepgemm.sh with DG_SCRIPT=gpu_ahead.py (its header says where, how,
and how DeepGEMM is built); the ranks are gpu_deepgemm.py's (R ranks, K shapes in one order,
each checked against PyTorch).

An image is a copy of the built deep_gemm package whose include tree differs from the others'
in one header (a comment line appended): DeepGEMM's own hash of its include tree, which it
writes into the first line of every kernel.cu, differs, and so does every key. Rounds:

  local   the image "new" on local disk, real nvcc, no kcachefs (the baseline)
  H       node A (a mount with a dir: cluster store) runs the image "old": every kernel is
          compiled, and the history of what it asked goes to the backing directory and the
          store (not a target figure)
  A       the same node A runs "new": its first kernel triggers the compiles ahead of the
          others from old's history. Target: median per rank / local <= 0.25x
  B+C     two fresh nodes on the same store, started together, run a third image "newer":
          they read the histories from the store and split the compiles ahead under its
          leases. Target: the slower node's median per rank / local <= 0.25x; each kernel
          compiled once in the cluster

It prints each round's ranks (min, median, max), the compiles (nvcc runs of local; the
mounts' compiler runs), the compile ahead counters (triggers, compiled ahead, used, never
asked and their CPU time) and PASS only if every rank of every round computed every shape
right, node A compiled each kernel once in H and in A, and B and C compiled each kernel once
between them.
"""
import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "mount"))
sys.path.insert(0, str(REPO / "scripts"))

from gpu_deepgemm import (M, cluster, finish, install_copy, run_round, settle, shapes,  # noqa: E402
                          summary)


def image(src, dst, tag):
    """A copy of the deep_gemm package at dst whose include tree has one more comment line
    (tag) in one header: another image."""
    site = install_copy(src, dst, new_mtimes=True)
    inc = site / "deep_gemm" / "include"
    header = inc / "deep_gemm" / "common" / "utils.cuh"  # in every kernel's includes
    if not header.exists():
        header = sorted(inc.rglob("*.cuh"))[0]
    with open(header, "a") as f:
        f.write("\n// kcachefs compile ahead run: image %s\n" % tag)
    return site


def counters(m):
    s = m.stats()
    return {k: int(s.get(k, 0)) for k in (
        "ahead_triggers_total", "ahead_compiles_total", "ahead_used_total",
        "ahead_failures_total", "ahead_unused", "ahead_unused_milliseconds")}


def say_ahead(name, m):
    c = counters(m)
    print("node %s: compile ahead: %d trigger(s), %d compiled ahead, %d used by ranks, %d "
          "failed, %d never asked (%.1f s of compiler time)" % (
              name, c["ahead_triggers_total"], c["ahead_compiles_total"],
              c["ahead_used_total"], c["ahead_failures_total"], c["ahead_unused"],
              c["ahead_unused_milliseconds"] / 1000))
    for line in m.daemon_log().splitlines():
        if "compile ahead:" in line:
            print("node %s: %s" % (name, line[:300]))
    return c


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--deepgemm", required=True, help="a built deep_gemm package directory")
    ap.add_argument("--kernels", type=int, default=16)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--timeout", type=int, default=400, help="seconds per round")
    args = ap.parse_args()

    import kcmount
    nvcc = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc"
    share = Path(tempfile.mkdtemp(prefix="kcachefs-dg."))
    os.chmod(share, 0o755)
    mounts, ok = [], True
    try:
        sites = {t: image(Path(args.deepgemm), share / t / "site", t)
                 for t in ("old", "new", "newer")}
        print("%d ranks x %d kernels (bf16_gemm_nt, m=%d, N x K: %s); images old, new, newer: "
              "copies of %s, each with one header's comment of its own" % (
                  args.ranks, args.kernels, M, " ".join("%dx%d" % s for s in shapes(args.kernels)),
                  args.deepgemm))
        counter = share / "nvcc-runs"
        wrapper = kcmount.write_script(share / "nvcc-counting", 'case "$*" in *--version*) ;; '
                                       '*) echo x >>%s;; esac\nexec %s "$@"\n' % (counter, nvcc))
        base = dict(os.environ, CUDA_HOME=str(nvcc.parents[1]))
        base.pop("DG_JIT_USE_NVRTC", None)

        print("\n=== local: image new, DeepGEMM's cache on local disk, real nvcc, no kcachefs")
        env = dict(base, PYTHONPATH=str(sites["new"]), DG_JIT_CACHE_DIR=str(share / "local-cache"),
                   DG_JIT_NVCC_COMPILER=str(wrapper))
        local, good = summary("local", run_round("local", share, env, args.ranks, args.kernels,
                                                 args.timeout))
        ok &= good
        print("local: %d nvcc runs" % (len(counter.read_text().split()) if counter.exists() else 0))

        store, opts, runs = cluster(share, nvcc)

        def compiled():
            return len(runs.read_text().split())

        def node(name):
            root = share / ("node" + name)
            root.mkdir()
            m = kcmount.Mount(root, opts)
            mounts.append(m)
            return m.start()

        def ranks_on(m, site, name):
            env = dict(base, PYTHONPATH=str(site), DG_JIT_CACHE_DIR=str(m.mnt / "dg"),
                       DG_JIT_NVCC_COMPILER=str(kcmount.SHIM))
            return summary(name, run_round(name, share, env, args.ranks, args.kernels,
                                           args.timeout))

        a = node("A")
        print("\n=== H: node A runs image old (its history)")
        n0 = compiled()
        _, good = ranks_on(a, sites["old"], "H")
        ok &= good
        settle(a, store)
        h_runs = compiled() - n0
        print("H: %d compiler runs" % h_runs)

        print("\n=== A: node A runs image new (compiled ahead from old's history)")
        n0 = compiled()
        first, good = ranks_on(a, sites["new"], "A")
        ok &= good
        a_runs = compiled() - n0
        ca = say_ahead("A", a)
        settle(a, store)
        print("A: %d compiler runs" % a_runs)
        a.stop()
        mounts.remove(a)

        print("\n=== B+C: two fresh nodes started together run image newer")
        b, c = node("B"), node("C")
        for m in (b, c):
            deadline = time.monotonic() + 30
            while "histories read from the cluster store" not in m.daemon_log() and \
                    time.monotonic() < deadline:
                time.sleep(0.05)
        n0 = compiled()
        res = {}

        def run(m, name):
            res[name] = ranks_on(m, sites["newer"], name)
        ts = [threading.Thread(target=run, args=(m, nm)) for m, nm in ((b, "B"), (c, "C"))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        ok &= res["B"][1] and res["C"][1]
        bc_runs = compiled() - n0
        cb, cc = say_ahead("B", b), say_ahead("C", c)
        print("B+C: %d compiler runs in the cluster" % bc_runs)
        together = max(res["B"][0], res["C"][0])

        print("\n=== summary")
        print("%-52s %8s %8s %7s %s" % ("figure", "kcachefs", "baseline", "ratio", "target"))
        print("%-52s %7.2fs %7.2fs %6.2fx %s" % ("first node of a new image, median per rank / local",
                                                  first, local, first / local, "<= 0.25x"))
        print("%-52s %7.2fs %7.2fs %6.2fx %s" % ("two nodes started together (slower) / local",
                                                  together, local, together / local, "<= 0.25x"))
        print("compiles: H %d, A %d (%d ahead, %d used, %d never asked), B+C %d (%d kernels)" % (
            h_runs, a_runs, ca["ahead_compiles_total"], ca["ahead_used_total"], ca["ahead_unused"],
            bc_runs, args.kernels))
        print("wasted: node A %d compiles never asked (%.1f s), B %d, C %d" % (
            ca["ahead_unused"], ca["ahead_unused_milliseconds"] / 1000, cb["ahead_unused"],
            cc["ahead_unused"]))
        for what, n in (("H", h_runs), ("A", a_runs), ("B+C", bc_runs)):
            if n != args.kernels:
                print("FAIL %s: %d compiler runs for %d kernels" % (what, n, args.kernels))
                ok = False
    finally:
        ok = finish(mounts, share, ok)
    print("PASS: gpu-ahead" if ok else "FAIL: gpu-ahead")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
