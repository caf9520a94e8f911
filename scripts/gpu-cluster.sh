#!/usr/bin/env bash
# gpu-cluster.sh - the cluster store on a GPU node: two mounts as two nodes sharing one store.
#
# Node A and node B are two daemons, each with its own backing directory and mountpoint, both
# with -o remote=dir:STORE (a fresh shared directory) and one cluster key (-o remote_key).
# Each runs scripts/gpu-smoke.sh with SMOKE_CLIENT=deepgemm-shim: 8 DeepGEMM ranks compile the
# three sample kernels through kcachefs-nvcc, then 8 processes load every cubin (4 with
# cuModuleLoad, 4 with cuLibraryLoadFromFile), launch it and check the numbers.
#   A, cold: compiles each kernel once (kcachefs_compiles_total 3) and stores it.
#   B, after A (a fresh backing directory): compiles nothing (kcachefs_compiles_total 0),
#      every cubin comes from the store (kcachefs_remote_hits_total 3, no remote miss, none
#      refused), every cubin loads and computes correctly, and B's cubins are byte-identical
#      to A's.
# It prints both nodes' full smoke output (prefixed A| and B|), their stats side by side and
# PASS or FAIL. Everything it made (the mounts, the daemons, the store, the temp dirs) is
# removed on every exit path, and it checks that no mount is left.
#
# Where and how: as gpu-smoke.sh (its header): on the GPU node, as root (the daemons mount with
# mount(2); no fusermount3 needed), with build-static/ and build/gpu_smoke built, python3.
#   scripts/gpu-cluster.sh
# About a minute on an H200 (the cold compiles dominate).
#
# The compiles run sandboxed as uids of their own (-o compile_uids, the default), and the
# DeepGEMM flags carry -I<client>/../kernels/include, which that uid must read. So the client
# (tests/mount/deepgemm.py) and tests/kernels/include are copied into the shared temp dir,
# mode 755, and run from there: wherever the tree is (/work/main, /root/...), the sandbox
# reaches the headers. Node B runs its own copy at another path, installed later (other
# mtimes, as a second machine's pip install): keys are made of bytes, so B still
# compiles nothing.
#
# Environment (the rest, ARCH, JOBS, NVCC, KCACHEFS, SHIM, GPU_SMOKE, SMOKE_PROCS, is passed to
# gpu-smoke.sh as it is):
#   SMOKE_NO_GPU=1       no GPU: the loaders read the cubins with cat (a dry run anywhere)
#   KCACHEFS_OPTS=a,b    more -o options for both daemons; compile_uids=daemon is the fallback
#                        if the sandbox cannot run on the node (it says why when it refuses)
#   CLUSTER_KEEP=DIR     keep the cubins, metrics and daemon logs of both nodes in DIR/A, DIR/B
set -u
set -o pipefail

cd "$(dirname "$0")/.." || exit 2
KERNELS=(vector_add saxpy block_sum)
NO_GPU=${SMOKE_NO_GPU:-0}
[ "$NO_GPU" = 0 ] && NO_GPU=
failures=0
share='' smoke_pid='' tail_pid=''

say() { printf '%s\n' "$*"; }
section() { printf '\n=== %s\n' "$*"; }
ok() { say "ok    $*"; }
bad() { say "FAIL  $*"; failures=$((failures + 1)); }

cleanup() {
	local rc=$?
	set +e
	trap - EXIT INT TERM HUP
	if [ -n "$smoke_pid" ] && kill -0 "$smoke_pid" 2>/dev/null; then
		say "stopping gpu-smoke.sh ($smoke_pid); it unmounts and removes its own temp dir"
		kill -TERM "$smoke_pid"
		wait "$smoke_pid" 2>/dev/null
	fi
	[ -n "$tail_pid" ] && wait "$tail_pid" 2>/dev/null
	section "clean up"
	if grep -q ' /tmp/kcachefs-smoke\.' /proc/mounts; then
		bad "a gpu-smoke mount is still in /proc/mounts: $(grep ' /tmp/kcachefs-smoke\.' /proc/mounts | cut -d' ' -f2 | paste -sd' ')"
	else
		ok "no kcachefs-smoke mount in /proc/mounts"
	fi
	if [ -n "$share" ] && [ -d "$share" ]; then
		if [ -n "${CLUSTER_KEEP:-}" ]; then
			mkdir -p "$CLUSTER_KEEP" && cp -r "$share/A" "$share/B" "$CLUSTER_KEEP/" &&
				say "kept both nodes' cubins, metrics and logs in $CLUSTER_KEEP"
		fi
		rm -rf --one-file-system "$share"
		if [ -e "$share" ]; then bad "shared dir $share not removed"; else ok "shared dir $share (store, key, client copy) removed"; fi
	fi
	[ "$rc" -ne 0 ] && [ "$failures" -eq 0 ] && failures=1
	say "elapsed: $SECONDS s"
	echo
	if [ "$failures" -eq 0 ]; then
		if [ -n "$NO_GPU" ]; then
			say "PASS: gpu-cluster (SMOKE_NO_GPU: no GPU loads): node B compiled nothing and got all 3 cubins from the store, byte-identical to node A's, read whole by every reader"
		else
			say "PASS: gpu-cluster: node B compiled nothing and got all 3 cubins from the store, byte-identical to node A's; every one loaded (cuModuleLoad, cuLibraryLoadFromFile) and computed correctly"
		fi
		exit 0
	fi
	say "FAIL: gpu-cluster: $failures check(s) failed"
	exit 1
}
trap cleanup EXIT
trap 'say "interrupted"; failures=$((failures + 1)); exit 1' INT TERM HUP
die() { bad "$*"; exit 1; }

