#!/bin/bash
# The dir: cluster store on a real network filesystem: exports a directory over sshfs
# (attribute caching on) between two network namespaces of its own on a veth pair, and
# runs the simulated-node cluster tests on it (tests/mount/test_remote_sshfs.py: 4 nodes x
# 32 processes x 8 kernels, a node mounted later, sshd killed or frozen mid-run).
# Needs root, iproute2, openssh-server, sshfs, and a build (scripts/setup.sh).
# Usage: scripts/remote-sshfs.sh [pytest arguments, e.g. -k killed]
set -euo pipefail
set -m  # pytest in a process group of its own, SIGINT not ignored: its fixtures tear down
cd "$(dirname "$0")/.."
base=$(mktemp -d /tmp/kcachefs-sshfs.XXXXXX)
pid=
cleanup() {
	local rc=$?
	set +e
	# The tests tear down what they made (fixtures); this catches a pytest that was killed.
	if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
		kill -INT "$pid" 2>/dev/null || true
		wait "$pid" 2>/dev/null || true
	fi
	if [ -n "$pid" ]; then
		{ grep -o " $base[^ ]*" /proc/mounts || true; } | sort -r | while read -r m; do
			fusermount3 -u -z "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
		done
		for ns in $(ip netns list | grep -o "^kc-\(srv\|cli\)-$pid-[0-9]*" || true); do
			for p in $(ip netns pids "$ns"); do kill -KILL "$p" 2>/dev/null || true; done
			ip netns delete "$ns" || true
		done
	fi
	rm -rf "$base"
	exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
export KCACHEFS_BIN=${KCACHEFS_BIN:-$PWD/build/kcachefs}
export KCACHEFS_NVCC_BIN=${KCACHEFS_NVCC_BIN:-$PWD/build/kcachefs-nvcc}
/usr/bin/python3 -m pytest -p no:cacheprovider -rs -v -s --durations=0 --basetemp="$base/pytest" \
	tests/mount/test_remote_sshfs.py "$@" &
pid=$!
wait "$pid"
