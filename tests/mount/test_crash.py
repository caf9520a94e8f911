"""SIGKILL the daemon at random points of compiles, publishes and staging writes, then
remount the same backing directory: no partial cubin is served, staged sources survive
whole, temporaries are gone, nothing stays in progress, and every entry compiles or serves
its verified cubin. KC_CRASH_ROUNDS sets the rounds (the long run uses many)."""
import os
import random
import subprocess
import sys
import time

from conftest import Mount, elf_machine, read_result, sample, write_script

WORKLOAD = r"""
import os, sys
mnt, n, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
src = open(sys.argv[4], 'rb').read()
for i in range(n):
    s = src + b'// crash %d %d\n' % (seed, i)
    e = os.path.join(mnt, 'cache', 'kernel.k%d.%064x' % (i, seed * 1000 + i))
    try:
        os.makedirs(e, exist_ok=True)
        with open(os.path.join(e, 'kernel.cu'), 'wb') as f:
            f.write(s[:100]); f.flush(); f.write(s[100:])
        with open(os.path.join(e, 'kernel.flags'), 'wb') as f:
            f.write(b'-O3\n')
        open(os.path.join(e, 'kernel.cubin'), 'rb').read()
    except OSError:
        pass  # the daemon is being killed under us
"""


def test_daemon_killed_at_random_points(tmp_path):
    rounds = int(os.environ.get("KC_CRASH_ROUNDS", "5"))
    rng = random.Random(int(os.environ.get("KC_CRASH_SEED", "1")))
    src_path = tmp_path / "src.cu"
    src = sample("vector_add")[0]
    src_path.write_bytes(src)
    nvcc = write_script(tmp_path / "nvcc-jitter",
                        'case "$*" in *-cubin*) sleep 0.$(( $$ %% 4 ));; esac\n'
                        'exec /usr/local/cuda/bin/nvcc "$@"\n'.replace("%%", "%"))
    (tmp_path / "m").mkdir()
    m = Mount(tmp_path / "m", ["nvcc=%s" % nvcc, "jobs=2"])
    staged = {}
    try:
        for r in range(rounds):
            m.start()
            work = subprocess.Popen([sys.executable, "-c", WORKLOAD, str(m.mnt), "6", str(r),
                                     str(src_path)])
            time.sleep(rng.uniform(0.2, 2.5))
            m.kill()  # SIGKILL the daemon wherever it is
            work.kill()
            work.wait()
            for i in range(6):
                staged[os.path.join("cache", "kernel.k%d.%064x" % (i, r * 1000 + i))] = \
                    src + b"// crash %d %d\n" % (r, i)
        m.start()
        state = m.backing / ".kcachefs"
        assert os.listdir(state / "tmp") == [] and os.listdir(state / "scratch") == []
        for rel, full in staged.items():
            b = m.backing / rel
            if (b / "kernel.cu").exists():  # staged sources are whole, never a prefix
                assert (b / "kernel.cu").read_bytes() == full, rel
            if (b / "kernel.cubin").exists():  # a published cubin is whole and verified
                r = read_result(m.mnt / rel / "kernel.cubin")
                assert r[0] == "ok" and r[2] == (b / "kernel.cubin").stat().st_size, (rel, r)
            if (b / "kernel.cu").exists() and (b / "kernel.flags").exists():
                data = (m.mnt / rel / "kernel.cubin").read_bytes()  # compiles or serves
                assert elf_machine(data) == 190
        assert m.stats()["flights"] == 0
        out = subprocess.run(["ps", "ax", "-o", "args="], capture_output=True, text=True).stdout
        assert str(state / "scratch") not in out, "a compiler of a killed daemon survived"
    finally:
        if m.proc:
            m.stop()
