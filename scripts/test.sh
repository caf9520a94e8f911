#!/usr/bin/env bash
# test.sh - set up, build and run every test, as CI does (.ci/run):
#   1. the core's unit tests (meson, TAP) and the mount tests (pytest, real FUSE mounts,
#      real nvcc) on the normal build (build/);
#   2. the same under AddressSanitizer and UBSan (build-asan/; any report fails the test
#      that triggered it);
#   3. each libFuzzer target for FUZZ_SECONDS (default 60) from its seed corpus
#      (build-fuzz/, clang).
# Needs root (mounts) and /dev/fuse. Extra arguments go to pytest (e.g. -k waiters).
# KCACHEFS_TEST_QUICK=1 runs step 1 only. The last line is "N passed, M failed" over all
# steps (tests, unit suites and fuzz targets).
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh || exit 1

passed=0 failed=0
base=$(mktemp -d /tmp/kcachefs-tests.XXXXXX)

sum_of() { # sum_of REGEX < text: the sum of the numbers in front of REGEX
	grep -oE "[0-9]+ ($1)" | awk '{ s += $1 } END { print s + 0 }'
}

count_pytest() { # add the counts of pytest's summary line in log $1
	local line
	line=$(grep -E '^=+ .*(passed|failed|error).* in [0-9.]+s' "$1" | tail -1)
	passed=$((passed + $(sum_of passed <<<"$line")))
	failed=$((failed + $(sum_of 'failed|errors?' <<<"$line")))
	[ -n "$line" ] || failed=$((failed + 1)) # pytest did not get to its summary
}

count_meson() { # add meson's Ok: and Fail: counts (one per unit suite) in log $1
	passed=$((passed + $(awk '$1 == "Ok:" { print $2 }' "$1")))
	failed=$((failed + $(awk '$1 == "Fail:" || $1 == "Timeout:" { s += $2 } END { print s + 0 }' "$1")))
}

run_suite() { # run_suite NAME BUILD_DIR [pytest args...]: unit then mount tests
	local name=$1 dir=$2
	shift 2
	echo "=== $name: unit tests ($dir)"
	meson test -C "$dir" --suite unit --print-errorlogs 2>&1 | tee "$base/$name-unit.log"
	count_meson "$base/$name-unit.log"
	echo "=== $name: mount tests ($dir)"
	mkdir -p "$base/$name"
	KCACHEFS_BIN="$PWD/$dir/kcachefs" KCACHEFS_NVCC_BIN="$PWD/$dir/kcachefs-nvcc" \
		/usr/bin/python3 -m pytest -p no:cacheprovider --basetemp="$base/$name" -v tests/mount "$@" \
		2>&1 | tee "$base/$name.log"
	count_pytest "$base/$name.log"
}

run_suite normal build "$@"

if [ "${KCACHEFS_TEST_QUICK:-0}" != 1 ]; then
	# A sanitizer report aborts the process (no recovery), so the test that triggered it fails.
	export ASAN_OPTIONS=abort_on_error=0:detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1
	[ -f build-asan/build.ninja ] || meson setup build-asan -Dbuildtype=debug \
		-Db_sanitize=address,undefined -Db_lundef=false -Dc_args=-fno-sanitize-recover=all >/dev/null
	if ninja -C build-asan >/dev/null; then
		run_suite sanitized build-asan "$@"
	else
		echo "test.sh: the sanitizer build failed" >&2
		failed=$((failed + 1))
	fi
	unset ASAN_OPTIONS UBSAN_OPTIONS

	echo "=== fuzz targets, ${FUZZ_SECONDS:-60} s each (build-fuzz)"
	[ -f build-fuzz/build.ninja ] || CC=clang meson setup build-fuzz -Dfuzz=true -Dbuildtype=debug \
		-Db_sanitize=address,undefined -Db_lundef=false -Dc_args=-fno-sanitize-recover=all >/dev/null
	if ninja -C build-fuzz >/dev/null; then
		for t in name flags flags_file redis_url; do
			mkdir -p "$base/corpus-$t"
			if build-fuzz/tests/fuzz_$t -max_total_time="${FUZZ_SECONDS:-60}" -print_final_stats=1 \
				-artifact_prefix="$base/crash-$t-" "$base/corpus-$t" "tests/fuzz/corpus/$t" \
				>"$base/fuzz-$t.log" 2>&1; then
				echo "fuzz_$t: $(grep -E '^Done' "$base/fuzz-$t.log")"
				passed=$((passed + 1))
			else
				echo "fuzz_$t: FAILED; its report:" >&2
				tail -40 "$base/fuzz-$t.log" >&2
				ls "$base"/crash-$t-* >&2 2>/dev/null
				failed=$((failed + 1))
			fi
		done
	else
		echo "test.sh: the fuzz build failed (needs clang)" >&2
		failed=$((failed + 1))
	fi
fi

# No test may leave a mount behind.
if awk -v b="$base" 'index($2, b) == 1 { found = 1 } END { exit !found }' /proc/mounts; then
	echo "test.sh: mounts left behind under $base:" >&2
	awk -v b="$base" 'index($2, b) == 1' /proc/mounts >&2
	failed=$((failed + 1))
elif [ "$failed" -eq 0 ]; then
	rm -rf "$base"
else
	echo "test.sh: logs kept in $base"
fi
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
