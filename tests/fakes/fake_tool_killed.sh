#!/bin/sh
# Fake compiler whose host-compiler tool was killed (the OOM killer, a memory limit): gcc
# reports it with the word "error", and nvcc exits 1. It is no verdict on the source.
echo "gcc: fatal error: Killed signal terminated program cc1plus"
echo "compilation terminated."
exit 1
