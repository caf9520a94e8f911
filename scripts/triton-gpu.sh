#!/usr/bin/env bash
# triton-gpu.sh - the Triton cache manager (python/kcachefs_triton) on one GPU node, with
# real Triton 3.x and PyTorch: after a round that only fills the page cache (plain Triton on
# the local disk, not counted), 8 processes at once each compile and run a vector add, a
# softmax and a matmul autotuned over two configs on a fresh kcachefs mount, cold then
# warm, with TRITON_CACHE_MANAGER=kcachefs_triton:KcachefsCacheManager, then with Triton's
# own manager on the mount and on the local disk (Triton without kcachefs), then one more
# cold pair, local and managed. Every result is checked against PyTorch; compiles are
# counted per kernel and key (scripts/triton_gpu.py says how). Prints a summary table, the
# line "ratio managed cold / local cold (median per process)" (the target: <= 1.0x),
# and PASS only if every managed cold round compiled each key once and the warm rounds
# compiled nothing. The mount is always unmounted and its temp dir removed. Takes about 2-4
# minutes.
#
# Where it runs: the GPU node, as root (the daemon mounts with mount(2) itself, so no
# fusermount3 is needed), from anywhere (it cds to the repository root). It needs a python3
# with torch and triton (PYTHON=... picks another) and the daemon: build-static/kcachefs as
# for scripts/gpu-smoke.sh (see its header), else build/kcachefs (KCACHEFS=... picks one).
# Nothing is installed or fetched.
#
# Environment:
#   PYTHON=python3        the Python with torch and triton
#   KCACHEFS=PATH         the daemon
#   PROCS=8               processes per round
#   KCACHEFS_OPTS=a,b     -o options for the daemon
#   PAIRS=2               managed cold / local cold pairs (--pairs)
#   TIMEOUT=570           seconds for the whole run (each round: 110 s at most)
set -u
cd "$(dirname "$0")/.." || exit 2
PYTHON=${PYTHON:-python3}
if [ -z "${KCACHEFS:-}" ]; then
	KCACHEFS=build-static/kcachefs
	[ -x "$KCACHEFS" ] || KCACHEFS=build/kcachefs
fi
[ -x "$KCACHEFS" ] || { echo "FAIL: no daemon at $KCACHEFS (ninja -C build-static)"; exit 1; }
[ -c /dev/fuse ] || { echo "FAIL: /dev/fuse is missing"; exit 1; }
[ "$(id -u)" = 0 ] || echo "warning: not root; mounting needs fusermount3 then"
"$PYTHON" -c 'import torch, triton; assert torch.cuda.is_available(), "no CUDA device"' ||
	{ echo "FAIL: $PYTHON cannot import torch and triton with a GPU"; exit 1; }
command -v nvidia-smi >/dev/null && nvidia-smi -L
KCACHEFS_BIN=$(realpath "$KCACHEFS")
# kcmount.py also wants the nvcc shim beside the daemon (it is not used here)
KCACHEFS_NVCC_BIN=$(realpath "$(dirname "$KCACHEFS")/kcachefs-nvcc")
export KCACHEFS_BIN KCACHEFS_NVCC_BIN
timeout -k 20 "${TIMEOUT:-570}" "$PYTHON" scripts/triton_gpu.py --procs "${PROCS:-8}" --pairs "${PAIRS:-2}"
rc=$?
[ "$rc" = 124 ] && echo "FAIL: timed out after ${TIMEOUT:-570} s"
# Whatever happened, nothing of ours stays mounted.
left=$(awk '$2 ~ "^/tmp/kcachefs-triton-gpu-" { print $2 }' /proc/mounts)
for m in $left; do
	echo "FAIL: $m was left mounted; detaching it"
	umount -l "$m"
	rc=1
done
exit "$rc"
