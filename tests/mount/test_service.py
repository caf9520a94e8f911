"""The service files in scripts/: the fstab line mounts through mount.fuse3, and the systemd
unit's commands start, stop and restart the daemon, both with the same options, here with
test paths in place of /var/cache/kcachefs and /mnt/kcache."""
import os
import re
import shlex
import signal
import subprocess
import time

from conftest import KCACHEFS, REPO, sample, entry_name

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


def daemons_of(backing):
    """Pids of kcachefs daemons serving backing."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open("/proc/%s/cmdline" % pid, "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv[0].endswith(b"kcachefs") and str(backing).encode() in argv:
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
        pids = daemons_of(backing)
        assert len(pids) == 1, "one daemon, in the background"
        compile_one(mnt)
        assert "\nkcachefs_compiles_total 1\n" in (mnt / ".kcachefs" / "metrics.prom").read_text()
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
    deadline = time.monotonic() + 20
    while daemons_of(backing):
        assert time.monotonic() < deadline, "the daemon did not exit after umount"
        time.sleep(0.05)
    assert not os.path.ismount(mnt)


def run_unit_commands(key, tmp_path):
    for value in unit_values(key):
        ignore = value.startswith("-")
        r = subprocess.run(shlex.split(to_test_paths(value.lstrip("-"), tmp_path)),
                           capture_output=True, text=True, timeout=60)
        assert ignore or r.returncode == 0, (value, r.stderr)


def mount_table():
    """The mountpoints of /proc/self/mounts (octal escapes such as \\040 decoded)."""
    with open("/proc/self/mounts") as f:
        return {re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[1])
                for line in f}


def start_unit(tmp_path):
    """systemd's start: ExecStartPre, ExecStart (the daemon, in the foreground), then
    ExecStartPost, which returns once the mount is up."""
    run_unit_commands("ExecStartPre", tmp_path)
    log = open(tmp_path / "journal", "ab")
    proc = subprocess.Popen(shlex.split(to_test_paths(unit_values("ExecStart")[0], tmp_path)),
                            stdout=log, stderr=subprocess.STDOUT)
    run_unit_commands("ExecStartPost", tmp_path)
    return proc


def test_the_unit_starts_stops_and_restarts_after_a_crash(tmp_path):
    mnt = tmp_path / "mnt"
    proc = start_unit(tmp_path)
    try:
        assert os.stat(tmp_path / "var").st_mode & 0o777 == 0o700
        assert os.path.ismount(mnt)
        compile_one(mnt)
        # A crash leaves a dead mount; the restart's ExecStartPre clears it.
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # A dead mount is still in the table; stat of it fails (ENOTCONN) once the kernel's
        # cached attributes expire, so os.path.ismount says False on a slow machine.
        assert str(mnt) in mount_table()
        proc = start_unit(tmp_path)
        assert os.path.ismount(mnt)
        assert (mnt / ".kcachefs" / "stats").read_text().startswith("kcachefs ")
        # systemd's stop: SIGTERM, and the daemon unmounts and exits 0.
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert not os.path.ismount(mnt)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
    assert "unmounting" in (tmp_path / "journal").read_text()
