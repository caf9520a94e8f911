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
# (scripts/gpu_ahead.py), DG_SCRIPT=gpu_sglang.py SGLang's fork (scripts/gpu_sglang.py). A
# second DeepGEMM, DG_TAR_B or DG_SO_B, is built the same way into DG_HOME_B (default
# DG_HOME-b) and given to the script as --deepgemm-b. Environment: DG_HOME (default /opt/kcachefs-dg), PYTHON (default python3), KCACHEFS and
# SHIM (default build-static/kcachefs and kcachefs-nvcc; KCACHEFS_NVCC is the shim's own
# variable, the real nvcc).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DG_HOME=${DG_HOME:-/opt/kcachefs-dg}
export KCACHEFS_BIN=$(realpath "${KCACHEFS:-build-static/kcachefs}")
export KCACHEFS_NVCC_BIN=$(realpath "${SHIM:-build-static/kcachefs-nvcc}")
[ -x "$KCACHEFS_BIN" ] || { echo "FAIL: no daemon at $KCACHEFS_BIN"; exit 1; }
# build TAR SO HOME: DeepGEMM's package HOME/src/deep_gemm with its _C*.so, from SO (a tarball
# of a _C*.so built before) or built from TAR; once: a later run finds it there.
build() {
	local tar=$1 so=$2 home=$3 pkg=$3/src/deep_gemm
	if ! ls "$pkg"/_C*.so >/dev/null 2>&1 && [ -r "$so" ]; then
		# a _C*.so built before on a machine like this one (a tarball of it): no 90 s build
		rm -rf "$home/src" && mkdir -p "$home/src"
		tar xzf "$tar" -C "$home/src"
		cp -r "$home/src/third-party/cutlass/include/cutlass" "$home/src/third-party/cutlass/include/cute" "$pkg/include/"
		tar xzf "$so" -C "$pkg"
	fi
	if ! ls "$pkg"/_C*.so >/dev/null 2>&1; then
		[ -r "$tar" ] || { echo "FAIL: no DeepGEMM build in $home and no tarball to build one from"; exit 1; }
		echo "building DeepGEMM from $tar into $home/src"
		rm -rf "$home/src" && mkdir -p "$home/src"
		tar xzf "$tar" -C "$home/src"
		# as develop.sh does, but copies: the package must stand alone when it is copied elsewhere
		cp -r "$home/src/third-party/cutlass/include/cutlass" "$home/src/third-party/cutlass/include/cute" "$pkg/include/"
		# Built with the g++ on PATH, whose libstdc++ is the one python loads: built with a newer
		# compiler (an image's CXX=/opt/gcc/bin/g++), std::regex in DeepGEMM's include parser
		# crashed against the older runtime.
		(cd "$home/src" && CC=$(command -v gcc) CXX=$(command -v g++) DG_USE_LOCAL_VERSION=0 "$PYTHON" setup.py build >"$home/build.log" 2>&1) ||
			{ tail -30 "$home/build.log"; echo "FAIL: DeepGEMM's setup.py build failed"; exit 1; }
		cp "$(find "$home/src/build" -name '_C*.so' | head -1)" "$pkg/"
	fi
	chmod -R a+rX "$home"
}
build "${DG_TAR:-}" "${DG_SO:-}" "$DG_HOME"
more=()
if [ -n "${DG_TAR_B:-}${DG_SO_B:-}" ]; then
	build "${DG_TAR_B:-}" "${DG_SO_B:-}" "${DG_HOME_B:=$DG_HOME-b}"
	more=(--deepgemm-b "$DG_HOME_B/src/deep_gemm")
fi
exec "$PYTHON" "scripts/${DG_SCRIPT:-gpu_deepgemm.py}" --deepgemm "$DG_HOME/src/deep_gemm" ${more[@]+"${more[@]}"} "$@"
