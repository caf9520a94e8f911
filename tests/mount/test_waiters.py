"""Waiters hold no FUSE worker thread: with 64 openers parked on one slow compile, the
rest of the mount keeps answering."""
import errno
import os
import signal
import time

from kcmount import entry_name, sample, slow_nvcc, start_openers, wait_for_flight, wait_until


def gated_openers(mount_factory, tmp_path, n):
    """A mount whose compiler waits for the file `release`, a staged entry, and n openers
    of its kernel.cubin already waiting on the compile. Returns (mount, entry, openers,
    release)."""
    release = tmp_path / "release"
    m = mount_factory(["nvcc=%s" % slow_nvcc(tmp_path, release)])
    entry = m.stage("vector_add", *sample("vector_add"))
    openers = start_openers(entry / "kernel.cubin", n)
    wait_for_flight(m)
    return m, entry, openers, release


def test_64_waiters_do_not_starve_the_mount(mount_factory, tmp_path):
    release = tmp_path / "release"
    m = mount_factory(["nvcc=%s" % slow_nvcc(tmp_path, release), "jobs=2"])
    src, flags = sample("vector_add")
    release.write_text("open")
    other = m.stage("saxpy", *sample("saxpy"))
    other_cubin = (other / "kernel.cubin").read_bytes()  # published before the gate closes
    release.unlink()
    plain = other.parent / "plain"
    plain.mkdir()
    (plain / "data").write_bytes(b"x" * 100000)

    entry = m.stage("vector_add", src, flags)
    openers = start_openers(entry / "kernel.cubin", 64)
    try:
        wait_for_flight(m)
        # 64 Pythons start slowly on busy cores
        wait_until(lambda: m.stats()["waits_total"] >= 64, m.stats, 120)
        # While 64 openers wait, everything else answers, in the same entry too.
        for i in range(200):
            assert os.stat(entry / "kernel.cu").st_size == len(src)
            assert "kernel.cubin" in os.listdir(entry)
            os.stat(other / "kernel.cubin")
            assert len(os.listdir(m.mnt / "cache")) == 3
            assert (plain / "data").read_bytes() == b"x" * 100000
            (plain / ("new%d" % i)).write_text("y")
            assert (other / "kernel.cubin").read_bytes() == other_cubin
        s = m.stats()
        assert s["flights"] == 1, "the compile should still be gated"
        assert all(p.poll() is None for p in openers), "an opener returned before the compile"
        assert s["waits_total"] >= 64, "each opener is its own parked request"
    finally:
        release.write_text("go")
    outs = [p.communicate(timeout=120)[0].split() for p in openers]
    assert all(o[0] == "ok" and int(o[1]) > 0 for o in outs), outs
    assert len({o[1] for o in outs}) == 1
    assert m.stats()["compiles_total"] == 2


HANDLER = "import signal; signal.signal(signal.SIGTERM, lambda *a: None)"


def test_killed_waiters_leave_others_unaffected(mount_factory, tmp_path):
    """Every waiter is its own request: any one of them can be killed at once, also after
    a signal it survived (SIGTERM caught by a handler, then SIGKILL)."""
    m, entry, openers, release = gated_openers(mount_factory, tmp_path, 6)
    survivor, = start_openers(entry / "kernel.cubin", 1, HANDLER)
    try:
        wait_until(lambda: m.stats()["waits_total"] >= 7, m.stats, 30)
        for victim in (openers[3], openers[0]):
            victim.send_signal(signal.SIGKILL)
            assert victim.wait(timeout=10) == -signal.SIGKILL
        survivor.send_signal(signal.SIGTERM)  # caught: it keeps waiting
        time.sleep(0.5)
        assert survivor.poll() is None
        survivor.send_signal(signal.SIGKILL)
        assert survivor.wait(timeout=10) == -signal.SIGKILL
        assert all(p.poll() is None for p in openers[1:3] + openers[4:])
        assert m.stats()["flights"] == 1, "the compile is still gated"
    finally:
        release.write_text("go")
    outs = [p.communicate(timeout=120)[0].split() for p in openers[1:3] + openers[4:]]
    assert all(o[0] == "ok" for o in outs), outs
    assert m.stats()["compiles_total"] == 1


def compilers_running(script):
    """Processes whose command line names script (the gated compiler)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open("/proc/%s/cmdline" % pid, "rb") as f:
                if str(script).encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def test_unmount_during_compile_answers_waiters(mount_factory, tmp_path):
    """SIGTERM (systemd's stop) with a compile in flight: the compiler is stopped, every
    waiter gets EIO at once, temporaries are removed, the daemon exits 0, and a remount on
    the same backing directory starts clean and compiles the entry on its next open."""
    m, entry, openers, release = gated_openers(mount_factory, tmp_path, 4)
    # A stage still open at the shutdown: its temporary lies in the state directory's tmp/.
    half = m.mnt / "cache" / entry_name("saxpy", b"// half\n") / "kernel.cu"
    half.parent.mkdir()
    stage = open(half, "wb")
    stage.write(b"// half")
    stage.flush()
    assert list((m.backing / ".kcachefs" / "tmp").iterdir())
    assert compilers_running(tmp_path / "nvcc-gated")
    # all four wait in the daemon, not the kernel
    wait_until(lambda: m.stats()["parked_requests"] >= 4, m.stats, 30)
    m.proc.send_signal(signal.SIGTERM)
    outs = [p.communicate(timeout=60)[0].split() for p in openers]
    assert outs == [["err", str(errno.EIO)]] * 4, outs
    assert m.proc.wait(timeout=30) == 0
    try:
        stage.close()
    except OSError:
        pass  # the mount is gone: the stage is lost, as a crash would lose it
    assert not compilers_running(tmp_path / "nvcc-gated")
    state = m.backing / ".kcachefs"
    assert list((state / "scratch").iterdir()) == []
    assert list((state / "tmp").iterdir()) == []
    assert not (m.backing / entry.relative_to(m.mnt) / "kernel.cubin").exists()
    assert "unmounting" in m.daemon_log()
    release.write_text("open")
    m2 = mount_factory(["nvcc=%s" % slow_nvcc(tmp_path, release)], name="m")
    assert m2.stats()["flights"] == 0 and m2.stats()["compiles_total"] == 0
    assert (entry / "kernel.cubin").read_bytes()[:4] == b"\x7fELF"
    assert m2.stats()["compiles_total"] == 1
