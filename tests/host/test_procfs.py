"""host.procfs against this test's own process, a child in namespaces of its own, and a
scripted /proc directory for the lines a live host does not show on demand."""

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tenon.errors import HostError
from tenon.host.domain import remove_empty_domain_dirs
from tenon.host.procfs import (
    Mount,
    cgroups_of,
    max_user_namespaces,
    mount_table,
    namespace_id,
    open_namespace,
    shares_namespace,
    stat_in_root,
)

GONE_PID = 2**31 - 1  # above any pid_max


def scripted_proc(tmp_path: Path, pid: int, **files: str) -> Path:
    """A directory laid out as /proc with `files` (name -> text) under `<pid>/`."""
    root = tmp_path / "proc"
    (root / str(pid)).mkdir(parents=True)
    for name, text in files.items():
        (root / str(pid) / name).write_text(text)
    return root


def test_mount_table_of_this_process_has_its_root_and_proc():
    table = mount_table(os.getpid())
    assert table == mount_table("self")
    by_point = {m.mount_point: m for m in table}
    assert "/" in by_point
    assert by_point["/proc"].fs_type == "proc"


def test_mount_table_parses_each_field_of_a_scripted_mountinfo(tmp_path):
    mountinfo = (
        "22 1 0:21 / / ro,relatime shared:1 - overlay overlay rw,lowerdir=/l\n"
        "23 22 0:22 / /workspace rw,nosuid - ext4 /dev/loop3 rw\n"
        "24 22 0:5 /null /proc/kcore rw,nosuid master:2 - devtmpfs udev rw,size=1k\n"
    )
    root = scripted_proc(tmp_path, 42, mountinfo=mountinfo)
    assert mount_table(42, root) == [
        Mount("/", writable=False, fs_type="overlay", root="/"),
        Mount("/workspace", writable=True, fs_type="ext4", root="/"),
        Mount("/proc/kcore", writable=True, fs_type="devtmpfs", root="/null"),
    ]


def test_mount_table_refuses_a_malformed_line_and_a_gone_process(tmp_path):
    root = scripted_proc(tmp_path, 42, mountinfo="22 1 0:21 / / rw no separator\n")
    with pytest.raises(HostError, match="malformed"):
        mount_table(42, root)
    with pytest.raises(HostError):
        mount_table(GONE_PID)


@pytest.fixture
def own_namespaces_child():
    """A child process in a network and mount namespace of its own (needs root)."""
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        pytest.skip("needs unshare(1) and root")
    proc = subprocess.Popen([unshare, "--net", "--mount", "sleep", "30"])
    try:
        deadline = time.monotonic() + 5
        while namespace_id(proc.pid, "net") == namespace_id("self", "net"):
            assert time.monotonic() < deadline, "the child never entered its namespaces"
            time.sleep(0.01)
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_namespace_identity_tells_own_namespaces_from_shared_ones(own_namespaces_child):
    pid = own_namespaces_child
    assert namespace_id(os.getpid(), "net") == os.readlink("/proc/self/ns/net")
    assert namespace_id(pid, "net").startswith("net:[")
    assert shares_namespace(os.getpid(), "mnt")
    assert not shares_namespace(pid, "net")
    assert not shares_namespace(pid, "mnt")
    assert shares_namespace(pid, "ipc")  # unshare left it in ours


def test_open_namespace_opens_that_process_namespace(own_namespaces_child):
    fd = open_namespace(own_namespaces_child, "net")
    try:
        opened = os.fstat(fd)
        assert (opened.st_dev, opened.st_ino) != (
            os.stat("/proc/self/ns/net").st_dev,
            os.stat("/proc/self/ns/net").st_ino,
        )
        target = os.stat(f"/proc/{own_namespaces_child}/ns/net")
        assert (opened.st_dev, opened.st_ino) == (target.st_dev, target.st_ino)
    finally:
        os.close(fd)
    with pytest.raises(ValueError, match="unknown namespace kind"):
        open_namespace(os.getpid(), "nett")
    with pytest.raises(HostError):
        open_namespace(GONE_PID, "net")


def test_cgroups_of_this_process_match_its_proc_entry():
    expected = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        expected.append((tuple(c for c in controllers.split(",") if c), path))
    assert cgroups_of(os.getpid()) == expected


def test_cgroups_of_splits_controllers_and_keeps_colons_in_paths(tmp_path):
    root = scripted_proc(tmp_path, 7, cgroup="4:memory:/tenon/abc\n3:cpu,cpuacct:/a:b\n0::/\n")
    assert cgroups_of(7, root) == [
        (("memory",), "/tenon/abc"),
        (("cpu", "cpuacct"), "/a:b"),
        ((), "/"),
    ]
    broken = scripted_proc(tmp_path / "b", 7, cgroup="no colons here\n")
    with pytest.raises(HostError, match="malformed"):
        cgroups_of(7, broken)


def test_stat_in_root_sees_the_path_through_the_process_root():
    through_root = stat_in_root(os.getpid(), "/etc")
    direct = os.stat("/etc")
    assert (through_root.st_dev, through_root.st_ino) == (direct.st_dev, direct.st_ino)
    with pytest.raises(ValueError, match="absolute"):
        stat_in_root(os.getpid(), "etc")


def test_max_user_namespaces_reads_the_sysctl_and_none_without_it(tmp_path):
    assert max_user_namespaces() == int(Path("/proc/sys/user/max_user_namespaces").read_text())
    root = tmp_path / "proc"
    assert max_user_namespaces(root) is None
    (root / "sys" / "user").mkdir(parents=True)
    (root / "sys" / "user" / "max_user_namespaces").write_text("0\n")
    assert max_user_namespaces(root) == 0


def test_remove_empty_domain_dirs_keeps_a_domain_with_children(tmp_path):
    for hierarchy in ("blkio", "devices", "unified"):
        (tmp_path / hierarchy / "dom").mkdir(parents=True)
    (tmp_path / "devices" / "dom" / "child").mkdir()
    (tmp_path / "blkio" / "other").mkdir()
    removed = remove_empty_domain_dirs("dom", tmp_path)
    assert sorted(removed) == [tmp_path / "blkio" / "dom", tmp_path / "unified" / "dom"]
    assert (tmp_path / "devices" / "dom" / "child").is_dir()
    assert (tmp_path / "blkio" / "other").is_dir()
