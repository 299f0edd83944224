from pathlib import Path

import pytest

from tenon.errors import CgroupUnavailable, HostError
from tenon.host.layout import detect_layout
from tenon.host.psi import host_mem_available_bytes, parse_pressure, read_pressure
from tenon.host.types import CgroupVersion


def make_v1_tree(root: Path, controllers=("memory", "freezer", "pids", "cpu", "cpuacct")) -> Path:
    for c in controllers:
        (root / c).mkdir(parents=True)
        (root / c / "cgroup.procs").write_text("")
    return root


def make_v2_tree(root: Path, controllers="cpuset cpu io memory pids") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text(controllers + "\n")
    return root


def test_detects_v1_and_reports_missing_controllers(tmp_path):
    layout = detect_layout(make_v1_tree(tmp_path, ("memory", "pids")))
    assert layout.version is CgroupVersion.V1
    assert layout.mounts["memory"] == tmp_path / "memory"
    assert any("freezer" in m for m in layout.missing)


def test_detects_v2(tmp_path):
    layout = detect_layout(make_v2_tree(tmp_path))
    assert layout.version is CgroupVersion.V2
    assert set(layout.controllers) >= {"memory", "pids", "cpu"}
    assert layout.missing == []


def test_v2_without_memory_controller_is_a_clear_error(tmp_path):
    with pytest.raises(CgroupUnavailable, match="no memory controller"):
        detect_layout(make_v2_tree(tmp_path, "cpu pids"))


def test_no_cgroups_at_all_is_a_clear_error(tmp_path):
    with pytest.raises(CgroupUnavailable, match="no cgroup memory controller"):
        detect_layout(tmp_path)


def test_parse_pressure():
    reading = parse_pressure(
        "some avg10=1.50 avg60=0.25 avg300=0.00 total=1234\n"
        "full avg10=0.75 avg60=0.10 avg300=0.00 total=99\n"
    )
    assert (reading.some_avg10, reading.full_avg10) == (1.5, 0.75)
    assert (reading.some_total_us, reading.full_total_us) == (1234, 99)
    with pytest.raises(HostError, match="malformed PSI"):
        parse_pressure("some avg10=x")


def test_read_pressure_absent_is_none(tmp_path):
    assert read_pressure(tmp_path / "nope") is None


def test_mem_available(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal: 100 kB\nMemAvailable:  2048 kB\n")
    assert host_mem_available_bytes(tmp_path) == 2048 * 1024
    (tmp_path / "meminfo").write_text("MemTotal: 100 kB\n")
    with pytest.raises(HostError, match="MemAvailable"):
        host_mem_available_bytes(tmp_path)


@pytest.mark.cgroups
def test_this_host_has_a_usable_layout():
    if not Path("/sys/fs/cgroup").exists():
        pytest.skip("no /sys/fs/cgroup on this host")
    layout = detect_layout()
    assert "memory" in layout.controllers


def test_detects_the_fake_v2_tree_and_its_missing_memory_controller(tmp_path):
    from tenon.host.fake import FakeCgroupV2Tree

    layout = FakeCgroupV2Tree(tmp_path / "ok").layout()
    assert layout.version is CgroupVersion.V2
    assert layout.root == tmp_path / "ok"
    with pytest.raises(CgroupUnavailable, match="no memory controller"):
        FakeCgroupV2Tree(tmp_path / "bad", controllers=("cpu", "pids")).layout()
