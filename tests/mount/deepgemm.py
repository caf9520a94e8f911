"""What DeepGEMM's JIT does in its cache directory, syscall for syscall (current versions:
a private tmp/<id> renamed into cache/kernel.<name>.<hash>; older ones, such as commit
477618c: files renamed into the final entry), so the mount can be tested against it
without DeepGEMM itself. Both sequences return the cubin bytes they loaded.

The compiler is DeepGEMM's: $DG_JIT_NVCC_COMPILER, else $CUDA_HOME/bin/nvcc. Like DeepGEMM,
it is asked for "--version" (the "release X.Y" line gives the signature in every key) and
called as  <nvcc> <src> -cubin -o <out> <flags>  from C/tmp, with DeepGEMM's flags.

Run as a script, it is the GPU check's client (scripts/gpu-smoke.sh, SMOKE_CLIENT):
  deepgemm.py [--ranks N] [--protocol current|older] CACHE_ROOT NAME=SOURCE...
runs N ranks at once over the kernels and prints one entry directory per kernel.
"""
import argparse
import errno
import functools
import hashlib
import multiprocessing
import os
import re
import shutil
import subprocess
import sys

# The kernels' include directory: the tests point it at kcmount.KERNELS (a copy compiles
# can reach when the tree is private).
INCLUDE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kernels", "include")


def compiler():
    return os.environ.get("DG_JIT_NVCC_COMPILER") or os.path.join(
        os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")


def flags():
    """DeepGEMM's nvcc flags for an sm_90a kernel, as it printed a real call on an H200."""
    return ["-std=c++20", "--diag-suppress=39,161,174,177,186,940",
            "--ptxas-options=--register-usage-level=10", "-I" + os.path.realpath(INCLUDE),
            "--gpu-architecture=sm_90a",
            "--compiler-options=-fPIC,-O3,-fconcepts,-Wno-deprecated-declarations,-Wno-abi",
            "-O3", "--expt-relaxed-constexpr", "--expt-extended-lambda"]


@functools.lru_cache(maxsize=None)
def signature(nvcc):
    """"NVCC13.0" from "<nvcc> --version", as DeepGEMM builds it (it asserts on failure)."""
    out = subprocess.run([nvcc, "--version"], check=True, capture_output=True, text=True).stdout
    m = re.search(r"release (\d+\.\d+)", out)
    if not m:
        raise RuntimeError("cannot read the nvcc version from: " + out)
    return "NVCC" + m.group(1)


def entry_dir(cache_root, name, source, nvcc=None):
    sig = signature(nvcc or compiler())
    key = hashlib.sha256(name.encode() + sig.encode() + " ".join(flags()).encode() + source)
    return os.path.join(cache_root, "cache", "kernel.%s.%s" % (name, key.hexdigest()[:32]))


def fsync_path(path, directory=False):
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def hit_test(entry):
    """DeepGEMM's check: an existing entry must hold kernel.cu and kernel.cubin."""
    if not os.path.exists(entry):
        return False
    if not (os.path.exists(os.path.join(entry, "kernel.cu")) and
            os.path.exists(os.path.join(entry, "kernel.cubin"))):
        raise RuntimeError("Corrupted JIT cache directory: " + entry)
    return True


def load(entry):
    with open(os.path.join(entry, "kernel.cubin"), "rb") as f:
        return f.read()


def run_nvcc(nvcc, src, out, cwd=None):
    r = subprocess.run([nvcc, src, "-cubin", "-o", out] + flags(), cwd=cwd,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("nvcc exited %d: %s" % (r.returncode, r.stdout + r.stderr))


def current(cache_root, name, source, nvcc=None):
    """Compile into a private C/tmp/<id>, rename the directory into C/cache."""
    nvcc = nvcc or compiler()
    entry = entry_dir(cache_root, name, source, nvcc)
    if hit_test(entry):
        return load(entry)
    tmp_root = os.path.join(cache_root, "tmp")
    os.makedirs(tmp_root, exist_ok=True)
    tmp = os.path.join(tmp_root, "%d-%s-%s-%s" % (os.getpid(), os.urandom(4).hex(),
                                                  os.urandom(4).hex(), os.urandom(4).hex()))
    os.mkdir(tmp)
    src = os.path.join(tmp, "kernel.cu")
    with open(src, "wb") as f:
        f.write(source)
        f.flush()
        os.fsync(f.fileno())
    run_nvcc(nvcc, src, os.path.join(tmp, "kernel.cubin"), cwd=tmp_root)
    for fname in os.listdir(tmp):
        fsync_path(os.path.join(tmp, fname))
    fsync_path(tmp, directory=True)
    os.makedirs(os.path.join(cache_root, "cache"), exist_ok=True)
    try:
        os.rename(tmp, entry)
    except OSError as e:
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
        shutil.rmtree(tmp)  # the loser uses the winner's entry
    if not hit_test(entry):
        raise RuntimeError("entry vanished after rename: " + entry)
    return load(entry)


def older(cache_root, name, source, nvcc=None):
    """DeepGEMM 477618c: create the final entry, rename a temp source over kernel.cu,
    compile it there into a temp cubin, rename that over kernel.cubin."""
    nvcc = nvcc or compiler()
    entry = entry_dir(cache_root, name, source, nvcc)
    cubin = os.path.join(entry, "kernel.cubin")
    if os.path.exists(cubin):
        return load(entry)
    tmp_root = os.path.join(cache_root, "tmp")
    os.makedirs(entry, exist_ok=True)
    os.makedirs(tmp_root, exist_ok=True)
    uid = "%d-%s" % (os.getpid(), os.urandom(6).hex())
    tmp_src = os.path.join(tmp_root, uid + ".cu")
    with open(tmp_src, "wb") as f:
        f.write(source)
    os.replace(tmp_src, os.path.join(entry, "kernel.cu"))
    tmp_cubin = os.path.join(tmp_root, uid + ".cubin")
    run_nvcc(nvcc, os.path.join(entry, "kernel.cu"), tmp_cubin)
    os.replace(tmp_cubin, cubin)
    return load(entry)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--protocol", choices=("current", "older"), default="current")
    ap.add_argument("cache_root")
    ap.add_argument("kernels", nargs="+", metavar="NAME=SOURCE")
    args = ap.parse_args()
    kernels = [(k.split("=", 1)[0], open(k.split("=", 1)[1], "rb").read()) for k in args.kernels]
    run = globals()[args.protocol]
    barrier = multiprocessing.Barrier(args.ranks)

    def rank(i):
        barrier.wait()
        try:
            for j in range(len(kernels)):  # rank i starts at kernel i, so compiles overlap
                name, src = kernels[(i + j) % len(kernels)]
                run(args.cache_root, name, src)
        except Exception as e:  # the rank's error, as DeepGEMM would die with it
            print("rank %d: %s" % (i, e), file=sys.stderr)
            os._exit(1)
        os._exit(0)

    procs = [multiprocessing.Process(target=rank, args=(i,)) for i in range(args.ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = [i for i, p in enumerate(procs) if p.exitcode != 0]
    for name, src in kernels:
        print(entry_dir(args.cache_root, name, src))
    if failed:
        print("ranks failed: %s" % failed, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
