"""The entry-point scripts (scripts/run.sh, test.sh, setup.sh) run by a user who cannot do
what they need: each stops at once, before installing or building anything, with a non-zero
status and a line that says what is missing and why. Run as nobody on a copy of the scripts
in a directory nobody may write, as a new user's checkout owned by someone else is."""
import os
import shutil
import subprocess

from conftest import REPO

NOBODY = 65534


def copy_of_scripts(tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(REPO / "scripts", tree / "scripts")
    os.chmod(tree, 0o755)
    return tree


def as_nobody(tree, script, env=None):
    return subprocess.run([str(tree / "scripts" / script)], capture_output=True, text=True,
                          cwd="/", timeout=120, env=dict(os.environ, **(env or {})),
                          preexec_fn=lambda: (os.setgroups([]), os.setgid(NOBODY),
                                              os.setuid(NOBODY)))


def test_test_sh_says_at_once_that_it_needs_root(tmp_path):
    tree = copy_of_scripts(tmp_path)
    r = as_nobody(tree, "test.sh")
    assert r.returncode != 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1] == "0 passed, 1 failed", "CI reads the last line"
    err = r.stderr
    assert "test.sh: needs root, and runs as uid 65534" in err, err
    for why in ("mount FUSE", "allow_other", "compile_uids", "apt-get"):
        assert why in err, (why, err)
    assert "setup:" not in err and "ninja" not in r.stdout + err, "nothing was set up or built"
    assert not (tree / "build").exists()


def test_run_sh_says_at_once_that_it_needs_root(tmp_path):
    tree = copy_of_scripts(tmp_path)
    r = as_nobody(tree, "run.sh", {"KCACHEFS_BACKING": str(tmp_path / "b"),
                                   "KCACHEFS_MOUNTPOINT": str(tmp_path / "m")})
    assert r.returncode != 0 and r.stdout == "", r.stdout + r.stderr
    assert "run.sh: needs root, and runs as uid 65534" in r.stderr, r.stderr
    for why in ("apt-get", "/var/cache/kcachefs", "compile_uids"):
        assert why in r.stderr, (why, r.stderr)
    assert not any(p.exists() for p in (tree / "build", tmp_path / "b", tmp_path / "m"))


def test_setup_sh_says_why_it_cannot_build(tmp_path):
    tree = copy_of_scripts(tmp_path)
    r = as_nobody(tree, "setup.sh")
    assert r.returncode != 0, r.stdout + r.stderr
    assert ("setup: cannot build in %s/build: uid 65534 may not write there" % tree) in r.stderr \
        or "installing them (apt-get) needs root" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tree / "build").exists()
