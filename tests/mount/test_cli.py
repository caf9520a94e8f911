"""The command line: libfuse conventions, --help, --version, and clear start-up errors."""
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from conftest import BUILD, KCACHEFS, NVCC, Mount, write_script
from kcmount import mounts_at, wait_until


def run(*args):
    return subprocess.run([str(KCACHEFS), *args], capture_output=True, text=True, timeout=30)


def test_help_and_version():
    r = run("--help")
    assert r.returncode == 0
    for opt in ("nvcc=", "arch=", "flags=", "jobs=", "compile_timeout=", "stop_timeout=",
                "autocompile"):
        assert opt in r.stdout
    r = run("--version")
    assert r.returncode == 0
    assert "kcachefs" in r.stdout and "libfuse" in r.stdout and "OpenSSL" in r.stdout
    assert "CUDA" in r.stdout


def test_usage_errors(tmp_path):
    r = run(str(tmp_path))
    assert r.returncode == 2 and "usage" in r.stderr
    r = run(str(tmp_path), str(tmp_path / "absent"))
    assert r.returncode == 2 and "absent" in r.stderr
    (tmp_path / "m").mkdir()
    r = run("-o", "log_level=loud", str(tmp_path), str(tmp_path / "m"))
    assert r.returncode == 2 and "log_level" in r.stderr
    for bad in ("jobs=0", "jobs=x", "jobs=257", "compile_timeout=0", "compile_timeout=-1",
                "stop_timeout=-1", "stop_timeout=3601", "stop_timeout=1s",
                "max_source_size=1k", "max_inodes=15", "max_inodes=many",
                "max_size=0", "max_size=10X", "max_size=-1G", "max_entries=0",
                "no_such_option", "no_such_option=1"):
        (tmp_path / "b").mkdir(exist_ok=True)
        r = run("-f", "-o", bad, str(tmp_path / "b"), str(tmp_path / "m"))
        assert r.returncode == 2 and bad.split("=")[0] in r.stderr, bad
    assert not os.path.ismount(tmp_path / "m")


def test_startup_errors_are_clear(tmp_path):
    mnt, backing = tmp_path / "mnt", tmp_path / "backing"
    mnt.mkdir()
    backing.mkdir()
    r = run("-f", str(tmp_path / "missing"), str(mnt))
    assert r.returncode == 1 and "missing" in r.stderr
    for arch in ("gpu9000", "sm_9", "compute_90", "sm_90b", "sm_12"):  # sm_12: not in CUDA 13
        r = run("-f", "-o", "arch=" + arch, str(backing), str(mnt))
        assert r.returncode == 1 and "arch" in r.stderr, arch
    r = run("-f", "-o", "flags=-ccbin=/bin/sh", str(backing), str(mnt))
    assert r.returncode == 1 and "ccbin" in r.stderr
    r = run("-f", str(tmp_path), str(mnt))
    assert r.returncode == 1 and "overlap" in r.stderr
    r = run("-f", str(mnt), str(tmp_path))
    assert r.returncode == 1 and "overlap" in r.stderr
    assert not os.path.ismount(mnt) and not os.path.ismount(tmp_path)


