#!/usr/bin/python3
"""Concurrent file-open stress test of a kcachefs mount.

P processes x K kernels x I iterations, started together by a barrier at every iteration.
Each process, for each kernel of an iteration, picks (by the seed) one of:
  native    stage kernel.cu + kernel.flags into cache/i<it>/kernel.k<k>.<hash>, open
            kernel.cubin
  deepgemm  the current DeepGEMM sequence: private dg/tmp/<id>, the client writes its own
            cubin there, fsync, rename the directory into dg/cache/i<it>/kernel.k<k>.<hash>
  reader    readdir the iteration's cache directories and open whatever it finds listed
Every iteration uses fresh entries (one directory per iteration keeps readdir short), so
every iteration is a cold start.

Compilers (-c): `nvcc` (the real one, on small kernels), `fake` (copies a real cubin and
appends the SHA-256 of the source, so every cubin names the source it was compiled from),
`faulty` (like fake, but kernels whose number is 3 mod 8 are rejected with an error
message, and 5 mod 8 exit 0 with garbage: their openers must get EIO, never bytes).
Every compile is logged, so compiles per entry are counted exactly.

It reports opens, compiles per entry, waits, errors by errno, byte mismatches, and exits 1
on any unexpected error or mismatch, or if an entry was compiled more than once.

  scripts/stress.py -P 8 -K 16 -I 10               # a short run (CI also runs -c faulty
                                                   # and -c nvcc, see tests/mount/test_stress.py)
  scripts/stress.py -P 8 -K 64 -I 1000 -c fake     # the long run quoted in doc/testing.md
"""
import argparse
import collections
import errno
import hashlib
import multiprocessing
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NVCC = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
FLAGS = b"-O3\n"
MARK = b"kcachefs-stress-source-sha256:"


def source_of(k, it, seed):
    return (b'// stress kernel %d, iteration %d, seed %d\n'
            b'extern "C" __global__ void k%d(float *x) { x[threadIdx.x] += %d.0f; }\n'
            % (k, it, seed, k, k + it))


def entry_name(k, src):
    return "kernel.k%d.%s" % (k, hashlib.sha256(src + FLAGS).hexdigest()[:32])


def expected_failure(compiler, k):
    if compiler != "faulty":
        return None
    return {3: "rejected", 5: "garbage"}.get(k % 8)


def write_compilers(work, template, log):
    """Wrapper scripts the daemon runs; each logs the SHA-256 of the source it compiles."""
    common = ('src="$1"; out="$4"\n'
              'case "$*" in *-cubin*) ;; *) exec %s "$@";; esac\n'
              'h=$(sha256sum "$src" | cut -c1-64); echo "$h" >> %s\n' % (NVCC, log))
    scripts = {
        "nvcc": common + 'exec %s "$@"\n' % NVCC,
        "fake": common + 'cat %s > "$out"; printf "%s%%s" "$h" >> "$out"\n'
                % (template, MARK.decode()),
        "faulty": common + 'k=$(sed -n "2s/.*void k\\([0-9]*\\).*/\\1/p" "$src")\n'
                  'case $((k %% 8)) in\n'
                  '3) echo "$src(2): error: stress rejection"; exit 1;;\n'
                  '5) head -c 3000 /dev/urandom > "$out"; exit 0;;\n'
                  'esac\n'
                  'cat %s > "$out"; printf "%s%%s" "$h" >> "$out"\n' % (template, MARK.decode()),
    }
    paths = {}
    for name, body in scripts.items():
        p = os.path.join(work, "cc-" + name)
        with open(p, "w") as f:
            f.write("#!/bin/sh\n" + body)
        os.chmod(p, 0o755)
        paths[name] = p
    return paths


def check_cubin(data, src, compiler):
    """None if data is a complete cubin compiled from src, else what is wrong."""
    if len(data) < 64 or data[:4] != b"\x7fELF":
        return "not an ELF file (%d bytes)" % len(data)
    if struct.unpack_from("<H", data, 18)[0] != 190:
        return "not EM_CUDA"
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    if shoff + shentsize * shnum > len(data):
        return "truncated"
    if compiler == "nvcc":
        return None if b"k%d" % int(src.split(b"void k")[1].split(b"(")[0]) in data \
            else "kernel symbol missing"
    want = MARK + hashlib.sha256(src).hexdigest().encode()
    if not data.endswith(want):
        return "compiled from another source"
    return None


