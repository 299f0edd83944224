"""Linux host access: the only layer that touches /sys/fs/cgroup and /proc."""
