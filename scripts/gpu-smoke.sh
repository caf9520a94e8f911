#!/usr/bin/env bash
# gpu-smoke.sh - GPU smoke test of kcachefs on one GPU node.
#
# Mounts a fresh kcachefs on a temp dir, stages the sample kernels of tests/kernels/
# (vector_add, saxpy, block_sum) as kernel entries, and starts 8 processes at once that each
# load all three cubins by path (4 with cuModuleLoad, 4 with cuLibraryLoadFromFile), run
# them on real data and check the results (scripts/gpu_smoke.c). Then it checks that the
# mount compiled each kernel exactly once (kcachefs_compiles_total 3, misses 3), that every
# cubin reads back whole (stat size = bytes read, ELF), and that the entry of broken.cu gives
# EIO on open, twice, with one compile failure and its compiler log kept. The mount is
# always unmounted, the daemon stopped and the temp dirs removed (trap EXIT), and that is
# checked too. Exit status 0 only if every check passed.
#
# Where it runs: the GPU node, as root (the daemon mounts with mount(2) itself, so no
# fusermount3 is needed; /dev/fuse must exist), from anywhere (it cds to the repository
# root). It needs CUDA's nvcc (/usr/local/cuda, or -o nvcc= through NVCC) and the driver's
# libcuda.so.1. Nothing is installed or fetched. The daemon compiles as uids of its own
# (-o compile_uids): run it from a tree all users can search and read (not under /root),
# or add compile_uids=daemon to KCACHEFS_OPTS.
#
# Build both binaries on a build machine (Debian 12 with libfuse3-dev, libssl-dev, meson,
# ninja-build and the CUDA toolkit), from the repository root, then carry the tree:
#   meson setup build-static -Dstatic_deps=true && ninja -C build-static
#       # build-static/kcachefs: libfuse3 and libcrypto linked in; needs glibc >= 2.36
#   cc -O2 -Wall -Wextra -I/usr/local/cuda/include scripts/gpu_smoke.c \
#      -L/usr/local/cuda/lib64/stubs -lcuda -o build/gpu_smoke
#       # links the toolkit's stub; the driver's libcuda.so.1 is used at run time
# Run on the GPU node:
#   scripts/gpu-smoke.sh
#
# Environment:
#   ARCH=sm_90a            -o arch= of the daemon (default sm_90a: H100/H200)
#   JOBS=4                 -o jobs= of the daemon
#   NVCC=PATH              -o nvcc= of the daemon (default: the daemon's own search)
#   KCACHEFS_OPTS=a,b      more -o options for the daemon
#   KCACHEFS=PATH          the daemon (default build-static/kcachefs)
#   GPU_SMOKE=PATH         the loader (default build/gpu_smoke)
#   SMOKE_PROCS=8          loader processes, alternately module and library mode
#   SMOKE_TIMEOUT=600      seconds each loader process may take (compiles included)
#   SMOKE_DAEMON_LOG=PATH  copy the daemon's log there (the temp dir holding it is removed)
#   SMOKE_CLIENT=deepgemm-shim
#                          stage through a client instead of natively: the current DeepGEMM
#                          sequence (tests/mount/deepgemm.py, python3) runs SMOKE_PROCS
#                          ranks at once with DG_JIT_NVCC_COMPILER=kcachefs-nvcc, and the
#                          loaders then load the cubins of DeepGEMM's own cache entries;
#                          the mount must still have compiled each kernel exactly once
#   SHIM=PATH              the nvcc shim (default build-static/kcachefs-nvcc)
#   SMOKE_NO_GPU=1         skip only the gpu_smoke launches: the same number of processes
#                          read the three cubins with cat instead (for a machine without a
#                          GPU: the mount, the compiles, the stats and EIO are still tested)
#   DEEPGEMM=PATH          the DeepGEMM client (default tests/mount/deepgemm.py); its -I is
#                          ../kernels/include beside it, so a copy where compiles can read it
#   SMOKE_EXPECT_COMPILES=3
#                          compiler runs the mount must make for the three kernels (0 for a
#                          node that gets every cubin from the cluster store, -o remote=)
#   SMOKE_BROKEN=0         skip the broken.cu section (it compiles, and fails, on every node)
#   SMOKE_SAVE=DIR         keep the three cubins (DIR/<kernel>.cubin), the metrics after
#                          the loads (DIR/metrics.prom) and the daemon log (DIR/daemon.log)
#                          (scripts/gpu-cluster.sh compares two nodes with them)
set -u
set -o pipefail