# metric FILE NAME: the value of a counter in a saved metrics.prom (empty if absent)
metric() { [ -r "$1" ] && awk -v k="$2" '$1 == k { sub(/\..*/, "", $2); print $2 }' "$1"; }
expect() { # expect NODE METRIC -eq|-ge VALUE
	local v
	v=$(metric "$share/$1/metrics.prom" "$2")
	if [ -z "$v" ]; then
		bad "node $1: $2 is missing (no metrics saved?)"
	elif test "$v" "$3" "$4"; then
		ok "node $1: $2 = $v ($3 $4)"
	else
		bad "node $1: $2 = $v, want $3 $4"
	fi
}

# node NAME: one gpu-smoke.sh run as a node of the cluster, its output prefixed with NAME|
node() {
	local name=$1 out=$share/$1.out rc
	shift
	mkdir "$share/$name" || die "mkdir $share/$name failed"
	: >"$out"
	say "$* SMOKE_CLIENT=deepgemm-shim DEEPGEMM=${NODE_CLIENT:-$client} SMOKE_SAVE=$share/$name KCACHEFS_OPTS=$opts scripts/gpu-smoke.sh"
	env "$@" SMOKE_CLIENT=deepgemm-shim DEEPGEMM="${NODE_CLIENT:-$client}" SMOKE_SAVE="$share/$name" \
		KCACHEFS_OPTS="$opts" scripts/gpu-smoke.sh >"$out" 2>&1 &
	smoke_pid=$!
	tail -n +1 -s 0.2 --pid="$smoke_pid" -f "$out" | sed -u "s/^/$name| /" &
	tail_pid=$!
	wait "$smoke_pid"
	rc=$?
	smoke_pid=''
	wait "$tail_pid"
	tail_pid=''
	if [ "$rc" = 0 ]; then ok "node $name: gpu-smoke.sh passed"; else bad "node $name: gpu-smoke.sh failed (status $rc)"; fi
	return "$rc"
}

section "cluster: two nodes, one store"
share=$(mktemp -d /tmp/kcachefs-cluster.XXXXXX) || die "mktemp failed"
share=$(realpath "$share")
chmod 755 "$share" || die "chmod $share failed"
store=$share/store
key=$share/cluster.key
mkdir -m 700 "$store" || die "mkdir $store failed"
(umask 077 && head -c 32 /dev/urandom >"$key") || die "writing the cluster key failed"
mkdir -p "$share/client/mount" "$share/client/kernels" &&
	cp tests/mount/deepgemm.py "$share/client/mount/" &&
	cp -r tests/kernels/include "$share/client/kernels/" &&
	chmod -R a+rX "$share/client" || die "copying the DeepGEMM client to $share/client failed"
client=$share/client/mount/deepgemm.py
# node B's copy: the same bytes at another path, every file dated an hour later
mkdir -p "$share/other-venv/lib" &&
	cp -r "$share/client" "$share/other-venv/lib/client" &&
	find "$share/other-venv" -exec touch -d '+1 hour' {} + &&
	chmod -R a+rX "$share/other-venv" || die "copying the client to $share/other-venv failed"
client_b=$share/other-venv/lib/client/mount/deepgemm.py
opts="remote=dir:$store,remote_key=$key${KCACHEFS_OPTS:+,$KCACHEFS_OPTS}"
say "store: dir:$store (fresh), cluster key $key (32 random bytes, mode 600)"
say "client: $client (a copy the compile sandbox can read); node B's: $client_b"

