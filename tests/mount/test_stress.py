"""The short configurations of scripts/stress.py (the long one is quoted in doc/testing.md)."""
import subprocess
import sys

import pytest

from conftest import KCACHEFS, REPO


@pytest.mark.parametrize("compiler, shape", [
    ("fake", ["-P", "8", "-K", "16", "-I", "10"]),
    ("faulty", ["-P", "8", "-K", "16", "-I", "5", "-j", "1"]),
    ("nvcc", ["-P", "4", "-K", "3", "-I", "2"]),
])
def test_stress_short(compiler, shape):
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "stress.py"), "-c", compiler,
                        "--kcachefs", str(KCACHEFS), "-s", "11"] + shape,
                       capture_output=True, text=True, timeout=600)
    print(r.stdout, r.stderr)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "stress: PASS" in r.stdout
    assert "errors: 0" in r.stdout and "byte mismatches: 0" in r.stdout
    assert "entries compiled more than once: 0" in r.stdout
