"""Compile ahead (src/cache/ahead.c): a new image's kernels, asked one at a time under new
headers, are compiled ahead from the last image's history, in idle job slots; a client's
own compile of one is a hit or joins that compile, never a second compile.

Each test runs the nvcc shim as DeepGEMM does (kernels that include a header through -I),
an "image" being a copy of the header tree with other bytes. DeepGEMM writes its include
tree's hash into each source's first line as a comment: the tests' sources do the same
where they say so."""
import hashlib
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from conftest import KERNELS, NVCC, SHIM, elf_symbols, write_script
from kcmount import wait_until

TEMPLATE = """#include <kc_test/scale.cuh>
extern "C" __global__ void scale_%d(const float *in, float *out, int n)
{
	int i = blockIdx.x * blockDim.x + threadIdx.x; // one thread an element
	if (i < n)
		out[i] = kc_scale<%d>(in[i]); /* the header's scale */
}
"""


def image(base, scale):
    """A copy of the sample include tree under base whose header scales by scale (other
    bytes: another image); returns its include directory."""
    inc = base / "include"
    if not inc.exists():
        import shutil
        shutil.copytree(KERNELS / "include", inc)
        header = inc / "kc_test" / "scale.cuh"
        header.write_text(header.read_text().replace("x * static_cast<float>(N)", scale))
    return inc


def source(tmp_path, i, inc=None, code=None):
    """Kernel i's source alone in a directory of its own; with inc, a first line naming
    the hash of the include tree, as DeepGEMM's do."""
    d = Path(tempfile.mkdtemp(dir=tmp_path))
    text = code if code is not None else TEMPLATE % (i, i + 2)
    if inc is not None:
        h = hashlib.sha256()
        for f in sorted(Path(inc).rglob("*")):
            if f.is_file():
                h.update(f.read_bytes())
        text = "// Includes' hash value: %s\n" % h.hexdigest() + text
    (d / "k.cu").write_text(text)
    return d / "k.cu"