cd "$(dirname "$0")/.." || exit 2
KCACHEFS=${KCACHEFS:-build-static/kcachefs}
GPU_SMOKE=${GPU_SMOKE:-build/gpu_smoke}
SHIM=${SHIM:-build-static/kcachefs-nvcc}
CLIENT=${SMOKE_CLIENT:-}
ARCH=${ARCH:-sm_90a}
JOBS=${JOBS:-4}
NPROCS=${SMOKE_PROCS:-8}
SMOKE_TIMEOUT=${SMOKE_TIMEOUT:-600}
NO_GPU=${SMOKE_NO_GPU:-0}
DEEPGEMM=${DEEPGEMM:-tests/mount/deepgemm.py}
EXPECT=${SMOKE_EXPECT_COMPILES:-3}
BROKEN=${SMOKE_BROKEN:-1}
SAVE=${SMOKE_SAVE:-}
[ "$NO_GPU" = 0 ] && NO_GPU=
KERNELS=(vector_add saxpy block_sum)

failures=0
tmp='' mnt='' backing='' dpid=''
loader_pids=()

say() { printf '%s\n' "$*"; }
section() { printf '\n== %s\n' "$*"; }
ok() { say "ok    $*"; }
bad() { say "FAIL  $*"; failures=$((failures + 1)); }
check() { # check DESCRIPTION COMMAND...: ok or FAIL by the command's status
	local what=$1
	shift
	if "$@"; then ok "$what"; else bad "$what"; fi
}

is_mounted() { [ -n "$mnt" ] && awk -v m="$mnt" '$2 == m { f = 1 } END { exit !f }' /proc/mounts; }
stat_value() { awk -v k="$1" '$1 == k { print $2; f = 1 } END { exit !f }' "$mnt/.kcachefs/metrics.prom"; }
expect_stat() { # expect_stat METRIC -eq|-ge VALUE: compare a counter of the stats file
	local v
	if ! v=$(stat_value "$1"); then
		bad "$1 is not in .kcachefs/metrics.prom"
		return
	fi
	v=${v%%.*}
	if test "$v" "$2" "$3"; then ok "$1 = $v ($2 $3)"; else bad "$1 = $v, want $2 $3"; fi
}

# Wait up to $2 seconds for process $1 to exit; its status goes to $waited_rc.
wait_exit() {
	local pid=$1 t=0
	while kill -0 "$pid" 2>/dev/null && [ "$t" -lt "$(($2 * 10))" ]; do
		sleep 0.1
		t=$((t + 1))
	done
	if kill -0 "$pid" 2>/dev/null; then
		return 1
	fi
	wait "$pid" 2>/dev/null
	waited_rc=$?
	return 0
}

