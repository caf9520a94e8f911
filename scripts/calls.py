#!/usr/bin/env python3
"""calls.py - which source files call each other's functions both ways.

    scripts/calls.py [BUILD_DIR]      (default: build)

Reads BUILD_DIR's compile_commands.json for the object of each source file of the programs
(fs/, src/; tests/ and scripts/ left out), and nm(1) for the functions and data each object
defines and the ones it uses. Prints each pair of files where each uses something the other
defines, and exits 1 if there is one; else prints how many files and calls it looked at and
exits 0. Run by the unit suite (tests/meson.build) on every build.
"""
import collections
import json
import os
import subprocess
import sys


def symbols(obj):
    """The global symbols obj defines and the ones it leaves undefined."""
    out = subprocess.run(["nm", obj], capture_output=True, text=True, check=True).stdout
    defined, used = set(), set()
    for line in out.splitlines():
        f = line.split()
        if len(f) == 3 and f[1] in "TDBRV":
            defined.add(f[2])
        elif len(f) == 2 and f[0] == "U":
            used.add(f[1])
    return defined, used


def main():
    build = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "build")
    with open(os.path.join(build, "compile_commands.json")) as f:
        commands = json.load(f)
    src_root = os.path.dirname(os.path.abspath(__file__ + "/.."))
    objects = {}  # source path (from the tree's root) -> object
    for c in commands:
        src = os.path.relpath(os.path.normpath(os.path.join(c["directory"], c["file"])), src_root)
        if src.split("/")[0] not in ("fs", "src"):
            continue
        obj = os.path.join(c["directory"], c["output"])
        if os.path.exists(obj):
            objects.setdefault(src, obj)  # the same file in two targets: one is enough
    if not objects:
        print(f"calls.py: no object of fs/ or src/ under {build}: build it first", file=sys.stderr)
        return 2
    defined_by = collections.defaultdict(set)
    uses = {}
    for src, obj in objects.items():
        d, u = symbols(obj)
        uses[src] = u
        for name in d:
            defined_by[name].add(src)
    calls = collections.defaultdict(lambda: collections.defaultdict(set))
    for src, used in uses.items():
        for name in used:
            for other in defined_by.get(name, ()):
                if other != src:
                    calls[src][other].add(name)
    both = []
    for a in sorted(calls):
        for b in sorted(calls[a]):
            if a < b and a in calls.get(b, {}):
                both.append((a, b))
    for a, b in both:
        print(f"{a} <-> {b}: {a} uses {', '.join(sorted(calls[a][b]))}; "
              f"{b} uses {', '.join(sorted(calls[b][a]))}")
    n_calls = sum(len(v) for v in calls.values())
    print(f"calls.py: {len(objects)} files, {n_calls} file-to-file uses, "
          f"{len(both)} pairs that use each other")
    return 1 if both else 0


if __name__ == "__main__":
    sys.exit(main())
