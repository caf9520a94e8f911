#!/usr/bin/env bash
# test.sh - set up, build and run every test: the core's unit tests (meson, TAP), then the
# mount tests (pytest, real FUSE mounts, real nvcc). Needs root (mounts) and /dev/fuse.
# Extra arguments go to pytest (e.g. -k waiters). The last line is pytest's summary.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh || exit 1

status=0
meson test -C build --suite unit --print-errorlogs || status=1
/usr/bin/python3 -m pytest -p no:cacheprovider -v tests/mount "$@" || status=1
# No test may leave a mount behind.
if grep -q " fuse.kcachefs " /proc/mounts; then
	echo "test.sh: kcachefs mounts left behind:" >&2
	grep " fuse.kcachefs " /proc/mounts >&2
	status=1
fi
exit $status