class Tally:
    def __init__(self):
        self.opens = 0
        self.bytes = 0
        self.expected_eio = 0
        self.errors = collections.Counter()
        self.mismatches = []

    def error(self, what, e):
        self.errors["%s %s" % (what, errno.errorcode.get(e.errno, e.errno))] += 1

    def merge(self, other):
        self.opens += other.opens
        self.bytes += other.bytes
        self.expected_eio += other.expected_eio
        self.errors.update(other.errors)
        self.mismatches += other.mismatches


def read_cubin(path, src, compiler, k, t, mode):
    try:
        with open(path, "rb") as f:
            data = f.read()
            size = os.fstat(f.fileno()).st_size
    except OSError as e:
        if e.errno == errno.EIO and expected_failure(compiler, k):
            t.expected_eio += 1
        else:
            t.error("open/read kernel.cubin", e)
        return
    t.opens += 1
    t.bytes += len(data)
    if expected_failure(compiler, k):
        t.mismatches.append("%s: served bytes of a kernel that must fail" % path)
        return
    problem = check_cubin(data, src, compiler) or (
        None if size == len(data) else "fstat size %d, read %d" % (size, len(data)))
    if problem:
        t.mismatches.append("%s (%s): %s [tail %r]" % (path, mode, problem, data[-24:]))


def native(mnt, k, it, seed, compiler, t):
    src = source_of(k, it, seed)
    entry = os.path.join(mnt, "cache", "i%d" % it, entry_name(k, src))
    try:
        os.makedirs(entry, exist_ok=True)
        for name, data in (("kernel.cu", src), ("kernel.flags", FLAGS)):
            with open(os.path.join(entry, name), "wb") as f:
                f.write(data)
    except OSError as e:
        t.error("stage", e)
        return
    read_cubin(os.path.join(entry, "kernel.cubin"), src, compiler, k, t, "native")


