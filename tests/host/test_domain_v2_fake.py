"""The v2 path of the workload domain, against a scripted cgroup2 tree in a temp directory."""

from pathlib import Path

from tenon.host.domain import WorkloadDomain
from tenon.host.layout import detect_layout
from tenon.host.types import CgroupVersion

MIB = 1024 * 1024


def make_v2_cgroup(path: Path, *, current=0, peak=0, swap=0, oom_kills=0, usage_usec=0) -> Path:
    """Lay out the files the kernel would show for one v2 cgroup."""
    path.mkdir(parents=True, exist_ok=True)
    files = {
        "cgroup.controllers": "memory pids cpu",
        "cgroup.subtree_control": "",
        "cgroup.procs": "",
        "cgroup.events": "populated 0\nfrozen 0\n",
        "cgroup.freeze": "0",
        "memory.current": str(current),
        "memory.peak": str(peak),
        "memory.swap.current": str(swap),
        "memory.max": "max",
        "memory.events": f"low 0\nhigh 0\nmax 0\noom 0\noom_kill {oom_kills}\n",
        "cpu.stat": f"usage_usec {usage_usec}\nuser_usec 0\nsystem_usec 0\n",
        "pids.max": "max",
    }
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def open_fake_domain(tmp_path: Path, budget_bytes=512 * MIB) -> WorkloadDomain:
    make_v2_cgroup(tmp_path)
    layout = detect_layout(tmp_path)
    assert layout.version is CgroupVersion.V2
    make_v2_cgroup(tmp_path / "tenon")
    return WorkloadDomain.open("tenon", budget_bytes=budget_bytes, layout=layout)


def test_budget_and_subtree_control_are_written(tmp_path):
    domain = open_fake_domain(tmp_path)
    assert (tmp_path / "tenon" / "memory.max").read_text() == str(512 * MIB)
    assert "+memory" in (tmp_path / "tenon" / "cgroup.subtree_control").read_text()
    domain.set_budget(None)
    assert (tmp_path / "tenon" / "memory.max").read_text() == "max"


def test_readings_sum_memory_and_swap(tmp_path):
    domain = open_fake_domain(tmp_path)
    make_v2_cgroup(tmp_path / "tenon" / "a", current=100 * MIB, peak=150 * MIB, swap=10 * MIB,
                   usage_usec=2_500_000)
    reading = domain.adopt("a", "a").reading()
    assert reading.usage_bytes == 110 * MIB
    assert reading.peak_bytes == 150 * MIB
    assert reading.cpu_usage_s == 2.5
    assert reading.limit_bytes is None


def test_oom_kills_are_attributed_once_to_the_child_they_hit(tmp_path):
    domain = open_fake_domain(tmp_path)
    make_v2_cgroup(tmp_path / "tenon" / "quiet")
    make_v2_cgroup(tmp_path / "tenon" / "hog")
    domain.adopt("quiet", "quiet")
    domain.adopt("hog", "hog")
    assert domain.poll_oom() == []
    (tmp_path / "tenon" / "hog" / "memory.events").write_text("oom 2\noom_kill 2\n")
    events = domain.poll_oom()
    assert [(e.sandbox_id, e.num_kills) for e in events] == [("hog", 2)]
    assert domain.poll_oom() == []


def test_frozen_state_comes_from_cgroup_events(tmp_path):
    domain = open_fake_domain(tmp_path)
    make_v2_cgroup(tmp_path / "tenon" / "a")
    box = domain.adopt("a", "a")
    assert not box.is_frozen()
    (tmp_path / "tenon" / "a" / "cgroup.events").write_text("populated 1\nfrozen 1\n")
    assert box.is_frozen()
    result = box.freeze()
    assert result.frozen
    assert not result.changed  # already frozen: idempotent, nothing written
    assert (tmp_path / "tenon" / "a" / "cgroup.freeze").read_text() == "0"
