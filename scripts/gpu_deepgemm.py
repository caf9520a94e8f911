#!/usr/bin/env python3
"""gpu_deepgemm.py - real DeepGEMM on a GPU node: the cold start of a two-node cluster against
DeepGEMM on local disk with no cache. Run through scripts/gpu-deepgemm.sh (its header says
where, how, and how DeepGEMM is built).

Three rounds, each of R ranks (default 8) that are released together once each has imported
torch and deep_gemm and made its CUDA context, and that then call deep_gemm.bf16_gemm_nt on K
shapes (default 16, each its own JIT kernel: N and K are compile-time dimensions) in the same
order, as the ranks of one model do. Every result is checked against PyTorch (a @ b.T in
fp32, DeepGEMM's own calc_diff).

  local   DG_JIT_CACHE_DIR on local disk, real nvcc, no kcachefs: every rank compiles what it
          misses, as DeepGEMM does today (the baseline)
  A       node A: a fresh kcachefs mount with a dir: cluster store and a cluster key;
          DG_JIT_CACHE_DIR on the mount, DG_JIT_NVCC_COMPILER=kcachefs-nvcc. Compiles each
          kernel once and stores it.
  B       node B: a fresh mount on the same store. --node-b moved (default): B's DeepGEMM is
          another copy at another path, with new mtimes (installed at another time);
          --node-b same: B imports A's copy.

It prints per-rank seconds (min, median, max) for each round, the compiles of each (nvcc runs
for local; kcachefs_compiles_total for A and B), node A's median per rank against local's
(the issue's target: <= 1.0x), B's store hits, and PASS only if every rank of every round
computed every shape correctly, A compiled each kernel once, and B compiled nothing when
--expect-b-compiles=0 (default).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "mount"))

M = 256
NS = (1536, 2048, 4096, 7168)
KS = (1024, 2048, 4096, 7168)


def shapes(count):
    """count (n, k) pairs, each a kernel of its own."""
    out = [(n, k) for k in KS for n in NS]
    while len(out) < count:  # more than 16: further N, still multiples of 128
        out.append((NS[-1] + 128 * (len(out) - 15), KS[len(out) % len(KS)]))
    return out[:count]


def rank_main(args):
    """One rank: import, make the context, say ready, wait for go, run every shape."""
    import torch
    import deep_gemm
    from deep_gemm.testing import calc_diff
    torch.cuda.init()
    torch.ones(1, device="cuda")
    torch.manual_seed(args.rank)
    Path(args.ready).write_text(str(os.getpid()))
    while not os.path.exists(args.go):
        time.sleep(0.005)
    start = time.monotonic()
    per_kernel, bad = [], []
    for n, k in shapes(args.kernels):
        t0 = time.monotonic()
        a = torch.randn((M, k), device="cuda", dtype=torch.bfloat16)
        b = torch.randn((n, k), device="cuda", dtype=torch.bfloat16)
        d = torch.empty((M, n), device="cuda", dtype=torch.bfloat16)
        deep_gemm.bf16_gemm_nt(a, b, d)
        torch.cuda.synchronize()
        ref = (a.float() @ b.float().t()).to(torch.bfloat16)
        diff = float(calc_diff(d, ref))
        if not diff < 1e-4:
            bad.append("n=%d k=%d diff %.3g" % (n, k, diff))
        per_kernel.append(time.monotonic() - t0)
    total = time.monotonic() - start
    Path(args.result).write_text(json.dumps({"seconds": total, "per_kernel": per_kernel, "bad": bad}))


def run_round(name, share, env, ranks, kernels, timeout):
    """R ranks of rank_main with env; returns their results (a failed rank: an error)."""
    d = share / ("round-" + name)
    d.mkdir()
    go = d / "go"
    procs = []
    for r in range(ranks):
        cmd = [sys.executable, __file__, "--rank", str(r), "--kernels", str(kernels),
               "--ready", str(d / ("ready.%d" % r)), "--go", str(go),
               "--result", str(d / ("result.%d" % r))]
        log = open(d / ("rank.%d.log" % r), "wb")
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + 300
    while not all((d / ("ready.%d" % r)).exists() for r in range(ranks)):
        if any(p.poll() is not None for p, _ in procs) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    go.write_text("")
    results = []
    for r, (p, log) in enumerate(procs):
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.close()
        res = d / ("result.%d" % r)
        if p.returncode == 0 and res.exists():
            results.append(json.loads(res.read_text()))
        else:
            tail = (d / ("rank.%d.log" % r)).read_text(errors="replace")[-1500:]
            results.append({"error": "rank %d exited %s: %s" % (r, p.returncode, tail)})
    return results


def summary(name, results):
    secs = [r["seconds"] for r in results if "seconds" in r]
    errors = [r["error"] for r in results if "error" in r]
    bad = [b for r in results for b in r.get("bad", [])]
    med = statistics.median(secs) if secs else float("nan")
    print("%-6s ranks ok %d/%d  per rank: min %.2f  median %.2f  max %.2f s" % (
        name, len(secs) - len([r for r in results if r.get("bad")]), len(results),
        min(secs) if secs else float("nan"), med, max(secs) if secs else float("nan")))
    for e in errors:
        print("  FAIL %s" % e)
    for b in bad[:10]:
        print("  FAIL wrong result: %s" % b)
    return med, not errors and not bad


def upgrade_when(m, after, out):
    """Once m has compiled after kernels, run kcachefs -f --upgrade on its mount (the same
    binary: a new process takes the mount) and wait for the old daemon to hand over."""
    deadline = time.monotonic() + 300
    while m.stats().get("compiles_total", 0) < after:
        if time.monotonic() > deadline:
            out["error"] = "node A compiled fewer than %d kernels in 300 s" % after
            return
        time.sleep(0.1)
    out["old_pid"] = m.proc.pid
    # Counted now, from the old daemon: once it has handed over, m.stats() is the new one's.
    out["compiled_before"] = m.stats().get("compiles_total", 0)
    out["log"] = open(m.log_path, "ab")
    t = time.monotonic()
    out["new"] = subprocess.Popen([str(m.bin), "-f", "--upgrade", str(m.mnt)],
                                  stdout=out["log"], stderr=subprocess.STDOUT)
    try:
        out["old_rc"] = m.proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        out["error"] = "the old daemon did not hand over in 300 s"
    out["seconds"] = time.monotonic() - t


def report_upgrade(m, up):
    """Print what the upgrade did; False if it failed."""
    log = m.daemon_log()
    new = up.get("new")
    if up.get("error") or new is None or up.get("old_rc") != 0 or new.poll() is not None:
        lines = [l for l in log.splitlines() if "upgrade" in l]  # the daemons' own account
        print("FAIL upgrade: %s (old daemon exit %s)\n%s" % (up.get("error", "the new daemon is not "
              "serving"), up.get("old_rc"), "\n".join(lines[-20:])))
        return False
    answered = "?"
    if "requests answered during the handover" in log:
        answered = log.split("requests answered during the handover")[0].rsplit("(", 1)[1]
    print("upgrade: begun when the old daemon had compiled %d of node A's kernels: pid %d handed "
          "the mount to pid %d in %.2f s (%s requests answered during the handover, their "
          "compiles finished first); the new daemon compiled the rest"
          % (up["compiled_before"], up["old_pid"], new.pid, up["seconds"], answered.strip()))
    return True


def settle(m, store, timeout=120):
    """Wait until m's shares are stored (an object and an index a compile) and no lease is
    held, at most timeout seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = m.stats()
        leases = [p for p in (store / "leases").rglob("*") if p.is_file() and
                  not p.name.startswith(".")] if (store / "leases").exists() else []
        if s.get("remote_puts_total", 0) + s.get("remote_put_errors_total", 0) >= \
                2 * s.get("compiles_total", 0) and not leases:
            return
        time.sleep(0.2)


