#!/usr/bin/env bash
# bench.sh - set up and build (scripts/setup.sh), then run every benchmark of
# scripts/bench.py side by side with its baseline and print the table. Arguments go to
# bench.py (--quick, --reps N, --only read,meta,cold,ahead,starve,store,triton,nvrtcwarm,cluster,cluster64,lag,
# keys, --kernels K, --stores dir,redis, --kernels64 K).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh >/dev/null
exec /usr/bin/python3 scripts/bench.py "$@"
