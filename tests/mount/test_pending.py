"""Readers that open or stat a kernel.cubin while it compiles (the pending inode): every
way of reading sees the whole compiled file, and a re-staged entry never mixes recipes."""
import fcntl
import mmap
import os
import resource
import signal
import time

import pytest

from conftest import entry_name, run_parallel, sample, start_openers, write_script
from kcmount import slow_nvcc, variant, wait_for_flight, wait_until


def delayed_nvcc(tmp_path, seconds):
    return write_script(tmp_path / "nvcc-delayed",
                        'case "$*" in *-cubin*) sleep %s;; esac\n'
                        'exec /usr/local/cuda/bin/nvcc "$@"\n' % seconds)


def read_while_compiling(i, path):
    """Open during the compile, then read without fstat first, in several ways."""
    fd = os.open(path, os.O_RDONLY)
    try:
        how = ("sendfile", "mmap", "pread", "read")[i % 4]
        if how == "sendfile":
            r, w = os.pipe()
            n = os.sendfile(w, fd, 0, 1 << 20)
            data = os.read(r, 1 << 20) if n else b""
            os.close(r)
            os.close(w)
        elif how == "mmap":
            with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as mm:  # size from the kernel's inode
                data = bytes(mm[:])
        elif how == "pread":
            data = os.pread(fd, 1 << 20, 0)
        else:
            with os.fdopen(os.dup(fd), "rb") as f:
                data = f.read()
        return how, data
    finally:
        os.close(fd)


def test_every_reader_of_a_compiling_cubin_gets_all_bytes(mount_factory, tmp_path):
    m = mount_factory(["nvcc=%s" % delayed_nvcc(tmp_path, 0.5)])
    src, flags = sample("saxpy")
    for round_ in range(4):
        source = src + b"// round %d\n" % round_
        entry = m.stage("saxpy", source, flags)
        results = run_parallel(12, read_while_compiling, str(entry / "kernel.cubin"))
        want = (m.backing / entry.relative_to(m.mnt) / "kernel.cubin").read_bytes()
        for how, data in results:
            assert data == want, "%s read %d of %d bytes" % (how, len(data), len(want))


def test_descriptor_on_a_re_staged_entry_keeps_its_recipe(mount_factory, tmp_path):
    m = mount_factory(["nvcc=%s" % delayed_nvcc(tmp_path, 0.5)])
    a_src, flags = sample("saxpy")
    entry = m.mnt / "cache" / entry_name("k", b"entry")
    entry.mkdir(parents=True)
    (entry / "kernel.flags").write_bytes(flags)
    (entry / "kernel.cu").write_bytes(a_src)
    fd1 = os.open(entry / "kernel.cubin", os.O_RDONLY)  # waits for recipe A
    a = os.pread(fd1, 1 << 20, 0)
    assert b"saxpy" in a
    (entry / "kernel.cu").unlink()
    (entry / "kernel.cu").write_bytes(sample("block_sum")[0])
    with open(entry / "kernel.cubin", "rb") as f:  # recipe B
        b = f.read()
    assert b"block_sum" in b and b != a
    assert os.pread(fd1, 1 << 20, 0) == a, "a descriptor of recipe A read another recipe"
    assert os.fstat(fd1).st_size == len(a)
    os.close(fd1)


def change_during_compile(mount_factory, tmp_path, name, openers, change):
    """Stage saxpy in entry name, with its compile held at a gate while `openers` processes
    open its cubin; run change(entry), then open the gate. Returns the mount, the entry,
    the openers' outputs and the cubin the entry then serves."""
    release = tmp_path / "release"
    m = mount_factory(["nvcc=%s" % slow_nvcc(tmp_path, release, "*-DKC_GATE*")])
    entry = m.mnt / "cache" / entry_name("k", name)
    entry.mkdir(parents=True)
    (entry / "kernel.flags").write_bytes(b"-O3\n-DKC_GATE\n")
    (entry / "kernel.cu").write_bytes(sample("saxpy")[0])
    procs = start_openers(entry / "kernel.cubin", openers)
    try:
        wait_for_flight(m)
        change(entry)
    finally:
        release.write_text("open")
        outs = [p.communicate(timeout=120)[0].split() for p in procs]
    data = (entry / "kernel.cubin").read_bytes()
    assert b"block_sum" in data and b"saxpy" not in data, "the old recipe's cubin was served"
    assert "recipe or compiler changed during the compile; result discarded" in m.daemon_log()
    return m, entry, outs, data


