"""The v2 path of the workload domain, against the scripted cgroup2 tree (host/fake.py)."""

import signal
import time

import pytest

from tenon.errors import CgroupUnavailable, ConfigError, HostError
from tenon.host.domain import WorkloadDomain
from tenon.host.fake import FakeCgroupV2Tree, UnscriptedError
from tenon.host.types import CgroupVersion

MIB = 1024 * 1024


def make_domain(tmp_path, budget_bytes=512 * MIB, name="tenon", **tree_kwargs):
    tree = FakeCgroupV2Tree(tmp_path / "cg", **tree_kwargs)
    domain = WorkloadDomain.open(name, budget_bytes=budget_bytes, layout=tree.layout())
    return tree, domain


def test_open_enables_controllers_and_sets_the_budget(tmp_path):
    tree, domain = make_domain(tmp_path)
    assert domain.version is CgroupVersion.V2
    assert tree.read("", "cgroup.subtree_control").split() == ["cpu", "memory", "pids"]
    assert tree.read("tenon", "cgroup.subtree_control").split() == ["cpu", "memory", "pids"]
    assert tree.read("tenon", "memory.max").strip() == str(512 * MIB)
    assert tree.read("tenon", "memory.swap.max").strip() == "0"
    domain.set_budget(None)
    assert tree.read("tenon", "memory.max").strip() == "max"
    assert tree.read("tenon", "memory.swap.max").strip() == "max"
    assert domain.budget_bytes is None


def test_open_adopts_an_existing_domain(tmp_path):
    tree, domain = make_domain(tmp_path)
    domain.sandbox("a")
    again = WorkloadDomain.open("tenon", budget_bytes=256 * MIB, layout=tree.layout())
    assert again.sandbox_ids() == ["a"]
    assert tree.read("tenon", "memory.max").strip() == str(256 * MIB)


def test_bad_budget_and_names_are_config_errors(tmp_path):
    tree = FakeCgroupV2Tree(tmp_path)
    with pytest.raises(ConfigError, match="negative"):
        WorkloadDomain.open("tenon", budget_bytes=-1, layout=tree.layout())
    domain = WorkloadDomain.open("tenon", layout=tree.layout())
    with pytest.raises(ConfigError, match="negative"):
        domain.set_budget(-5)
    with pytest.raises(ConfigError, match="sandbox id"):
        domain.sandbox("../escape")
    with pytest.raises(ConfigError, match="relative"):
        domain.adopt("x", "/abs")


def test_readings_sum_memory_and_swap_and_roll_up(tmp_path):
    tree, domain = make_domain(tmp_path)
    box = domain.sandbox("a")
    domain.sandbox("b")
    tree.set_memory("tenon/a", current=100 * MIB, peak=150 * MIB, swap=10 * MIB)
    tree.set_memory("tenon/b", current=20 * MIB)
    tree.set_cpu_usage("tenon/a", 2.5)
    reading = box.reading()
    assert reading.usage_bytes == 110 * MIB
    assert reading.peak_bytes == 150 * MIB
    assert reading.cpu_usage_s == 2.5
    assert reading.limit_bytes is None
    assert reading.num_oom_kills == 0
    assert box.sample() == (110 * MIB, 2.5)  # the execution loop's cheap read agrees
    whole = domain.reading()
    assert whole.usage_bytes == 130 * MIB
    assert whole.limit_bytes == 512 * MIB


def test_peak_falls_back_to_current_without_memory_peak(tmp_path):
    tree, domain = make_domain(tmp_path, peak=False, swap=False)
    box = domain.sandbox("a")
    tree.set_memory("tenon/a", current=40 * MIB)
    assert (box.reading().usage_bytes, box.reading().peak_bytes) == (40 * MIB, 40 * MIB)


def test_oom_kills_are_attributed_once_to_the_child_they_hit(tmp_path):
    tree, domain = make_domain(tmp_path)
    domain.sandbox("quiet")
    domain.sandbox("hog")
    victim = tree.spawn("tenon/hog")
    assert domain.poll_oom() == []
    tree.add_oom_kill("tenon/hog", 2, victim=victim)
    events = domain.poll_oom()
    assert [(e.sandbox_id, e.num_kills) for e in events] == [("hog", 2)]
    assert domain.poll_oom() == []
    assert domain.num_oom_kills() == 2
    assert domain.sandbox("hog").pids() == []


def test_oom_in_a_stray_child_is_reported_under_its_directory_name(tmp_path):
    tree, domain = make_domain(tmp_path)
    tree.make_cgroup("tenon/0123abcd")  # e.g. a container Docker created under the domain
    tree.add_oom_kill("tenon/0123abcd")
    assert domain.sandbox_ids() == ["0123abcd"]
    assert [(e.sandbox_id, e.num_kills) for e in domain.poll_oom()] == [("0123abcd", 1)]


def test_adopt_uses_the_given_path(tmp_path):
    tree, domain = make_domain(tmp_path)
    tree.make_cgroup("tenon/ctr-1")
    box = domain.adopt("agent-7", "ctr-1")
    assert box.procs_files() == [tree.path("tenon/ctr-1") / "cgroup.procs"]
    tree.add_oom_kill("tenon/ctr-1")
    assert [e.sandbox_id for e in domain.poll_oom()] == ["agent-7"]
    assert domain.sandbox_ids() == ["agent-7"]
    with pytest.raises(HostError, match="does not exist"):
        domain.adopt("ghost", "nope")


