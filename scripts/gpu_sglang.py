#!/usr/bin/env python3
"""gpu_sglang.py - SGLang's DeepGEMM (sgl-project/DeepGEMM a348cd9: upstream 88965b0 and a
README note) through kcachefs on a GPU node. Run through scripts/gpu-deepgemm.sh with
DG_SCRIPT=gpu_sglang.py (its header says where and how DeepGEMM is built): DG_TAR (or DG_SO)
is the fork, DG_TAR_B (or DG_SO_B) upstream 54e2261 for node B.

Two parts (--part tests, nodes or both):

  tests   the fork's own tests (--tests, default test_bf16.py and test_layout.py), each run as
          DeepGEMM runs it (`python tests/test_X.py`, from its tests/ directory; test_X.py:fn
          runs the one function fn of it, with the seeds its main sets), all at once, on one
          fresh mount: DG_JIT_CACHE_DIR on the mount, DG_JIT_NVCC_COMPILER=kcachefs-nvcc.
          The shim's own nvcc (KCACHEFS_NVCC) is the real one behind a wrapper that logs each
          call: the shim runs it only for what the mount does not serve, so every call there
          but `--version` (DeepGEMM's signature) is a fallback to nvcc. PASS: every test exits
          0, 0 fallbacks, and the mount compiled each of the shim's kernels once, without a
          failure. --extra-tests run beside them and may be cut at --test-timeout (said so).
  nodes   two nodes sharing a dir: store with a cluster key, as scripts/gpu_deepgemm.py runs
          them (R ranks x K bf16_gemm_nt kernels, every result checked against PyTorch): node A
          the fork, node B upstream 54e2261 (another copy, new mtimes), then node C the fork
          again at another path (a control: the store does share where the headers are the
          same). For each kernel node B asked (the shim's entries and compiles ahead), the
          headers it reads under its include root (`nvcc -M` with its own flags) are compared
          with node A's tree, byte for byte: B may take A's cubin only where the code (its
          source without comments) is one of A's and none of those headers differs. PASS:
          every rank of every node right, A compiled each kernel once, each of B's store hits
          is a kernel whose headers are A's (and every hit is found in an entry), B's compiles
          and hits make each kernel once, C compiled nothing, 0 fallbacks on every node.

--save DIR writes the logs (each test's output, the daemons' logs, the shim's calls of nvcc,
the ranks' logs and node B's kernels with the headers that differ) to DIR/gpu-sglang-logs.tar.gz.
"""
import argparse
import concurrent.futures
import filecmp
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "mount"))
sys.path.insert(0, str(REPO / "scripts"))

from gpu_deepgemm import (M, cluster, counting_compiler, end_node, finish, install_copy,  # noqa: E402
                          run_round, shapes, shim_env, start_node, summary)

SHIM_DIR = "kcachefs-nvcc"  # the shim's entries at the mount's root (src/shim/shim.h)
AHEAD_DIR = ".kcachefs/ahead/entries"  # compiles ahead, in the backing directory


def shim_nvcc(share, nvcc):
    """The shim's own nvcc (KCACHEFS_NVCC): nvcc behind a wrapper that logs each call's
    arguments. Returns (the wrapper, the log)."""
    import kcmount
    log = share / "shim-to-nvcc"
    log.write_text("")
    log.chmod(0o666)
    return kcmount.write_script(share / "nvcc-shim-fallback",
                                'echo "$*" >>%s\nexec %s "$@"\n' % (log, nvcc)), log


def fallbacks(log):
    """The calls the shim handed to nvcc that were compiles: all but `nvcc --version`."""
    return [l for l in log.read_text(errors="replace").splitlines() if l.strip() not in ("", "--version")]


def tree_diff(a, b):
    """Relative paths of the files under a and b whose bytes differ or that only one has."""
    def files(root):
        return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
    fa, fb = files(a), files(b)
    return sorted(r for r in fa | fb if r not in fa or r not in fb or
                  not filecmp.cmp(a / r, b / r, shallow=False))


