"""Per-agent filesystems: a sparse ext4 image loop-mounted on the agent's persistent root.

Each image has a fixed byte size and inode count (`DiskLimits`), so an agent that fills its
persistent root gets ENOSPC inside its own filesystem, never on the host's disk, the
recovery store or another agent's root. The image is sparse: it takes host disk only for
what the agent writes (the `discard` mount option hands deleted blocks back), so the sum of
the limits may exceed the host disk; the limit bounds one agent, not all of them together.

Choices, and why:
- `mkfs.ext4 -m 0`: no blocks reserved for root (the sandbox is never host root anyway);
  lazy inode-table and journal init, and the mount option `noinit_itable`, so neither mkfs
  nor the kernel zeroes a fresh, all-zero sparse file (which would also un-sparse it).
- The loop device uses direct I/O: without it every page the agent writes would be cached
  twice, in the image's filesystem and in the host's cache of the image file, on a host
  whose scarce resource is memory. fsync inside the image still reaches the host disk (the
  loop driver turns the flush into an fsync of the backing file).
- The loop device is detached right after mounting: the kernel then sets autoclear and
  frees it when the last mount of the filesystem goes, including copies held by sandbox
  mount namespaces that outlive the host mount by a moment.
- Mounted `nodev,nosuid`: a device node or setuid binary written by an agent is inert.

Only `host/` touches mounts; `state/workspace.py` decides which agent gets what.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from tenon.errors import ConfigError, HostError
from tenon.units import GIB, MIB, parse_size

logger = logging.getLogger(__name__)

DEFAULT_DISK_BYTES = 4 * GIB
DEFAULT_MAX_INODES = 262144
MIN_DISK_BYTES = 32 * MIB  # below this the journal and metadata leave little room for files
MAX_DISK_BYTES = 16 * 1024 * GIB
MIN_INODES = 64
BLOCK_BYTES = 4096
# Inodes cost 256 bytes of inode table each, allocated up front: at most one per block.
_BYTES_PER_INODE_MIN = BLOCK_BYTES
# A filesystem with less than this free counts as at its limit: a write refused with ENOSPC
# leaves the blocks that did not fit what it asked for (hundreds of KiB measured), and a
# program that failed to write a few MiB more deserves the same explanation.
FULL_SLACK_BYTES = 1 * MIB
FULL_SLACK_FRACTION = 0.01  # of the capacity, bytes and inodes alike, when that is larger
# noatime: a read must not dirty an inode, or every teardown's syncfs commits a journal.
MOUNT_OPTIONS = "nodev,nosuid,noatime,noinit_itable,discard,errors=remount-ro"
_TOOLS = {"mkfs.ext4": "e2fsprogs", "losetup": "mount", "mount": "mount", "umount": "mount"}
_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class DiskLimits:
    """The size of one agent's persistent filesystem."""

    disk_bytes: int = DEFAULT_DISK_BYTES
    """Size of the image: everything under the persistent root shares it (metadata too)."""
    max_inodes: int = DEFAULT_MAX_INODES
    """Files, directories and symlinks the persistent root can hold, in all."""

    CONFIG_KEYS: ClassVar[tuple[str, ...]] = ("disk_bytes", "max_inodes")

    def __post_init__(self) -> None:
        for key in self.CONFIG_KEYS:
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"{key} must be an integer, got {value!r}")
        if not MIN_DISK_BYTES <= self.disk_bytes <= MAX_DISK_BYTES:
            raise ConfigError(
                f"disk_bytes {self.disk_bytes} is outside [{MIN_DISK_BYTES}, {MAX_DISK_BYTES}]")
        most_inodes = self.disk_bytes // _BYTES_PER_INODE_MIN
        if not MIN_INODES <= self.max_inodes <= most_inodes:
            raise ConfigError(
                f"max_inodes {self.max_inodes} is outside [{MIN_INODES}, {most_inodes}] "
                f"(at most one per {_BYTES_PER_INODE_MIN} bytes of disk_bytes)")

    def with_config(self, config: Mapping[str, Any]) -> DiskLimits:
        """These limits with `disk_bytes` / `max_inodes` from a sandbox config, if set there
        (`disk_bytes` may be a size string such as "2GiB")."""
        disk = config.get("disk_bytes", self.disk_bytes)
        if isinstance(disk, str):
            disk = parse_size(disk, what="disk_bytes")
        return DiskLimits(disk_bytes=disk, max_inodes=config.get("max_inodes", self.max_inodes))