def test_a_recipe_re_staged_during_its_compile_never_gets_the_old_cubin(mount_factory,
                                                                        tmp_path):
    # The compile of recipe A waits at the gate while a client unlinks kernel.cu and stages
    # recipe B: A's cubin is discarded at its publish (the recipe moved on), and the openers
    # that waited for A get B's compile.
    def re_stage(entry):
        (entry / "kernel.cu").unlink()
        (entry / "kernel.cu").write_bytes(sample("block_sum")[0])
    m, entry, outs, data = change_during_compile(mount_factory, tmp_path, b"re-staged", 2,
                                                 re_stage)
    assert all(o[0] == "ok" and int(o[1]) == len(data) for o in outs), outs
    assert (m.backing / entry.relative_to(m.mnt) / "kernel.cubin").read_bytes() == data
    assert m.stats()["compiles_total"] == 1


def test_a_recipe_changed_out_of_its_entry_during_its_compile_is_not_served(mount_factory,
                                                                           tmp_path):
    # While recipe A compiles, the entry is renamed to a plain name, its kernel.cu written
    # there as a plain file (no stage, no unstage) and renamed back: A's cubin must not be
    # published for the new bytes (the publish reads the recipe again).
    def moved_out(entry):
        plain = entry.parent / "plain"
        entry.rename(plain)
        (plain / "kernel.cu").write_bytes(sample("block_sum")[0])
        plain.rename(entry)
    _, _, outs, _ = change_during_compile(mount_factory, tmp_path, b"moved-out", 1,
                                          moved_out)
    assert all(o[0] in ("ok", "err") for o in outs), outs


def test_waiter_killed_by_a_core_dumping_signal_goes_at_once(mount_factory, tmp_path):
    m = mount_factory(["nvcc=%s" % delayed_nvcc(tmp_path, 20)])
    entry = m.stage("vector_add", *sample("vector_add"))
    def no_core():
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        for sig in (signal.SIGQUIT, signal.SIGABRT):  # a shell's background job (`&`) runs
            signal.signal(sig, signal.SIG_DFL)        # with SIGQUIT ignored, and so would they
    victims = start_openers(entry / "kernel.cubin", 3, preexec_fn=no_core)
    wait_until(lambda: m.stats()["waits_total"] >= 3, m.stats, 30)
    for p, sig in zip(victims, (signal.SIGQUIT, signal.SIGABRT, signal.SIGTERM)):
        p.send_signal(sig)
        started = time.monotonic()
        assert p.wait(timeout=15) == -sig
        assert time.monotonic() - started < 10, "held until the compile ended"
    assert m.stats()["flights"] == 1, "the compile is still running"


def test_a_cubin_looked_up_while_it_compiled_is_one_file_to_its_later_openers(mount_factory,
                                                                            tmp_path):
    """A kernel.cubin looked up while it compiles gets a pending inode; once the cubin is
    published, a lookup answers that inode while the kernel holds it, even when no request
    of it waited for the compile (a lookup only: O_PATH), so the kernel has one inode of the
    cubin and a flock taken through a later open keeps out an open of the early inode.
    Before, the later lookup answered an inode of its own, and the two opens' locks were
    two sets."""
    release = tmp_path / "release"
    m = mount_factory(["nvcc=%s" % slow_nvcc(tmp_path, release)])
    entry = m.stage("vadd_one", *variant(7))
    early = os.open(entry / "kernel.cubin", os.O_PATH)  # looked up while it compiles
    try:
        wait_for_flight(m)
        release.write_text("")
        backing = m.backing / entry.relative_to(m.mnt) / "kernel.cubin"
        wait_until(backing.exists, "the cubin is published", timeout=120)
        with open(entry / "kernel.cubin", "rb") as later:
            data = later.read()
            fcntl.flock(later, fcntl.LOCK_EX)
            with open("/proc/self/fd/%d" % early, "rb") as again:  # the early inode
                assert os.fstat(again.fileno()).st_ino == os.fstat(later.fileno()).st_ino
                with pytest.raises(BlockingIOError):
                    fcntl.flock(again, fcntl.LOCK_EX | fcntl.LOCK_NB)
                assert again.read() == data
            fcntl.flock(later, fcntl.LOCK_UN)
    finally:
        os.close(early)