def code_form(source):
    """The source with its comments removed: what the compiler sees of it (DeepGEMM's first
    line is a comment with its include tree's hash)."""
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", source, flags=re.S)


def entries(backing):
    """The kernels a node asked through the shim and compiled ahead: name -> {source, flags,
    log (the head line of its kernel.log), fetched (taken from the cluster store)}."""
    out = {}
    for d in sorted(list((backing / SHIM_DIR).glob("kernel.nvcc.*")) + list((backing / AHEAD_DIR).glob("*"))):
        if not (d / "kernel.cu").exists():
            continue
        log = (d / "kernel.log").read_text(errors="replace") if (d / "kernel.log").exists() else ""
        head = log.splitlines()[0] if log else ""
        out[str(d.relative_to(backing))] = {
            "source": (d / "kernel.cu").read_text(errors="replace"),
            "flags": (d / "kernel.flags").read_text(errors="replace") if (d / "kernel.flags").exists() else "",
            "log": head, "fetched": "from the cluster store" in head}
    return out


def headers_read(entry, nvcc, scratch):
    """(the include root, the files under it that the kernel's compile reads): nvcc -M with
    the entry's own flags, on a copy of its source."""
    args = [l for l in entry["flags"].splitlines() if l and not l.startswith(("#", "--kcachefs-"))]
    roots = [a[2:] for a in args if a.startswith("-I")]
    scratch.mkdir(parents=True)
    (scratch / "kernel.cu").write_text(entry["source"])
    r = subprocess.run([str(nvcc), "-M", "-x", "cu", *args, "kernel.cu"], cwd=scratch,
                       capture_output=True, text=True)
    if r.returncode != 0 or not roots:
        raise RuntimeError("nvcc -M failed (%d): %s" % (r.returncode, r.stderr[-800:]))
    deps = r.stdout.replace("\\\n", " ").split(":", 1)[1].split()
    root = os.path.realpath(roots[0])
    return root, sorted({os.path.relpath(os.path.realpath(p), root) for p in deps
                         if os.path.realpath(p).startswith(root + "/")})


def judge_b(b, a, include_a, nvcc, scratch):
    """For each of node B's kernels: the headers it reads under its include root that differ
    from node A's tree, whether its code is one of A's, and whether it may take A's cubin
    (same code, no header differs). Returns rows (name, fetched, same code, differing)."""
    codes_a = {code_form(e["source"]) for e in a.values()}
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        reads = dict(zip(b, pool.map(lambda n: headers_read(b[n], nvcc, scratch / n.replace("/", "_")), b)))
    rows = []
    for name, e in b.items():
        root, rels = reads[name]
        differ = [r for r in rels if not (include_a / r).is_file() or
                  not filecmp.cmp(Path(root) / r, include_a / r, shallow=False)]
        rows.append((name, e["fetched"], code_form(e["source"]) in codes_a, differ, len(rels)))
    return rows


def test_command(test):
    """How a test runs: "test_X.py" as DeepGEMM runs it; "test_X.py:test_fn" one function of
    it, with the seeds its main sets first."""
    name, _, fn = test.partition(":")
    if not fn:
        return [sys.executable, name]
    return [sys.executable, "-c", "import random, sys, torch; sys.path.insert(0, '.'); "
            "import %s as t; torch.manual_seed(0); random.seed(0); t.%s()" % (name[:-3], fn)]


