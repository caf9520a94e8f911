"""The compile sandbox (doc/security.md; src/compile/sandbox.h): a daemon run as root
compiles each kernel as a uid of its own (-o compile_uids), without groups, network or the
daemon's descriptors, checks include directories as that uid, and leaves no process of it
behind."""
import errno
import os
import re
import shutil
import subprocess
import time

import pytest

from conftest import KCACHEFS, NVCC, Mount, sample, write_script

FIRST_UID = 2147418112  # KC_DEFAULT_COMPILE_UIDS: the first of 64 default ranges
SLOTS = 256


def compile_uids(m):
    """The first uid of the range the daemon of m claimed (its start-up line)."""
    first = int(re.search(r"compiles run as uids (\d+)\+", m.daemon_log()).group(1))
    assert FIRST_UID <= first < FIRST_UID + 64 * SLOTS and (first - FIRST_UID) % SLOTS == 0
    return first


def leak_attempt(m, name, path):
    """Stage a source that includes path; returns kernel.log once the open failed."""
    e = m.stage(name, b'#include "%s"\n' % path.encode())
    with pytest.raises(OSError) as err:
        (e / "kernel.cubin").read_bytes()
    assert err.value.errno == errno.EIO
    return (e / "kernel.log").read_text(errors="replace")


def test_root_only_files_stay_out_of_kernel_log(mount_factory, tmp_path):
    """By default #include of a root-only file fails on permissions and kernel.log holds no
    line of it; with compile_uids=daemon (the control) the same source puts the line there.
    Real kernels still compile, CUB headers included."""
    secret = tmp_path / "secret.h"  # root-only, like /etc/shadow, with a known line
    secret.write_text("kcachefs-secret-line-4711\n")
    os.chmod(secret, 0o600)
    m = mount_factory()
    assert "compiles run as uids %d+ in namespaces of their own" % compile_uids(m) in m.daemon_log()
    log = leak_attempt(m, "leak", str(secret))
    assert "kcachefs-secret-line-4711" not in log and "Permission denied" in log, log
    log = leak_attempt(m, "shadow", "/etc/shadow")
    assert "Permission denied" in log and "root:" not in log, log
    src, flags = sample("block_sum")
    good = m.stage("block_sum", src, flags)
    assert b"block_sum" in (good / "kernel.cubin").read_bytes()
    published = m.backing / good.relative_to(m.mnt) / "kernel.cubin"
    assert os.stat(published).st_uid == 0, "the published cubin is the daemon's"
    assert list((m.backing / ".kcachefs" / "scratch").iterdir()) == []
    assert list((m.backing / ".kcachefs" / "tmp").iterdir()) == []

    control = mount_factory(["compile_uids=daemon"], name="control")
    assert "compiles run as the daemon, uid 0" in control.daemon_log()
    log = leak_attempt(control, "leak", str(secret))
    assert "kcachefs-secret-line-4711" in log, log


def test_a_compile_has_its_own_uid_no_network_no_daemon_descriptors(mount_factory, tmp_path):
    """A wrapper compiler records what it is and can do, and leaves a process that left its
    group (setsid) behind; two run at once (jobs=2)."""
    tag = "%d%d" % (os.getpid(), time.monotonic_ns() % 1000000)
    report = tmp_path / "report"
    report.mkdir(mode=0o777)
    os.chmod(report, 0o777)
    nvcc = write_script(tmp_path / "nvcc-inspect", """
case "$*" in *-cubin*) ;; *) exec %(nvcc)s "$@";; esac
r=%(report)s/$(id -u).$$
{
  echo "uid $(id -u) gid $(id -g) groups $(id -G)"
  echo "net $(tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | tr '\\n' ' ')"
  echo "fds $(ls -l /proc/self/fd/ | sed -n 's/.*-> //p' | tr '\\n' ' ')"
  touch %(backing)s/planted 2>/dev/null && echo "wrote backing" || echo "backing closed"
  touch %(mnt)s/open/planted 2>/dev/null && echo "wrote mount" || echo "mount closed"
} > $r
setsid sleep 1000.%(tag)s < /dev/null > /dev/null 2>&1 &
sleep 1
exec %(nvcc)s "$@"
""" % {"nvcc": NVCC, "report": report, "backing": tmp_path / "m" / "backing",
       "mnt": tmp_path / "m" / "mnt", "tag": tag})
    m = mount_factory(["nvcc=%s" % nvcc, "jobs=2", "allow_other"])
    (m.mnt / "open").mkdir()
    os.chmod(m.mnt / "open", 0o1777)  # any user may write here: a compile may not
    src, flags = sample("vector_add")
    entries = [m.stage("k%d" % i, src + b"// %d\n" % i, flags) for i in range(2)]
    procs = [subprocess.Popen(["cat", str(e / "kernel.cubin")], stdout=subprocess.PIPE)
             for e in entries]
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0 and out[:4] == b"\x7fELF"
    first = compile_uids(m)
    reports = [f.read_text() for f in sorted(report.iterdir())]
    assert len(reports) == 2, reports
    uids = set()
    for r in reports:
        fields = dict(line.split(" ", 1) for line in r.splitlines() if " " in line)
        uid = int(fields["uid"].split()[0])
        assert first <= uid < first + SLOTS, r
        assert fields["uid"] == "%d gid %d groups %d" % (uid, uid, uid), r
        uids.add(uid)
        assert fields["net"].split() == ["lo"], r
        # ls's: stdin, a pipe to sed, the compile's log as stderr, its own /proc directory
        for target in fields["fds"].split():
            assert (target == "/dev/null" or target.startswith(("pipe:", "/proc/")) or
                    target.endswith("/compile.log")), r
        assert "backing closed" in r and "mount closed" in r, r
    assert len(uids) == 2, "two compiles at once share a uid: %s" % reports
    assert not (m.backing / "planted").exists() and not (m.mnt / "open" / "planted").exists()
    ps = subprocess.run(["ps", "ax", "-o", "args="], capture_output=True, text=True).stdout
    assert "sleep 1000.%s" % tag not in ps, "a process of a compile outlived it"