cleanup() {
	local rc=$? p
	set +e
	trap - EXIT INT TERM HUP
	# Loaders still running (an interrupt): stop them and their children (cat, or gpu_smoke
	# under timeout, which passes SIGTERM on), so that nothing keeps the mount busy.
	if [ "${#loader_pids[@]}" -gt 0 ]; then
		# shellcheck disable=SC2046 # the children's pids are meant to split
		for p in "${loader_pids[@]}"; do
			kill -TERM "$p" $(ps -o pid= --ppid "$p" 2>/dev/null) 2>/dev/null
		done
		# shellcheck disable=SC2046
		for p in "${loader_pids[@]}"; do
			wait_exit "$p" 10 || kill -KILL "$p" $(ps -o pid= --ppid "$p" 2>/dev/null) 2>/dev/null
		done
		sleep 0.5
	fi
	if [ -n "$dpid" ] || is_mounted; then
		section "unmount and stop the daemon"
	fi
	if is_mounted; then
		for ((t = 0; t < 10; t++)); do # "target is busy" while killed readers wind down
			umount "$mnt" 2>/dev/null && break
			sleep 0.5
		done
		if ! is_mounted; then
			say "umount $mnt: done"
		elif umount "$mnt" 2>&1; then
			say "umount $mnt: done"
		elif command -v fusermount3 >/dev/null && fusermount3 -u "$mnt"; then
			say "fusermount3 -u $mnt: done"
		else
			say "umount $mnt failed; detaching it (umount -l)"
			umount -l "$mnt"
			bad "plain umount of the mount failed"
		fi
	fi
	if [ -n "$dpid" ]; then
		waited_rc=
		loglines=25
		if wait_exit "$dpid" 20; then
			if [ "$waited_rc" = 0 ]; then
				ok "daemon $dpid exited with status 0 after the unmount"
			else
				bad "daemon $dpid exited with status $waited_rc$( [ "$waited_rc" -gt 128 ] && printf ' (signal %s)' "$(kill -l "$((waited_rc - 128))")")"
				loglines=400
			fi
		else
			loglines=400
			bad "daemon $dpid still running 20 s after the unmount; SIGTERM"
			kill -TERM "$dpid" 2>/dev/null
			wait_exit "$dpid" 10 || { kill -KILL "$dpid"; wait "$dpid" 2>/dev/null; }
		fi
		if [ -s "$tmp/daemon.log" ]; then
			say "daemon log (last $loglines lines):"
			tail -n "$loglines" "$tmp/daemon.log" | sed 's/^/  daemon| /'
			[ -n "${SMOKE_DAEMON_LOG:-}" ] && cp "$tmp/daemon.log" "$SMOKE_DAEMON_LOG"
			[ -n "$SAVE" ] && cp "$tmp/daemon.log" "$SAVE/daemon.log"
		fi
	fi
	if is_mounted; then
		bad "$mnt is still in /proc/mounts; temp dir $tmp left in place"
	else
		[ -n "$mnt" ] && ok "$mnt is not in /proc/mounts"
		if [ -n "$tmp" ] && [ -d "$tmp" ]; then
			rm -rf --one-file-system "$tmp"
			if [ -e "$tmp" ]; then bad "temp dir $tmp not removed"; else ok "temp dir $tmp removed"; fi
		fi
	fi
	if [ -n "$tmp" ] && grep -q "$tmp" /proc/mounts; then
		bad "something under $tmp is still mounted"
	fi
	[ "$rc" -ne 0 ] && [ "$failures" -eq 0 ] && failures=1
	echo
	if [ "$failures" -eq 0 ]; then
		say "PASS: gpu-smoke${NO_GPU:+ (SMOKE_NO_GPU: no GPU loads)}"
		exit 0
	fi
	say "FAIL: gpu-smoke: $failures check(s) failed"
	exit 1
}
trap cleanup EXIT
trap 'say "interrupted"; failures=$((failures + 1)); exit 1' INT TERM HUP

die() { bad "$*"; exit 1; }

# ---------------------------------------------------------------------------- preflight
section "node"
say "host $(uname -n), kernel $(uname -r), $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
if command -v nvidia-smi >/dev/null; then
	nvidia-smi -L
else
	say "(no nvidia-smi)"
fi
[ -x "$KCACHEFS" ] || die "$KCACHEFS is missing: meson setup build-static -Dstatic_deps=true && ninja -C build-static"
"$KCACHEFS" --version || die "$KCACHEFS --version failed"
if command -v ldd >/dev/null && ldd "$KCACHEFS" 2>/dev/null | grep -E 'libfuse3|libcrypto|not found'; then
	say "warning: $KCACHEFS is dynamically linked to the libraries above (want the static_deps build)"
fi
if [ -z "$NO_GPU" ]; then
	[ -x "$GPU_SMOKE" ] || die "$GPU_SMOKE is missing: see the cc line at the top of $0"
fi
[ "$(id -u)" = 0 ] || say "warning: not root; mounting needs fusermount3 then"
[ -c /dev/fuse ] || die "/dev/fuse is missing"
for k in "${KERNELS[@]}" broken; do
	[ -r "tests/kernels/$k.cu" ] && [ -r "tests/kernels/$k.flags" ] ||
		die "tests/kernels/$k.cu or .flags is missing"