def deepgemm(mnt, k, it, seed, template, t):
    """DeepGEMM's current sequence, the client compiling for itself (a fake cubin)."""
    src = source_of(k, it, seed)
    entry = os.path.join(mnt, "dg", "cache", "i%d" % it, entry_name(k, src))
    try:
        if os.path.exists(entry):
            for name in ("kernel.cu", "kernel.cubin"):
                os.stat(os.path.join(entry, name))  # DeepGEMM's hit test
        else:
            tmp = os.path.join(mnt, "dg", "tmp", "%d-%s" % (os.getpid(), os.urandom(6).hex()))
            os.makedirs(tmp)
            for name, data in (("kernel.cu", src),
                               ("kernel.cubin", template + MARK + hashlib.sha256(src).hexdigest().encode())):
                with open(os.path.join(tmp, name), "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
            fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
            os.fsync(fd)
            os.close(fd)
            os.makedirs(os.path.dirname(entry), exist_ok=True)
            try:
                os.rename(tmp, entry)
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                shutil.rmtree(tmp)
    except OSError as e:
        t.error("deepgemm", e)
        return
    read_cubin(os.path.join(entry, "kernel.cubin"), src, "fake", k, t, "deepgemm")


def reader(mnt, it, compiler, names, t):
    """Open whatever is listed. The expected source comes from the entry's name: another
    process may be re-staging kernel.cu with O_TRUNC, which, as on any filesystem, can make
    a concurrent read of kernel.cu short for a moment."""
    for sub in ("cache", os.path.join("dg", "cache")):
        root = os.path.join(mnt, sub, "i%d" % it)
        try:
            listed = os.listdir(root)
        except FileNotFoundError:
            continue
        for name in listed:
            entry = os.path.join(root, name)
            try:
                listing = os.listdir(entry)
                if "kernel.cubin" not in listing:
                    continue
                os.close(os.open(os.path.join(entry, "kernel.cu"), os.O_RDONLY))
            except OSError as e:
                t.error("reader listdir/open kernel.cu", e)  # a listed name must open
                continue
            k, src = names[name]
            read_cubin(os.path.join(entry, "kernel.cubin"), src,
                       "fake" if sub != "cache" else compiler, k, t, "reader")


def worker(i, args, mnt, template, barrier, queue):
    t = Tally()
    rng = random.Random(args.seed * 1000003 + i)
    names = {}
    for it in range(args.iterations):
        for k in range(args.kernels):
            src = source_of(k, it, args.seed)
            names[entry_name(k, src)] = (k, src)
    try:
        for it in range(args.iterations):
            barrier.wait(timeout=600)
            if i == 0 and it >= 2 and not args.keep:
                # Evict the iteration before last, as an operator's rm -rf would: every
                # entry the kernel knows holds descriptors in the daemon.
                for sub in ("cache", os.path.join("dg", "cache")):
                    shutil.rmtree(os.path.join(mnt, sub, "i%d" % (it - 2)), ignore_errors=True)
            for k in rng.sample(range(args.kernels), args.kernels):
                mode = rng.choices(("native", "deepgemm", "reader"), weights=(6, 2, 1))[0]
                if mode == "native":
                    native(mnt, k, it, args.seed, args.compiler, t)
                elif mode == "deepgemm":
                    deepgemm(mnt, k, it, args.seed, template, t)
                else:
                    reader(mnt, it, args.compiler, names, t)
    except Exception as e:  # reported, never silent
        t.errors["exception %r" % e] += 1
        barrier.abort()
    queue.put(t)


def stats(mnt):
    out = {}
    with open(os.path.join(mnt, ".kcachefs", "metrics.prom")) as f:
        for line in f:
            if line.strip() and not line.startswith("#") and "{" not in line:
                k, v = line.split()
                out[k.replace("kcachefs_", "")] = float(v)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-P", "--procs", type=int, default=4)
    ap.add_argument("-K", "--kernels", type=int, default=8)
    ap.add_argument("-I", "--iterations", type=int, default=5)
    ap.add_argument("-c", "--compiler", choices=("nvcc", "fake", "faulty"), default="fake")
    ap.add_argument("-s", "--seed", type=int, default=1)
    ap.add_argument("-j", "--jobs", type=int, default=0, help="-o jobs= of the daemon")
    ap.add_argument("--kcachefs", default=os.path.join(REPO, "build", "kcachefs"))
    ap.add_argument("--log-level", default="info", help="-o log_level= of the daemon")
    ap.add_argument("--max-entries", type=int, default=0,
                    help="-o max_entries= of the daemon: entries are evicted during the run "
                    "(and may then be compiled again)")
    ap.add_argument("--show-stats", action="store_true",
                    help="print the mount's .kcachefs/stats at the end")
    ap.add_argument("--max-inodes", type=int, default=0,
                    help="-o max_inodes= of the daemon (small: the kernel is made to forget often)")
    ap.add_argument("--keep", action="store_true",
                    help="keep every iteration's entries (default: remove those two back)")
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="kcachefs-stress.")
    os.chmod(work, 0o711)  # the wrapper compilers run as the compiles' uids (compile_uids)
    backing, mnt = os.path.join(work, "backing"), os.path.join(work, "mnt")
    os.mkdir(backing)
    os.mkdir(mnt)
    log = os.path.join(work, "compiles.log")
    open(log, "w").close()
    os.chmod(log, 0o666)
    template_path = os.path.join(work, "template.cubin")
    with open(os.path.join(work, "t.cu"), "w") as f:
        f.write('extern "C" __global__ void t(float *x) { x[0] = 1.0f; }\n')
    subprocess.run([NVCC, os.path.join(work, "t.cu"), "-cubin", "-o", template_path,
                    "--gpu-architecture=sm_90a"], check=True)
    template = open(template_path, "rb").read()
    compilers = write_compilers(work, template_path, log)
    opts = "nvcc=%s,compile_timeout=120,log_level=%s" % (compilers[args.compiler], args.log_level)
    if args.jobs:
        opts += ",jobs=%d" % args.jobs
    if args.max_inodes:
        opts += ",max_inodes=%d" % args.max_inodes
    if args.max_entries:
        opts += ",max_entries=%d" % args.max_entries
    daemon_log = open(os.path.join(work, "daemon.log"), "w")
    daemon = subprocess.Popen([args.kcachefs, "-f", "-o", opts, backing, mnt],
                              stdout=daemon_log, stderr=subprocess.STDOUT)
    status = 1
    try:
        deadline = time.monotonic() + 15
        while not os.path.ismount(mnt):
            if daemon.poll() is not None or time.monotonic() > deadline:
                sys.exit("stress: kcachefs did not mount (see %s)" % daemon_log.name)
            time.sleep(0.02)
        started = time.monotonic()
        ctx = multiprocessing.get_context("fork")
        barrier, queue = ctx.Barrier(args.procs), ctx.Queue()
        procs = [ctx.Process(target=worker, args=(i, args, mnt, template, barrier, queue))
                 for i in range(args.procs)]
        for p in procs:
            p.start()
        total = Tally()
        for _ in procs:
            total.merge(queue.get())
        for p in procs:
            p.join()
        elapsed = time.monotonic() - started
        s = stats(mnt)
        bound_ok = True
        if args.max_entries:
            # Once the load stops, the bound holds within the grace period and a pass.
            deadline = time.monotonic() + 10
            while stats(mnt)["entries"] > args.max_entries and time.monotonic() < deadline:
                time.sleep(0.1)
            after = stats(mnt)
            bound_ok = after["entries"] <= args.max_entries
            print("eviction: %d evicted; %d entries (max_entries %d) after the load stopped"
                  % (after["evictions_total"], after["entries"], args.max_entries))

        compiled = collections.Counter(l.strip() for l in open(log) if l.strip())
        sources = {hashlib.sha256(source_of(k, it, args.seed)).hexdigest(): k
                   for k in range(args.kernels) for it in range(args.iterations)}
        twice = {h: n for h, n in compiled.items()
                 if n > 1 and not expected_failure(args.compiler, sources.get(h, 0))
                 and not args.max_entries}  # an evicted entry is compiled again
        print("stress: P=%d K=%d I=%d compiler=%s seed=%d: %.1f s"
              % (args.procs, args.kernels, args.iterations, args.compiler, args.seed, elapsed))
        print("opens (cubins read whole): %d, bytes: %d, expected EIO: %d"
              % (total.opens, total.bytes, total.expected_eio))
        print("compiler runs: %d for %d entries; entries compiled more than once: %d"
              % (sum(compiled.values()), len(compiled), len(twice)))
        print("daemon: compiles %d, failures %d, misses %d, waits %d, hits %d, cubin opens %d"
              % (s["compiles_total"], s["compile_failures_total"], s["misses_total"],
                 s["waits_total"], s["hits_total"], s["cubin_opens_total"]))
        print("errors: %d%s" % (sum(total.errors.values()),
                                "".join("\n  %s: %d" % kv for kv in sorted(total.errors.items()))))
        print("byte mismatches: %d%s" % (len(total.mismatches),
                                         "".join("\n  " + m for m in total.mismatches[:20])))
        leftovers = os.listdir(os.path.join(backing, "dg", "tmp")) if os.path.isdir(
            os.path.join(backing, "dg", "tmp")) else []
        print("temp directories left by clients: %d" % len(leftovers))
        daemon_log.flush()
        with open(daemon_log.name, errors="replace") as f:
            # libfuse's own complaints, e.g. a notification that named a stale node id
            fuse_errors = [l.strip() for l in f if l.startswith("fuse: ")]
        print("libfuse errors in the daemon's log: %d%s" % (
            len(fuse_errors), " (first: %s)" % fuse_errors[0] if fuse_errors else ""))
        ok = (not total.errors and not total.mismatches and not twice and not leftovers and
              not fuse_errors and bound_ok)
        if args.show_stats:
            with open(os.path.join(mnt, ".kcachefs", "stats")) as f:
                print("$ cat %s/.kcachefs/stats\n%s" % (mnt, f.read()), end="")
        print("stress: %s" % ("PASS" if ok else "FAIL"))
        status = 0 if ok else 1
    finally:
        subprocess.run(["fusermount3", "-u", mnt], capture_output=True)
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            subprocess.run(["umount", "-l", mnt], capture_output=True)
        daemon_log.close()
        if status == 0:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print("stress: kept %s for inspection" % work)
    sys.exit(status)


if __name__ == "__main__":
    main()
