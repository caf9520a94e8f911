#!/bin/sh
# Fake compiler that hangs, as a stuck nvcc would: records its pid next to the output,
# starts a helper in its process group (as nvcc starts cicc and ptxas) and sleeps.
# argv as nvcc's: <src> -cubin -o <out> ...
dir=$(dirname "$4")
sleep 30 &
echo "$$ $!" > "$dir/compiler.pid"
sleep 30
