#!/usr/bin/env bash
# Boots the cgroup v2 test VM (built and cached by build.sh), runs one command in it from the
# repository's root, streams the guest's console, and exits with the command's exit code.
# The guest sees this machine's root read-only (writes go to a tmpfs overlay) and the io
# directory read-write at /mnt/io: anything the command writes there comes back.
# Usage: scripts/vm/run.sh [--mem MiB] [--cpus N] [--timeout S] [--io DIR] -- COMMAND...
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
mem=6144 cpus="$(nproc)" timeout_s=1800 io=""
while [ $# -gt 0 ]; do
  case "$1" in
    --mem) mem="$2"; shift 2 ;;
    --cpus) cpus="$2"; shift 2 ;;
    --timeout) timeout_s="$2"; shift 2 ;;
    --io) io="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "vm run: unknown option $1 (usage: run.sh [--mem MiB] [--cpus N] [--timeout S] [--io DIR] -- COMMAND...)" >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "vm run: no command given (usage: run.sh [options] -- COMMAND...)" >&2; exit 2; }
cache="$(bash "$here/build.sh")"
if [ -z "$io" ]; then io="$(mktemp -d /tmp/tenon-vm-io.XXXXXX)"; fi
mkdir -p "$io"
rm -f "$io/rc"
printf '%q ' "$@" >"$io/command"
echo >>"$io/command"

# The guest's /var/lib/tenon is a disk of its own, made for this run: ext4, where the process
# backend's idmapped mounts work (the 9p root and its overlay do not allow them), holding a copy
# of the image store (/var/lib/tenon/images) and room for the tests' state and TMPDIR.
disk="$io/tenon-state.img" mnt="$io/tenon-state.mnt"
images=/var/lib/tenon/images
used_mib=0
[ -d "$images" ] && used_mib="$(du -sm "$images" | cut -f1)"
rm -f "$disk"
truncate -s "$((used_mib + 6144))M" "$disk"
mkfs.ext4 -q -F -O ^has_journal "$disk"
mkdir -p "$mnt"
mount -o loop "$disk" "$mnt"
trap 'umount "$mnt" 2>/dev/null || true; rmdir "$mnt" 2>/dev/null || true; rm -f "$disk"' EXIT
if [ -d "$images" ]; then
  echo "[vm run] copying the image store ($used_mib MiB) to the guest's disk" >&2
  cp -a "$images" "$mnt/images"
fi
umount "$mnt"
rmdir "$mnt"

# KVM where the host offers one that works: a guest kernel with no root must boot under it to
# its panic (QEMU then exits 0 for -no-reboot); a KVM that cannot run this guest aborts at once.
# TCG runs the guest's CPUs in one host thread: the kernel patches its own text (static keys
# flip when sched_ext loads or unloads, or the TSC is marked unstable), and with one thread
# per CPU the guest died of "Oops: int3" in about a quarter of the boots that loaded sched_ext.
# TENON_VM_TCG_THREAD=multi trades that for speed.
accel="tcg,thread=${TENON_VM_TCG_THREAD:-single}"
if [ -w /dev/kvm ] && [ "${TENON_VM_ACCEL:-}" != tcg ]; then
  if sh -c 'timeout 30 qemu-system-x86_64 -accel kvm -cpu host -M q35 -nodefaults -no-user-config \
       -nographic -m 256 -kernel "$0" -append "console=ttyS0 panic=-1" -serial none -monitor none \
       -no-reboot' "$cache/vmlinuz" </dev/null >/dev/null 2>&1; then
    accel=kvm
  fi
fi
khz="$(awk -F: '/^cpu MHz/ {printf "%d", $2 * 1000; exit}' /proc/cpuinfo)"
cpu=max
[ "$accel" = kvm ] && cpu=host
echo "[vm run] accel=$accel cpus=$cpus mem=${mem}MiB io=$io" >&2
set +e
timeout --kill-after=10 "$timeout_s" qemu-system-x86_64 -M q35 -cpu "$cpu" -accel "$accel" -smp "$cpus" -m "$mem" \
  -nodefaults -no-user-config -nographic -serial stdio -monitor none -no-reboot \
  -kernel "$cache/vmlinuz" -initrd "$cache/initrd.img" \
  -append "console=ttyS0 panic=-1 tsc_early_khz=$khz tsc=reliable quiet loglevel=3 tenon.repo=$repo tenon.ci=${CI:-} tenon.cache=$cache" \
  -virtfs "local,path=/,mount_tag=hostroot,security_model=passthrough,readonly=on,multidevs=remap" \
  -virtfs "local,path=$io,mount_tag=io,security_model=passthrough" \
  -drive "file=$disk,format=raw,if=virtio,cache=unsafe" \
  -device virtio-rng-pci </dev/null
qrc=$?
set -e
if [ ! -f "$io/rc" ]; then
  echo "vm run: the guest did not report an exit code (qemu exited $qrc; timeout ${timeout_s}s)" >&2
  exit 1
fi
exit "$(cat "$io/rc")"
