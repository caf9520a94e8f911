"""Triton without Triton, for the cache manager's tests (python/kcachefs_triton).

install_standin() puts a stand-in of triton.runtime.cache into sys.modules: FileCacheManager
with Triton 3.x's files (the key directory <TRITON_CACHE_DIR>/<base32 of the key>, each
artifact written into a tmp.pid_<pid>_<uuid> directory and os.replace'd into place, the group
index __grp__<name>.json written last; tests/mount/triton_cache.py has those steps), and
get_cache_manager(), which loads TRITON_CACHE_MANAGER=module:Class as Triton does.

compile() makes the calls of triton.compiler.compile() in their order: get_group of
"<name>.json"; on a hit, load the group as CompiledKernel does; on a miss, "compile" (a
deterministic fake, counted in a file so compiles are counted across processes), put each
artifact, put the metadata json, then put_group.

Run as a program it is one client process (see main()).
"""
import base64
import fcntl
import hashlib
import importlib
import json
import logging
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import triton_cache  # noqa: E402

STAGES = ("ttir", "ttgir", "llir", "ptx", "cubin")


class FileCacheManager:
    """Triton 3.x's FileCacheManager, as far as the compile path uses it."""

    def __init__(self, key, override=False, dump=False):
        self.key = key
        self.lock_path = None
        if dump or override:
            base = os.environ.get("TRITON_DUMP_DIR" if dump else "TRITON_OVERRIDE_DIR", "")
            self.cache_dir = os.path.join(base or os.path.expanduser("~/.triton/dump"), key)
            if dump:
                os.makedirs(self.cache_dir, exist_ok=True)
                self.lock_path = os.path.join(self.cache_dir, "lock")
            return
        base = os.environ.get("TRITON_CACHE_DIR", "").strip() or os.path.expanduser("~/.triton/cache")
        self.cache_dir = os.path.join(base, key)
        self.lock_path = os.path.join(self.cache_dir, "lock")  # named, never used, as in Triton
        os.makedirs(self.cache_dir, exist_ok=True)

    def _make_path(self, filename):
        return os.path.join(self.cache_dir, filename)

    def has_file(self, filename):
        return os.path.exists(self._make_path(filename))

    def get_file(self, filename):
        return self._make_path(filename) if self.has_file(filename) else None

    def get_group(self, filename):
        return triton_cache.get_group(self.cache_dir, filename)

    def put_group(self, filename, group):
        return self.put(json.dumps({"child_paths": group}), "__grp__" + filename, binary=False)

    def put(self, data, filename, binary=True):
        if not isinstance(data, bytes):
            data = str(data)
        return triton_cache.put(self.cache_dir, data, filename)


def get_cache_manager(key):
    """Triton's: the class named by TRITON_CACHE_MANAGER (module:Class), on base32 of the
    hex key."""
    spec = os.environ.get("TRITON_CACHE_MANAGER")
    cls = FileCacheManager
    if spec:
        module, name = spec.split(":")
        cls = getattr(importlib.import_module(module), name)
    return cls(base64.b32encode(bytes.fromhex(key)).decode().rstrip("="))


def install_standin():
    """Make `import triton.runtime.cache` give this stand-in."""
    cache = types.ModuleType("triton.runtime.cache")
    cache.FileCacheManager = FileCacheManager
    cache.get_cache_manager = get_cache_manager
    runtime = types.ModuleType("triton.runtime")
    runtime.cache = cache
    triton = types.ModuleType("triton")
    triton.runtime = runtime
    sys.modules.update({"triton": triton, "triton.runtime": runtime, "triton.runtime.cache": cache})


def artifacts(name, source):
    """The fake compile's output: (filename, bytes or text) per stage, deterministic in the
    source; the cubin is 64 KiB so that a partial one is visible."""
    seed = hashlib.sha256(name.encode() + b"\0" + source).digest()
    out = []
    for ext in STAGES:
        if ext == "cubin":
            blocks = [hashlib.sha256(seed + i.to_bytes(4, "little")).digest() for i in range(2048)]
            out.append((name + ".cubin", b"\x7fELF" + b"".join(blocks)))
        else:
            out.append((name + "." + ext, "%s of %s: %s\n" % (ext, name, seed.hex())))
    return out


