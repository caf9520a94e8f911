#!/usr/bin/env bash
# bench-gpu.sh - figure 7 of the benchmarks, by hand on a GPU node: cuModuleLoad of one cubin
# through a kcachefs mount against the same file in the backing directory, 100 loads each,
# alternating, in one process (scripts/bench_gpu.c). Two cubins: a small kernel
# (tests/kernels/vector_add.cu) and a 1 MiB one (a kernel with 1 MiB of initialised data).
# The mount is always unmounted and the temp dir removed.
#
# Build here or there (see gpu-smoke.sh for the static daemon):
#   cc -O2 -I/usr/local/cuda/include scripts/bench_gpu.c -L/usr/local/cuda/lib64/stubs \
#      -lcuda -o build/bench_gpu
# Environment: KCACHEFS (default build-static/kcachefs), BENCH_GPU (default
# build/bench_gpu), LOADS (100), REPS (7), NVCC (default /usr/local/cuda/bin/nvcc).
set -euo pipefail
cd "$(dirname "$0")/.."
KCACHEFS=${KCACHEFS:-build-static/kcachefs}
BENCH_GPU=${BENCH_GPU:-build/bench_gpu}
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
LOADS=${LOADS:-100}
REPS=${REPS:-7}
tmp=$(realpath "$(mktemp -d /tmp/kcachefs-bench-gpu.XXXXXX)")
dpid=
cleanup() {
	set +e
	if awk -v m="$tmp/mnt" '$2 == m { f = 1 } END { exit !f }' /proc/mounts; then
		umount "$tmp/mnt" || fusermount3 -u "$tmp/mnt" || umount -l "$tmp/mnt"
	fi
	[ -n "$dpid" ] && wait "$dpid"
	rm -rf --one-file-system "$tmp"
}
trap cleanup EXIT
mkdir "$tmp/b" "$tmp/mnt"
"$KCACHEFS" -f "$tmp/b" "$tmp/mnt" >"$tmp/daemon.log" 2>&1 &
dpid=$!
for _ in $(seq 100); do [ -r "$tmp/mnt/.kcachefs/stats" ] && break; sleep 0.1; done
printf '__device__ char kc_pad[1048576] = {1};\nextern "C" __global__ void padded(char *o) { o[threadIdx.x] = kc_pad[threadIdx.x * 7]; }\n' >"$tmp/pad.cu"
"$NVCC" "$tmp/pad.cu" -cubin -o "$tmp/pad.cubin" -arch=sm_90a
"$NVCC" tests/kernels/vector_add.cu -cubin -o "$tmp/small.cubin" -arch=sm_90a
echo "node: $(uname -n), $(nvidia-smi -L 2>/dev/null | head -1), kernel $(uname -r)"
for k in small pad; do
	e=$tmp/mnt/cache/kernel.bench_$k.0123456789abcdef
	mkdir -p "$e"
	cp "$tmp/$k.cubin" "$e/kernel.cubin" # a client publishes it
	echo "== $k.cubin ($(stat -c %s "$tmp/$k.cubin") bytes): $LOADS loads x $REPS repetitions"
	"$BENCH_GPU" "$e/kernel.cubin" "$tmp/b/cache/kernel.bench_$k.0123456789abcdef/kernel.cubin" \
		"$LOADS" "$REPS"
done
