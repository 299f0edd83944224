"""What a container may have written outside its persistent and disposable directories,
read from the host: its mount table and its overlay upper directory."""

from __future__ import annotations

import os
from pathlib import Path

from tenon.host import procfs
from tenon.sandbox.base import PERSISTENT_MOUNTS

# Mount points runc creates in the writable layer; they and their parent dirs are no action's.
MOUNT_POINTS = (*PERSISTENT_MOUNTS.values(), "/sbin/docker-init", "/usr/sbin/docker-init")
# Writable mounts besides the persistent and disposable ones. `nsinspect` lists what is in
# these two; the others cannot carry an action's state: /dev and /sys/fs/cgroup are tmpfs
# that only root may write (checked each time: the sandbox's uid is not root and holds no
# capability), /dev/pts holds the ptys of live processes only, /proc is not files.
_INSPECTED_MOUNTS = ("/dev/shm", "/dev/mqueue")
_ROOT_ONLY_MOUNTS = ("/dev", "/sys/fs/cgroup")
_STATELESS_MOUNTS = ("/proc", "/dev/pts")


def walk_upper(upper: Path) -> list[tuple[str, bool]]:
    """(path, is a directory) for every entry of an overlay upper dir (whiteouts included)."""
    found = []
    for root, dirs, files in os.walk(upper):
        base = "/" + Path(root).relative_to(upper).as_posix().removeprefix(".")
        found += [(f"{base.rstrip('/')}/{name}", True) for name in dirs]
        found += [(f"{base.rstrip('/')}/{name}", False) for name in files]
    return found


def unexpected_writable_mounts(pid: int, disposable: tuple[str, ...]) -> list[str]:
    """Writable mounts in `pid`'s mount namespace that may hold an action's state and that
    `leftover_state` does not inspect."""
    inspected = (*PERSISTENT_MOUNTS.values(), *disposable, *_INSPECTED_MOUNTS)
    unexpected = []
    for mount in procfs.mount_table(pid):
        mount_point = mount.mount_point
        if not mount.writable or mount_point in inspected or mount_point in _STATELESS_MOUNTS:
            continue
        if mount_point.startswith("/proc/") and (mount.fs_type == "proc"
                                                 or mount.root == "/null"):
            continue  # a /proc entry, or one Docker masks with a bind of /dev/null
        if mount_point in _ROOT_ONLY_MOUNTS:
            st = procfs.stat_in_root(pid, mount_point)
            if st.st_uid == 0 and not st.st_mode & 0o022:
                continue
        unexpected.append(mount_point)
    return unexpected


def written_paths(changed: list[tuple[str, bool]], disposable: tuple[str, ...]) -> list[str]:
    """The paths among `changed` ((path, is a directory) from `walk_upper` or `docker diff`)
    that are an action's writes: not a mount point, its parent, or inside a mount."""
    mounts = (*MOUNT_POINTS, *disposable)
    return sorted(path for path, is_dir in changed if not _untracked(path, is_dir, mounts))


def _untracked(path: str, is_dir: bool, mounts: tuple[str, ...]) -> bool:
    if any(path == p or path.startswith(p + "/") for p in mounts):
        return True
    # A copied-up parent of a mount point; writes inside it show up as their own paths.
    return is_dir and any(m.startswith(path + "/") for m in mounts)