def count_compile(counter, name):
    """One line per compile in the counter file (appended under flock: many processes)."""
    fd = os.open(counter, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, ("%d %s\n" % (os.getpid(), name)).encode())
    finally:
        os.close(fd)


def compiles(counter):
    """Compiles so far per kernel name, from the counter file."""
    out = {}
    if os.path.exists(counter):
        with open(counter) as f:
            for line in f:
                name = line.split()[1]
                out[name] = out.get(name, 0) + 1
    return out


def load(group, name):
    """CompiledKernel's load: the metadata json, then every other file of the group; checks
    the bytes are this kernel's and returns a digest of the whole group."""
    meta = json.loads(open(group[name + ".json"]).read())
    assert meta["name"] == name, meta
    h = hashlib.sha256()
    for child in sorted(group):
        with open(group[child], "rb") as f:
            data = f.read()
        h.update(child.encode() + b"\0" + data)
    want = dict(artifacts(name, meta["source"].encode()))
    for child, data in want.items():
        got = open(group[child], "rb").read()
        assert got == (data if isinstance(data, bytes) else data.encode()), \
            "%s: not the compile's bytes (%d bytes)" % (child, len(got))
    return h.hexdigest()


def compile(name, source, counter, during=None):
    """triton.compiler.compile()'s calls; during(name) runs inside the compile (a gate, a
    failure). Returns the digest of the group loaded."""
    from triton.runtime.cache import get_cache_manager
    key = hashlib.sha256(b"standin-3.x:" + name.encode() + b":" + source).hexdigest()
    manager = get_cache_manager(key)
    metadata_filename = name + ".json"
    group = manager.get_group(metadata_filename) or {}
    if group.get(metadata_filename) is not None:
        return load(group, name)
    count_compile(counter, name)
    if during:
        during(name)
    group = {}
    for filename, data in artifacts(name, source):
        group[filename] = manager.put(data, filename)
    meta = {"name": name, "source": source.decode(), "num_warps": 4, "hash": key}
    group[metadata_filename] = manager.put(json.dumps(meta), metadata_filename, binary=False)
    manager.put_group(metadata_filename, group)
    return load(group, name)


def source_of(name):
    return ("__global__ void %s(float *x) { x[threadIdx.x] += 1; }\n" % name).encode()


def main(argv):
    """triton_harness.py [--gate | --stall | --raise] COUNTER NAME...: compile each kernel
    (with the manager TRITON_CACHE_MANAGER names, on TRITON_CACHE_DIR) and print
    "ok NAME DIGEST". Inside the first compile this process makes:
      --gate   prints "compiling NAME" and goes on when a line comes on stdin;
      --stall  prints "compiling NAME" and waits for stdin to close (to be SIGKILLed);
      --raise  prints "compiling NAME", and raises when a line comes on stdin; the exception is caught (as Triton's
               autotuner catches a config's failure), "raised NAME" printed, and the process
               stays alive until stdin closes.
    The manager's debug log goes to stderr ("waiting for ..." when it waits)."""
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("kcachefs_triton").setLevel(logging.DEBUG)
    install_standin()
    mode = argv.pop(0) if argv[0].startswith("--") else None
    counter, names = argv[0], argv[1:]
    first = [True]

    def during(name):
        if not first[0] or mode is None:
            return
        first[0] = False
        print("compiling", name, flush=True)
        if mode == "--gate":
            sys.stdin.readline()
        elif mode == "--stall":
            sys.stdin.read()
        elif mode == "--raise":
            sys.stdin.readline()
            raise RuntimeError("compile of %s failed" % name)

    for name in names:
        try:
            print("ok", name, compile(name, source_of(name), counter, during), flush=True)
        except RuntimeError:
            if mode != "--raise":
                raise
            print("raised", name, flush=True)
        else:
            continue
        sys.stdin.read()  # out of the except block: the failure is dropped, as Triton's is
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
