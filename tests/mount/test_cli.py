"""The command line: libfuse conventions, --help, --version, and clear start-up errors."""
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from conftest import KCACHEFS, Mount


def run(*args):
    return subprocess.run([str(KCACHEFS), *args], capture_output=True, text=True, timeout=30)


def test_help_and_version():
    r = run("--help")
    assert r.returncode == 0
    for opt in ("nvcc=", "arch=", "flags=", "jobs=", "compile_timeout=", "autocompile"):
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
    for bad in ("jobs=0", "jobs=x", "compile_timeout=0", "compile_timeout=-1",
                "max_source_size=1k", "max_inodes=15", "max_inodes=many",
                "max_size=0", "max_size=10X", "max_size=-1G", "max_entries=0"):
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
    for arch in ("gpu9000", "sm_9", "compute_90", "sm_90b"):
        r = run("-f", "-o", "arch=" + arch, str(backing), str(mnt))
        assert r.returncode == 1 and "arch" in r.stderr, arch
    r = run("-f", "-o", "flags=-ccbin=/bin/sh", str(backing), str(mnt))
    assert r.returncode == 1 and "ccbin" in r.stderr
    r = run("-f", str(tmp_path), str(mnt))
    assert r.returncode == 1 and "overlap" in r.stderr
    r = run("-f", str(mnt), str(tmp_path))
    assert r.returncode == 1 and "overlap" in r.stderr
    assert not os.path.ismount(mnt) and not os.path.ismount(tmp_path)


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


def test_a_backing_directory_every_user_can_reach_is_warned_about(mount_factory):
    public = Path(tempfile.mkdtemp(prefix="kcachefs-reach-"))
    os.chmod(public, 0o755)
    m = Mount(public)
    try:
        m.start()
        assert "can be reached by every user" in m.daemon_log()
    finally:
        m.stop()
        shutil.rmtree(public)
    private = mount_factory()  # under pytest's own directory, which only root can enter
    assert "can be reached by every user" not in private.daemon_log()


MAN = Path(__file__).resolve().parents[2] / "doc" / "kcachefs.1"


def test_the_man_page_documents_every_option_and_renders_cleanly(tmp_path):
    text = MAN.read_text()
    options = [l.split()[1].split("=")[0] for l in run("--help").stdout.splitlines()
               if l.startswith("    -o ") and l.split()[1][0].isalpha()]
    assert len(options) >= 12, options
    for opt in options:  # kcachefs's own and libfuse's
        assert re.search(r"^\.(B|BI|BR) (\\-o )?%s\b" % re.escape(opt), text, re.M), \
            "option %s is not in kcachefs.1" % opt
    for section in ("SYNOPSIS", "OPTIONS", "THE ON-DISK CONTRACT", "FILES", "EXIT STATUS",
                    "EXAMPLES", ".kcachefs/stats", ".kcachefs/metrics.prom"):
        assert section in text, section
    r = subprocess.run(["groff", "-man", "-ww", "-z", str(MAN)], capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    # meson install puts it where man finds it.
    build = KCACHEFS.parent
    r = subprocess.run(["meson", "install", "-C", str(build), "--destdir", str(tmp_path),
                        "--no-rebuild", "--quiet"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert list(tmp_path.rglob("share/man/man1/kcachefs.1*")), list(tmp_path.rglob("*"))
