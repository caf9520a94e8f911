"""The service files in scripts/: the fstab line mounts through mount.fuse3, and the systemd
unit's commands start, stop and restart the daemon, both with the same options, here with
test paths in place of /var/cache/kcachefs and /mnt/kcache."""
import os
import re
import shlex
import signal
import subprocess

import pytest

from conftest import KCACHEFS, REPO, sample, entry_name
from kcmount import FakeManager, wait_until

FSTAB = REPO / "scripts" / "kcachefs.fstab"
UNIT = REPO / "scripts" / "kcachefs.service"


def fstab_fields():
    lines = [l for l in FSTAB.read_text().splitlines() if l.strip() and not l.startswith("#")]
    assert len(lines) == 1, lines
    return lines[0].split()


def unit_values(key):
    """Values of key= in the unit, in order."""
    return [l.split("=", 1)[1] for l in UNIT.read_text().splitlines() if l.startswith(key + "=")]


def exec_start():
    argv = shlex.split(unit_values("ExecStart")[0])
    assert argv[0] == "/usr/local/bin/kcachefs" and argv[1] == "-f" and argv[2] == "-o"
    return argv


def test_the_unit_and_the_fstab_line_agree():
    source, target, fstype, options, dump, passno = fstab_fields()
    argv = exec_start()
    assert fstype == "fuse.kcachefs" and (dump, passno) == ("0", "0")
    assert argv[3] == options, "the unit and the fstab line must mount with the same options"
    assert argv[4:] == [source, target]
    assert "allow_other" in options.split(",")
    assert unit_values("Restart") == ["on-failure"]
    assert unit_values("WantedBy") == ["multi-user.target"]
    assert int(unit_values("LimitNOFILE")[0]) >= 1 << 20


def to_test_paths(text, tmp_path):
    return (text.replace("/usr/local/bin/kcachefs", str(KCACHEFS))
            .replace("/var/cache/kcachefs", str(tmp_path / "var"))
            .replace("/mnt/kcache", str(tmp_path / "mnt")))


def daemons_of(backing, comm="kcachefs"):
    """Pids of kcachefs daemons whose command line names backing (or the mountpoint: a daemon
    started by kcachefs --upgrade names only that); comm "kcachefs-holder": their holders."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open("/proc/%s/cmdline" % pid, "rb") as f:
                argv = f.read().split(b"\0")
            with open("/proc/%s/comm" % pid) as f:
                name = f.read().strip()
        except OSError:
            continue
        if argv[0].endswith(b"kcachefs") and str(backing).encode() in argv and name == comm:
            pids.append(int(pid))
    return pids


def compile_one(mnt):
    src, flags = sample("vector_add")
    entry = mnt / "cache" / entry_name("vector_add", src, flags)
    entry.mkdir(parents=True)
    (entry / "kernel.cu").write_bytes(src)
    (entry / "kernel.flags").write_bytes(flags)
    assert (entry / "kernel.cubin").read_bytes()[:4] == b"\x7fELF"


def test_the_fstab_line_mounts_through_mount_fuse3(tmp_path):
    source, target, fstype, options, _, _ = fstab_fields()
    backing = tmp_path / "var" / "store"
    mnt = tmp_path / "mnt"
    backing.mkdir(parents=True)
    mnt.mkdir()
    os.chmod(tmp_path / "var", 0o700)
    env = dict(os.environ, PATH="%s:%s" % (KCACHEFS.parent, os.environ["PATH"]))
    # How mount(8) runs the helper for this line.
    r = subprocess.run(["mount.fuse3", to_test_paths(source, tmp_path),
                        to_test_paths(target, tmp_path), "-t", fstype, "-o", options],
                       env=env, capture_output=True, text=True, timeout=60)
    try:
        assert r.returncode == 0, r.stderr
        assert os.path.ismount(mnt)
        line = [l for l in open("/proc/mounts") if " %s " % mnt in l][0]
        for opt in ("nosuid", "nodev", "allow_other", "default_permissions"):
            assert opt in line.split()[3].split(","), line
        # One daemon, in the background, and its holder (named so once it has forked).
        wait_until(lambda: (len(daemons_of(backing)),
                            len(daemons_of(backing, "kcachefs-holder"))) == (1, 1),
                   lambda: (daemons_of(backing), daemons_of(backing, "kcachefs-holder")))
        compile_one(mnt)
        assert "\nkcachefs_compiles_total 1\n" in (mnt / ".kcachefs" / "metrics.prom").read_text()
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
    wait_until(lambda: not (daemons_of(backing) or daemons_of(backing, "kcachefs-holder")),
               "the daemon did not exit after umount", 20)
    assert not os.path.ismount(mnt)


def run_unit_commands(key, tmp_path, env=None):
    for value in unit_values(key):
        ignore = value.startswith("-")
        r = subprocess.run(shlex.split(to_test_paths(value.lstrip("-"), tmp_path)),
                           capture_output=True, text=True, timeout=60, env=env)
        assert ignore or r.returncode == 0, (value, r.stderr)


def mount_table():
    """The mountpoints of /proc/self/mounts (octal escapes such as \\040 decoded)."""
    with open("/proc/self/mounts") as f:
        return {re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[1])
                for line in f}


def start_unit(tmp_path, manager=None):
    """systemd's start: ExecStartPre, ExecStart (the holder and its daemon, in the
    foreground), then ExecStartPost, which returns once the mount is up. With manager (a
    FakeManager), the process gets its NOTIFY_SOCKET and the descriptors it stored."""
    run_unit_commands("ExecStartPre", tmp_path)
    log = open(tmp_path / "journal", "ab")
    argv = shlex.split(to_test_paths(unit_values("ExecStart")[0], tmp_path))
    proc = (manager.run(argv, log) if manager else
            subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
    run_unit_commands("ExecStartPost", tmp_path)
    return proc


def kill_the_rest(path):
    """What systemd does to the processes left in the unit's cgroup once its main process
    is gone (KillMode=mixed: SIGKILL): the daemons whose command line names path."""
    for pid in daemons_of(path):
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not daemons_of(path), "a daemon survived SIGKILL")


def test_the_unit_starts_stops_and_restarts_after_a_crash(tmp_path):
    mnt = tmp_path / "mnt"
    proc = start_unit(tmp_path)
    try:
        assert os.stat(tmp_path / "var").st_mode & 0o777 == 0o700
        assert os.path.ismount(mnt)
        compile_one(mnt)
        # A crash of the whole service (systemd kills what is left once the main process
        # died) without a file descriptor store leaves a dead mount; the next start clears it.
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kill_the_rest(tmp_path / "var" / "store")
        # A dead mount is still in the table; stat of it fails (ENOTCONN) once the kernel's
        # cached attributes expire, so os.path.ismount says False on a slow machine.
        assert str(mnt) in mount_table()
        proc = start_unit(tmp_path)
        assert os.path.ismount(mnt)
        assert (mnt / ".kcachefs" / "stats").read_text().startswith("kcachefs ")
        # systemd's stop: SIGTERM to the holder, which passes it on; the daemon unmounts,
        # both exit 0.
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert not os.path.ismount(mnt)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
    assert "unmounting" in (tmp_path / "journal").read_text()


def builds_with_the_fd_store():
    out = subprocess.run([str(KCACHEFS), "--version"], capture_output=True, text=True).stdout
    return "file descriptor store: yes" in out


def stop_post(tmp_path, result, restart_queued):
    """The unit's ExecStopPost as systemd runs it ($SERVICE_RESULT), with a systemctl that
    lists a restart job of the unit or none."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "systemctl"
    fake.write_text("#!/bin/sh\n%s\n" % ("echo '42 kcachefs.service restart running'"
                                          if restart_queued else "exit 0"))
    fake.chmod(0o755)
    env = dict(os.environ, SERVICE_RESULT=result,
               PATH="%s:%s" % (bin_dir, os.environ["PATH"]))
    run_unit_commands("ExecStopPost", tmp_path, env)