section "node A: cold, compiles and stores every kernel"
node A SMOKE_EXPECT_COMPILES=3
section "node B: a fresh backing dir, the same store; must compile nothing"
NODE_CLIENT=$client_b node B SMOKE_EXPECT_COMPILES=0 SMOKE_BROKEN=0

section "the store"
nobj=$(find "$store/objects" -type f ! -name '.*' 2>/dev/null | wc -l)
nbytes=$(du -sb "$store/objects" 2>/dev/null | cut -f1)
say "$nobj objects in $store/objects (a header index and a cubin object per kernel; ${nbytes:-0} bytes)"
# A lease file left is either a live lease (none should be) or a failure note ("failed ..."):
# node A's broken.cu leaves one for a few seconds, so that waiters elsewhere do not wait.
nlease=$(find "$store/leases" -type f ! -name '.*' 2>/dev/null | wc -l)
nfail=$(find "$store/leases" -type f ! -name '.*' -exec head -c 7 {} \; -exec echo \; 2>/dev/null | grep -c '^failed ')
if [ "$nlease" = "$nfail" ]; then
	ok "no lease held: $nlease lease file(s) left, all failure notes (node A's broken.cu)"
else
	bad "$((nlease - nfail)) lease(s) still held in the store after both nodes stopped"
fi

section "A against B"
for k in "${KERNELS[@]}"; do
	a=$share/A/$k.cubin b=$share/B/$k.cubin
	if [ -s "$a" ] && [ -s "$b" ] && cmp -s "$a" "$b"; then
		ok "$k: B's cubin is byte-identical to A's ($(wc -c <"$a") bytes, sha256 $(sha256sum <"$a" | cut -c1-16)...)"
	else
		bad "$k: B's cubin differs from A's or is missing (A: $(sha256sum <"$a" 2>&1 | cut -c1-16), B: $(sha256sum <"$b" 2>&1 | cut -c1-16))"
	fi
done
expect A kcachefs_compiles_total -eq 3
expect A kcachefs_remote_misses_total -eq 3
expect A kcachefs_remote_puts_total -ge 3
expect A kcachefs_remote_hits_total -eq 0
expect B kcachefs_compiles_total -eq 0
expect B kcachefs_compile_failures_total -eq 0
expect B kcachefs_remote_hits_total -eq 3
expect B kcachefs_remote_misses_total -eq 0
expect B kcachefs_remote_puts_total -eq 0
for n in A B; do
	expect "$n" kcachefs_remote_rejected_total -eq 0
	expect "$n" kcachefs_remote_get_errors_total -eq 0
	expect "$n" kcachefs_remote_put_errors_total -eq 0
	expect "$n" kcachefs_remote_up -eq 1
done
if [ -r "$share/B/daemon.log" ]; then
	n=$(grep -c 'published (ok)' "$share/B/daemon.log")
	if [ "$n" = 0 ]; then ok "node B's daemon log has no compile"; else bad "node B's daemon log shows $n compile(s)"; fi
fi

section "stats after the loads (metrics.prom), side by side"
printf '%-44s %12s %12s\n' metric "node A" "node B"
for m in compiles_total misses_total compile_failures_total remote_hits_total remote_misses_total \
	remote_puts_total remote_rejected_total remote_get_errors_total remote_put_errors_total \
	remote_lease_errors_total remote_lease_waits_total remote_takeovers_total remote_hedged_total \
	remote_bytes_in_total remote_bytes_out_total remote_fetches_total \
	remote_fetch_microseconds_total remote_up; do
	printf '%-44s %12s %12s\n' "kcachefs_$m" "$(metric "$share/A/metrics.prom" "kcachefs_$m")" \
		"$(metric "$share/B/metrics.prom" "kcachefs_$m")"
done
for n in A B; do
	t=$(sed -n 's/.*DeepGEMM ranks finished without error in \([0-9.]*\) s.*/\1/p' "$share/$n.out")
	l=$(sed -n 's/.*all [0-9]* processes exited 0 .* in \([0-9.]*\) s.*/\1/p' "$share/$n.out")
	f=$(metric "$share/$n/metrics.prom" kcachefs_remote_fetches_total)
	u=$(metric "$share/$n/metrics.prom" kcachefs_remote_fetch_microseconds_total)
	say "node $n: ${SMOKE_PROCS:-8} DeepGEMM ranks (stage and compile or fetch) ${t:-?} s; loads ${l:-?} s$([ "${f:-0}" -gt 0 ] && awk -v u="$u" -v f="$f" 'BEGIN { printf "; %d fetches from the store, %.1f ms each on average", f, u / f / 1000 }')"
done
exit 0 # cleanup prints PASS or FAIL
