#!/usr/bin/env bash
# gpu-deepgemm.sh - real DeepGEMM on a GPU node: 8 ranks x 16 JIT kernels on local disk with
# no cache, then on two kcachefs nodes sharing a dir: cluster store (scripts/gpu_deepgemm.py
# says what each round does and what PASS means).
#
# Where and how: on the GPU node, as root (the daemons mount with mount(2)), with
# build-static/ built (see scripts/gpu-smoke.sh) and a python3 with torch. DeepGEMM itself is
# not part of this tree: DG_TAR names a tarball of a DeepGEMM checkout with its third-party/
# cutlass/include and third-party/fmt/include (the submodules' commits), which is unpacked
# and built once into DG_HOME (its setup.py, about 90 s); later runs reuse the build.
#   DG_TAR=carry/dg/deepgemm-54e2261.tar.gz scripts/gpu-deepgemm.sh [gpu_deepgemm.py args]
# DG_SO names a tarball of a _C*.so built before (by this script, on a machine like this one):
# then nothing is built. DG_SCRIPT=gpu_ahead.py runs compile ahead's rounds instead
# (scripts/gpu_ahead.py). Environment: DG_HOME (default /opt/kcachefs-dg), PYTHON (default python3), KCACHEFS and
# SHIM (default build-static/kcachefs and kcachefs-nvcc; KCACHEFS_NVCC is the shim's own
# variable, the real nvcc).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DG_HOME=${DG_HOME:-/opt/kcachefs-dg}
export KCACHEFS_BIN=$(realpath "${KCACHEFS:-build-static/kcachefs}")
export KCACHEFS_NVCC_BIN=$(realpath "${SHIM:-build-static/kcachefs-nvcc}")
[ -x "$KCACHEFS_BIN" ] || { echo "FAIL: no daemon at $KCACHEFS_BIN"; exit 1; }
pkg=$DG_HOME/src/deep_gemm
if ! ls "$pkg"/_C*.so >/dev/null 2>&1 && [ -r "${DG_SO:-}" ]; then
	# a _C*.so built before on a machine like this one (a tarball of it): no 90 s build
	rm -rf "$DG_HOME/src" && mkdir -p "$DG_HOME/src"
	tar xzf "$DG_TAR" -C "$DG_HOME/src"
	cp -r "$DG_HOME/src/third-party/cutlass/include/cutlass" "$DG_HOME/src/third-party/cutlass/include/cute" "$pkg/include/"
	tar xzf "$DG_SO" -C "$pkg"
fi
if ! ls "$pkg"/_C*.so >/dev/null 2>&1; then
	[ -r "${DG_TAR:-}" ] || { echo "FAIL: no DeepGEMM build in $DG_HOME and no DG_TAR to build one from"; exit 1; }
	echo "building DeepGEMM from $DG_TAR into $DG_HOME/src"
	rm -rf "$DG_HOME/src" && mkdir -p "$DG_HOME/src"
	tar xzf "$DG_TAR" -C "$DG_HOME/src"
	# as develop.sh does, but copies: the package must stand alone when it is copied elsewhere
	cp -r "$DG_HOME/src/third-party/cutlass/include/cutlass" "$DG_HOME/src/third-party/cutlass/include/cute" "$pkg/include/"
	# Built with the g++ on PATH, whose libstdc++ is the one python loads: built with a newer
	# compiler (an image's CXX=/opt/gcc/bin/g++), std::regex in DeepGEMM's include parser
	# crashed against the older runtime.
	(cd "$DG_HOME/src" && CC=$(command -v gcc) CXX=$(command -v g++) DG_USE_LOCAL_VERSION=0 "$PYTHON" setup.py build >"$DG_HOME/build.log" 2>&1) ||
		{ tail -30 "$DG_HOME/build.log"; echo "FAIL: DeepGEMM's setup.py build failed"; exit 1; }
	cp "$(find "$DG_HOME/src/build" -name '_C*.so' | head -1)" "$pkg/"
fi
chmod -R a+rX "$DG_HOME"
exec "$PYTHON" "scripts/${DG_SCRIPT:-gpu_deepgemm.py}" --deepgemm "$pkg" "$@"