def start_refused(*args, mnt):
    """Run kcachefs -f ARGS, which should refuse to start. Returns (exit status, stderr); a
    daemon that mounts instead (the fault) is unmounted and stopped, and gives
    ("mounted", stderr)."""
    before = mounts_at(mnt)
    p = subprocess.Popen([str(KCACHEFS), "-f", *args], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    while p.poll() is None and mounts_at(mnt) == before:
        time.sleep(0.05)
    if p.poll() is None:  # it mounted
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        p.terminate()
        return "mounted", p.communicate(timeout=60)[1]
    return p.returncode, p.communicate()[1]


def test_a_mountpoint_that_has_a_kcachefs_mount_is_refused(mount_factory, tmp_path):
    m = mount_factory()
    (m.mnt / "marker").write_text("first")
    other = tmp_path / "other-backing"
    other.mkdir()
    rc, err = start_refused(str(other), str(m.mnt), mnt=m.mnt)
    assert rc == 1, (rc, err)
    assert "already has a kcachefs mount" in err and "umount" in err, err
    assert mounts_at(m.mnt) == 1 and (m.mnt / "marker").read_text() == "first"
    assert os.listdir(other) == [], "the refused daemon wrote to its backing directory"


def test_a_compiler_missing_at_the_start_is_refused(tmp_path):
    """Every compile would fail: say so at the start. (One that goes away after the start
    fails its compiles as a passing cause: test_compiler_faults.py, not-runnable.)"""
    mnt, backing = tmp_path / "mnt", tmp_path / "backing"
    mnt.mkdir()
    backing.mkdir()
    plain = tmp_path / "not-executable"
    plain.write_text("#!/bin/sh\n")
    for nvcc in (tmp_path / "no-such-nvcc", tmp_path, plain):
        rc, err = start_refused("-o", "nvcc=%s" % nvcc, str(backing), str(mnt), mnt=mnt)
        assert rc == 1 and str(nvcc) in err and "-o nvcc=" in err, (nvcc, rc, err)
    assert not os.path.ismount(mnt)
    if (BUILD / "kcachefs-nvrtc").exists():  # NVRTC needs no nvcc: a warning
        m = Mount(tmp_path, ["nvcc=%s" % (tmp_path / "no-such-nvcc"), "compiler=nvrtc"])
        try:
            m.start()
            assert "entries that ask for nvcc will fail" in m.daemon_log()
        finally:
            m.stop()


def test_an_unknown_option_is_the_first_thing_said(tmp_path):
    mnt, backing = tmp_path / "mnt", tmp_path / "backing"
    mnt.mkdir()
    backing.mkdir()  # every user can reach it: a warning, once the options are good
    odd = write_script(tmp_path / "nvcc-without-version",  # another warning
                       'case "$*" in *--version*) exit 1;; esac\nexec %s "$@"\n' % NVCC)
    for bad in ("no_such_option", "allow_other,no_such_option=1"):
        rc, err = start_refused("-o", "nvcc=%s,%s" % (odd, bad), str(backing), str(mnt),
                                mnt=mnt)
        assert rc == 2, (rc, err)
        assert "no_such_option" in err.splitlines()[0], err
        assert "warning" not in err, err


def test_a_user_who_cannot_open_dev_fuse_is_told_what_is_needed():
    if os.geteuid() != 0:
        pytest.skip("needs root to run kcachefs as another user without /dev/fuse")
    public = Path(tempfile.mkdtemp(prefix="kcachefs-nofuse-"))
    try:
        os.chmod(public, 0o755)
        backing, mnt, fake = public / "backing", public / "mnt", public / "fuse"
        for d in (backing, mnt):
            d.mkdir()
            os.chown(d, 65534, 65534)
        fake.write_text("")
        fake.chmod(0o600)  # what a node without a usable /dev/fuse has
        script = ("mount --bind %s /dev/fuse && exec setpriv --reuid=65534 --regid=65534 "
                  "--clear-groups %s -f %s %s" % (fake, KCACHEFS, backing, mnt))
        r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                            script], capture_output=True, text=True, timeout=120)
        assert r.returncode == 1, r
        line = [l for l in r.stderr.splitlines() if "/dev/fuse" in l and "kcachefs" in l]
        assert line and "root" in line[0] and "fusermount3" in line[0], r.stderr
        assert os.listdir(backing) == [], "the refused daemon wrote to its backing directory"
        assert not os.path.ismount(mnt)
    finally:
        shutil.rmtree(public)


def test_second_daemon_on_same_backing_is_refused(mount_factory, tmp_path):
    m = mount_factory()
    other = tmp_path / "other-mnt"
    other.mkdir()
    r = run("-f", str(m.backing), str(other))
    assert r.returncode == 1 and "another kcachefs" in r.stderr
    assert not os.path.ismount(other)