def run_tests(args, share, base, nvcc, out, logs):
    """The fork's own tests at once on a fresh mount; True if they passed."""
    import kcmount
    tdir = share / "tests"
    tdir.mkdir(mode=0o755)
    tests_src = Path(args.deepgemm).parent / "tests"
    site = install_copy(Path(args.deepgemm), tdir / "site", new_mtimes=False)
    mount_nvcc, counter = counting_compiler(tdir, nvcc)
    fallback_nvcc, fallback_log = shim_nvcc(tdir, nvcc)
    (tdir / "mount").mkdir()
    m = kcmount.Mount(tdir / "mount", ["nvcc=%s" % mount_nvcc])
    out.append(m)
    m.start()
    env = dict(shim_env(base, site, m), KCACHEFS_NVCC=str(fallback_nvcc), PYTHONUNBUFFERED="1")
    print("=== tests: the fork's own tests at once, %s, on %s (DG_JIT_CACHE_DIR=%s, "
          "DG_JIT_NVCC_COMPILER=kcachefs-nvcc)" % (" ".join(args.tests + args.extra_tests), m.mnt,
                                                   env["DG_JIT_CACHE_DIR"]))
    t0 = time.monotonic()
    procs, cut, ended = {}, [], {}
    for t in args.tests + args.extra_tests:
        log = open(tdir / (t.replace(":", ".") + ".log"), "wb")
        procs[t] = (subprocess.Popen(test_command(t), cwd=tests_src, env=env, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True), log)
    while len(ended) < len(procs) and time.monotonic() - t0 < args.test_timeout:
        ended.update({t: time.monotonic() - t0 for t, (p, _) in procs.items()
                      if t not in ended and p.poll() is not None})
        time.sleep(0.2)
    ok = True
    for t, (p, log) in procs.items():
        if p.poll() is None:
            # the test and its shims: a shim left waiting would run nvcc itself once the
            # mount's stop kills the compile it waits for
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            cut.append(t)
        rc = "killed at %d s" % args.test_timeout if t in cut else p.returncode
        secs = ended.get(t, time.monotonic() - t0)
        log.close()
        logs.append(Path(log.name))
        text = Path(log.name).read_text(errors="replace")
        sections = [l.strip().rstrip(":") for l in text.splitlines() if l.startswith("Testing ")]
        cases = sum(1 for l in text.splitlines() if l.lstrip().startswith("> Perf"))
        print("%-16s exit %s in %.1f s: %d sections (%s), %d cases timed after their checks" % (
            t, rc, secs, len(sections), "; ".join(sections), cases))
        if rc != 0 and not (t in cut and t in args.extra_tests):
            print("  FAIL %s:\n%s" % (t, "\n".join(text.splitlines()[-25:])))
            ok = False
        elif rc != 0:
            print("  (an extra test, cut at the time limit: what it checked before passed)")
    dg = len(list((m.mnt / "dg" / "cache").glob("kernel.*")))
    shimmed = len(list((m.mnt / SHIM_DIR).glob("kernel.nvcc.*")))
    s = m.stats()
    compiles = len(counter.read_text().split())
    took = [float(x) for x in re.findall(r"published \(ok\) in ([0-9.]+) s", m.daemon_log())]
    logs.extend([m.log_path, fallback_log])
    m.stop()
    out.remove(m)
    fb = fallbacks(fallback_log)  # once the mount is gone: a call its stop caused counts too
    versions = fallback_log.read_text().split("\n").count("--version")
    print("tests: %d DeepGEMM kernels in its cache, %d shim entries, %d mount compiles (%d "
          "failed), %d fallbacks to nvcc (and %d shim calls of nvcc --version); %.1f s in all" % (
              dg, shimmed, compiles, s.get("compile_failures_total", 0), len(fb), versions,
              time.monotonic() - t0))
    if took:
        print("tests: the mount's compiles took %.1f s of compiler time, %.2f s each on average, "
              "%.2f s the longest" % (sum(took), sum(took) / len(took), max(took)))
    for l in fb[:5]:
        print("  FAIL fallback: nvcc %s" % l[:300])
    # A test cut in a shim's call may leave an entry staged and never compiled.
    if fb or not shimmed - len(cut) <= compiles <= shimmed or s.get("compile_failures_total", 0):
        ok = False
        print("FAIL tests: %d fallbacks, %d compiles for %d shim entries" % (len(fb), compiles, shimmed))
    return ok