def test_include_directories_are_checked_as_the_compiles_uid(mount_factory, tmp_path):
    """-I of a directory under a root-only one: existing or not, the compile's uid cannot
    tell, so kernel.log says the same; a missing one says it is missing."""
    private = tmp_path / "private"
    (private / "exists").mkdir(parents=True)
    os.chmod(private, 0o700)
    m = mount_factory()
    src = sample("vector_add")[0]
    logs = {}
    for name, d in (("exists", private / "exists"), ("missing", private / "missing"),
                    ("nowhere", tmp_path / "nowhere")):
        e = m.stage("inc_" + name, src, b"-I%s\n" % str(d).encode())
        with pytest.raises(OSError) as err:
            (e / "kernel.cubin").read_bytes()
        assert err.value.errno == errno.EIO
        log = (e / "kernel.log").read_text().replace(str(d), "DIR")
        logs[name] = re.search(r"failed \((.*)\) in [0-9.]+ s", log).group(1)
    assert logs["exists"] == logs["missing"], logs
    assert logs["exists"] == ("include directory DIR: Permission denied for the compiler's uid "
                              "%d" % compile_uids(m))
    assert logs["nowhere"].startswith("include directory DIR: No such file or directory"), logs
    # there, with an open parent, but not to be searched by the uid: not a rejection
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    e = m.stage("inc_closed", src, b"-I%s\n" % str(closed).encode())
    with pytest.raises(OSError):
        (e / "kernel.cubin").read_bytes()
    log = (e / "kernel.log").read_text()
    assert "include directory %s: Permission denied for the compiler's uid" % closed in log, log
    assert m.stats()["rejected_lookups_total"] == 0
    os.chmod(closed, 0o755)
    time.sleep(2.2)  # past the hold-off of a passing failure
    assert (e / "kernel.cubin").read_bytes()[:4] == b"\x7fELF"
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    e = m.stage("inc_open", src, b"-I%s\n" % str(open_dir).encode())
    assert (e / "kernel.cubin").read_bytes()[:4] == b"\x7fELF"


def kcachefs_exit(tmp_path, *options):
    (tmp_path / "b").mkdir(exist_ok=True)
    (tmp_path / "mnt").mkdir(exist_ok=True)
    r = subprocess.run([str(KCACHEFS), "-f", "-o", ",".join(options), str(tmp_path / "b"),
                        str(tmp_path / "mnt")], capture_output=True, text=True, timeout=60)
    assert not os.path.ismount(tmp_path / "mnt")
    return r.returncode, r.stderr


@pytest.mark.parametrize("value", ["abc", "0", "-5", "+5", " 5", "4294967295", "12x"])
def test_compile_uids_that_are_not_a_range_are_refused(tmp_path, value):
    rc, err = kcachefs_exit(tmp_path, "compile_uids=" + value)
    assert rc == 1 and "compile_uids=%s: give the first of 256 free uids" % value in err, err


def test_compile_uids_that_a_user_has_are_refused(tmp_path):
    rc, err = kcachefs_exit(tmp_path, "compile_uids=65500")  # 65534 is nobody
    assert rc == 1 and "id 65534 belongs to the user 'nobody'" in err, err


def test_mount_flags_with_an_include_directory_the_uid_cannot_reach_are_refused(tmp_path):
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    rc, err = kcachefs_exit(tmp_path, "flags=-I%s" % closed)
    assert rc == 1 and "flags=: include directory %s: Permission denied" % closed in err, err