def test_daemon_mode_and_clean_unmount(tmp_path):
    m = Mount(tmp_path)
    r = subprocess.run([str(KCACHEFS), str(m.backing), str(m.mnt)], capture_output=True,
                       text=True, timeout=30)
    try:
        assert r.returncode == 0, r.stderr
        assert os.path.ismount(m.mnt)
        (m.mnt / "f").write_text("x")
    finally:
        subprocess.run(["fusermount3", "-u", str(m.mnt)], check=True)
    assert not os.path.ismount(m.mnt)
    assert (m.backing / "f").read_text() == "x"


def test_restart_after_crash_recovers(mount_factory, tmp_path):
    """SIGKILL the daemon, remount the same backing: temporaries are gone, published
    cubins are served, nothing is in progress."""
    from conftest import sample
    m = mount_factory()
    entry = m.stage("vector_add", *sample("vector_add"))
    cubin = (entry / "kernel.cubin").read_bytes()
    leftover = m.backing / ".kcachefs" / "tmp" / "t1.1"
    leftover.write_text("half a stage")
    m.kill()
    m2 = mount_factory(name="m")  # same backing
    assert not leftover.exists()
    assert (entry / "kernel.cubin").read_bytes() == cubin
    assert m2.stats()["compiles_total"] == 0


def test_a_backing_directory_every_user_can_reach_is_warned_about():
    public = Path(tempfile.mkdtemp(prefix="kcachefs-reach-"))
    os.chmod(public, 0o755)
    m = Mount(public)
    try:
        m.start()
        assert "can be reached by every user" in m.daemon_log()
    finally:
        m.stop()
        shutil.rmtree(public)
    private = Path(tempfile.mkdtemp(prefix="kcachefs-private-"))  # only root can enter it
    m = Mount(private)
    try:
        m.start()
        assert "can be reached by every user" not in m.daemon_log()
    finally:
        m.stop()
        shutil.rmtree(private)


def daemon_messages(tmp_path, options, work):
    """Run kcachefs as a daemon with -o options, call work(mnt), unmount; return the syslog
    datagrams it sent to /dev/log (a socket of this test's own)."""
    import socket
    import time
    tmp_path.mkdir()
    m = Mount(tmp_path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("/dev/log")
    sock.settimeout(0.2)
    try:
        r = subprocess.run([str(KCACHEFS), "-o", options, str(m.backing), str(m.mnt)],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        try:
            work(m.mnt)
        finally:
            subprocess.run(["umount", str(m.mnt)], check=True)
        wait_until(lambda: subprocess.run(["pgrep", "-f", str(m.backing)],
                                          capture_output=True).returncode != 0,
                   "the daemon did not exit", 20)
        messages = []
        while True:
            try:
                messages.append(sock.recv(65536).decode(errors="replace"))
            except socket.timeout:
                return messages
    finally:
        sock.close()
        os.unlink("/dev/log")


def test_a_daemon_logs_to_syslog_with_levels(tmp_path):
    if os.path.exists("/dev/log"):
        import pytest
        pytest.skip("a syslog daemon owns /dev/log here; its messages cannot be read back")
    from conftest import sample, entry_name

    def compile_one(mnt):
        src, flags = sample("vector_add")
        e = mnt / entry_name("vector_add", src, flags)
        e.mkdir()
        (e / "kernel.cu").write_bytes(src)
        (e / "kernel.flags").write_bytes(flags)
        assert (e / "kernel.cubin").read_bytes()[:4] == b"\x7fELF"

    msgs = daemon_messages(tmp_path / "info", "log_level=info", compile_one)
    compiled = [x for x in msgs if "published (ok)" in x]
    assert len(compiled) == 1, msgs
    # <30>: facility daemon (3), priority info (6); the line names the entry, the result,
    # the seconds and the compiler.
    assert compiled[0].startswith("<30>") and "kcachefs[" in compiled[0]
    assert "kernel.vector_add." in compiled[0] and " s with /" in compiled[0]
    assert any(x.startswith("<30>") and "unmounting" in x for x in msgs)
    quiet = daemon_messages(tmp_path / "warning", "log_level=warning", compile_one)
    assert not any("published (ok)" in x or "unmounting" in x for x in quiet), quiet
