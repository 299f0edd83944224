"""Per-agent ext4 images: limits, mountinfo parsing, and real create/mount/unmount."""

from __future__ import annotations

import errno
import os
import subprocess
import time
from pathlib import Path

import pytest

from tenon.errors import ConfigError, HostError
from tenon.host import diskfs
from tenon.host.diskfs import DiskLimits, DiskUsage
from tenon.units import GIB, MIB

SMALL = DiskLimits(disk_bytes=64 * MIB, max_inodes=1024)


def make_usage(**overrides: int) -> DiskUsage:
    fields = {"used_bytes": MIB, "capacity_bytes": 60 * MIB, "free_bytes": 59 * MIB,
              "used_inodes": 11, "max_inodes": 1024, "free_inodes": 1013}
    return DiskUsage(**{**fields, **overrides})


# -- limits and usage (no root) ------------------------------------------------------------


def test_default_limits_are_four_gib_and_262144_inodes():
    assert DiskLimits() == DiskLimits(disk_bytes=4 * GIB, max_inodes=262144)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"disk_bytes": 1 * MIB}, "disk_bytes 1048576 is outside"),
        ({"disk_bytes": 64 * 1024 * GIB}, "disk_bytes"),
        ({"max_inodes": 10}, "max_inodes 10 is outside"),
        ({"disk_bytes": 64 * MIB, "max_inodes": 64 * MIB // 4096 + 1}, "at most one per 4096"),
        ({"disk_bytes": True}, "disk_bytes must be an integer"),
        ({"max_inodes": 1.5}, "max_inodes must be an integer"),
    ],
)
def test_limits_out_of_bounds_fail_with_one_line_naming_the_field(fields, named):
    with pytest.raises(ConfigError, match=named) as info:
        DiskLimits(**fields)
    assert "\n" not in str(info.value)


def test_config_overrides_limits_and_accepts_size_strings():
    base = DiskLimits()
    assert base.with_config({}) == base
    assert base.with_config({"disk_bytes": "2GiB"}).disk_bytes == 2 * GIB
    assert base.with_config({"max_inodes": 4096}) == DiskLimits(max_inodes=4096)
    with pytest.raises(ConfigError, match="disk_bytes"):
        base.with_config({"disk_bytes": "lots"})


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        (make_usage(), None),
        (make_usage(free_bytes=512 * 1024), "disk limit reached"),
        (make_usage(free_bytes=2 * MIB), None),
        (make_usage(free_inodes=11), None),
        (make_usage(free_inodes=0, used_inodes=1024), "inode limit reached (1024 of 1024"),
    ],
)
def test_full_reason_names_the_limit_reached(usage, expected):
    reason = usage.full_reason()
    if expected is None:
        assert reason is None
    else:
        assert expected in reason


def test_mountinfo_parsing_unescapes_paths_and_keeps_stacking_order(tmp_path):
    info = tmp_path / "mountinfo"
    info.write_text(
        "22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
        "40 22 7:3 / /srv/with\\040space rw,nodev - ext4 /dev/loop3 rw\n"
        "41 40 7:4 / /srv/with\\040space rw,nodev shared:9 master:2 - ext4 /dev/loop4 rw\n"
    )
    found = diskfs.mounts(info)
    assert [m.mount_point for m in found] == [
        Path("/"), Path("/srv/with space"), Path("/srv/with space")]
    assert [m.source for m in found] == ["/dev/vda", "/dev/loop3", "/dev/loop4"]


# -- real images (root, loop devices) ----------------------------------------------------------


def _loops_under(directory: Path) -> dict[str, Path]:
    return {dev: f for dev, f in diskfs.loop_devices().items() if directory in f.parents}


def _mounts_under(directory: Path) -> list[Path]:
    return [m.mount_point for m in diskfs.mounts() if directory in m.mount_point.parents]


def assert_nothing_left(directory: Path) -> None:
    """No mount below `directory` and, once the kernel's autoclear has run (it may lag the
    unmount by a moment), no loop device backed by a file below it."""
    assert _mounts_under(directory) == []
    deadline = time.monotonic() + 10.0
    while _loops_under(directory) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _loops_under(directory) == {}


@pytest.fixture
def area(tmp_path):
    if problems := diskfs.check():
        pytest.skip("; ".join(problems))
    yield tmp_path
    for point in reversed(_mounts_under(tmp_path)):
        subprocess.run(["umount", "--lazy", str(point)], check=False)
    assert_nothing_left(tmp_path)


def make_mounted(area: Path, name: str = "a1", limits: DiskLimits = SMALL) -> tuple[Path, Path]:
    image, point = area / f"{name}.ext4", area / name
    point.mkdir()
    diskfs.create_image(image, limits)
    diskfs.mount(image, point)
    return image, point


