"""Bad names get the errno a POSIX filesystem would give, and nothing is created."""
import errno
import os

import pytest


@pytest.mark.parametrize("name, why", [
    ("kernel.gemm.0123456789ABCDEF", "uppercase hex"),
    ("kernel.gemm.0123456789abcde", "15 hex digits"),
    ("kernel.gemm." + "a" * 129, "129 hex digits"),
    ("kernel..0123456789abcdef", "empty name"),
    ("kernel.ge.mm.0123456789abcdef", "a dot in the name"),
    ("kernel.gémm.0123456789abcdef", "UTF-8 in the name"),
    ("kernel.gemm.0123456789abcdeg", "not hex"),
    ("kernel.", "nothing after the prefix"),
    ("kernel.ge\nmm.0123456789abcdef", "a newline in the name"),
    ("kernel.gemm\x01.0123456789abcdef", "a control character in the name"),
    ("kernel.gemm.0123456789abcdef\x7f", "DEL after the hash"),
    ("kernel.gemm.0123456789abcdef ", "a blank after the hash"),
])
def test_bad_entry_names_are_einval(mount_factory, name, why):
    m = mount_factory()
    with pytest.raises(OSError) as e:
        os.mkdir(m.mnt / name)
    assert e.value.errno == errno.EINVAL, why
    assert not (m.backing / name).exists()
    assert "not a valid kernel entry name" in m.daemon_log()
    # Renaming a directory to such a name is refused the same way.
    (m.mnt / "d").mkdir()
    with pytest.raises(OSError) as e:
        os.rename(m.mnt / "d", m.mnt / name)
    assert e.value.errno == errno.EINVAL


def test_other_names(mount_factory):
    m = mount_factory()
    with pytest.raises(OSError) as e:
        os.mkdir(m.mnt / ("x" * 256))
    assert e.value.errno == errno.ENAMETOOLONG
    entry = "kernel.%s.%s" % ("n" * (255 - 7 - 1 - 128), "a" * 128)
    assert len(entry) == 255
    os.mkdir(m.mnt / entry)
    (m.mnt / entry / "kernel.cu").write_text("// x\n")
    assert os.listdir(m.mnt / entry) == ["kernel.cu"]
    os.mkdir(m.mnt / "données-ü-日本")
    assert "données-ü-日本" in os.listdir(m.mnt)
    # Outside entries any byte but '/' and NUL is a name, as on the backing filesystem.
    odd = "tab\tnew\nline\x01\x7f"
    os.mkdir(m.mnt / odd)
    assert odd in os.listdir(m.mnt) and (m.backing / odd).is_dir()
    os.mkdir(m.mnt / ("y" * 255))
    with pytest.raises(OSError) as e:
        os.mkdir(m.mnt / ".")
    assert e.value.errno == errno.EEXIST
    # .kcachefs is reserved at the root only; below it, it is a name like any other.
    os.mkdir(m.mnt / odd / ".kcachefs")
    assert (m.backing / odd / ".kcachefs").is_dir()
    with pytest.raises(OSError) as e:
        os.mkdir(m.mnt / "..")
    assert e.value.errno == errno.EEXIST
    # The control directory is reserved.
    with pytest.raises(OSError) as e:
        os.mkdir(m.mnt / ".kcachefs")
    assert e.value.errno == errno.EEXIST
    for op in (lambda: os.rmdir(m.mnt / ".kcachefs"),
               lambda: os.rename(m.mnt / ".kcachefs", m.mnt / "x"),
               lambda: open(m.mnt / ".kcachefs" / "new", "w"),
               lambda: open(m.mnt / ".kcachefs" / "metrics.prom", "w"),
               lambda: open(m.mnt / ".kcachefs" / "metrics.prom", "a")):
        with pytest.raises(OSError) as e:
            op()
        assert e.value.errno in (errno.EPERM, errno.EBUSY, errno.EACCES)
    assert sorted(os.listdir(m.mnt / ".kcachefs")) == ["metrics.prom", "stats"]
    assert "kcachefs_compiles_total 0" in (m.mnt / ".kcachefs" / "metrics.prom").read_text()
    # no store, no bound: the stats leave those groups out, the metrics keep every one
    text = (m.mnt / ".kcachefs" / "stats").read_text()
    assert "\nlocal cache:\n" in text and "\ncompiles:\n" in text and "\ninodes:\n" in text
    assert "cluster store:" not in text and "eviction:" not in text, text
    assert "kcachefs_remote_hits_total 0" in (m.mnt / ".kcachefs" / "metrics.prom").read_text()
    # The backing store's own state directory is never visible.
    assert (m.backing / ".kcachefs" / "tmp").is_dir()
    assert "tmp" not in os.listdir(m.mnt / ".kcachefs")