def run_nodes(args, share, base, nvcc, mounts, logs):
    """Nodes A (the fork), B (upstream) and C (the fork again) on one store; True if passed."""
    site = {"A": install_copy(Path(args.deepgemm), share / "nodeA" / "site", new_mtimes=False),
            "B": install_copy(Path(args.deepgemm_b), share / "nodeB" / "venv" / "lib" / "site-packages",
                              new_mtimes=True),
            "C": install_copy(Path(args.deepgemm), share / "nodeC" / "site", new_mtimes=True)}
    inc = {n: site[n] / "deep_gemm" / "include" for n in site}
    differ = tree_diff(inc["A"], inc["B"])
    own = [r for r in differ if r.startswith("deep_gemm/")]
    print("\n=== nodes: A the fork (%s), B upstream (%s), C the fork again at another path; "
          "%d ranks x %d kernels (bf16_gemm_nt, m=%d, N x K: %s)" % (
              args.deepgemm, args.deepgemm_b, args.ranks, args.kernels, M,
              " ".join("%dx%d" % s for s in shapes(args.kernels))))
    print("include roots A and B: %d files differ or are in one only, %d of them under "
          "deep_gemm/ (%s), %d under cute/ and cutlass/" % (
              len(differ), len(own), " ".join(own), len(differ) - len(own)))
    store, opts, counter = cluster(share, nvcc)
    fallback_nvcc, fallback_log = shim_nvcc(share, nvcc)
    ok, counted, stats, kernels, meds = True, 0, {}, {}, {}
    for node in ("A", "B", "C"):
        m = start_node(share, node, opts, mounts)
        env = dict(shim_env(base, site[node], m), KCACHEFS_NVCC=str(fallback_nvcc))
        meds[node], good = summary(node, run_round(node, share, env, args.ranks, args.kernels, args.timeout))
        ok &= good
        ahead = {k: int(m.stats().get(k, 0)) for k in ("ahead_compiles_total", "ahead_unused")}
        stats[node], counted = end_node(m, node, store, counter, counted, mounts)
        stats[node].update(ahead)
        kernels[node] = entries(m.backing)
        logs.append(m.log_path)
    fb = fallbacks(fallback_log)
    logs.append(fallback_log)

    rows = judge_b(kernels["B"], kernels["A"], inc["A"], nvcc, share / "deps")
    with open(share / "nodeB-kernels.txt", "w") as f:
        for name, fetched, same, diff, n in rows:
            f.write("%s %s, code %s A's, reads %d headers under its root, %d differ from A's: %s\n" % (
                name, "fetched" if fetched else "not fetched", "is one of" if same else "is none of",
                n, len(diff), " ".join(diff)))
    logs.append(share / "nodeB-kernels.txt")
    shared_ok = [r for r in rows if r[2] and not r[3]]
    taken = [r for r in rows if r[1]]
    wrong = [r for r in taken if not (r[2] and not r[3])]
    asked = [r for r in rows if r[0].startswith(SHIM_DIR)]
    b, a, c = stats["B"], stats["A"], stats["C"]
    print("\n=== summary")
    for node in ("A", "B", "C"):
        s = stats[node]
        print("node %s: median per rank %.2f s, compiles %d (%d of them ahead, %d never asked), "
              "store hits %d" % (node, meds[node], s.get("compiles_total", 0),
                                 s["ahead_compiles_total"], s["ahead_unused"], s.get("remote_hits_total", 0)))
    print("node B: %d kernels asked through the shim, %d compiled ahead; each reads %s headers "
          "under its include root, of which %s differ from A's; %d could take A's cubin (same "
          "code and headers), %d were taken from the store, %d of them where B's headers differ" % (
              len(asked), len(rows) - len(asked), "/".join(sorted({str(r[4]) for r in rows})),
              "/".join(sorted({str(len(r[3])) for r in rows})), len(shared_ok), len(taken), len(wrong)))
    print("node B: the headers its kernels read that differ from A's: %s" % (
        " ".join(sorted({h for r in rows for h in r[3]})) or "none"))
    print("fallbacks to nvcc on the three nodes: %d" % len(fb))
    checks = [
        (a.get("compiles_total", 0) == args.kernels, "node A compiled %d times for %d kernels" % (
            a.get("compiles_total", 0), args.kernels)),
        (not wrong, "node B took %d cubins where its headers differ: %s" % (len(wrong), [r[0] for r in wrong])),
        (len(taken) == b.get("remote_hits_total", 0), "node B: %d store hits, %d found in its entries" % (
            b.get("remote_hits_total", 0), len(taken))),
        (len(asked) == args.kernels and b.get("compiles_total", 0) - b["ahead_unused"] +
         b.get("remote_hits_total", 0) == args.kernels,
         "node B: %d kernels asked, %d compiles (%d never asked) and %d hits for %d kernels" % (
             len(asked), b.get("compiles_total", 0), b["ahead_unused"], b.get("remote_hits_total", 0),
             args.kernels)),
        (c.get("compiles_total", 0) == 0 and c.get("remote_hits_total", 0) >= args.kernels,
         "node C (A's headers) compiled %d and took %d from the store, for %d kernels" % (
             c.get("compiles_total", 0), c.get("remote_hits_total", 0), args.kernels)),
        (not fb, "%d fallbacks to nvcc: %s" % (len(fb), fb[:3]))]
    for good, what in checks:
        if not good:
            print("FAIL %s" % what)
            ok = False
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--deepgemm", required=True, help="the fork's built deep_gemm package (with _C*.so)")
    ap.add_argument("--deepgemm-b", help="node B's built deep_gemm package (upstream 54e2261)")
    ap.add_argument("--part", choices=("tests", "nodes", "both"), default="both")
    ap.add_argument("--tests", nargs="+", default=["test_bf16.py", "test_layout.py"])
    ap.add_argument("--extra-tests", nargs="*", default=[], help="more of its tests, run with the "
                    "others and cut without a failure if they are still running at --test-timeout")
    ap.add_argument("--test-timeout", type=int, default=450, help="seconds for all the tests")
    ap.add_argument("--kernels", type=int, default=16)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--timeout", type=int, default=400, help="seconds per node's round")
    ap.add_argument("--save", help="a directory for gpu-sglang-logs.tar.gz")
    args = ap.parse_args()
    if args.part != "tests" and not args.deepgemm_b:
        ap.error("--part nodes needs --deepgemm-b (DG_TAR_B or DG_SO_B in gpu-deepgemm.sh)")

    nvcc = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc"
    share = Path(tempfile.mkdtemp(prefix="kcachefs-dg."))
    os.chmod(share, 0o755)
    base = dict(os.environ, CUDA_HOME=str(nvcc.parents[1]))
    base.pop("DG_JIT_USE_NVRTC", None)
    mounts, logs, ok = [], [], True
    try:
        if args.part in ("tests", "both"):
            ok &= run_tests(args, share, base, nvcc, mounts, logs)
        if args.part in ("nodes", "both"):
            ok &= run_nodes(args, share, base, nvcc, mounts, logs)
            logs.extend(sorted(share.glob("round-*/rank.*.log")))
    finally:
        for m in list(mounts):  # stopped before the logs are read
            m.stop()
            mounts.remove(m)
        if args.save:
            Path(args.save).mkdir(parents=True, exist_ok=True)
            with tarfile.open(Path(args.save) / "gpu-sglang-logs.tar.gz", "w:gz") as tar:
                for p in logs:
                    if p.exists():
                        tar.add(p, arcname=str(p.relative_to(share)))
        ok = finish(mounts, share, ok)
    print("PASS: gpu-sglang" if ok else "FAIL: gpu-sglang")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