def finish(mounts, share, ok):
    """Stop the mounts, remove the share, and check that no mount of this run (under its
    share: another run may go on beside it) is left; returns ok, false when one is."""
    for m in mounts:
        m.stop()
    shutil.rmtree(share, ignore_errors=True)
    left = [l.split()[1] for l in open("/proc/mounts") if l.split()[1].startswith(str(share) + "/")]
    if left:
        print("FAIL mounts left: %s" % left)
        return False
    return ok


def start_node(share, node, opts, mounts):
    """Node node: a fresh mount with opts under share, started and added to mounts."""
    import kcmount
    root = share / ("node" + node + "-mount")
    root.mkdir()
    m = kcmount.Mount(root, opts)
    mounts.append(m)
    m.start()
    print("\n=== node %s: kcachefs on %s, dir: store, DG_JIT_NVCC_COMPILER=kcachefs-nvcc" % (node, m.mnt))
    return m


def shim_env(base, site, m):
    """base with DeepGEMM at site, its cache on m and the nvcc shim as its compiler."""
    import kcmount
    return dict(base, PYTHONPATH=str(site), DG_JIT_CACHE_DIR=str(m.mnt / "dg"),
                DG_JIT_NVCC_COMPILER=str(kcmount.SHIM))


def end_node(m, node, store, counter, counted, mounts):
    """After node's ranks: wait for its shares, say what its log says of the store, stop its
    mount and print its figures. Its compiles are the counter's lines past counted (both
    daemons of an upgraded node). Returns (its stats, the counter's lines now)."""
    # The share follows the publish: before the next node starts, wait for it.
    settle(m, store)
    s = m.stats()
    unwatched = [l for l in m.daemon_log().splitlines() if "header lists are not watched" in l]
    print("node %s: header watch %s" % (node, unwatched[0] if unwatched else "on (no 'not watched' line)"))
    # why a compile was not shared, or what the store said at start: the first few
    unshared = [l for l in m.daemon_log().splitlines()
                if "not shared" in l or "header lists checked" in l or "is this node's" in l]
    for line in unshared[:4]:
        print("node %s: %s" % (node, line[:400]))
    done = len(counter.read_text().split())
    s["compiles_total"] = done - counted
    m.stop()
    mounts.remove(m)
    print("node %s: compiles %d, store hits %d, misses %d, puts %d, rejected %d, fetch %.1f ms avg" % (
        node, s.get("compiles_total", 0), s.get("remote_hits_total", 0),
        s.get("remote_misses_total", 0), s.get("remote_puts_total", 0),
        s.get("remote_rejected_total", 0),
        s.get("remote_fetch_microseconds_total", 0) / 1000 / max(1, s.get("remote_fetches_total", 0))))
    return s, done


