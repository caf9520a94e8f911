"""Shared nodes (doc/security.md, the threat model): two real Unix users on an allow_other mount, the
permissions the kernel checks (default_permissions), what nobody can change, and
-o verify_keys against a poisoned pre-stage."""
import errno
import hashlib
import os
import subprocess

import pytest

from kcmount import KERNELS, SHIM, as_user, sample


def key_of(source, flags):
    """The key of src/entry/key.h: SHA-256 over "kcachefs-key-v1\\n", then each file as a field
    (its decimal length, '\\n', the bytes, '\\n')."""
    h = hashlib.sha256(b"kcachefs-key-v1\n")
    for part in (source, flags):
        h.update(b"%d\n" % len(part) + part + b"\n")
    return h.hexdigest()


# Try an operation; print "ok" or the errno name.
TRY = """
import errno, os, sys
def attempt(fn):
    try:
        fn()
        print("ok")
    except OSError as e:
        print(errno.errorcode[e.errno])
"""


def stage_as(user, entry, source, flags):
    code = TRY + """
entry, src, flags = sys.argv[1], sys.argv[2], sys.argv[3]
attempt(lambda: os.mkdir(entry))
def put(name, path):
    with open(path, "rb") as f:
        data = f.read()
    with open(os.path.join(entry, name), "wb") as f:
        f.write(data)
attempt(lambda: put("kernel.cu", src))
attempt(lambda: put("kernel.flags", flags))
"""
    return as_user(user, code, entry, source, flags)


def test_two_users_permissions_and_what_nobody_can_change(public_mount_factory, two_users):
    alice, bob = two_users
    m = public_mount_factory(["allow_other"])
    shared = m.mnt / "cache"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # like /tmp
    src, flags = sample("vector_add")
    files = m.root / "in"  # readable by the other users (pytest's tmp_path is not)
    files.mkdir()
    os.chmod(files, 0o755)
    (files / "k.cu").write_bytes(src)
    (files / "k.flags").write_bytes(flags)
    entry = shared / ("kernel.vector_add.%s" % key_of(src, flags)[:32])
    assert stage_as(alice, entry, files / "k.cu", files / "k.flags") == ["ok"] * 3
    assert os.stat(entry).st_uid == alice[0]
    assert os.stat(entry / "kernel.cu").st_uid == alice[0]
    cubin = (entry / "kernel.cubin").read_bytes()
    assert cubin[:4] == b"\x7fELF" and os.stat(entry / "kernel.cubin").st_mode & 0o777 == 0o444

    code = TRY + """
entry = sys.argv[1]
attempt(lambda: open(os.path.join(entry, "kernel.cubin"), "rb").read())   # read: ok
attempt(lambda: open(os.path.join(entry, "kernel.cu"), "r+b"))             # write
attempt(lambda: os.unlink(os.path.join(entry, "kernel.cu")))               # delete
attempt(lambda: open(os.path.join(entry, "extra"), "wb"))                  # add
attempt(lambda: os.rename(entry, entry + ".x"))                            # sticky dir
attempt(lambda: os.rmdir(entry))
attempt(lambda: os.chmod(entry, 0o777))
"""
    assert as_user(bob, code, entry) == ["ok", "EACCES", "EACCES", "EACCES", "EPERM",
                                         "EPERM", "EPERM"]
    # What nobody changes, root included: the published cubin and the staged source.
    for flagset in (os.O_WRONLY, os.O_RDWR | os.O_TRUNC):
        with pytest.raises(OSError) as e:
            os.open(entry / "kernel.cubin", flagset)
        assert e.value.errno == errno.EPERM
    with pytest.raises(OSError) as e:
        with open(entry / "kernel.cu", "wb") as f:
            f.write(b"// root's other source\n")
    assert e.value.errno == errno.EEXIST
    assert (entry / "kernel.cu").read_bytes() == src
    assert (entry / "kernel.cubin").read_bytes() == cubin
    # Alice may do what Bob may not.
    code = TRY + """
entry = sys.argv[1]
attempt(lambda: os.unlink(os.path.join(entry, "kernel.flags")))
"""
    assert as_user(alice, code, entry) == ["ok"]


