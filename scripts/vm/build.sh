#!/usr/bin/env bash
# Builds (once, then cached) what the cgroup v2 test VM boots:
#  - a kernel with sched_ext from Debian's unstable suite (apt-get download, never installed on the host),
#  - a busybox initramfs that mounts the host's root read-only over 9p under a tmpfs overlay,
#  - bpftool and libbpf's headers from the same suite (bpftool runs with its own libraries),
#  - vmlinux.h from the kernel's BTF and the sched_ext gate's BPF object (with the repository's
#    .venv, when it exists).
# The guest's root is this machine's own root, so the guest runs the repository's .venv as it is.
# Usage: scripts/vm/build.sh   (prints the cache directory; TENON_VM_CACHE overrides it)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cache="${TENON_VM_CACHE:-/var/cache/tenon/vm}"
log() { printf '\033[1m[vm build]\033[0m %s\n' "$*" >&2; }

if [ "$(id -u)" -ne 0 ]; then echo "vm build: must run as root" >&2; exit 1; fi

need=()
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
[ -x /bin/busybox ] && busybox --list 2>/dev/null | grep -qx switch_root || need+=(busybox-static)
command -v clang-16 >/dev/null || need+=(clang-16)
command -v xz >/dev/null || need+=(xz-utils)
command -v cpio >/dev/null || need+=(cpio)
command -v depmod >/dev/null || need+=(kmod)
command -v zstd >/dev/null || need+=(zstd)
if [ "${#need[@]}" -gt 0 ]; then
  log "installing Debian packages: ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

mkdir -p "$cache/apt/lists/partial" "$cache/apt/cache/archives/partial" "$cache/debs"
apt_opts=(-o "Dir::Etc::SourceList=$cache/apt/sources.list" -o "Dir::Etc::SourceParts=$cache/apt/none"
  -o "Dir::State::Lists=$cache/apt/lists" -o "Dir::Cache=$cache/apt/cache"
  -o "Dir::State::status=$cache/apt/status" -o Debug::NoLocking=1 -o APT::Sandbox::User=root)
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian unstable main" \
  >"$cache/apt/sources.list"
touch "$cache/apt/status"

if [ ! -f "$cache/kernel.version" ]; then
  log "fetching the package lists of Debian unstable"
  apt-get "${apt_opts[@]}" update -qq
  # The kernel the BPF gate was written and measured against, while unstable still has it;
  # else unstable's current one (TENON_VM_KERNEL names another).
  kver="${TENON_VM_KERNEL:-7.2.13+deb14-amd64}"
  if ! apt-cache "${apt_opts[@]}" show "linux-binary-$kver" >/dev/null 2>&1; then
    kver="$(apt-cache "${apt_opts[@]}" depends linux-image-amd64 | sed -n 's/.*Depends: linux-image-\(.*\)-amd64$/\1/p' | head -1)"
    [ -n "$kver" ] || { echo "vm build: no linux-image-amd64 in Debian unstable" >&2; exit 1; }
    kver="$kver-amd64"
  fi
  log "downloading kernel $kver, bpftool and libbpf headers"
  (cd "$cache/debs" && apt-get "${apt_opts[@]}" download -q "linux-binary-$kver" "linux-modules-$kver" \
    bpftool libbpf-dev libc6 libcap2 libelf1t64 libssl3t64 zlib1g libzstd1 >/dev/null)
  rm -rf "$cache/root" && mkdir -p "$cache/root"
  for deb in "$cache"/debs/*.deb; do dpkg-deb -x "$deb" "$cache/root"; done
  echo "$kver" >"$cache/kernel.version"
fi
kver="$(cat "$cache/kernel.version")"
moddir="$cache/root/usr/lib/modules/$kver"
cp "$moddir/vmlinuz" "$cache/vmlinuz"
# modules.dep for the guest's modprobe (loop, ext4, veth...): the guest mounts this tree.
[ -f "$moddir/modules.dep" ] || depmod -b "$cache/root/usr" "$kver"

# bpftool from unstable runs through unstable's own dynamic loader and libraries.
cat >"$cache/bpftool" <<WRAP
#!/bin/sh
exec "$cache/root/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" --library-path "$cache/root/usr/lib/x86_64-linux-gnu" "$cache/root/usr/sbin/bpftool" "\$@"
WRAP
chmod +x "$cache/bpftool"

# vmlinux.h from the guest kernel's BTF (the ELF inside the bzImage, zstd-compressed), and the
# sched_ext gate's BPF object built for that kernel: dumping the BTF inside the emulated guest
# takes minutes, here a fraction of a second.
if [ ! -s "$cache/vmlinux.h" ]; then
  log "dumping the guest kernel's BTF to vmlinux.h"
  off="$(grep -abo "$(printf '\x28\xb5\x2f\xfd')" "$cache/vmlinuz" | head -1 | cut -d: -f1)"
  [ -n "$off" ] || { echo "vm build: no zstd payload in $cache/vmlinuz" >&2; exit 1; }
  tail -c +"$((off + 1))" "$cache/vmlinuz" | zstd -dcq 2>/dev/null >"$cache/vmlinux" || true
  "$cache/bpftool" btf dump file "$cache/vmlinux" format c >"$cache/vmlinux.h.tmp"
  mv "$cache/vmlinux.h.tmp" "$cache/vmlinux.h"
  rm -f "$cache/vmlinux"
fi
if [ -x "$repo/.venv/bin/python" ]; then
  TENON_BPFTOOL="$cache/bpftool" TENON_BPF_CLANG=clang-16 TENON_BPF_INCLUDE="$cache/root/usr/include" \
    "$repo/.venv/bin/python" -m tenon.host.scx build --release "$kver" --vmlinux-h "$cache/vmlinux.h" >/dev/null
fi

# The initramfs: busybox, the modules for a 9p root with an overlay, and an init that hands over
# to the repository's guest init on the shared root.
if [ ! -f "$cache/initrd.img" ] || [ "$here/build.sh" -nt "$cache/initrd.img" ]; then
  log "building the initramfs"
  ird="$(mktemp -d)"
  trap 'rm -rf "$ird"' EXIT
  mkdir -p "$ird"/{bin,dev,proc,sys,lower,rw,newroot,modules}
  cp /bin/busybox "$ird/bin/busybox"
  for m in fs/netfs/netfs net/9p/9pnet net/9p/9pnet_virtio fs/9p/9p fs/overlayfs/overlay; do
    xz -dc "$moddir/kernel/$m.ko.xz" >"$ird/modules/$(basename "$m").ko"
  done
  cat >"$ird/init" <<'INIT'
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in netfs 9pnet 9pnet_virtio 9p overlay; do insmod /modules/$m.ko || echo "initramfs: insmod $m failed"; done
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=524288,cache=loose hostroot /lower || { echo "initramfs: no host root"; poweroff -f; }
mount -t tmpfs -o mode=0755 rw /rw
mkdir -p /rw/upper /rw/work
mount -t overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work root /newroot || { echo "initramfs: overlay failed"; poweroff -f; }
repo="$(sed -n 's/.*tenon\.repo=\([^ ]*\).*/\1/p' /proc/cmdline)"
umount /proc /sys
mount --move /dev /newroot/dev
exec switch_root /newroot /bin/bash "$repo/scripts/vm/guest-init.sh"
INIT
  chmod +x "$ird/init"
  (cd "$ird" && find . | cpio -o -H newc --quiet | gzip -1) >"$cache/initrd.img.tmp"
  mv "$cache/initrd.img.tmp" "$cache/initrd.img"
fi
echo "$cache"