def cluster(share, nvcc):
    """A dir: store in share with a cluster key, and the mounts' compiler: nvcc behind a
    wrapper that counts compiles (not --version nor the dependency pass), one file for every
    node, so that the two daemons of an upgraded node count as one, and all nodes have the
    same compiler identity. Returns (store, the mounts' -o options, the counter file: one
    line a compile)."""
    store = share / "store"
    store.mkdir(mode=0o700)
    key = share / "cluster.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    mount_nvcc, counter = counting_compiler(share, nvcc)
    return store, ["remote=dir:%s" % store, "remote_key=%s" % key, "nvcc=%s" % mount_nvcc], counter


def counting_compiler(share, nvcc):
    """A mount's compiler in share: nvcc behind a wrapper that writes a line to a counter
    file for each compile (not --version nor the dependency pass). Returns (the wrapper,
    the counter file)."""
    import kcmount
    counter = share / "mount-compiles"
    counter.write_text("")
    counter.chmod(0o666)  # appended to by the compiles' own uids
    mount_nvcc = kcmount.write_script(share / "nvcc-mount", 'case " $* " in *"/pass.cubin "*) ;; '
                                      '*-cubin*) echo x >>%s;; esac\nexec %s "$@"\n' % (counter, nvcc))
    return mount_nvcc, counter