def test_verify_keys_refuses_a_poisoned_prestage(public_mount_factory, two_users):
    alice, bob = two_users
    honest_src, flags = sample("vector_add")
    poison = (KERNELS / "saxpy.cu").read_bytes()
    key = key_of(honest_src, flags)
    plain = public_mount_factory(["allow_other"])
    files = plain.root / "in"  # readable by the other users (pytest's tmp_path is not)
    files.mkdir()
    os.chmod(files, 0o755)
    for name, data in (("honest.cu", honest_src), ("poison.cu", poison), ("k.flags", flags)):
        (files / name).write_bytes(data)

    # Without verify_keys the attack works: a poisoned recipe renamed in under the name an
    # honest client will compute is compiled and served.
    for m, refused in ((plain, False),
                       (public_mount_factory(["allow_other", "verify_keys"]), True)):
        shared = m.mnt / "cache"
        shared.mkdir()
        os.chmod(shared, 0o1777)
        entry = shared / ("kernel.vector_add." + key[:40])
        code = TRY + """
shared, entry, poison, flags = sys.argv[1:5]
tmp = os.path.join(shared, "tmp-bob")
os.mkdir(tmp)
for name, path in (("kernel.cu", poison), ("kernel.flags", flags)):
    with open(path, "rb") as f, open(os.path.join(tmp, name), "wb") as out:
        out.write(f.read())
attempt(lambda: os.rename(tmp, entry))
attempt(lambda: open(os.path.join(entry, "kernel.cubin"), "rb").read())
"""
        out = as_user(bob, code, shared, entry, files / "poison.cu", files / "k.flags")
        assert out == (["ok", "EIO"] if refused else ["ok", "ok"]), out
        if refused:
            assert "not compiled: the key of kernel.cu and kernel.flags" in m.daemon_log()
            assert m.stats()["compiles_total"] == 0

    # Staging the pair file by file: the second file is refused, and a lone file gives way.
    m = public_mount_factory(["allow_other", "verify_keys"])
    (m.mnt / "cache").mkdir()
    os.chmod(m.mnt / "cache", 0o1777)
    entry = m.mnt / "cache" / ("kernel.vector_add." + key[:16])
    assert stage_as(alice, entry, files / "poison.cu", files / "k.flags") == ["ok", "ok", "EINVAL"]
    assert "kernel.flags refused: the key of" in (entry / "kernel.log").read_text()
    assert not os.path.exists(entry / "kernel.flags")
    assert stage_as(alice, entry, files / "honest.cu", files / "k.flags") == ["EEXIST", "ok", "ok"]
    assert (entry / "kernel.cu").read_bytes() == honest_src
    assert b"vector_add" in (entry / "kernel.cubin").read_bytes()
    # A hash longer than a SHA-256 can never be a key.
    long_entry = m.mnt / "cache" / ("kernel.vector_add." + key + "00")
    assert stage_as(alice, long_entry, files / "honest.cu", files / "k.flags") == ["ok", "ok",
                                                                                    "EINVAL"]