done

# ---------------------------------------------------------------------------- mount
section "mount"
tmp=$(mktemp -d /tmp/kcachefs-smoke.XXXXXX) || die "mktemp failed"
tmp=$(realpath "$tmp")
backing=$tmp/backing
mnt=$tmp/mnt
mkdir "$backing" "$mnt" || die "mkdir under $tmp failed"
opts="arch=$ARCH,jobs=$JOBS${NVCC:+,nvcc=$NVCC}${KCACHEFS_OPTS:+,$KCACHEFS_OPTS}"
say "$KCACHEFS -f -o $opts $backing $mnt"
"$KCACHEFS" -f -o "$opts" "$backing" "$mnt" </dev/null >"$tmp/daemon.log" 2>&1 &
dpid=$!
for ((t = 0; t < 300; t++)); do
	if ! kill -0 "$dpid" 2>/dev/null; then
		wait "$dpid"
		drc=$?
		dpid=
		say "daemon log:"
		sed 's/^/  daemon| /' "$tmp/daemon.log"
		die "the daemon exited with status $drc before the mount was up"
	fi
	is_mounted && [ -r "$mnt/.kcachefs/stats" ] && break
	sleep 0.1
done
is_mounted && [ -r "$mnt/.kcachefs/stats" ] || die "the mount did not come up within 30 s"
ok "mounted after $((t / 10)).$((t % 10)) s: $(awk -v m="$mnt" '$2 == m { print $1, $3, $4 }' /proc/mounts)"

