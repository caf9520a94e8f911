#!/usr/bin/env bash
# setup.sh - install what kcachefs needs (Debian 12 packages; CUDA is expected at
# $CUDA_HOME or /usr/local/cuda) and build it into build/. Safe to run again: installs
# only what is missing and rebuilds incrementally. Used by run.sh and test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(gcc libc6-dev pkg-config meson ninja-build libfuse3-dev fuse3 libssl-dev libhiredis-dev python3 python3-pytest python3-pytest-xdist
	procps e2fsprogs mount groff-base libsystemd-dev clang libclang-rt-14-dev redis-server openssh-server sshfs iproute2)
missing=()
for p in "${packages[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
	if [ "$(id -u)" -ne 0 ]; then
		echo "setup: missing packages: ${missing[*]}; installing them (apt-get) needs root:" \
			"run this as root, or have them installed" >&2
		exit 1
	fi
	echo "setup: installing ${missing[*]}"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -q
	apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

cuda="${CUDA_HOME:-/usr/local/cuda}"
if [ ! -x "$cuda/bin/nvcc" ]; then
	echo "setup: no nvcc at $cuda/bin/nvcc (set CUDA_HOME): kcachefs builds, but cannot compile kernels" >&2
fi

if [ ! -w . ] || { [ -e build ] && [ ! -w build ]; }; then
	echo "setup: cannot build in $PWD/build: uid $(id -u) may not write there" \
		"(build as the tree's owner, or in a clone of your own)" >&2
	exit 1
fi
[ -f build/build.ninja ] || meson setup build
ninja -C build