@dataclass(frozen=True)
class DiskUsage:
    """What a mounted persistent filesystem holds, as statvfs reports it."""

    used_bytes: int
    capacity_bytes: int  # the image size less ext4's metadata and journal
    free_bytes: int
    used_inodes: int
    max_inodes: int
    free_inodes: int

    @property
    def at_byte_limit(self) -> bool:
        return self.free_bytes < max(FULL_SLACK_BYTES, self.capacity_bytes * FULL_SLACK_FRACTION)

    @property
    def at_inode_limit(self) -> bool:
        return self.free_inodes < max(1, self.max_inodes * FULL_SLACK_FRACTION)

    def full_reason(self) -> str | None:
        """Why writes fail here, or None while neither limit is reached."""
        reasons = []
        if self.at_byte_limit:
            reasons.append(f"disk limit reached ({self.used_bytes} of {self.capacity_bytes} "
                           f"bytes used, {self.free_bytes} free)")
        if self.at_inode_limit:
            reasons.append(f"inode limit reached ({self.used_inodes} of {self.max_inodes} "
                           f"files and directories)")
        return "; ".join(reasons) or None


@dataclass(frozen=True)
class MountedImage:
    """A filesystem mounted at `mount_point`, and the image file behind its loop device."""

    mount_point: Path
    source: str
    backing_file: Path | None  # None when the source is not a loop device (or is gone)


def check() -> list[str]:
    """What is missing to create and mount images, each with its fix."""
    problems = [f"{tool} is missing; run: apt-get install {package}"
                for tool, package in _TOOLS.items() if shutil.which(tool) is None]
    if not Path("/dev/loop-control").exists():
        problems.append("/dev/loop-control is missing; run: modprobe loop")
    if os.geteuid() != 0:
        problems.append("mounting workspace images needs root")
    return problems


def _run(argv: list[str], what: str) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, env=_ENV, check=False)
    except OSError as exc:
        raise HostError(f"{what}: cannot run {argv[0]}: {exc}") from exc
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip().replace("\n", "; ")
        raise HostError(f"{what}: {' '.join(argv)} exited {done.returncode}: {detail}")
    return done.stdout


def create_image(image: Path, limits: DiskLimits) -> None:
    """Make `image` a fresh, sparse ext4 filesystem of `limits` (never overwrites one).

    mkfs works on a temporary name that is renamed into place only when complete, so a
    crash leaves either no image or a whole one (and perhaps a `*.partial` to remove).
    """
    partial = image.with_name(image.name + ".partial")
    with contextlib.suppress(FileNotFoundError):
        partial.unlink()
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, limits.disk_bytes)
        finally:
            os.close(fd)
        _run(["mkfs.ext4", "-q", "-F", "-b", str(BLOCK_BYTES), "-N", str(limits.max_inodes),
              "-m", "0", "-E", "lazy_itable_init=1,lazy_journal_init=1,root_owner=0:0",
              str(partial)], f"creating {image}")
        _fsync(partial)
        if image.exists():
            raise HostError(f"image {image} already exists; refusing to replace it")
        os.rename(partial, image)
        _fsync(image.parent, directory=True)
    except BaseException:
        with contextlib.suppress(OSError):
            partial.unlink()
        raise


def mount(image: Path, mount_point: Path) -> None:
    """Mount `image` at `mount_point` (an existing directory); a no-op if it already is."""
    current = mounted_at(mount_point)
    if current is not None:
        if current.backing_file is not None and _same_file(current.backing_file, image):
            return
        raise HostError(f"{mount_point} already has {current.source} mounted, not {image}")
    if not image.is_file():
        raise HostError(f"image {image} does not exist")
    device = _run(["losetup", "--find", "--show", "--direct-io=on", str(image)],
                  f"attaching {image}").strip()
    try:
        _run(["mount", "-t", "ext4", "-o", MOUNT_OPTIONS, device, str(mount_point)],
             f"mounting {image} at {mount_point}")
    finally:
        # Mounted: the kernel only sets autoclear and frees the device with the last mount.
        # Not mounted: this detaches it now.
        with contextlib.suppress(HostError):
            _run(["losetup", "-d", device], f"detaching {device}")
    logger.debug("mounted %s at %s via %s", image, mount_point, device)


def unmount(mount_point: Path) -> None:
    """Unmount every filesystem stacked on `mount_point` (a no-op when none is).

    A mount a host process still uses (its cwd, an open file) is detached lazily: it leaves
    the host's namespace now and the kernel frees it when the last user lets go.
    """
    while mounted_at(mount_point) is not None:
        try:
            _run(["umount", str(mount_point)], f"unmounting {mount_point}")
        except HostError as exc:
            logger.warning("%s; detaching it lazily", exc)
            _run(["umount", "--lazy", str(mount_point)], f"unmounting {mount_point}")