# ---------------------------------------------------------------------------- stage
section "stage"
declare -A entry
stage() { # stage NAME: mkdir the entry, write kernel.cu and kernel.flags; sets entry[NAME]
	local k=$1 hash e
	hash=$(cat "tests/kernels/$k.cu" "tests/kernels/$k.flags" | sha256sum | cut -c1-32) || return 1
	e=$mnt/cache/kernel.$k.$hash
	mkdir -p "$e" &&
		cp "tests/kernels/$k.cu" "$e/kernel.cu" &&
		cp "tests/kernels/$k.flags" "$e/kernel.flags" || return 1
	entry[$k]=$e
	say "staged cache/kernel.$k.$hash ($(wc -c <"tests/kernels/$k.cu") bytes of source, flags: $(paste -sd' ' "tests/kernels/$k.flags"))"
}
deepgemm_stage() { # the DeepGEMM ranks compile through the shim; sets entry[NAME]
	local k args=() lines=()
	[ -x "$SHIM" ] || die "$SHIM is missing: ninja -C build-static builds it"
	command -v python3 >/dev/null || die "SMOKE_CLIENT=deepgemm-shim needs python3"
	for k in "${KERNELS[@]}"; do args+=("$k=tests/kernels/$k.cu"); done
	say "DG_JIT_NVCC_COMPILER=$SHIM $DEEPGEMM --ranks $NPROCS $mnt/dg ${args[*]}"
	local t0=$(date +%s.%N)
	if ! DG_JIT_NVCC_COMPILER=$(realpath "$SHIM") python3 "$DEEPGEMM" \
		--ranks "$NPROCS" "$mnt/dg" "${args[@]}" >"$tmp/dg.out" 2>"$tmp/dg.err"; then
		sed 's/^/  dg| /' "$tmp/dg.err"
		die "a DeepGEMM rank failed"
	fi
	ok "$NPROCS DeepGEMM ranks finished without error in $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s"
	mapfile -t lines <"$tmp/dg.out"
	for ((i = 0; i < ${#KERNELS[@]}; i++)); do
		entry[${KERNELS[i]}]=${lines[i]}
		say "DeepGEMM entry ${lines[i]#"$mnt"/}: $(ls "${lines[i]}" | paste -sd' ')"
	done
	check "DeepGEMM left no temp files (dg/tmp is empty)" [ -z "$(ls -A "$mnt/dg/tmp")" ]
	say "the shim's entries: $(ls "$mnt/kcachefs-nvcc" | sed 's/\(kernel\.[^.]*\.[0-9a-f]\{12\}\).*/\1.../' | paste -sd' ')"
}
if [ "$CLIENT" = deepgemm-shim ]; then
	section "stage: DeepGEMM, $NPROCS ranks, DG_JIT_NVCC_COMPILER=kcachefs-nvcc"
	deepgemm_stage
elif [ -n "$CLIENT" ]; then
	die "SMOKE_CLIENT=$CLIENT: only deepgemm-shim is known"
else
	for k in "${KERNELS[@]}"; do
		stage "$k" || die "staging $k failed"
	done
fi
# (No stat of kernel.cubin here: its lookup is what compiles.)

# ---------------------------------------------------------------------------- load
# Process i loads the three entries starting at kernel i mod 3, so the first opens of all
# three kernels (and their compiles) overlap; all processes are released together by the
# barrier file once each has its CUDA context (or, without a GPU, has started).
read_cubins() { # stand-in for gpu_smoke without a GPU: read each cubin whole, keep a digest
	local out=$1 e k n
	shift
	: >"$tmp/go.ready.$BASHPID"
	while [ ! -e "$tmp/go" ]; do sleep 0.01; done
	for e in "$@"; do
		k=${e##*/kernel.}
		k=${k%.*}
		if ! cat "$e/kernel.cubin" >"$out.$k.bin"; then
			say "pid $BASHPID read $k: FAILED (cat kernel.cubin failed)"
			return 1
		fi
		sha256sum <"$out.$k.bin" | cut -c1-64 >"$out.$k.sha"
		n=$(wc -c <"$out.$k.bin")
		say "pid $BASHPID read $k: $n bytes"
	done
}

if [ -n "$NO_GPU" ]; then
	section "load: $NPROCS processes read the cubins with cat (SMOKE_NO_GPU)"
else
	section "load: $NPROCS processes run gpu_smoke (module and library), at once"
fi
export GPU_SMOKE_BARRIER=$tmp/go
start=$(date +%s.%N)
modes=()
for ((i = 0; i < NPROCS; i++)); do
	args=()
	for ((j = 0; j < 3; j++)); do
		args+=("${entry[${KERNELS[(i + j) % 3]}]}")
	done
	if [ -n "$NO_GPU" ]; then
		modes+=(read)
		read_cubins "$tmp/read.$i" "${args[@]}" >"$tmp/load.$i.out" 2>&1 &
	else
		if ((i % 2 == 0)); then mode=module; else mode=library; fi
		modes+=("$mode")
		timeout -k 10 "$SMOKE_TIMEOUT" "$GPU_SMOKE" "$mode" "${args[@]}" >"$tmp/load.$i.out" 2>&1 &
	fi
	loader_pids+=($!)
done
# Release them once every live process is ready (at most 120 s).
for ((t = 0; t < 1200; t++)); do
	ready=$(find "$tmp" -maxdepth 1 -name 'go.ready.*' | wc -l)
	alive=0
	for p in "${loader_pids[@]}"; do
		kill -0 "$p" 2>/dev/null && alive=$((alive + 1))
	done
	[ "$ready" -ge "$alive" ] && break
	sleep 0.1
done
say "released $ready ready of $NPROCS processes after $((t / 10)).$((t % 10)) s"
: >"$tmp/go"
load_fail=0
for ((i = 0; i < NPROCS; i++)); do
	wait "${loader_pids[i]}"
	rcs[i]=$?
done
loader_pids=()
end=$(date +%s.%N)
for ((i = 0; i < NPROCS; i++)); do
	sed 's/^/  /' "$tmp/load.$i.out"
done
for ((i = 0; i < NPROCS; i++)); do
	if [ "${rcs[i]}" = 0 ]; then
		:
	elif [ "${rcs[i]}" = 124 ] || [ "${rcs[i]}" = 137 ]; then
		bad "process $i (${modes[i]}) timed out after ${SMOKE_TIMEOUT} s"
		load_fail=1
	else
		bad "process $i (${modes[i]}) exited with status ${rcs[i]}"
		load_fail=1
	fi
done
[ "$load_fail" = 0 ] &&
	ok "all $NPROCS processes exited 0 (exit codes: ${rcs[*]}) in $(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }') s"
if [ -n "$NO_GPU" ]; then
	# Every reader got the same bytes of each kernel.
	for k in "${KERNELS[@]}"; do
		got=$(find "$tmp" -maxdepth 1 -name "read.*.$k.sha" | wc -l)
		n=$(cat "$tmp"/read.*."$k".sha 2>/dev/null | sort -u | wc -l)
		check "$k: $got of $NPROCS readers read it, $n distinct digest(s)" [ "$got" = "$NPROCS" -a "$n" = 1 ]
	done
fi

# ---------------------------------------------------------------------------- cubins
section "cubins"
for k in "${KERNELS[@]}"; do
	c=${entry[$k]}/kernel.cubin
	size=$(stat -c %s "$c") || { bad "stat $c failed"; continue; }
	read_bytes=$(wc -c <"$c") || { bad "read $c failed"; continue; }
	magic=$(head -c 4 "$c" | od -An -tx1 | tr -d ' \n')
	say "$k: $(stat -c '%A %s' "$c") sha256 $(sha256sum <"$c" | cut -c1-16)..."
	check "$k: stat size $size = bytes read $read_bytes, ELF magic ($magic)" \
		[ "$size" = "$read_bytes" -a "$size" -gt 0 -a "$magic" = 7f454c46 ]
	if [ -n "$SAVE" ]; then
		cp "$c" "$SAVE/$k.cubin" || bad "copying $k's cubin to $SAVE failed"
	fi
done
say "entry listing:"
ls -l "${entry[vector_add]}" | sed 's/^/  /'

# ---------------------------------------------------------------------------- stats
section "stats"
sed 's/^/  /' "$mnt/.kcachefs/stats"
[ -n "$SAVE" ] && { cp "$mnt/.kcachefs/metrics.prom" "$SAVE/metrics.prom" || bad "copying the metrics to $SAVE failed"; }
expect_stat kcachefs_compiles_total -eq "$EXPECT"
expect_stat kcachefs_misses_total -eq 3
expect_stat kcachefs_compile_failures_total -eq 0
expect_stat kcachefs_compiles_in_flight -eq 0
if [ "$(stat_value kcachefs_compiles_total)" = "$EXPECT" ]; then
	say "compile count: PASS (kcachefs_compiles_total $EXPECT: $EXPECT compile(s) for 3 kernels and $NPROCS processes)"
else
	say "compile count: FAIL (kcachefs_compiles_total $(stat_value kcachefs_compiles_total), want $EXPECT)"
fi
[ "$BROKEN" = 0 ] && exit 0 # cleanup (the EXIT trap) unmounts, checks and prints PASS or FAIL

# ---------------------------------------------------------------------------- broken
section "broken.cu: open fails with EIO"
stage broken || die "staging broken failed"
c=${entry[broken]}/kernel.cubin
for attempt in 1 2; do
	if cat "$c" >/dev/null 2>"$tmp/cat.err"; then
		bad "open #$attempt of broken's kernel.cubin succeeded"
	else
		err=$(sed 's/.*: //' "$tmp/cat.err")
		say "open #$attempt: $(cat "$tmp/cat.err")"
		check "open #$attempt of broken's kernel.cubin fails with EIO ($err)" [ "$err" = "Input/output error" ]
	fi
done
if [ -s "${entry[broken]}/kernel.log" ]; then
	say "kernel.log (first lines):"
	head -n 8 "${entry[broken]}/kernel.log" | sed 's/^/  | /'
	check "kernel.log names the compiler's error" grep -q 'undefined_symbol_kcachefs_test' "${entry[broken]}/kernel.log"
else
	bad "broken's kernel.log is missing or empty"
fi
grep -v '^#' "$mnt/.kcachefs/metrics.prom" | grep -E 'compiles_total|failures|rejected' | sed 's/^/  /'
expect_stat kcachefs_compile_failures_total -eq 1 # the second open did not compile again
expect_stat kcachefs_rejected_lookups_total -ge 1
expect_stat kcachefs_compiles_total -eq "$EXPECT"

exit 0 # cleanup (the EXIT trap) unmounts, checks and prints PASS or FAIL
