"""Mount-level test fixtures: mount the built kcachefs on temp directories, as libfuse's
own test suite does, and always unmount, also when a test fails. The libraries they use are
kcmount.py and kccluster.py (no pytest in them: tests and scripts import them, never a test
module); kcmount's names are re-exported here for the tests.
"""
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

import deepgemm
from kccluster import make_template
from kcmount import (BUILD, EM_CUDA, KCACHEFS, KERNELS, NVCC, OPENER, REPO, SHIM, Mount,  # noqa: F401
                     all_stopped, elf_machine, elf_symbols, entry_name, open_to_compiles,
                     read_result, run_parallel, sample, start_openers, write_script)

deepgemm.INCLUDE = str(KERNELS / "include")  # where compiles can read it (kcmount.py)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "serial: changes a machine-wide setting that other tests' mounts would "
        "take up (a sysctl); scripts/test.sh runs these alone, after the others, which run "
        "in parallel (pytest-xdist)")


@pytest.fixture(autouse=True, scope="session")
def shim_memo_in_a_temp_dir():
    """The nvcc shim remembers file digests in $XDG_CACHE_HOME/kcachefs-nvcc (src/entry/tree.h):
    the suite's shims (and the DeepGEMM clients that run them) keep theirs in a temp dir of
    the session, removed at its end, not in the home directory."""
    d = tempfile.mkdtemp(prefix="kcachefs-xdg-")
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = d
    yield d
    if old is None:
        del os.environ["XDG_CACHE_HOME"]
    else:
        os.environ["XDG_CACHE_HOME"] = old
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(autouse=True)
def tmp_path_open_to_compiles(tmp_path):
    """A test's wrapper compilers, and the files they keep, live in its tmp_path, which
    pytest makes private to root: open it to the compiles' uids (kcmount.open_to_compiles)."""
    open_to_compiles(tmp_path)


@pytest.fixture
def mount_factory(tmp_path):
    """mount_factory(options=(), name="m") -> started Mount; all are stopped at teardown."""
    def mount(options=(), name="m"):
        root = tmp_path / name
        root.mkdir(exist_ok=True)
        return Mount(root, options)

    with all_stopped(mount) as (start, mounts):
        yield start
    for m in mounts:
        assert not os.path.ismount(m.mnt), "mount left behind"


@pytest.fixture
def counting_nvcc(tmp_path):
    """A compiler that records each compile (not --version, nor the dependency pass of a
    compile to be shared, whose output is pass.cubin) in a file, then runs nvcc. Returns (path, calls) where calls()
    is the number of compiles so far."""
    log = tmp_path / "compiler-calls"
    log.write_text("")
    os.chmod(log, 0o666)  # appended to by compiles, which run as uids of their own

    def make(delay=0):
        script = write_script(
            tmp_path / "nvcc-counting",
            'case " $* " in *"/pass.cubin "*) ;; *-cubin*) echo "$$ $*" >> %s; sleep %s;; esac\n'
            'exec %s "$@"\n'
            % (log, delay, NVCC))
        return script

    def calls():
        return len([l for l in log.read_text().splitlines() if l.strip()])

    return make, calls


@pytest.fixture
def public_mount_factory():
    """Like mount_factory, but under a directory every user can traverse (pytest's own
    temp directory is private to root), for tests that run a second user."""
    root = Path(tempfile.mkdtemp(prefix="kcachefs-public-"))
    os.chmod(root, 0o755)
    mounts = []

    def make(options=()):
        d = root / str(len(mounts))
        d.mkdir()
        mounts.append(Mount(d, options).start())
        return mounts[-1]

    try:
        yield make
    finally:
        for m in mounts:
            m.stop()
        assert not any(os.path.ismount(m.mnt) for m in mounts), "mount left behind"
        shutil.rmtree(root)


@pytest.fixture
def two_users():
    """Two throwaway system users (alice, bob), removed afterwards: [(uid, gid), ...]."""
    names = ["kcfs-alice-%d" % os.getpid(), "kcfs-bob-%d" % os.getpid()]
    users = []
    try:
        for n in names:
            subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                            "/usr/sbin/nologin", n], check=True, capture_output=True)
            ids = subprocess.run(["id", "-u", n], capture_output=True, text=True).stdout
            gid = subprocess.run(["id", "-g", n], capture_output=True, text=True).stdout
            users.append((int(ids), int(gid)))
        yield users
    finally:
        for n in names:
            subprocess.run(["userdel", n], capture_output=True)


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A real cubin the cluster tests' fake compiler copies (kccluster.make_template)."""
    return make_template(tmp_path_factory.mktemp("template"))
