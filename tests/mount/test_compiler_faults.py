"""Every way a compiler run can go wrong: waiters get EIO promptly, nothing is published,
kernel.log says why, a passing failure is not remembered while a rejection is, and no
compiler process remains."""
import errno
import os
import subprocess
import time

import pytest

from conftest import KERNELS, read_result, run_parallel, sample, write_script

NVCC = "/usr/local/cuda/bin/nvcc"

# name: (shell fragment run for the first compile, later compiles run nvcc; kind; log text)
FAULTS = {
    "half-cubin-then-error": ('"$NVCC" "$@" || exit; head -c 1000 "$4" > "$4.x"; mv "$4.x" "$4"; '
                              'echo "$1(1): error: out of registers"; exit 2', "rejected",
                              "rejected"),
    "half-cubin-silent-exit-1": ('"$NVCC" "$@" || exit; truncate -s 1000 "$4"; exit 1',
                                 "passing", "without reporting an error"),
    "exit-0-empty": (': > "$4"; exit 0', "passing", "cubin is empty"),
    "exit-0-truncated": ('"$NVCC" "$@" || exit; truncate -s 2000 "$4"; exit 0', "passing",
                         "truncated"),
    "exit-0-garbage": ('head -c 5000 /dev/urandom > "$4"; exit 0', "passing", "not a 64-bit ELF"),
    "sigkill": ('kill -KILL $$', "passing", "killed by signal 9"),
    "hang": ('exec sleep 300 0.TAG', "passing", "timed out"),  # TAG: this run's own
    "not-runnable": (None, "passing", "cannot run"),
}


def compiler_processes(tag):
    out = subprocess.run(["ps", "ax", "-o", "stat=,args="], capture_output=True, text=True).stdout
    return [l for l in out.splitlines() if tag in l and "kcachefs -f" not in l]


def children(pid):
    out = subprocess.run(["ps", "--ppid", str(pid), "-o", "stat=,args="], capture_output=True,
                         text=True).stdout
    return out.splitlines()


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_compiler_fault(mount_factory, tmp_path, fault):
    first, kind, why = FAULTS[fault]
    tag = "%d%d" % (os.getpid(), time.monotonic_ns() % 1000000)  # tells its sleep from others'
    first = first and first.replace("TAG", tag)
    marker = tmp_path / "faulted"
    if first is None:  # there at the start (a missing one is refused), then gone
        nvcc = write_script(tmp_path / "compiler-goes-away", 'exec %s "$@"\n' % NVCC)
    else:
        later = 'exec "$NVCC" "$@"'
        if fault == "hang":
            # Only this fault needs a short compile_timeout; the compile after it must not
            # race that timeout on a loaded machine: it hands over a cubin nvcc made here.
            made = tmp_path / "made.cubin"
            subprocess.run([NVCC, "-cubin", "-arch=sm_90a", "-o", str(made), str(KERNELS / "vector_add.cu")],
                           check=True, timeout=300)
            os.chmod(made, 0o644)
            later = 'exec cp %s "$4"' % made
        nvcc = write_script(tmp_path / ("nvcc-" + fault),
                            'NVCC=%s\ncase "$*" in *-cubin*) ;; *) exec "$NVCC" "$@";; esac\n'
                            'if [ ! -e %s ]; then touch %s; %s; fi\n%s\n'
                            % (NVCC, marker, marker, first, later))
    m = mount_factory(["nvcc=%s" % nvcc, "compile_timeout=%d" % (3 if fault == "hang" else 300)])
    if first is None:
        nvcc.unlink()
    entry = m.stage("vector_add", *sample("vector_add"))
    started = time.monotonic()
    results = run_parallel(6, lambda i, p: read_result(p), str(entry / "kernel.cubin"))
    assert results == [("err", errno.EIO)] * 6
    assert time.monotonic() - started < 60, "waiters were not answered promptly"
    assert not (m.backing / entry.relative_to(m.mnt) / "kernel.cubin").exists(), "published"
    log = (entry / "kernel.log").read_text()
    assert why in log, log
    s = m.stats()
    assert s["compile_failures_total"] == 1 and s["compiles_total"] == 0
    assert not compiler_processes(str(tmp_path)), "a compiler process remains"
    assert children(m.proc.pid) == [], "the daemon left a child (zombie or running)"
    assert not compiler_processes("sleep 300 0.%s" % tag), "a compiler process remains"
    assert os.listdir(m.backing / ".kcachefs" / "scratch") == []
    time.sleep(2.2)  # past the retry hold-off
    if first is None:  # the compiler is back: the next open compiles
        write_script(nvcc, 'exec %s "$@"\n' % NVCC)
    r = read_result(entry / "kernel.cubin")
    if kind == "rejected":  # remembered for this recipe: no retry storm
        assert r == ("err", errno.EIO)
        assert m.stats()["compile_failures_total"] == 1
        assert m.stats()["rejected_lookups_total"] >= 1
    else:  # a passing cause: compiled again, and served
        assert r[0] == "ok", r
        assert m.stats()["compiles_total"] == 1