def install_copy(src, dst, new_mtimes):
    """A copy of the built deep_gemm package at dst/deep_gemm, readable by the compile uids."""
    dst.mkdir(parents=True)
    target = dst / "deep_gemm"
    if new_mtimes:
        shutil.copytree(src, target, symlinks=False)  # new mtimes: installed at another time
        now = time.time()
        for p in [target, *target.rglob("*")]:
            os.utime(p, (now, now), follow_symlinks=False)
    else:
        subprocess.run(["cp", "-a", str(src), str(target)], check=True)
    subprocess.run(["chmod", "-R", "a+rX", str(dst)], check=True)
    return dst


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int)
    ap.add_argument("--ready")
    ap.add_argument("--go")
    ap.add_argument("--result")
    ap.add_argument("--deepgemm", help="a built deep_gemm package directory (with _C*.so)")
    ap.add_argument("--kernels", type=int, default=16)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--node-b", choices=("moved", "same"), default="moved")
    ap.add_argument("--expect-b-compiles", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=400, help="seconds per round")
    ap.add_argument("--options", default="", help="more -o options for both daemons")
    ap.add_argument("--no-local", action="store_true", help="skip the local-disk round "
                    "(no baseline: for a run that checks something else, such as an upgrade)")
    ap.add_argument("--upgrade-after", type=int, default=0, metavar="N",
                    help="once node A has compiled N kernels, hand its mount to a new daemon "
                    "(kcachefs --upgrade) while its ranks go on compiling the rest")
    ap.add_argument("--save-sources", help="copy the local round's kernel.cu files here (for "
                    "compiling DeepGEMM's kernels on a machine without a GPU)")
    args = ap.parse_args()
    if args.rank is not None:
        return rank_main(args)

    import kcmount
    nvcc = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc"
    share = Path(tempfile.mkdtemp(prefix="kcachefs-dg."))
    os.chmod(share, 0o755)
    mounts = []
    ok = True
    try:
        site_a = install_copy(Path(args.deepgemm), share / "nodeA" / "site", new_mtimes=False)
        site_b = site_a if args.node_b == "same" else install_copy(
            Path(args.deepgemm), share / "nodeB" / "venv" / "lib" / "site-packages", new_mtimes=True)
        print("DeepGEMM: node A imports %s/deep_gemm, node B %s/deep_gemm (%s)" % (
            site_a, site_b, "another path, new mtimes" if args.node_b == "moved" else "the same copy"))
        print("%d ranks x %d kernels (bf16_gemm_nt, m=%d, N x K: %s)" % (
            args.ranks, args.kernels, M, " ".join("%dx%d" % s for s in shapes(args.kernels))))
        counter = share / "nvcc-runs"
        wrapper = kcmount.write_script(share / "nvcc-counting", 'case "$*" in *--version*) ;; *) echo x >>%s;; esac\nexec %s "$@"\n' % (counter, nvcc))
        base = dict(os.environ, CUDA_HOME=str(nvcc.parents[1]))
        base.pop("DG_JIT_USE_NVRTC", None)

        local_med, local_runs = float("nan"), 0
        if not args.no_local:
            print("\n=== local: DeepGEMM's cache on local disk, real nvcc, no kcachefs")
            env = dict(base, PYTHONPATH=str(site_a), DG_JIT_CACHE_DIR=str(share / "local-cache"),
                       DG_JIT_NVCC_COMPILER=str(wrapper))
            local_med, good = summary("local", run_round("local", share, env, args.ranks, args.kernels, args.timeout))
            ok &= good
            local_runs = len(counter.read_text().split()) if counter.exists() else 0
        if args.save_sources:
            for cu in sorted((share / "local-cache" / "cache").glob("kernel.*/kernel.cu")):
                Path(args.save_sources).mkdir(parents=True, exist_ok=True)
                shutil.copy(cu, Path(args.save_sources) / (cu.parent.name[:40] + ".cu"))
        print("local: %d nvcc runs" % local_runs)

        store, opts, mount_counter = cluster(share, nvcc)
        opts += [o for o in args.options.split(",") if o]
        meds, stats, counted = {}, {}, 0
        for node, site in (("A", site_a), ("B", site_b)):
            m = start_node(share, node, opts, mounts)
            env = shim_env(base, site, m)
            upgrade = {}
            th = None
            if node == "A" and args.upgrade_after:
                th = threading.Thread(target=upgrade_when, args=(m, args.upgrade_after, upgrade))
                th.start()
            meds[node], good = summary(node, run_round(node, share, env, args.ranks, args.kernels, args.timeout))
            ok &= good
            if th:
                th.join()
                if upgrade.get("new") is not None:
                    m.proc = upgrade["new"]  # the new daemon serves the mount now; stop() ends it
                ok &= report_upgrade(m, upgrade)
            stats[node], counted = end_node(m, node, store, mount_counter, counted, mounts)

        print("\n=== summary")
        print("%-46s %8s %8s %7s %s" % ("figure", "kcachefs", "baseline", "ratio", "target"))
        print("%-46s %7.2fs %7.2fs %6.2fx %s" % ("first node cold, median per rank / local disk",
                                                  meds["A"], local_med, meds["A"] / local_med, "<= 1.0x"))
        print("%-46s %7.2fs %7.2fs %6.2fx %s" % ("second node, median per rank / local disk",
                                                  meds["B"], local_med, meds["B"] / local_med, "-"))
        print("compiles: local %d nvcc runs, node A %d, node B %d (%d kernels)" % (
            local_runs, stats["A"].get("compiles_total", 0), stats["B"].get("compiles_total", 0), args.kernels))
        if stats["A"].get("compiles_total", 0) != args.kernels:
            print("FAIL node A compiled %d times for %d kernels" % (stats["A"].get("compiles_total", 0), args.kernels))
            ok = False
        if args.expect_b_compiles >= 0 and stats["B"].get("compiles_total", 0) != args.expect_b_compiles:
            print("FAIL node B compiled %d times, expected %d" % (stats["B"].get("compiles_total", 0), args.expect_b_compiles))
            ok = False
    finally:
        ok = finish(mounts, share, ok)
    print("PASS: gpu-deepgemm" if ok else "FAIL: gpu-deepgemm")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
