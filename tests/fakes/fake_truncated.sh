#!/bin/sh
# Fake compiler that exits 0 after writing the first half of a real cubin, given as the
# first argument after "<src> -cubin -o <out>".
size=$(wc -c < "$5")
head -c $((size / 2)) "$5" > "$4"
exit 0
