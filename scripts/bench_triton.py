"""The triton figure of scripts/bench.py: P=8 processes released together make the
calls of Triton's compile() (tests/mount/triton_harness.py, the stand-in of
triton.runtime.cache: no Triton on the build machine) on 4 kernels in one order, as
scripts/triton_gpu.py's processes do (add, softmax, two matmul configs). Each round is
managed cold (TRITON_CACHE_MANAGER=kcachefs_triton:KcachefsCacheManager, TRITON_CACHE_DIR on
a fresh kcachefs mount) against plain cold (Triton's own FileCacheManager, TRITON_CACHE_DIR
on the local disk beside the mount), in alternating order; a process's time is from the
barrier to its last kernel loaded, and a round's figure the median over its processes.

Two compilers, two rows:
  nvcc   each compile is real nvcc -cubin -arch=sm_90a of a small kernel: the managed round
         compiles each kernel once, the plain one 8 times, so where there are fewer cores than
         processes plain also pays for the others' compiles;
  fixed  each compile takes a fixed wall time (--triton-compile-s, default 0.5 s) without
         using a core, as on a GPU node with a core per process: what is left is the
         manager's own cost (the lock wait, the group's verification) and the mount's round
         trips for Triton's own files (its puts and loads). A second row splits the two: the
         same managed rounds against plain Triton cold with its cache directory on a mount.
"""
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kcmount import NVCC, Mount, run_parallel

NAMES = ["add", "softmax", "matmul_cfg0", "matmul_cfg1"]
MANAGER = "kcachefs_triton:KcachefsCacheManager"
REPO = Path(__file__).resolve().parents[1]


def nvcc_compile(name):
    """A real compile of the kernel's source (the harness's source_of), output discarded."""
    import triton_harness
    with tempfile.TemporaryDirectory(prefix="bench-triton-") as d:
        src = Path(d) / (name + ".cu")
        src.write_bytes(triton_harness.source_of(name))
        subprocess.run([str(NVCC), str(src), "-cubin", "-o", str(Path(d) / "k.cubin"),
                        "-arch=sm_90a"], check=True, capture_output=True)


def one_process(i, root, counter, managed, compile_s):
    """One Triton process: compile and load every kernel; returns its seconds."""
    import triton_harness
    triton_harness.install_standin()  # in the forked child only
    os.environ["TRITON_CACHE_DIR"] = str(root)
    if managed:
        os.environ["TRITON_CACHE_MANAGER"] = MANAGER
    else:
        os.environ.pop("TRITON_CACHE_MANAGER", None)
    work = nvcc_compile if compile_s is None else (lambda name: time.sleep(compile_s))
    t0 = time.monotonic()
    for name in NAMES:
        triton_harness.compile(name, triton_harness.source_of(name), str(counter), work)
    return time.monotonic() - t0


def bench_triton(tmp, reps, row, compile_s=0.5, procs=8):
    sys.path.insert(0, str(REPO / "python"))  # the manager, for the forked processes
    import triton_harness
    for compiler in ("nvcc", "fixed"):
        secs = None if compiler == "nvcc" else compile_s
        print("triton: %d processes x %d kernels, managed cold on a mount / plain cold on local "
              "disk, compile: %s" % (procs, len(NAMES), "real nvcc" if secs is None else
                                     "fixed %.2f s" % secs), flush=True)
        modes = ["managed", "local"] + (["mount"] if secs is not None else [])
        medians = {mode: [] for mode in modes}
        # real compiles load every core: fewer rounds of them
        for rep in range(max(2, reps // 2) if secs is None else reps):
            for mode in (modes if rep % 2 == 0 else modes[::-1]):
                managed = mode == "managed"
                name = "triton-%s-%d-%s" % (compiler, rep, mode)
                base = Path(tmp) / name
                base.mkdir()
                counter = base / "compiles"
                m = Mount(base, []).start() if mode != "local" else None
                try:
                    root = (m.mnt if m else base) / "triton"
                    times = run_parallel(procs, one_process, root, counter, managed, secs,
                                         timeout=900)
                    bad = [t for t in times if not isinstance(t, float)]
                    assert not bad, bad
                    compiles = triton_harness.compiles(str(counter))
                    want = 1 if managed else procs
                    assert compiles == {n: want for n in NAMES}, compiles
                finally:
                    if m:
                        m.stop()
                medians[mode].append(statistics.median(times))
                print("  %-8s round %d: median %.3f s per process (%.3f-%.3f), %d compiles" % (
                    mode, rep, medians[mode][-1], min(times), max(times),
                    sum(compiles.values())), flush=True)
        what = compiler if secs is None else "%.1f s fixed" % secs
        row("triton %d procs, %s compile: managed cold (plain cold on local disk is "
            "baseline)" % (procs, what), medians["managed"], medians["local"], "s", "<= 1.0x")
        if "mount" in medians:
            row("triton %d procs, %s compile: managed cold (plain cold on a mount is "
                "baseline)" % (procs, what), medians["managed"], medians["mount"], "s",
                "<= 1.0x")
