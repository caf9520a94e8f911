#!/usr/bin/env bash
# run.sh - set up, build, mount kcachefs and show its main job working.
#
# Mounts the backing directory $KCACHEFS_BACKING (default /var/cache/kcachefs/store, in a
# directory only root can enter, so users reach the store only through the mount) on
# $KCACHEFS_MOUNTPOINT (default /mnt/kcache), stages a sample kernel (tests/kernels/block_sum.cu,
# which includes CUB headers, with its flags) into a fresh kernel entry, starts 8 readers of
# its kernel.cubin at once, and shows: one compile for 8 readers, identical bytes for all,
# the ELF header of a CUDA cubin, the compile log and the statistics. The mount stays up;
# the last lines say how to unmount it. Needs root and /dev/fuse (checked first, before
# anything is installed or built).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then
	echo "run.sh: needs root, and runs as uid $(id -u): setup installs missing packages with" \
		"apt-get, the store goes under /var/cache/kcachefs (a directory only root may enter)" \
		"and the mount on /mnt/kcache by default, and the daemon runs each compile as a uid" \
		"of its own (compile_uids), which only root may do; run it as root (sudo $0)" >&2
	exit 1
fi
[ -c /dev/fuse ] || { echo "run.sh: no /dev/fuse: mounting needs the fuse module (modprobe fuse)" >&2; exit 1; }
scripts/setup.sh >/dev/null || { echo "run.sh: setup failed (run scripts/setup.sh to see why)" >&2; exit 1; }

backing="${KCACHEFS_BACKING:-/var/cache/kcachefs/store}"
mnt="${KCACHEFS_MOUNTPOINT:-/mnt/kcache}"
[ -n "${KCACHEFS_BACKING:-}" ] || install -d -m 700 /var/cache/kcachefs
mkdir -p "$backing" "$mnt"
if ! grep -q " $mnt fuse.kcachefs " /proc/mounts; then
	build/kcachefs "$backing" "$mnt" ${KCACHEFS_OPTIONS:+-o "$KCACHEFS_OPTIONS"}
	if [ -S /dev/log ]; then where="daemon logs go to syslog"; else
		where="no syslog here (/dev/log): daemon logs are lost; to see them, unmount and run build/kcachefs -f"; fi
	echo "mounted: kcachefs $backing on $mnt ($where)"
else
	echo "already mounted: kcachefs on $mnt"
fi

stat_of() { awk -v k="kcachefs_$1" '$1 == k {print $2}' "$mnt/.kcachefs/metrics.prom"; }

# A fresh entry each run, so the demo shows a cold compile: the source carries the time.
src="$(cat tests/kernels/block_sum.cu; echo "// kcachefs demo $(date +%s.%N)")"
flags="$(cat tests/kernels/block_sum.flags)"
key="$(printf '%s\n%s' "$src" "$flags" | sha256sum | cut -c1-32)"
entry="$mnt/cache/kernel.block_sum.$key"
mkdir -p "$entry"
printf '%s\n' "$src" > "$entry/kernel.cu"
printf '%s\n' "$flags" > "$entry/kernel.flags"
echo "staged:  $entry/{kernel.cu,kernel.flags}"

before=$(stat_of compiles_total)
opens=$(stat_of cubin_opens_total)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
start=$(date +%s%N)
for i in 1 2 3 4 5 6 7 8; do
	( sha256sum < "$entry/kernel.cubin" | cut -c1-16 > "$tmp/$i" ) &
done
wait
end=$(date +%s%N)
after=$(stat_of compiles_total)
echo "readers: 8 concurrent readers of kernel.cubin finished in $(( (end - start) / 1000000 )) ms"
echo "bytes:   $(sort -u "$tmp"/* | wc -l) distinct sha256 among 8 readers: $(sort -u "$tmp"/* | tr '\n' ' ')"
echo "compile: $((after - before)) compiler run(s) for $(( $(stat_of cubin_opens_total) - opens )) opens of kernel.cubin"
python3 - "$entry/kernel.cubin" <<'PY'
import struct, sys
data = open(sys.argv[1], "rb").read()
machine = struct.unpack_from("<H", data, 18)[0]
ok = data[:4] == b"\x7fELF" and machine == 190
print("elf:     %d bytes, magic %r, e_machine %d (%s)" % (len(data), data[:4], machine,
      "EM_CUDA: a CUDA cubin" if ok else "NOT a CUDA cubin"))
sys.exit(0 if ok else 1)
PY
echo "log:     $(head -n1 "$entry/kernel.log")"
echo "stats:   ($mnt/.kcachefs/stats)"
sed 's/^/  /' "$mnt/.kcachefs/stats"
echo
echo "kcachefs stays mounted on $mnt. Point a JIT cache at it, e.g. for DeepGEMM (README.md):"
echo "  DG_JIT_CACHE_DIR=$mnt/deepgemm/\$USER DG_JIT_NVCC_COMPILER=$PWD/build/kcachefs-nvcc"
echo "Unmount with:  fusermount3 -u $mnt    (or: umount $mnt)"
