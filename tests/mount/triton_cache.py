"""What Triton's file cache (triton/runtime/cache.py, FileCacheManager, and the compile
path of triton/compiler/compiler.py) does in $TRITON_CACHE_DIR, syscall for syscall, so the
mount can be tested against it without Triton.

Per kernel: a directory named by the key; every artifact is written into a private temp
subdirectory tmp.pid_<pid>_<uuid> of it and replaced into place, the emptied temp directory
is removed with os.removedirs, and the group index __grp__<name>.json is written last. A
hit reads the group index and loads the files it lists.
"""
import base64
import hashlib
import json
import os
import subprocess
import tempfile
import uuid

NVCC = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")


def key_dir(cache_root, name, source):
    digest = hashlib.sha256(b"triton-3:" + name.encode() + b":" + source).digest()
    return os.path.join(cache_root, base64.b32encode(digest).decode().rstrip("="))


def put(cache_dir, data, filename):
    """FileCacheManager.put: temp dir, write, os.replace into place, os.removedirs."""
    filepath = os.path.join(cache_dir, filename)
    temp_dir = os.path.join(cache_dir, "tmp.pid_%d_%s" % (os.getpid(), uuid.uuid4()))
    os.makedirs(temp_dir, exist_ok=True)
    temp_path = os.path.join(temp_dir, filename)
    with open(temp_path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
    os.replace(temp_path, filepath)
    os.removedirs(temp_dir)  # stops at the first parent that is not empty
    return filepath


def get_group(cache_dir, filename):
    """FileCacheManager.get_group: the children of the index that exist, or None."""
    grp = os.path.join(cache_dir, "__grp__" + filename)
    if not os.path.exists(grp):
        return None
    with open(grp) as f:
        child_paths = json.load(f).get("child_paths")
    if child_paths is None:
        return None
    return {c: p for c, p in child_paths.items() if os.path.exists(p)}


def compile_cubin(name, source, nvcc=NVCC):
    """Triton compiles in memory and runs ptxas on temp files outside its cache."""
    with tempfile.TemporaryDirectory(prefix="triton-emu-") as d:
        src = os.path.join(d, name + ".cu")
        with open(src, "wb") as f:
            f.write(source)
        out = os.path.join(d, name + ".cubin")
        subprocess.run([nvcc, src, "-cubin", "-o", out, "-arch=sm_90a", "-O3"], check=True,
                       capture_output=True)
        with open(out, "rb") as f:
            return f.read()


def compile_and_load(cache_root, name, source, nvcc=NVCC):
    """triton.compile: a hit loads the group; a miss writes every stage, then the index.
    Returns the cubin bytes loaded."""
    cache_dir = key_dir(cache_root, name, source)
    os.makedirs(cache_dir, exist_ok=True)
    meta_name = name + ".json"
    group = get_group(cache_dir, meta_name) or {}
    if meta_name not in group:
        cubin = compile_cubin(name, source, nvcc)
        group = {}
        for ext, data in (("ttir", "ttir of %s\n" % name), ("ttgir", "ttgir of %s\n" % name),
                          ("llir", "llir of %s\n" % name), ("ptx", "ptx of %s\n" % name),
                          ("cubin", cubin)):
            group[name + "." + ext] = put(cache_dir, data, name + "." + ext)
        meta = {"name": name, "target": "cuda:90", "num_warps": 4,
                "hash": hashlib.sha256(cubin).hexdigest()}
        group[meta_name] = put(cache_dir, json.dumps(meta), meta_name)
        put(cache_dir, json.dumps({"child_paths": group}), "__grp__" + meta_name)
    # CompiledKernel: read every file of the group, load the cubin from its bytes
    files = {}
    for fname, path in group.items():
        with open(path, "rb") as f:
            files[fname] = f.read()
    meta = json.loads(files[meta_name])
    cubin = files[name + ".cubin"]
    if hashlib.sha256(cubin).hexdigest() != meta["hash"]:
        raise RuntimeError("cubin of %s does not match its metadata" % name)
    return cubin
