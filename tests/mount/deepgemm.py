"""What DeepGEMM's JIT does in its cache directory, syscall for syscall (DESIGN.md,
"What current DeepGEMM does on disk"), so the mount can be tested against it without
DeepGEMM itself. Both return the cubin bytes they loaded."""
import errno
import hashlib
import os
import shutil
import subprocess

NVCC = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
FLAGS = ["-O3", "--gpu-architecture=sm_90a"]


def entry_dir(cache_root, name, source):
    key = hashlib.sha256(name.encode() + b"NVCC13.0" + " ".join(FLAGS).encode() + source)
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


def current(cache_root, name, source, nvcc=NVCC):
    """Compile into a private C/tmp/<id>, rename the directory into C/cache."""
    entry = entry_dir(cache_root, name, source)
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
    subprocess.run([nvcc, src, "-cubin", "-o", os.path.join(tmp, "kernel.cubin")] + FLAGS,
                   cwd=tmp_root, check=True, capture_output=True)
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


def older(cache_root, name, source, nvcc=NVCC):
    """DeepGEMM 477618c: create the final entry, rename a temp source over kernel.cu,
    compile it there into a temp cubin, rename that over kernel.cubin."""
    entry = entry_dir(cache_root, name, source)
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
    subprocess.run([nvcc, os.path.join(entry, "kernel.cu"), "-cubin", "-o", tmp_cubin] + FLAGS,
                   check=True, capture_output=True)
    os.replace(tmp_cubin, cubin)
    return load(entry)
