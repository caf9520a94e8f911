"""kcachefs_triton: a Triton cache manager that compiles each kernel once per node on a
kcachefs mount.

    export TRITON_CACHE_DIR=/mnt/kcache/triton/$USER
    export TRITON_CACHE_MANAGER=kcachefs_triton:KcachefsCacheManager

On a miss in a cache directory on a kcachefs mount, one process of the node takes the
kernel's lock (a flock through the mount, node-wide, released by the kernel when its holder
dies) and compiles; the others wait and load the group it publishes. Off a kcachefs mount it
is Triton's FileCacheManager unchanged. `python3 -m kcachefs_triton stats DIR` prints the
counters (doc/clients.md, "Triton").

The manager class is imported on first use, so that the stats command runs without Triton.
"""

__all__ = ["KcachefsCacheManager"]


def __getattr__(name):
    # Triton loads TRITON_CACHE_MANAGER=module:Class with import_module + getattr.
    if name == "KcachefsCacheManager":
        from .manager import KcachefsCacheManager
        return KcachefsCacheManager
    raise AttributeError("module %r has no attribute %r" % (__name__, name))
