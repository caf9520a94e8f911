"""The compile options of the mount: jobs, arch, flags, and how the compiler is called."""
import os

import pytest

from conftest import read_result, run_parallel, sample, write_script


def logging_nvcc(tmp_path, delay):
    """A compiler that logs 'start <pid> <args>' and 'end <pid>' around a real nvcc run."""
    log = tmp_path / "calls.log"
    log.write_text("")
    os.chmod(log, 0o666)  # appended to by compiles, which run as uids of their own
    nvcc = write_script(tmp_path / "nvcc-logging",
                        'case "$*" in *-cubin*) ;; *) exec /usr/local/cuda/bin/nvcc "$@";; esac\n'
                        'echo "start $$ $* cwd=$(pwd) env=$(env | cut -d= -f1 | sort | tr \'\\n\' \' \')" >> %s\n'
                        'sleep %s\n/usr/local/cuda/bin/nvcc "$@"; rc=$?\necho "end $$" >> %s\nexit $rc\n'
                        % (log, delay, log))
    return nvcc, log


def test_jobs_bounds_concurrent_compiles(mount_factory, tmp_path):
    nvcc, log = logging_nvcc(tmp_path, 0.5)
    m = mount_factory(["nvcc=%s" % nvcc, "jobs=2"])
    src, flags = sample("vector_add")
    entries = [m.stage("k%d" % i, src + b"// %d\n" % i, flags) for i in range(6)]
    results = run_parallel(6, lambda i, es: read_result(es[i] + "/kernel.cubin"),
                           [str(e) for e in entries])
    assert all(r[0] == "ok" for r in results), results
    running = peak = 0
    for line in log.read_text().splitlines():
        running += 1 if line.startswith("start") else -1
        peak = max(peak, running)
    assert peak == 2, "at most jobs=2 compiles at once, and the limit was reached"
    assert m.stats()["compiles_total"] == 6


def test_arch_flags_and_compiler_call(mount_factory, tmp_path):
    nvcc, log = logging_nvcc(tmp_path, 0)
    m = mount_factory(["nvcc=%s" % nvcc, "arch=sm_80", "flags=-lineinfo -DKC_TEST=1"])
    entry = m.stage("vector_add", *sample("vector_add"))
    assert read_result(entry / "kernel.cubin")[0] == "ok"
    call = log.read_text().splitlines()[0]
    args = call.split(" cwd=")[0].split()[2:]
    scratch = call.split(" cwd=")[1].split()[0]
    # nvcc <cwd>/kernel.cu -cubin -o <cwd>/kernel.cubin <mount flags> <entry flags> arch, where
    # <cwd> is /proc/self/cwd: the private scratch directory it runs in
    assert args[:4] == ["/proc/self/cwd/kernel.cu", "-cubin", "-o", "/proc/self/cwd/kernel.cubin"]
    assert scratch.startswith(str(m.backing / ".kcachefs" / "scratch"))
    assert args[4:] == ["-lineinfo", "-DKC_TEST=1", "-O3", "-std=c++17", "--gpu-architecture=sm_80"]
    # A scrubbed environment: nothing of the daemon's caller leaks in.
    env = set(call.split("env=")[1].split())
    assert env <= {"PATH", "HOME", "TMPDIR", "LC_ALL", "CUDA_HOME", "PWD", "SHLVL", "_", "OLDPWD"}, env
    # The scratch directory is gone after the compile.
    assert not os.path.exists(scratch)
    # An entry that names its own architecture keeps it.
    entry = m.stage("own_arch", sample("vector_add")[0], b"--gpu-architecture=sm_90a\n")
    assert read_result(entry / "kernel.cubin")[0] == "ok"
    call = log.read_text().splitlines()[2]
    assert "--gpu-architecture=sm_90a" in call and "sm_80" not in call


def test_default_arch_without_gpu_is_sm_90a(mount_factory):
    m = mount_factory()
    assert "arch sm_90a" in m.daemon_log()
