#!/bin/bash
# PID 1 of the cgroup v2 test VM, started by the initramfs on the overlaid host root.
# Mounts a pure cgroup v2 hierarchy with every controller enabled for children, runs the
# command the host left in the shared io directory, writes its exit code there, powers off.
set -u
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
export TENON_IN_VM=1 PYTHONDONTWRITEBYTECODE=1
[ -n "${CI:-}" ] || CI="$(sed -n 's/.*tenon\.ci=\([^ ]*\).*/\1/p' /proc/cmdline)"; export CI
mount -t proc proc /proc
mount -t sysfs sysfs /sys
# /tmp stays the overlaid host /tmp (writes land in the overlay's tmpfs): the repository
# itself may live under the host's /tmp, as a CI clone does.
mount -t tmpfs -o mode=0755 tmpfs /run
mkdir -p /dev/pts /dev/shm /run/lock
mount -t devpts -o newinstance,ptmxmode=0666 devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t cgroup2 -o nsdelegate,memory_recursiveprot cgroup2 /sys/fs/cgroup
mount -t bpf bpf /sys/fs/bpf 2>/dev/null || true
mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null || true
for c in $(cat /sys/fs/cgroup/cgroup.controllers); do
  echo "+$c" >/sys/fs/cgroup/cgroup.subtree_control || echo "guest: cannot enable controller $c"
done
# the guest kernel's modules (from the build cache on the shared root), for modprobe; the
# cache's bpftool and libbpf headers, for the sched_ext gate
cache="$(sed -n 's/.*tenon\.cache=\([^ ]*\).*/\1/p' /proc/cmdline)"
export TENON_BPFTOOL="$cache/bpftool" TENON_BPF_INCLUDE="$cache/root/usr/include" TENON_BPF_CLANG=clang-16
modules="$cache/root/usr/lib/modules"
if [ -n "$cache" ] && [ -d "$modules/$(uname -r)" ]; then
  mkdir -p /lib/modules && mount --bind "$modules" /lib/modules
  modprobe loop && modprobe ext4 || echo "guest: cannot load loop or ext4"
fi
# /var/lib/tenon: the disk run.sh made (ext4, with the image store); TMPDIR on it too, so
# the tests' own directories allow the idmapped mounts sandboxes need
modprobe virtio_blk 2>/dev/null || true
for _ in $(seq 50); do [ -b /dev/vda ] && break; sleep 0.1; done
mkdir -p /var/lib/tenon
if [ -b /dev/vda ] && mount -t ext4 /dev/vda /var/lib/tenon; then
  mkdir -p /var/lib/tenon/tmp && chmod 1777 /var/lib/tenon/tmp
  export TMPDIR=/var/lib/tenon/tmp
else
  echo "guest: no disk for /var/lib/tenon; sandboxes will not start"
fi
hostname tenon-vm
ip link set lo up 2>/dev/null || true
mkdir -p /mnt/io
mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288 io /mnt/io
echo "guest: kernel $(uname -r), cgroup controllers: $(cat /sys/fs/cgroup/cgroup.subtree_control)"
repo="$(sed -n 's/.*tenon\.repo=\([^ ]*\).*/\1/p' /proc/cmdline)"
cd "$repo"
bash /mnt/io/command </dev/null
rc=$?
dmesg >/mnt/io/dmesg.log 2>/dev/null  # the kernel's log (OOM kills, sched_ext) comes back
echo "$rc" >/mnt/io/rc.tmp && mv /mnt/io/rc.tmp /mnt/io/rc
sync
umount /mnt/io 2>/dev/null
echo o >/proc/sysrq-trigger
{ sleep 10; } 2>/dev/null  # until the power-off completes
