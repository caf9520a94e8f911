#!/bin/sh
# kcachefs-pod.sh - the command of the kcachefs DaemonSet's pod (daemonset.yaml;
# doc/kubernetes.md says why each step is there).
#
#   kcachefs-pod.sh run     serve the node's mount: take it over from the pod that serves it
#                           now (a rolling update: kcachefs --upgrade), else mount it (a dead
#                           mount left there is unmounted by kcachefs first)
#   kcachefs-pod.sh ready   the readiness probe: this pod's daemon serves the mount
#
# Paths and options come from the environment (the manifest sets them; a test overrides them):
#   KCACHEFS              the daemon (/usr/local/bin/kcachefs)
#   KCACHEFS_BACKING      the backing directory (/var/cache/kcachefs/store); its parent is
#                         made a directory only root may enter, as the systemd unit does
#   KCACHEFS_MOUNTPOINT   the mountpoint (/mnt/kcachefs/kcache), inside the hostPath volume
#                         whose mountPropagation is Bidirectional
#   KCACHEFS_OPTIONS      -o options for a new mount (nosuid,nodev,allow_other)
#   KCACHEFS_REMOTE       the cluster store's URL (from the Secret; empty: no store)
#   KCACHEFS_SECRET       the Secret's volume (/etc/kcachefs/secret): remote_key and
#                         remote_auth, copied to files of root's with mode 600 (kcachefs
#                         refuses the volume's own files, which are symbolic links)
#   KCACHEFS_STATE        this pod's own directory (/run/kcachefs-pod, an emptyDir): the
#                         daemon's pid for the probe, the copies of the secrets
#   KCACHEFS_PROBE_TIMEOUT  seconds a look at the mount may take (5): a hung one fails it
set -u

KCACHEFS=${KCACHEFS:-/usr/local/bin/kcachefs}
BACKING=${KCACHEFS_BACKING:-/var/cache/kcachefs/store}
MNT=${KCACHEFS_MOUNTPOINT:-/mnt/kcachefs/kcache}
OPTIONS=${KCACHEFS_OPTIONS:-nosuid,nodev,allow_other}
REMOTE=${KCACHEFS_REMOTE:-}
SECRET=${KCACHEFS_SECRET:-/etc/kcachefs/secret}
STATE=${KCACHEFS_STATE:-/run/kcachefs-pod}
T=${KCACHEFS_PROBE_TIMEOUT:-5}

say() { echo "kcachefs-pod: $*" >&2; }

# A kcachefs mount is on $MNT in this pod's mount table (the pod's view of the hostPath,
# which the host's and the other pods' mounts reach through propagation).
mounted() {
	awk -v m="$MNT" '$2 == m && $3 == "fuse.kcachefs" {f = 1} END {exit !f}' /proc/self/mounts
}