@pytest.mark.skipif(not builds_with_the_fd_store(), reason="built without libsystemd")
def test_the_unit_keeps_the_mount_across_reload_restart_and_crash(tmp_path):
    """systemctl reload (ExecReload: a live upgrade), systemctl restart (a stop while a
    restart job is queued, then a start), and a crash that takes the holder and the daemon
    (what systemd kills when the main process is gone): each keeps the mount, the last two
    through the file descriptor store; systemctl stop unmounts. Run with FakeManager in place
    of systemd."""
    mnt = tmp_path / "mnt"
    manager = FakeManager(tmp_path)
    proc = start_unit(tmp_path, manager)
    try:
        manager.wait_stored(["kcachefs-fuse", "kcachefs-init"])
        compile_one(mnt)
        cubins = list(mnt.glob("cache/*/kernel.cubin"))
        data = cubins[0].read_bytes()
        dev = os.stat(mnt).st_dev
        holder = [proc.pid]
        wait_until(lambda: daemons_of(mnt, "kcachefs-holder") == holder and
                   len(daemons_of(mnt)) == 1, "no holder and daemon")
        daemon = daemons_of(mnt)
        # systemctl reload: the upgrade returns once the new daemon serves; the holder, the
        # main process, stays.
        run_unit_commands("ExecReload", tmp_path)
        assert daemons_of(mnt) not in ([], daemon)
        assert daemons_of(mnt, "kcachefs-holder") == holder
        assert cubins[0].read_bytes() == data and os.stat(mnt).st_dev == dev

        # systemctl restart: SIGTERM to the holder (KillMode=mixed), which ends the daemon
        # and exits 0, leaving the mount to the store; ExecStopPost sees the restart job.
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        kill_the_rest(mnt)
        stop_post(tmp_path, "success", restart_queued=True)
        assert str(mnt) in mount_table()
        proc = start_unit(tmp_path, manager)
        assert os.stat(mnt).st_dev == dev and cubins[0].read_bytes() == data

        # A crash: the holder and the daemon are killed; the store keeps the mount and the
        # next start serves it again.
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kill_the_rest(mnt)
        stop_post(tmp_path, "signal", restart_queued=False)
        assert str(mnt) in mount_table()
        proc = start_unit(tmp_path, manager)
        assert os.stat(mnt).st_dev == dev
        assert cubins[0].read_bytes() == data
        src, flags = sample("vector_add")
        entry = mnt / "cache" / entry_name("vector_add", src + b"//2", flags)
        entry.mkdir()
        (entry / "kernel.cu").write_bytes(src + b"//2")
        (entry / "kernel.flags").write_bytes(flags)
        assert (entry / "kernel.cubin").read_bytes()[:4] == b"\x7fELF"
        journal = (tmp_path / "journal").read_text()
        assert journal.count("the service manager kept the mount") == 2, journal

        # systemctl stop: the same SIGTERM, no restart job: ExecStopPost unmounts, and
        # systemd closes the store.
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        kill_the_rest(mnt)
        stop_post(tmp_path, "success", restart_queued=False)
        manager.release()
        assert not os.path.ismount(mnt) and str(mnt) not in mount_table()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_the_rest(mnt)
        manager.release()
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