@pytest.mark.disk
def test_image_is_sparse_mounted_with_its_limits_and_unmounted_without_trace(area):
    image, point = make_mounted(area)
    assert image.stat().st_size == SMALL.disk_bytes
    assert image.stat().st_blocks * 512 < SMALL.disk_bytes // 4  # sparse: metadata only
    mounted = diskfs.mounted_at(point)
    assert mounted is not None
    assert mounted.backing_file == image
    assert {"nodev", "nosuid"} <= set(_options_of(point))
    used = diskfs.usage(point)
    assert used.max_inodes == SMALL.max_inodes
    assert SMALL.disk_bytes * 0.8 < used.capacity_bytes <= SMALL.disk_bytes
    assert used.full_reason() is None
    diskfs.mount(image, point)  # idempotent: no second, stacked mount
    assert len([m for m in diskfs.mounts() if m.mount_point == point]) == 1
    diskfs.unmount(point)
    assert diskfs.mounted_at(point) is None
    assert_nothing_left(area)
    with pytest.raises(HostError, match="not a mount point"):
        diskfs.usage(point)


@pytest.mark.disk
def test_create_image_refuses_to_replace_an_existing_image(area):
    image = area / "a1.ext4"
    diskfs.create_image(image, SMALL)
    before = image.stat().st_ino
    with pytest.raises(HostError, match="already exists"):
        diskfs.create_image(image, SMALL)
    assert image.stat().st_ino == before
    assert not (area / "a1.ext4.partial").exists()


@pytest.mark.disk
def test_mount_refuses_another_image_on_a_taken_mount_point(area):
    _, point = make_mounted(area)
    other = area / "b1.ext4"
    diskfs.create_image(other, SMALL)
    with pytest.raises(HostError, match="already has /dev/loop"):
        diskfs.mount(other, point)
    diskfs.unmount(point)


@pytest.mark.disk
def test_writes_past_the_limits_fail_with_enospc_inside_the_image(area):
    _, point = make_mounted(area, limits=DiskLimits(disk_bytes=32 * MIB, max_inodes=128))
    with pytest.raises(OSError, match="No space left") as info:
        write_mib(point / "fill", 64)
    assert info.value.errno == errno.ENOSPC
    assert diskfs.usage(point).at_byte_limit
    (point / "fill").unlink()
    made = 0
    with pytest.raises(OSError, match="No space left"):  # noqa: PT012 - an inode flood
        for made in range(1000):  # noqa: B007 - `made` is read after the loop
            (point / f"f{made}").touch()
    assert made < 128
    assert diskfs.usage(point).at_inode_limit
    assert "inode limit reached" in (diskfs.usage(point).full_reason() or "")
    diskfs.unmount(point)


@pytest.mark.disk
def test_detach_loops_frees_a_device_left_attached_without_a_mount(area):
    image = area / "a1.ext4"
    diskfs.create_image(image, SMALL)
    # What a crash between attaching and mounting leaves.
    subprocess.run(["losetup", "--find", str(image)], check=True)
    assert len(_loops_under(area)) == 1
    assert diskfs.detach_loops(image) == 1
    assert_nothing_left(area)


@pytest.mark.disk
def test_detaching_a_device_the_kernel_already_freed_is_not_a_failure(area):
    image = area / "a1.ext4"
    diskfs.create_image(image, SMALL)
    device = subprocess.run(["losetup", "--find", "--show", str(image)], check=True,
                            capture_output=True, text=True).stdout.strip()
    assert diskfs.detach(device)
    assert not diskfs.detach(device)  # freed meanwhile (autoclear after the last umount)
    with pytest.raises(HostError, match="detaching /dev/no-such-loop"):
        diskfs.detach("/dev/no-such-loop")
    assert_nothing_left(area)


@pytest.mark.disk
def test_unmount_removes_stacked_mounts_and_detaches_a_busy_one_lazily(area):
    image, point = make_mounted(area)
    second = area / "b1.ext4"
    diskfs.create_image(second, SMALL)
    # A second filesystem stacked on the same point (mount(8) by hand would do this).
    device = subprocess.run(["losetup", "--find", "--show", str(second)], check=True,
                            capture_output=True, text=True).stdout.strip()
    subprocess.run(["mount", device, str(point)], check=True)
    subprocess.run(["losetup", "-d", device], check=True)
    holder = subprocess.Popen(["sleep", "60"], cwd=point)  # keeps the top mount busy
    try:
        diskfs.unmount(point)
        assert diskfs.mounted_at(point) is None
    finally:
        holder.kill()
        holder.wait()
    assert_nothing_left(area)


def write_mib(path: Path, num_mib: int) -> None:
    with path.open("wb") as f:
        for _ in range(num_mib):
            f.write(b"\0" * MIB)
            f.flush()
            os.fsync(f.fileno())


def _options_of(point: Path) -> list[str]:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == str(point):
            return fields[5].split(",")
    return []