def test_the_shims_entries_satisfy_verify_keys(mount_factory, tmp_path):
    m = mount_factory(["verify_keys"])
    (tmp_path / "src").mkdir()
    src = tmp_path / "src" / "k.cu"  # alone in its directory, as the shim wants
    src.write_bytes((KERNELS / "vector_add.cu").read_bytes())
    out = m.mnt / "out"
    out.mkdir()
    r = subprocess.run([str(SHIM), str(src), "-cubin", "-o", str(out / "k.cubin"), "-O3",
                        "-arch=sm_90a"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert m.stats()["compiles_total"] == 1, "the mount compiled it, not nvcc"
    assert "refused" not in m.daemon_log() and "not compiled" not in m.daemon_log()


def test_hostile_input_is_a_compile_error_not_a_crash(mount_factory):
    """Binary garbage, a NUL byte and a source over max_source_size: errors with reasons,
    and the daemon keeps serving."""
    m = mount_factory(["max_source_size=4096"])
    garbage = hashlib.sha256(b"seed").digest() * 100  # 3200 bytes, NULs and all
    src, flags = sample("vector_add")
    for i, source in enumerate((garbage, b"__global__ void k() {}\0 trailing\n")):
        e = m.mnt / ("kernel.junk%d.%032x" % (i, i))
        e.mkdir()
        (e / "kernel.cu").write_bytes(source)
        (e / "kernel.flags").write_bytes(flags)
        with pytest.raises(OSError) as err:
            (e / "kernel.cubin").read_bytes()
        assert err.value.errno == errno.EIO
        assert "rejected" in (e / "kernel.log").read_text(errors="replace")
    big = m.mnt / ("kernel.big.%032x" % 9)
    big.mkdir()
    with pytest.raises(OSError) as err:
        (big / "kernel.cu").write_bytes(b"// x\n" * 1000)
    assert err.value.errno == errno.EFBIG
    assert not (big / "kernel.cu").exists()
    good = m.stage("vector_add", src, flags)
    assert (good / "kernel.cubin").read_bytes()[:4] == b"\x7fELF"
    assert m.proc.poll() is None


def test_verify_keys_holds_against_renames_links_and_client_cubins(public_mount_factory,
                                                                    two_users):
    """From a break-it round: an entry renamed (with its cubin) to another key's name, a
    client's cubin beside a lone kernel.cu under autocompile, a symbolic link named like an
    entry, a hard-linked file renamed onto kernel.cu, a non-ELF 'cubin' renamed in."""
    honest, eve = two_users
    src, flags = sample("vector_add")
    evil = src.replace(b"a[i] + b[i]", b"a[i] - b[i] + 1337.0f")
    assert evil != src
    kh, ke = key_of(src, flags), key_of(evil, flags)
    m = public_mount_factory(["allow_other", "verify_keys", "autocompile"])
    os.chmod(m.mnt, 0o1777)
    files = m.root / "in"
    files.mkdir()
    os.chmod(files, 0o755)
    for name, data in (("src.cu", src), ("evil.cu", evil), ("k.flags", flags)):
        (files / name).write_bytes(data)
    # 1. Eve's own (valid) compile, renamed to the honest key's name: nobody is served it.
    evil_entry = m.mnt / ("kernel.va." + ke[:32])
    assert stage_as(eve, evil_entry, files / "evil.cu", files / "k.flags") == ["ok"] * 3
    code = TRY + """
import sys
a, b = sys.argv[1], sys.argv[2]
attempt(lambda: open(os.path.join(a, "kernel.cubin"), "rb").read())
attempt(lambda: os.rename(a, b))
attempt(lambda: open(os.path.join(b, "kernel.cubin"), "rb").read())
"""
    renamed = m.mnt / ("kernel.va." + kh[:32])
    assert as_user(eve, code, evil_entry, renamed) == ["ok", "ok", "EIO"]
    with pytest.raises(OSError) as e:
        (renamed / "kernel.cubin").read_bytes()
    assert e.value.errno == errno.EIO
    assert "which the entry's name does not give" in m.daemon_log()
    # 2. A client's cubin beside a lone kernel.cu (a recipe under autocompile): served to
    #    its owner only.
    lone = m.mnt / ("kernel.ac." + key_of(src, b"")[:32])
    code = TRY + """
import shutil, sys
entry, src, cubin = sys.argv[1:4]
os.mkdir(entry)
os.chmod(entry, 0o777)
shutil.copyfile(src, os.path.join(entry, "kernel.cu"))
shutil.copyfile(cubin, os.path.join(entry, "x.bin"))
attempt(lambda: os.rename(os.path.join(entry, "x.bin"), os.path.join(entry, "kernel.cubin")))
attempt(lambda: open(os.path.join(entry, "kernel.cubin"), "rb").read())
"""
    cubin_file = files / "evil.cubin"
    cubin_file.write_bytes((m.backing / renamed.name / "kernel.cubin").read_bytes())
    assert as_user(eve, code, lone, files / "src.cu", cubin_file) == ["ok", "ok"]
    code = TRY + """
import sys
attempt(lambda: open(sys.argv[1], "rb").read())
"""
    assert as_user(honest, code, lone / "kernel.cubin") == ["EACCES"]
    # 3. A symbolic link named like an entry, made or renamed: refused.
    code = TRY + """
import sys
d = sys.argv[1]
attempt(lambda: os.symlink("/tmp", os.path.join(d, sys.argv[2])))
os.symlink("/tmp", os.path.join(d, "plain-link"))
attempt(lambda: os.rename(os.path.join(d, "plain-link"), os.path.join(d, sys.argv[2])))
"""
    assert as_user(eve, code, m.mnt, "kernel.sx." + kh[:32]) == ["EINVAL", "EINVAL"]
    # 4. A file with another hard link cannot become a staged file by rename.
    entry = m.mnt / ("kernel.hl." + kh[:32])
    entry.mkdir()
    (m.mnt / "a.cu").write_bytes(src)
    os.link(m.mnt / "a.cu", m.mnt / "b.cu")
    with pytest.raises(OSError) as e:
        os.rename(m.mnt / "a.cu", entry / "kernel.cu")
    assert e.value.errno == errno.EPERM
    assert not (entry / "kernel.cu").exists()
    # 5. A directory renamed in with a 'cubin' that is no CUDA ELF: never served.
    plain = m.mnt / "plain"
    plain.mkdir()
    (plain / "kernel.cubin").write_bytes(b"not an elf at all")
    os.rename(plain, m.mnt / ("kernel.ne." + kh[:32]))
    with pytest.raises(OSError) as e:
        (m.mnt / ("kernel.ne." + kh[:32]) / "kernel.cubin").read_bytes()
    assert e.value.errno == errno.EIO
