#!/bin/sh
# Fake compiler that prints the resource limits it runs under (after a moment: the daemon
# sets them right after the spawn), then fails.
sleep 0.3
echo "limits: nofile $(ulimit -n) cpu $(ulimit -t) core $(ulimit -c) fsize $(ulimit -f)"
exit 1