# The readiness probe. The daemon this pod started holds the mount's /dev/fuse descriptor
# (a new mount's, or the one a live upgrade handed over: before that, the running daemon
# of the other pod answers, and this pod is not ready yet), and it answers: an open of
# the stats file is always a request to the daemon, and a hung mount fails within $T s.
ready() {
	pid=$(cat "$STATE/daemon.pid" 2>/dev/null) && kill -0 "$pid" 2>/dev/null || return 1
	if [ ! -e "$STATE/holds-fuse.$pid" ]; then
		# Looked for once per daemon: it keeps a descriptor per inode, and /dev/fuse is one
		# of its first.
		for fd in /proc/"$pid"/fd/*; do
			if [ "$(readlink "$fd" 2>/dev/null)" = /dev/fuse ]; then
				: > "$STATE/holds-fuse.$pid"
				break
			fi
		done
		[ -e "$STATE/holds-fuse.$pid" ] || return 1
	fi
	timeout -s KILL "$T" head -c1 "$MNT/.kcachefs/stats" >/dev/null 2>&1
}

run() {
	case $MNT in *[[:space:]]*)
		say "the mountpoint '$MNT' has a blank in it, which /proc/self/mounts escapes"
		exit 2;;
	esac
	install -d -m 700 "$STATE" || exit 1
	rm -f "$STATE"/daemon.pid "$STATE"/holds-fuse.*
	install -d -m 700 "$(dirname "$BACKING")" && install -d "$BACKING" || exit 1

	# The cluster store's URL and secrets, from the Secret.
	if [ -n "$REMOTE" ]; then
		OPTIONS="$OPTIONS,remote=$REMOTE"
		for f in remote_key remote_auth; do
			[ -e "$SECRET/$f" ] || continue
			install -m 600 "$SECRET/$f" "$STATE/$f" || exit 1
			OPTIONS="$OPTIONS,$f=$STATE/$f"
		done
	fi

	# What is on the mountpoint decides: a live mount is taken over (the pod serving it runs
	# on until this one serves), a dead one (its daemon was killed) is left to kcachefs,
	# which unmounts it before mounting, and a busy one (a handover to another daemon in
	# progress, a hung daemon) is tried again at the container's restart.
	if mounted; then
		timeout -s KILL "$T" stat -f "$MNT" >/dev/null 2>&1
		case $? in
		0) set -- "$KCACHEFS" -f --upgrade "$MNT"
		   say "a live kcachefs mount is on $MNT: taking it over (kcachefs --upgrade)";;
		124|137) say "the kcachefs mount on $MNT did not answer within $T s (a handover" \
			"in progress, or a hung daemon): trying again at the next start"
		   exit 1;;
		*) set -- "$KCACHEFS" -f -o "$OPTIONS" "$BACKING" "$MNT"
		   say "the kcachefs mount on $MNT is dead: mounting anew (kcachefs unmounts it first)";;
		esac
	else
		install -d "$MNT" || exit 1
		set -- "$KCACHEFS" -f -o "$OPTIONS" "$BACKING" "$MNT"
		say "mounting $BACKING on $MNT"
	fi

	# A deletion of the pod (SIGTERM) stops the daemon this pod runs: it unmounts, and
	# clients get an error (the mount is gone, or ENOTCONN where they hold it) rather
	# than a wait. A successor that took the mount over has already asked it to leave.
	stopping=
	pid=
	trap 'stopping=1; [ -z "$pid" ] || kill -TERM "$pid" 2>/dev/null' TERM INT HUP
	"$@" &
	pid=$!
	[ -z "$stopping" ] || kill -TERM "$pid" # a deletion that came before $pid was known
	echo "$pid" > "$STATE/daemon.pid"
	while :; do
		wait "$pid"
		st=$?
		# Over 128: a trapped signal interrupted the wait (or the daemon died of one).
		[ "$st" -gt 128 ] && kill -0 "$pid" 2>/dev/null && continue
		break
	done
	rm -f "$STATE"/daemon.pid "$STATE"/holds-fuse.*
	if [ -n "$stopping" ]; then
		say "stopped: the daemon exited with status $st"
		exit "$st"
	fi

	# Exit status 0 with the mount still in place: the daemon handed it to another daemon (a
	# newer pod's kcachefs --upgrade) and exited without unmounting. A stop by signal or an
	# unmount leaves no mount; a crash exits by a signal, leaving a dead mount. This container
	# must not end now: the kubelet would start it again, and its start would take the
	# mount back (an upgrade back and forth), and the deletion to come would then stop the
	# only daemon. It waits, serving nothing, and leaves the mount alone when deleted.
	if [ "$st" -eq 0 ] && mounted; then
		say "the daemon handed the mount to another daemon (a newer pod's kcachefs --upgrade):" \
			"this pod serves nothing now and waits to be deleted"
		sleeper=
		trap '[ -z "$sleeper" ] || kill "$sleeper" 2>/dev/null; exit 0' TERM INT HUP
		while :; do
			sleep 3600 &
			sleeper=$!
			wait "$sleeper"
		done
	fi
	if mounted; then
		say "the daemon exited with status $st and left a dead mount on $MNT (Transport" \
			"endpoint is not connected): the next start mounts anew"
	else
		say "the daemon exited with status $st; no mount is on $MNT"
	fi
	exit "$st"
}

case ${1:-run} in
run) run;;
ready) ready;;
*) echo "usage: $0 [run|ready]" >&2; exit 2;;
esac
