"""`SandboxCgroup.sample`, the execution loop's per-period read: files kept open, re-read
in place, closed with the cgroup (the scripted v2 tree; the kernel in test_domain_real)."""

import os
from pathlib import Path

import pytest

from tenon.errors import HostError
from tenon.host import cgroup as cgroup_module
from tenon.host.domain import WorkloadDomain
from tenon.host.fake import FakeCgroupV2Tree

MIB = 1024 * 1024


def make_domain(tmp_path, **tree_kwargs):
    tree = FakeCgroupV2Tree(tmp_path / "cg", **tree_kwargs)
    return tree, WorkloadDomain.open("tenon", budget_bytes=512 * MIB, layout=tree.layout())


def open_files_under(directory: Path) -> list[str]:
    """Paths of this process's open descriptors that lie under `directory`."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor listdir itself used, closed by now
            continue
        if target.startswith(f"{directory}/"):
            found.append(target)
    return sorted(found)


def test_sample_keeps_its_files_open_and_reads_fresh_values(tmp_path):
    tree, domain = make_domain(tmp_path)
    box = domain.sandbox("a")
    tree.set_memory("tenon/a", current=10 * MIB, swap=1 * MIB)
    tree.set_cpu_usage("tenon/a", 0.5)
    assert box.sample() == (11 * MIB, 0.5)
    kept = open_files_under(tree.path("tenon/a"))
    assert [Path(p).name for p in kept] == ["cpu.stat", "memory.current", "memory.swap.current"]
    tree.set_memory("tenon/a", current=30 * MIB, swap=2 * MIB)
    tree.set_cpu_usage("tenon/a", 1.25)
    assert box.sample() == (32 * MIB, 1.25)  # the same descriptors, re-read from the start
    assert open_files_under(tree.path("tenon/a")) == kept


def test_remove_closes_the_kept_files(tmp_path):
    tree, domain = make_domain(tmp_path, swap=False)
    boxes = [domain.sandbox(name) for name in ("a", "b")]
    for box in boxes:
        box.sample()
    assert len(open_files_under(tree.path("tenon"))) == 4  # memory.current, cpu.stat each
    boxes[0].remove()
    assert [Path(p).parent.name for p in open_files_under(tree.path("tenon"))] == ["b", "b"]
    domain.remove()
    assert open_files_under(tmp_path) == []
    with pytest.raises(HostError, match="cannot sample cgroup of a"):
        boxes[0].sample()
    assert open_files_under(tmp_path) == []  # a failed open leaves nothing open either


def test_close_is_idempotent_and_a_later_sample_reopens(tmp_path):
    tree, domain = make_domain(tmp_path, swap=False)
    box = domain.sandbox("a")
    tree.set_memory("tenon/a", current=5 * MIB)
    box.sample()
    box.close()
    box.close()
    assert open_files_under(tree.path("tenon/a")) == []
    tree.set_memory("tenon/a", current=7 * MIB)
    assert box.sample() == (7 * MIB, 0.0)
    assert len(open_files_under(tree.path("tenon/a"))) == 2
    box.close()


def test_a_dropped_cgroup_object_closes_its_files(tmp_path):
    tree, domain = make_domain(tmp_path)
    box = domain.sandbox("a")
    box.sample()
    assert open_files_under(tree.path("tenon/a"))
    domain.adopt("a", "a")  # same directories: the known object, still open
    assert open_files_under(tree.path("tenon/a"))
    tree.make_cgroup("tenon/elsewhere")
    domain.adopt("a", "elsewhere")  # the domain forgets the old object for a new one
    del box
    assert open_files_under(tree.path("tenon/a")) == []


def test_past_the_descriptor_cap_a_sample_reads_without_keeping(tmp_path, monkeypatch):
    cap = cgroup_module._num_kept_fds + 4  # room for two sandboxes' files from here
    monkeypatch.setattr(cgroup_module, "_max_kept_fds", lambda: cap)
    tree, domain = make_domain(tmp_path, swap=False)
    boxes = [domain.sandbox(name) for name in ("a", "b", "c")]
    for i, box in enumerate(boxes):
        tree.set_memory(f"tenon/{box.sandbox_id}", current=(i + 1) * MIB)
    assert [box.sample()[0] for box in boxes] == [1 * MIB, 2 * MIB, 3 * MIB]
    assert {Path(p).parent.name for p in open_files_under(tree.path("tenon"))} == {"a", "b"}
    tree.set_memory("tenon/c", current=5 * MIB)
    assert boxes[2].sample() == (5 * MIB, 0.0)  # read afresh each time, nothing left open
    boxes[0].remove()  # gives its two back
    boxes[2].sample()
    assert {Path(p).parent.name for p in open_files_under(tree.path("tenon"))} == {"b", "c"}
    domain.remove()
    assert open_files_under(tmp_path) == []