_LIBC = ctypes.CDLL(None, use_errno=True)


def sync(mount_point: Path) -> None:
    """Make everything on the filesystem at `mount_point` durable at once (syncfs(2): its
    data, metadata and journal, then a flush through the loop device to the image file).
    Called directly: a `sync --file-system` process per teardown costs a fork and exec."""
    try:
        fd = os.open(mount_point, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise HostError(f"syncing {mount_point}: {exc}") from exc
    try:
        if _LIBC.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise HostError(f"syncing {mount_point}: {os.strerror(err)}")
    finally:
        os.close(fd)


def written_kib(mount_point: Path) -> int | None:
    """What the ext4 filesystem at `mount_point` has written to its device in its life, in
    KiB (`/sys/fs/ext4/<device>/lifetime_write_kbytes`: every data, metadata and journal
    write counts, down to a sector), or None when the kernel does not tell. Read after a
    sync(), an unchanged value proves nothing was written since the last reading."""
    try:
        dev = os.stat(mount_point).st_dev
        name = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve().name
        return int(Path(f"/sys/fs/ext4/{name}/lifetime_write_kbytes").read_text())
    except (OSError, ValueError):
        return None


def detach_loops(image: Path) -> int:
    """Detach loop devices still attached to `image` (left by a crash between attach and
    mount); return how many. A device whose filesystem is still mounted is only marked
    autoclear."""
    if not image.exists():
        return 0
    listing = _run(["losetup", "--noheadings", "--output", "NAME", "--associated", str(image)],
                   f"listing loop devices of {image}")
    devices = [line.strip() for line in listing.splitlines() if line.strip()]
    return sum(detach(device) for device in devices)


def detach(device: str) -> bool:
    """Detach one loop device; False when it was already gone. The kernel frees an
    autoclear device when its last mount goes, asynchronously: one listed a moment ago
    may be free by now, and that is not a failure."""
    try:
        _run(["losetup", "-d", device], f"detaching {device}")
    except HostError as exc:
        if "No such device or address" in str(exc):
            return False
        raise
    return True


def usage(mount_point: Path) -> DiskUsage:
    """Bytes and inodes used and free on the filesystem mounted at `mount_point`."""
    if not os.path.ismount(mount_point):
        raise HostError(f"{mount_point} is not a mount point")
    st = os.statvfs(mount_point)
    return DiskUsage(
        used_bytes=(st.f_blocks - st.f_bfree) * st.f_frsize,
        capacity_bytes=st.f_blocks * st.f_frsize,
        free_bytes=st.f_bavail * st.f_frsize,
        used_inodes=st.f_files - st.f_ffree,
        max_inodes=st.f_files,
        free_inodes=st.f_favail,
    )


def mounts(mountinfo: Path = Path("/proc/self/mountinfo")) -> list[MountedImage]:
    """Every mount in this mount namespace, in mount order (a stacked mount comes later)."""
    found = []
    for line in mountinfo.read_text().splitlines():
        fields = line.split()
        try:
            separator = fields.index("-", 6)
        except ValueError:
            continue
        point = Path(_unescape(fields[4]))
        source = _unescape(fields[separator + 2])
        found.append(MountedImage(point, source, _backing_file(source)))
    return found


def mounted_at(mount_point: Path) -> MountedImage | None:
    """The topmost mount at `mount_point`, or None."""
    target = Path(os.path.realpath(mount_point))
    on_it = [m for m in mounts() if m.mount_point == target]
    return on_it[-1] if on_it else None


def mounts_under(directory: Path) -> list[MountedImage]:
    """Mounts whose mount point is an immediate child of `directory`."""
    parent = Path(os.path.realpath(directory))
    return [m for m in mounts() if m.mount_point.parent == parent]


def loop_devices() -> dict[str, Path]:
    """Every attached loop device (e.g. "/dev/loop3") and its backing file."""
    found = {}
    for device in sorted(Path("/sys/block").glob("loop*")):
        backing = _backing_file(f"/dev/{device.name}")
        if backing is not None:
            found[f"/dev/{device.name}"] = backing
    return found


def _backing_file(source: str) -> Path | None:
    if not source.startswith("/dev/loop"):
        return None
    try:
        text = Path(f"/sys/block/{Path(source).name}/loop/backing_file").read_text().strip()
    except OSError:
        return None
    return Path(text.removesuffix(" (deleted)"))


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _unescape(text: str) -> str:
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), text)


def _fsync(path: Path, *, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
