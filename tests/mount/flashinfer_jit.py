"""What FlashInfer's JIT (flashinfer/jit/core.py, JitSpec.build_and_load) does in its
workspace, syscall for syscall, so the mount can be tested against it without FlashInfer.

A lock file <jit>/tmp/<name>.lock is held with the filelock package's UnixFileLock (open
O_RDWR|O_CREAT|O_TRUNC, flock(LOCK_EX|LOCK_NB) polled every 50 ms, LOCK_UN and close on
release; the file stays) around both the build and the load. The build writes the generated
source and build.ninja only if they differ, then "ninja" compiles when the output is missing
or older than its inputs: the compiler writes its output in place, and ninja appends to
.ninja_log.
"""
import fcntl
import os
import subprocess
import time
from contextlib import contextmanager

NVCC = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")


@contextmanager
def file_lock(path, poll=0.05, timeout=300):
    """filelock.UnixFileLock, as FileLock(path, thread_local=False) uses it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError("lock %s not acquired in %s s" % (path, timeout))
                time.sleep(poll)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def write_if_different(path, content):
    if os.path.exists(path):
        with open(path, "rb") as f:
            if f.read() == content:
                return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(content)


def ninja(build_dir, src, out, nvcc):
    """The part of ninja that matters on disk: rebuild if out is missing or older."""
    if os.path.exists(out) and os.stat(out).st_mtime_ns >= os.stat(src).st_mtime_ns:
        return False
    subprocess.run([nvcc, src, "-cubin", "-o", out, "-arch=sm_90a", "-O3"], check=True,
                   capture_output=True)
    with open(os.path.join(build_dir, ".ninja_log"), "a") as f:
        f.write("0\t1\t%d\t%s\t0\n" % (time.time_ns(), os.path.basename(out)))
    return True


def build_and_load(jit_dir, name, source, nvcc=NVCC):
    """Returns the cubin bytes loaded under the lock."""
    os.makedirs(os.path.join(jit_dir, "tmp"), exist_ok=True)
    build_dir = os.path.join(jit_dir, "cached_ops", name)
    with file_lock(os.path.join(jit_dir, "tmp", name + ".lock")):
        src = os.path.join(jit_dir, "generated", name, name + ".cu")
        write_if_different(src, source)
        write_if_different(os.path.join(build_dir, "build.ninja"),
                           ("rule nvcc\nbuild %s.cubin: nvcc %s\n" % (name, src)).encode())
        ninja(build_dir, src, os.path.join(build_dir, name + ".cubin"), nvcc)
        with open(os.path.join(build_dir, name + ".cubin"), "rb") as f:
            return f.read()