def ask(m, tmp_path, i, inc, comment=False, code=None):
    """Compile kernel i through the shim against inc; returns the cubin's bytes."""
    out = Path(tempfile.mkdtemp(dir=tmp_path)) / "k.cubin"
    env = dict(os.environ, KCACHEFS_MOUNT=str(m.mnt))
    r = subprocess.run([str(SHIM), str(source(tmp_path, i, inc if comment else None, code)),
                        "-cubin", "-o", str(out), "-arch=sm_90a", "-I", str(inc)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stderr == "", r.stderr + m.daemon_log()[-3000:]
    return out.read_bytes()


def counted(m):
    s = m.stats()
    return {k: int(s[k]) for k in ("compiles_total", "ahead_triggers_total",
                                   "ahead_compiles_total", "ahead_used_total",
                                   "ahead_failures_total")}


def started(m):
    """Wait until the compiles ahead of m's trigger have all started (none queued): a
    client that asks then joins one or finds it published. Compiles ahead run in the idle
    class, which a loaded machine starves (a minute each beside two busy loops): a test
    waits for their start, which needs no CPU, and joins them, which promotes them."""
    wait_until(lambda: m.stats()["ahead_triggers_total"] >= 1 and
               m.stats()["ahead_queued"] == 0, m.daemon_log)


def idle_compiles(tmp_path, log, release=None):
    """A compiler that writes one line per compile to log: "start idle" for a compile run
    in the idle scheduling class (a compile ahead), "start demand" for others; then runs
    nvcc. With release, compiles ahead wait until that file exists."""
    log.write_text("")
    os.chmod(log, 0o666)
    hold = ('  if [ $c = idle ]; then while [ ! -e %s ]; do sleep 0.05; done; fi\n' % release
            if release else "")
    return write_script(
        tmp_path / "nvcc-classed",
        'case " $* " in *"/pass.cubin "*) ;; *-cubin*)\n'
        '  if grep -q "^policy.* 5$" /proc/$$/sched 2>/dev/null; then c=idle; else c=demand; fi\n'
        '  echo "start $c $$" >> %s\n%s;; esac\n'
        'exec %s "$@"\n' % (log, hold, NVCC))


def lines(log):
    return [l.split()[1] for l in log.read_text().splitlines() if l.strip()]


@pytest.mark.parametrize("comment", [False, True], ids=["same-source", "deepgemm-comment"])
def test_a_new_image_is_compiled_ahead(mount_factory, tmp_path, comment):
    """Image A asks K kernels one at a time: K compiles. Image B (other header bytes) asks
    the same K one at a time: the first compiles and triggers; the other K-1 are compiled
    ahead, each once, and every client's open after the first is a hit or a join. Each
    cubin is the one a plain nvcc makes from B's headers. The same when each source's first
    line is a comment naming its headers' hash, as DeepGEMM's are."""
    K = 4
    log = tmp_path / "compiles"
    m = mount_factory(["nvcc=%s" % idle_compiles(tmp_path, log), "jobs=%d" % K])
    a = image(tmp_path / "a", "x * static_cast<float>(N)")
    b = image(tmp_path / "b", "x * static_cast<float>(N) + 1.0f")
    for i in range(K):
        ask(m, tmp_path, i, a, comment)
    assert counted(m)["compiles_total"] == K and counted(m)["ahead_triggers_total"] == 0
    got = [ask(m, tmp_path, 0, b, comment)]
    started(m)
    got += [ask(m, tmp_path, i, b, comment) for i in range(1, K)]
    c = counted(m)
    assert c["ahead_triggers_total"] == 1, m.daemon_log()[-3000:]
    assert c["ahead_used_total"] == K - 1, (c, m.daemon_log()[-3000:])
    # compiles_total counts every compiler run that published: B's first kernel and the
    # K - 1 compiled ahead, never a second compile of one of those
    assert c["compiles_total"] == 2 * K and c["ahead_compiles_total"] == K - 1, c
    # compiles ahead start in the idle class; one a client caught up with before its
    # compiler started runs in the normal class from its start
    assert len(lines(log)) == 2 * K and lines(log).count("idle") >= 1, lines(log)
    assert "compile ahead: recipe" in m.daemon_log()
    # the bytes are what nvcc makes of B's headers
    for i in (1, K - 1):
        ref = Path(tempfile.mkdtemp(dir=tmp_path)) / "ref.cubin"
        subprocess.run([str(NVCC), str(source(tmp_path, i, b if comment else None)), "-cubin",
                        "-o", str(ref), "-arch=sm_90a", "-I", str(b)], check=True)
        assert got[i] == ref.read_bytes() and "scale_%d" % i in elf_symbols(got[i])
    stats = (m.mnt / ".kcachefs" / "stats").read_text()
    assert "compile ahead:" in stats and "never asked" in stats


def test_without_a_history_each_is_compiled_in_turn(mount_factory, tmp_path):
    """-o ahead=0: no history, no compile ahead: image B's K kernels are K compiles, one
    after another, as before; the stats leave the group out."""
    K = 3
    m = mount_factory(["ahead=0"])
    a = image(tmp_path / "a", "x * static_cast<float>(N)")
    b = image(tmp_path / "b", "x * static_cast<float>(N) + 1.0f")
    for inc in (a, b):
        for i in range(K):
            ask(m, tmp_path, i, inc, True)
    c = counted(m)
    assert c["compiles_total"] == 2 * K and c["ahead_triggers_total"] == 0
    assert "compile ahead:" not in (m.mnt / ".kcachefs" / "stats").read_text()
    assert not (m.backing / ".kcachefs" / "ahead").exists()


def test_other_code_is_never_taken(mount_factory, tmp_path):
    """Image B asks a kernel whose code differs from the history's in one token (not a
    comment): it is compiled for itself, and its cubin is its own code's."""
    m = mount_factory(["jobs=3"])
    a = image(tmp_path / "a", "x * static_cast<float>(N)")
    b = image(tmp_path / "b", "x * static_cast<float>(N) + 1.0f")
    for i in range(3):
        ask(m, tmp_path, i, a)
    ask(m, tmp_path, 0, b)  # the trigger: 1 and 2 compiled ahead
    started(m)
    other = (TEMPLATE % (1, 3)).replace("if (i < n)", "if (i <= n - 1)")
    got = ask(m, tmp_path, 1, b, code=other)
    c = counted(m)
    assert c["ahead_used_total"] == 0, c
    assert "published from its compile ahead" not in m.daemon_log()
    ref = Path(tempfile.mkdtemp(dir=tmp_path)) / "ref.cubin"
    srcf = source(tmp_path, 1, code=other)
    subprocess.run([str(NVCC), str(srcf), "-cubin", "-o", str(ref), "-arch=sm_90a", "-I",
                    str(b)], check=True)
    assert got == ref.read_bytes()


def test_a_client_joins_the_compile_ahead_it_asks(mount_factory, tmp_path):
    """A client asks for a kernel while its compile ahead runs: it waits for that compile
    (one compiler run), which it promotes out of the idle class, and gets its bytes."""
    release, log = tmp_path / "release", tmp_path / "compiles"
    m = mount_factory(["nvcc=%s" % idle_compiles(tmp_path, log, release), "jobs=2", "ahead=1"])
    a = image(tmp_path / "a", "x * static_cast<float>(N)")
    b = image(tmp_path / "b", "x * static_cast<float>(N) + 1.0f")
    release.touch()
    for i in range(2):
        ask(m, tmp_path, i, a, True)
    release.unlink()
    ask(m, tmp_path, 0, b, True)  # the trigger: kernel 1 is compiled ahead, held at the gate
    wait_until(lambda: "start idle" in log.read_text(), m.daemon_log)
    got = {}
    t = threading.Thread(target=lambda: got.update(k=ask(m, tmp_path, 1, b, True)))
    t.start()
    time.sleep(1)
    assert t.is_alive(), "the client waits for the compile ahead"
    release.touch()
    t.join(120)
    assert not t.is_alive() and "scale_1" in elf_symbols(got["k"])
    c = counted(m)
    assert c["compiles_total"] == 4 and c["ahead_used_total"] == 1, c
    assert lines(log).count("idle") == 1


def test_a_client_never_waits_behind_compiles_ahead(mount_factory, tmp_path):
    """Every job slot compiles ahead (held); a client's kernel that no history holds starts
    at once, beside them, and is answered while they are still held."""
    release, log = tmp_path / "release", tmp_path / "compiles"
    m = mount_factory(["nvcc=%s" % idle_compiles(tmp_path, log, release), "jobs=1"])
    a = image(tmp_path / "a", "x * static_cast<float>(N)")
    b = image(tmp_path / "b", "x * static_cast<float>(N) + 1.0f")
    release.touch()
    for i in range(3):
        ask(m, tmp_path, i, a)
    release.unlink()
    ask(m, tmp_path, 0, b)
    wait_until(lambda: "start idle" in log.read_text(), m.daemon_log)
    try:
        got = ask(m, tmp_path, 7, b)  # a kernel of its own: no history holds it
        assert "scale_7" in elf_symbols(got)
        assert not release.exists() and m.stats()["ahead_running"] == 1
        # the queued compile ahead (kernel 2) waits for an idle slot, never the client
        starts = lines(log)
        assert starts[-2:] == ["idle", "demand"] or starts[-1] == "demand", starts
    finally:
        release.touch()
    for i in (1, 2):  # each joins or takes its compile ahead, or compiles if it is queued
        assert "scale_%d" % i in elf_symbols(ask(m, tmp_path, i, b))


def failing_ahead(tmp_path):
    """A compiler whose compiles in the idle class (compiles ahead) fail."""
    return write_script(
        tmp_path / "nvcc-ahead-fails",
        'case " $* " in *-cubin*)\n'
        '  if grep -q "^policy.* 5$" /proc/$$/sched 2>/dev/null; then echo "no" >&2; exit 3; fi;; esac\n'
        'exec %s "$@"\n' % NVCC)


def test_a_failing_compile_ahead_changes_nothing_for_the_client(mount_factory, tmp_path):
    """Compiles ahead that fail are counted; each client's compile then runs as without the
    feature and gets its cubin."""
    m = mount_factory(["nvcc=%s" % failing_ahead(tmp_path), "jobs=3"])
    a = image(tmp_path / "a", "x * static_cast<float>(N)")
    b = image(tmp_path / "b", "x * static_cast<float>(N) + 1.0f")
    for i in range(3):
        ask(m, tmp_path, i, a)
    ask(m, tmp_path, 0, b)
    wait_until(lambda: counted(m)["ahead_failures_total"] == 2, m.daemon_log)
    for i in (1, 2):
        assert "scale_%d" % i in elf_symbols(ask(m, tmp_path, i, b))
    c = counted(m)
    assert c["ahead_used_total"] == 0 and c["compiles_total"] == 6, c


def test_the_history_survives_a_restart_and_a_bad_one_is_refused(mount_factory, tmp_path):
    """The history is in the backing directory: after a restart, image B still triggers. A
    history file with other bytes (cut, or past the bounds) is refused with a log line and
    removed, and the mount serves as without it."""
    m = mount_factory(["jobs=3"])
    a = image(tmp_path / "a", "x * static_cast<float>(N)")
    b = image(tmp_path / "b", "x * static_cast<float>(N) + 1.0f")
    for i in range(3):
        ask(m, tmp_path, i, a)
    m.stop()
    hist = m.backing / ".kcachefs" / "ahead" / "history"
    files = sorted(hist.iterdir())
    assert len(files) == 1 and files[0].read_bytes().startswith(b"kcachefs-history-v1\n")
    bad = hist / ("0" * 64)
    bad.write_bytes(b"kcachefs-history-v1\n" + b"0" * 64 + b"\n2\n5 3\nab")  # cut
    m.start()
    assert not bad.exists() and "history 0000000000000000 not loaded" in m.daemon_log()
    for i in range(3):
        if i == 1:
            started(m)
        ask(m, tmp_path, i, b)
    c = counted(m)
    assert c["ahead_triggers_total"] == 1 and c["ahead_used_total"] == 2, c


HISTORIES_KEY = hashlib.sha256(b"kcachefs-histories-key-v1\n" + b"0\n\n").hexdigest()


def history_key(context):
    return hashlib.sha256(b"kcachefs-history-key-v1\n" + b"64\n" + context.encode() +
                          b"\n").hexdigest()


def plant_history(store, key, manifest):
    """Write an unsigned history-kind object (remote_object.h) under key, as anyone who can
    write a dir: store can."""
    obj = (b"kcachefs-object-v1\nhistory %s %d 0 0\n" % (key.encode(), len(manifest)) +
           manifest + hashlib.sha256(b"").hexdigest().encode() + b"\n")
    d = store / "objects" / key[:2]
    d.mkdir(parents=True, exist_ok=True)
    (d / key).write_bytes(obj)


def stored_histories(store):
    """The recipe counts of the history records in a dir: store."""
    out = []
    for p in (store / "objects").glob("*/*"):
        data = p.read_bytes()
        i = data.find(b"kcachefs-history-v1\n")
        if p.name != HISTORIES_KEY and i >= 0:
            out.append(int(data[i + 20 + 65:].split(b"\n", 1)[0]))
    return out


def test_two_nodes_of_a_new_image_compile_each_kernel_once(tmp_path, template):
    """A node runs image A: its history goes to the cluster store. Two new nodes start
    together on image B, read it, and ask image B's kernels at once, one at a time: each
    compile ahead takes the cluster lease of its code key, so the two split the list, and
    each of B's kernels is compiled once in the cluster; both nodes serve the same bytes."""
    from kccluster import Cluster
    K = 4
    c = Cluster(tmp_path, template)
    try:
        a = image(tmp_path / "a", "x * static_cast<float>(N)")
        b = image(tmp_path / "b", "x * static_cast<float>(N) + 1.0f")
        n0 = c.node("n0", ["jobs=2"])
        for i in range(K):
            ask(n0, tmp_path, i, a, True)
        wait_until(lambda: stored_histories(c.store) == [K], n0.daemon_log)
        n0.stop()
        before = len(c.compiles())
        n1, n2 = c.node("n1", ["jobs=2"]), c.node("n2", ["jobs=2"])
        for n in (n1, n2):
            wait_until(lambda: "1 histories read from the cluster store" in n.daemon_log(),
                       n.daemon_log)
        got = {}

        def run(n):
            got[n.root.name] = [ask(n, tmp_path, i, b, True) for i in range(K)]
        ts = [threading.Thread(target=run, args=(n,)) for n in (n1, n2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(300)
        assert len(got) == 2, n1.daemon_log()[-2000:] + n2.daemon_log()[-2000:]
        assert got["n1"] == got["n2"], "one compile of each kernel, shared"
        after = c.compiles()[before:]
        assert len(after) == K, (after, n1.daemon_log()[-3000:], n2.daemon_log()[-3000:])
        ahead = sum(int(n.stats()["ahead_compiles_total"]) for n in (n1, n2))
        assert 1 <= ahead <= 2 * (K - 1)
    finally:
        c.stop()


@pytest.mark.parametrize("how", ["oversized", "unsigned"])
def test_a_bad_history_in_the_store_is_refused(tmp_path, template, how):
    """The cluster store's histories are checked as objects are: an unsigned one where the
    nodes sign (-o remote_key), or one past the bounds, is refused (logged, counted in
    remote_rejected) and the node compiles as without it."""
    from kccluster import Cluster
    c = Cluster(tmp_path, template)
    try:
        context = "ab" * 32
        body = b"kcachefs-history-v1\n" + context.encode() + b"\n1\n"
        if how == "oversized":
            body += b"%d 0\n" % (5 << 20) + b"x" * (5 << 20)
        else:
            body += b"2 1\n-Os"
        plant_history(c.store, history_key(context), body)
        plant_history(c.store, HISTORIES_KEY, context.encode() + b"\n")
        opts = ["jobs=2"]
        if how == "unsigned":
            keyf = tmp_path / "store.key"
            keyf.write_bytes(os.urandom(32))
            os.chmod(keyf, 0o600)
            opts.append("remote_key=%s" % keyf)
        n = c.node("n", opts)
        wait_until(lambda: "histories read from the cluster store" in n.daemon_log(),
                   n.daemon_log)
        assert "refused" in n.daemon_log() and n.stats()["remote_rejected_total"] >= 1
        inc = image(tmp_path / "a", "x * static_cast<float>(N)")
        assert ask(n, tmp_path, 0, inc, True)[:4] == b"\x7fELF"
        assert int(n.stats()["ahead_triggers_total"]) == 0
    finally:
        c.stop()


def test_with_the_store_down_compile_ahead_works_on_the_node(mount_factory, tmp_path):
    """A cluster store that does not answer (its directory is not mounted): the history's
    puts and gets fail (counted as the store's faults), and the node compiles ahead from its
    own history as a node without a store does."""
    m = mount_factory(["remote=dir:%s" % (tmp_path / "not-mounted"), "remote_timeout=500",
                       "jobs=3"])
    a = image(tmp_path / "a", "x * static_cast<float>(N)")
    b = image(tmp_path / "b", "x * static_cast<float>(N) + 1.0f")
    for i in range(3):
        ask(m, tmp_path, i, a, True)
    for i in range(3):
        if i == 1:
            started(m)
        assert "scale_%d" % i in elf_symbols(ask(m, tmp_path, i, b, True))
    c = counted(m)
    assert c["ahead_triggers_total"] == 1 and c["ahead_used_total"] == 2, c
    assert m.stats()["remote_up"] == 0


def test_a_full_disk_fails_compiles_ahead_not_clients(tmp_path):
    """The backing directory's disk is full when image B's first kernel comes: that
    client's compile fails as it would without compile ahead (the shim falls back to nvcc),
    the compiles ahead fail (logged, counted), the mount serves on; once there is room, B's
    other kernels compile for their clients."""
    from kcmount import Mount
    img, disk = tmp_path / "disk.img", tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["truncate", "-s", "24M", str(img)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True)
    subprocess.run(["mount", "-o", "loop", str(img), str(disk)], check=True)
    m = None
    try:
        (tmp_path / "m").mkdir()
        m = Mount(tmp_path / "m", ["jobs=2"])
        os.rmdir(m.backing)
        m.backing = disk
        m.start()
        a = image(tmp_path / "a", "x * static_cast<float>(N)")
        b = image(tmp_path / "b", "x * static_cast<float>(N) + 1.0f")
        for i in range(3):
            ask(m, tmp_path, i, a)
        filler = disk / "filler"
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
            except OSError:
                pass
        os.sync()
        out = Path(tempfile.mkdtemp(dir=tmp_path)) / "k.cubin"
        r = subprocess.run([str(SHIM), str(source(tmp_path, 0)), "-cubin", "-o", str(out),
                            "-arch=sm_90a", "-I", str(b)], capture_output=True, text=True,
                           env=dict(os.environ, KCACHEFS_MOUNT=str(m.mnt)), timeout=300)
        assert r.returncode == 0 and "instead" in r.stderr, r.stderr  # nvcc's, as before
        wait_until(lambda: counted(m)["ahead_failures_total"] == 2, m.daemon_log)
        log = m.daemon_log()
        assert "compile ahead: recipe" in log and ("out of disk space" in log or
                                                   "No space left" in log), log[-2000:]
        filler.unlink()
        os.sync()
        time.sleep(2.2)  # past the retry hold-off of kernel 0
        for i in (1, 2):
            assert "scale_%d" % i in elf_symbols(ask(m, tmp_path, i, b))
        assert counted(m)["ahead_used_total"] == 0
    finally:
        if m is not None:
            m.stop()
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