def test_freeze_goes_through_cgroup_freeze_and_events(tmp_path):
    tree, domain = make_domain(tmp_path)
    box = domain.sandbox("a")
    assert not box.is_frozen()
    first = box.freeze()
    assert (first.frozen, first.changed) == (True, True)
    assert first.elapsed_s >= 0
    assert tree.read("tenon/a", "cgroup.freeze").strip() == "1"
    assert tree.events("tenon/a")["frozen"] == 1
    assert box.is_frozen()
    again = box.freeze()
    assert (again.frozen, again.changed) == (True, False)
    thawed = box.thaw()
    assert (thawed.frozen, thawed.changed) == (False, True)
    assert not box.thaw().changed


def test_a_freeze_that_never_settles_is_a_clear_error(tmp_path):
    tree, domain = make_domain(tmp_path)
    box = domain.sandbox("a")
    tree.stall_freezer("tenon/a")
    with pytest.raises(HostError, match="did not reach frozen=True"):
        box.freeze(timeout_s=0.05)


def test_held_time_counts_from_the_freeze_request_even_when_it_settles_late(tmp_path):
    tree, domain = make_domain(tmp_path)
    box = domain.sandbox("a")
    tree.stall_freezer("tenon/a")
    with pytest.raises(HostError):
        box.freeze(timeout_s=0.05)  # requested; the kernel would finish it later
    first = box.held_s()
    assert first >= 0.05
    time.sleep(0.05)
    assert box.held_s() >= first + 0.05  # still held
    tree.stall_freezer("tenon/a", stalled=False)
    box.thaw(timeout_s=1.0)
    after = box.held_s()
    time.sleep(0.05)
    assert box.held_s() == after  # the hold ended with the thaw


def test_pids_limits_and_cpu_quota(tmp_path):
    tree, domain = make_domain(tmp_path)
    box = domain.sandbox("a")
    pid = tree.spawn("tenon")  # the launcher, moved in by the driver
    box.add_pid(pid)
    assert box.pids() == [pid]
    assert tree.events("tenon/a")["populated"] == 1
    box.set_max_pids(20)
    assert tree.read("tenon/a", "pids.max").strip() == "20"
    box.set_cpu_quota(1.5)
    assert tree.read("tenon/a", "cpu.max").split() == ["150000", "100000"]
    box.set_cpu_quota(None)
    assert tree.read("tenon/a", "cpu.max").split() == ["max", "100000"]
    box.set_memory_high(64 * MIB)
    assert tree.read("tenon/a", "memory.high").strip() == str(64 * MIB)
    box.set_memory_high(None)
    assert tree.read("tenon/a", "memory.high").strip() == "max"
    with pytest.raises(ConfigError):
        box.set_max_pids(0)
    with pytest.raises(ConfigError):
        box.set_cpu_quota(0)


def test_pressure_is_read_per_cgroup(tmp_path):
    tree, domain = make_domain(tmp_path)
    box = domain.sandbox("a")
    tree.set_pressure("tenon/a", some_avg10=12.5, full_avg10=3.0, some_total_us=777)
    pressure = box.pressure()
    assert (pressure.some_avg10, pressure.full_avg10, pressure.some_total_us) == (12.5, 3.0, 777)


def test_kill_all_and_remove_are_idempotent(tmp_path):
    tree, domain = make_domain(tmp_path)
    box = domain.sandbox("a")
    pids = [tree.spawn("tenon/a") for _ in range(3)]
    box.freeze()
    box.kill_all()
    assert box.pids() == []
    assert not box.is_frozen()
    assert {(p, signal.SIGKILL) for p in pids} <= set(tree.signals)
    box.remove()
    box.remove()
    assert not tree.path("tenon/a").exists()


def test_domain_remove_takes_children_and_nested_cgroups(tmp_path):
    tree, domain = make_domain(tmp_path)
    domain.sandbox("a")
    tree.spawn("tenon/a")
    tree.make_cgroup("tenon/stray")
    tree.make_cgroup("tenon/stray/inner")
    tree.spawn("tenon/stray/inner")
    domain.remove()
    domain.remove()
    assert not tree.path("tenon").exists()
    assert tree.path("").exists()


def test_the_fake_refuses_what_it_was_not_scripted_for(tmp_path):
    tree, domain = make_domain(tmp_path)
    with pytest.raises(UnscriptedError, match="never created"):
        tree.set_memory("tenon/nope", current=1)
    with pytest.raises(UnscriptedError, match="not a fake process"):
        tree.kill(1, signal.SIGKILL)
    box = domain.sandbox("a")
    with pytest.raises(UnscriptedError, match="never spawned"):
        box.add_pid(4242)
    with pytest.raises(HostError, match="no such control file"):
        tree.io.write(tree.path("tenon/a") / "memory.limit_in_bytes", "1")
    with pytest.raises(HostError, match="invalid argument"):
        tree.io.write(tree.path("tenon/a") / "memory.max", "lots")


def test_without_the_pids_controller_limits_are_unavailable(tmp_path):
    tree, domain = make_domain(tmp_path, controllers=("cpu", "memory"))
    assert any("pids" in m for m in domain.layout.missing)
    box = domain.sandbox("a")
    with pytest.raises(CgroupUnavailable, match="pids"):
        box.set_max_pids(10)
