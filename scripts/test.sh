#!/usr/bin/env bash
# test.sh - set up, build and run every test: the core's unit tests (meson, TAP), then the
# mount tests (pytest, real FUSE mounts, real nvcc). Needs root (mounts) and /dev/fuse.
# Extra arguments go to pytest (e.g. -k waiters). The last line is pytest's summary.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh || exit 1

status=0
meson test -C build --suite unit --print-errorlogs || status=1
base=$(mktemp -d /tmp/kcachefs-tests.XXXXXX)
/usr/bin/python3 -m pytest -p no:cacheprovider --basetemp="$base" -v tests/mount "$@" || status=1
# No test may leave a mount or a temp file behind.
if awk -v b="$base" 'index($2, b) == 1 { found = 1 } END { exit !found }' /proc/mounts; then
	echo "test.sh: mounts left behind under $base:" >&2
	awk -v b="$base" 'index($2, b) == 1' /proc/mounts >&2
	status=1
else
	rm -rf "$base"
fi
exit $status
