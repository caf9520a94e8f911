#!/bin/sh
# Fake compiler that reports an error and exits 1; prints its arguments and environment
# so that the test can check what it was given.
echo "fake-nvcc: error: rejected"
echo "args: $*"
env | sort | sed 's/^/env: /'
exit 1
