"""The compiler of record is the compiler on disk (src/compile/identity.h): a compiler replaced
while mounted is noticed before the next compile, and nothing one compiler produced (a
cubin, a remembered rejection) is served or remembered under another one's identity; and
one binary has one identity, wherever it is installed."""
import errno
import os

from conftest import KERNELS, NVCC, elf_symbols, read_result, sample, write_script

REJECTS = ('case "$*" in *-cubin*) echo "$1(1): error: compiler A rejects every kernel"; '
           'exit 2;; esac\nexec %s "$@"\n' % NVCC)
COMPILES = '# compiler B\nexec %s "$@"\n' % NVCC


def compiler_dir(tmp_path):
    d = tmp_path / "toolkit"
    d.mkdir()
    d.chmod(0o777)  # the swap in test_a_compiler_swapped_during_a_compile runs as a compile
    return d


def install(path, body):
    """Replace the compiler at path atomically, as a package manager does."""
    new = write_script(path.with_name(path.name + ".new"), body)
    os.rename(new, path)


def test_a_rejection_belongs_to_the_compiler_that_gave_it(mount_factory, tmp_path):
    nvcc = compiler_dir(tmp_path) / "nvcc"
    install(nvcc, COMPILES)
    m = mount_factory(["nvcc=%s" % nvcc])
    install(nvcc, REJECTS)  # a broken in-place upgrade
    entry = m.stage("vector_add", *sample("vector_add"))
    later = m.stage("saxpy", *sample("saxpy"))
    assert read_result(entry / "kernel.cubin") == ("err", errno.EIO)
    assert "compiler A rejects" in (entry / "kernel.log").read_text()
    assert read_result(entry / "kernel.cubin") == ("err", errno.EIO)
    assert read_result(later / "kernel.cubin") == ("err", errno.EIO)
    s = m.stats()
    assert s["compile_failures_total"] == 2 and s["rejected_lookups_total"] >= 1, s
    install(nvcc, COMPILES)  # the real one is back: its own verdict counts
    r = read_result(entry / "kernel.cubin")
    assert r[0] == "ok", r
    assert "vector_add" in elf_symbols((entry / "kernel.cubin").read_bytes())
    m.stop()  # and after a remount
    m.start()
    r = read_result(m.mnt / later.relative_to(m.mnt) / "kernel.cubin")
    assert r[0] == "ok", r
    assert m.stats()["compiles_total"] == 1


def test_a_cubin_belongs_to_the_compiler_that_built_it(mount_factory, tmp_path):
    nvcc = compiler_dir(tmp_path) / "nvcc"
    install(nvcc, REJECTS)
    m = mount_factory(["nvcc=%s" % nvcc])
    install(nvcc, COMPILES)
    entry = m.stage("vector_add", *sample("vector_add"))
    assert read_result(entry / "kernel.cubin")[0] == "ok"
    install(nvcc, REJECTS)  # back to the mount-time compiler
    other = m.stage("saxpy", *sample("saxpy"))
    assert read_result(other / "kernel.cubin") == ("err", errno.EIO)  # a compile notices
    # B's cubin is B's: the compiler there now is asked, and rejects the recipe
    assert read_result(entry / "kernel.cubin") == ("err", errno.EIO)
    assert "compiler A rejects" in (entry / "kernel.log").read_text()
    install(nvcc, COMPILES)
    assert read_result(entry / "kernel.cubin")[0] == "ok"
    m.stop()
    install(nvcc, REJECTS)
    m.start()  # a mount with A never serves what B built
    assert read_result(entry / "kernel.cubin") == ("err", errno.EIO)
    assert not (m.backing / entry.relative_to(m.mnt) / "kernel.cubin").exists()
    # Nor does a mount that started with B, where the kernel holds B's cubin as a published
    # file, once A is back and noticed
    install(nvcc, COMPILES)
    assert read_result(entry / "kernel.cubin")[0] == "ok"
    m.stop()
    m.start()
    assert read_result(entry / "kernel.cubin")[0] == "ok"
    install(nvcc, REJECTS)
    assert read_result(other / "kernel.cubin") == ("err", errno.EIO)
    assert read_result(entry / "kernel.cubin") == ("err", errno.EIO)


def test_a_compiler_swapped_during_a_compile(mount_factory, tmp_path):
    """The compile that ran while the compiler was replaced is discarded, whichever of the
    two ran; the compiler there now compiles the recipe again."""
    d = compiler_dir(tmp_path)
    nvcc, calls = d / "nvcc", tmp_path / "b-calls"
    calls.write_text("")
    calls.chmod(0o666)
    b = write_script(d / "compiler-b", 'case "$*" in *-cubin*) echo $$ >> %s;; esac\n'
                     'exec %s "$@"\n' % (calls, NVCC))
    # A builds another kernel (saxpy) and, before it exits, B is installed in its place
    install(nvcc, 'case "$*" in *-cubin*) ;; *) exec %s "$@";; esac\n'
            '%s %s -cubin -o "$4" -arch=sm_90a || exit\n'
            'cp %s %s.swap && mv -f %s.swap %s\nexit 0\n'
            % (NVCC, NVCC, KERNELS / "saxpy.cu", b, nvcc, nvcc, nvcc))
    m = mount_factory(["nvcc=%s" % nvcc])
    entry = m.stage("vector_add", *sample("vector_add"))
    r = read_result(entry / "kernel.cubin")
    assert r[0] == "ok", (r, m.daemon_log())
    symbols = elf_symbols((entry / "kernel.cubin").read_bytes())
    assert "vector_add" in symbols and "saxpy" not in symbols, symbols
    assert len(calls.read_text().split()) == 1, "B did not compile the recipe once"
    assert "compiler changed during the compile" in m.daemon_log()


def test_one_binary_has_one_identity(mount_factory, tmp_path):
    """The same compiler reached through another path (a symlink, CUDA_HOME or PATH, or
    another node's install prefix) is the same compiler: nothing is compiled again."""
    one, two = tmp_path / "prefix-1", tmp_path / "prefix-2"
    for d in (one, two):
        d.mkdir()
        d.chmod(0o755)
        write_script(d / "nvcc", COMPILES)
    m = mount_factory(["nvcc=%s" % (one / "nvcc")])
    entry = m.stage("vector_add", *sample("vector_add"))
    first = read_result(entry / "kernel.cubin")
    assert first[0] == "ok" and m.stats()["compiles_total"] == 1
    m.stop()
    m.options = ["nvcc=%s" % (two / "nvcc")]
    m.start()
    assert read_result(entry / "kernel.cubin") == first
    assert m.stats()["compiles_total"] == 0, "the same compiler at another path compiled again"
    # A wrapper and the nvcc it runs are two compilers (their bytes differ); the toolkit's
    # nvcc by its symlink and by its target (as CUDA_HOME and PATH find it) is one
    m.stop()
    m.options = ["nvcc=%s" % NVCC]
    m.start()
    assert read_result(entry / "kernel.cubin")[0] == "ok"
    assert m.stats()["compiles_total"] == 1, "a wrapper's cubin was taken for nvcc's"
    m.stop()
    m.options = ["nvcc=%s" % os.path.realpath(NVCC)]
    m.start()
    assert read_result(entry / "kernel.cubin")[0] == "ok"
    assert m.stats()["compiles_total"] == 0, "nvcc by its symlink and by its target differ"