def test_nvrtc_the_uid_cannot_run_is_fatal_only_when_it_is_the_mounts_compiler(tmp_path):
    """A daemon built in a private directory (a clone under /root): its kcachefs-nvrtc is out
    of the compiles' reach. nvcc mounts still work, with a warning."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    for name in ("kcachefs", "kcachefs-nvrtc"):
        shutil.copy2(KCACHEFS.parent / name, private / name)
    m = Mount(tmp_path, bin=private / "kcachefs")
    try:
        m.start()
        assert "kcachefs-nvrtc runs as the daemon but not as uid" in m.daemon_log()
        assert "entries that ask for NVRTC will fail" in m.daemon_log()
    finally:
        m.stop()
    r = subprocess.run([str(private / "kcachefs"), "-f", "-o", "compiler=nvrtc",
                        str(m.backing), str(m.mnt)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "kcachefs-nvrtc runs as the daemon but not as uid" in r.stderr
    assert not os.path.ismount(m.mnt)


def test_a_compiler_the_compiles_uid_cannot_run_is_refused_at_the_mount(tmp_path):
    """A wrapper in a directory only root can enter: runs as the daemon, not sandboxed."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    os.chmod(private, 0o700)
    nvcc = write_script(private / "nvcc", 'exec %s "$@"\n' % NVCC)
    rc, err = kcachefs_exit(tmp_path, "nvcc=%s" % nvcc)
    assert rc == 1 and re.search(r"runs as the daemon but not as uid \d+ ", err), err
    assert "Permission denied" in err, err
    assert "compile_uids=daemon" in err


def test_daemons_on_one_node_claim_ranges_of_their_own(mount_factory, tmp_path):
    """Two daemons in one range would kill each other's compiles: each claims its own (a lock
    in /run/kcachefs), and a range given that another daemon holds is refused."""
    a = mount_factory(name="a")
    b = mount_factory(name="b")
    assert compile_uids(a) != compile_uids(b)
    for first in (compile_uids(a), compile_uids(a) + 100, compile_uids(a) - 255):
        rc, err = kcachefs_exit(tmp_path, "compile_uids=%d" % first)  # the same, or overlapping
        assert rc == 1 and "another kcachefs on this node compiles as these uids" in err, err
    src, flags = sample("vector_add")
    for m in (a, b):
        assert (m.stage("vector_add", src, flags) / "kernel.cubin").read_bytes()[:4] == b"\x7fELF"


@pytest.mark.parametrize("uids", ["default", "daemon"])
def test_a_compile_that_reaches_for_its_own_cubin_fails_at_once(mount_factory, uids):
    """An include directory or an #include naming the entry's own kernel.cubin, through the
    mount: the compile would wait on itself. Sandboxed, the mount refuses the compile's uid
    (EACCES); as the daemon, the wait is refused (EDEADLK). Neither waits for the timeout,
    and other compiles go on."""
    m = mount_factory(["compile_timeout=120"] + (["compile_uids=daemon"] if uids == "daemon" else []))
    src, flags = sample("vector_add")
    hashes = iter("%032x" % i for i in range(1, 10))
    for how in ("flags", "include"):
        e = m.mnt / "cache" / ("kernel.self_%s.%s" % (how, next(hashes)))
        e.mkdir(parents=True)
        if how == "flags":
            (e / "kernel.cu").write_bytes(src)
            (e / "kernel.flags").write_bytes(flags + b"-I%s/kernel.cubin\n" % str(e).encode())
        else:
            (e / "kernel.cu").write_bytes(b'#include "%s/kernel.cubin"\n' % str(e).encode() + src)
            (e / "kernel.flags").write_bytes(flags)
        with pytest.raises(OSError) as err:
            (e / "kernel.cubin").read_bytes()
        assert err.value.errno == errno.EIO
        log = (e / "kernel.log").read_text(errors="replace")
        assert "timed out" not in log, log
        want = "Resource deadlock avoided" if uids == "daemon" else "Permission denied"
        assert want in log, log
    good = m.stage("vector_add", src, flags)
    assert (good / "kernel.cubin").read_bytes()[:4] == b"\x7fELF"


def test_a_group_given_a_compile_gid_after_the_mount_stops_its_compiles(mount_factory):
    """The range is checked at the mount and again before every compile: a group created
    since with a gid of the range would share the compile's files."""
    first = 2147418112 + 100 * SLOTS  # no default range
    m = mount_factory(["compile_uids=%d" % first])
    name = "kcfs-late-%d" % os.getpid()
    subprocess.run(["groupadd", "-g", str(first), name], check=True, capture_output=True)
    try:
        e = m.stage("late", *sample("vector_add"))
        with pytest.raises(OSError) as err:
            (e / "kernel.cubin").read_bytes()
        assert err.value.errno == errno.EIO
        assert "compile uid %d belongs to the group '%s'" % (first, name) in \
            (e / "kernel.log").read_text()
        assert "compiles refused until the range (compile_uids=) is free again" in m.daemon_log()
    finally:
        subprocess.run(["groupdel", name], capture_output=True)
    time.sleep(2.2)  # past the hold-off of a passing failure
    assert (e / "kernel.cubin").read_bytes()[:4] == b"\x7fELF"
