"""The host layer's cgroup v2 paths against a real kernel with a pure v2 hierarchy (the test
VM: scripts/vm/test.sh). Each test's domain and sandbox cgroups are gone afterwards."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_domain_real import (
    FORK_LOOP,
    GROW,
    cgroup_files_open,
    leftovers,
    real_layout_or_skip,
    start_in,
    wait_for_usage,
)

from tenon.errors import HostError
from tenon.host.cgroup import SandboxCgroup
from tenon.host.cgroupfs import read_keyed
from tenon.host.domain import WorkloadDomain
from tenon.host.procs import is_alive
from tenon.host.types import CgroupVersion
from tenon.units import MIB

pytestmark = pytest.mark.vm

BUDGET_BYTES = 64 * MIB


@pytest.fixture
def domain() -> Iterator[WorkloadDomain]:
    layout = real_layout_or_skip()
    if layout.version is not CgroupVersion.V2:
        pytest.skip(f"needs a pure cgroup v2 hierarchy, found {layout.version.value}")
    d = WorkloadDomain.open(f"tenon-v2-{uuid.uuid4().hex[:8]}", budget_bytes=BUDGET_BYTES)
    yield d
    d.remove()
    assert leftovers(d.name) == [], "cgroups left behind"


def events(box: SandboxCgroup) -> dict[str, int]:
    return read_keyed(box.dirs["memory"] / "memory.events")


HOG = "b = bytearray(256 * 1024 * 1024)\nfor i in range(0, len(b), 4096): b[i] = 1"
SLEEP = "import time; time.sleep(120)"


def test_the_budget_is_the_domains_memory_max(domain):
    memory_max = Path("/sys/fs/cgroup", domain.name, "memory.max")
    assert memory_max.read_text().strip() == str(BUDGET_BYTES)
    assert domain.reading().limit_bytes == BUDGET_BYTES
    domain.set_budget(96 * MIB)
    assert memory_max.read_text().strip() == str(96 * MIB)
    assert domain.reading().limit_bytes == 96 * MIB
    domain.set_budget(None)
    assert memory_max.read_text().strip() == "max"
    assert domain.reading().limit_bytes is None
    enabled = set(Path("/sys/fs/cgroup", domain.name, "cgroup.subtree_control").read_text().split())
    assert {"memory", "pids", "cpu"} <= enabled
    assert set(domain.sandbox("a").dirs.values()) == {Path("/sys/fs/cgroup", domain.name, "a")}


def test_usage_peak_and_cpu_of_a_busy_process(domain):
    domain.set_budget(None)
    box = domain.sandbox("busy")
    before = box.reading()
    proc = start_in(box, "import time\nb = bytearray(40 * 1024 * 1024)\n"
                         "for i in range(0, len(b), 4096): b[i] = 1\n"
                         "t = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
                         "print('ok', flush=True)\ntime.sleep(60)")
    try:
        assert proc.stdout.readline().strip() == b"ok"
        after = box.reading()
        assert after.usage_bytes - before.usage_bytes > 30 * MIB
        assert after.peak_bytes >= after.usage_bytes
        assert after.cpu_usage_s - before.cpu_usage_s > 0.2
        assert after.limit_bytes is None
        usage, cpu_s = box.sample()
        assert abs(usage - after.usage_bytes) < 4 * MIB
        assert abs(cpu_s - after.cpu_usage_s) < 0.2
        assert box.pids() == [proc.pid]
        assert domain.reading().usage_bytes >= after.usage_bytes  # v2 charges the parent too
    finally:
        box.kill_all()
        proc.communicate()


def test_an_oom_kill_is_attributed_to_the_sandbox_it_hit(domain):
    idle, greedy = domain.sandbox("idle"), domain.sandbox("greedy")
    sleeper = start_in(idle, SLEEP)
    hog = start_in(greedy, HOG)
    try:
        hog.communicate(timeout=120)
        assert hog.returncode == -9
        assert events(greedy)["oom_kill"] >= 1
        assert [(e.sandbox_id, e.num_kills >= 1) for e in domain.poll_oom()] == [("greedy", True)]
        assert domain.poll_oom() == []  # counted once
        assert greedy.new_oom_kills() == 0  # poll_oom took it through the same object
        assert domain.num_oom_kills() >= 1  # memory.events is hierarchical on v2
        assert idle.reading().num_oom_kills == 0
        assert sleeper.poll() is None  # the idle sandbox was not the victim
        assert domain.reading().peak_bytes <= BUDGET_BYTES
    finally:
        sleeper.kill()
        sleeper.communicate()


def test_memory_oom_group_takes_the_whole_sandbox(domain):
    single, group = domain.sandbox("single"), domain.sandbox("group")
    group.set_oom_group(True)
    assert (group.dirs["memory"] / "memory.oom.group").read_text().strip() == "1"
    assert (single.dirs["memory"] / "memory.oom.group").read_text().strip() == "0"
    procs = []
    try:
        # without the group, only the largest process dies; its neighbour lives on
        bystander = start_in(single, SLEEP)
        procs.append(bystander)
        hog = start_in(single, HOG)
        procs.append(hog)
        hog.communicate(timeout=120)
        assert hog.returncode == -9
        assert bystander.poll() is None
        single.kill_all()
        # with it, the OOM kill takes every process of the sandbox
        member = start_in(group, SLEEP)
        procs.append(member)
        hog = start_in(group, HOG)
        procs.append(hog)
        hog.communicate(timeout=120)
        member.communicate(timeout=30)
        assert (hog.returncode, member.returncode) == (-9, -9)
        assert events(group)["oom_group_kill"] >= 1
        assert group.pids() == []
        assert [e.sandbox_id for e in domain.poll_oom()] == ["group", "single"]
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate()


def test_memory_high_throttles_instead_of_killing_and_pressure_rises(domain):
    domain.set_budget(None)
    box = domain.sandbox("throttled")
    quiet = box.pressure()
    assert quiet is not None
    assert quiet.some_total_us == 0  # a new cgroup has stalled for nothing yet
    box.set_memory_high(32 * MIB)
    assert (box.dirs["memory"] / "memory.high").read_text().strip() == str(32 * MIB)
    proc = start_in(box, GROW)  # wants about 200 MiB/s without a mark
    try:
        wait_for_usage(box, 24 * MIB, timeout_s=30)
        time.sleep(3)
        held = box.reading()
        assert proc.poll() is None  # throttled, not killed
        assert held.num_oom_kills == 0
        assert held.usage_bytes < 64 * MIB, "memory.high did not hold usage near the mark"
        assert events(box)["high"] > 0
        pressure = box.pressure()
        assert pressure is not None
        assert pressure.some_total_us > 0
        assert pressure.some_total_us >= pressure.full_total_us
        # lifting the mark lets it grow again
        box.set_memory_high(None)
        assert (box.dirs["memory"] / "memory.high").read_text().strip() == "max"
        wait_for_usage(box, held.usage_bytes + 40 * MIB, timeout_s=30)
    finally:
        box.kill_all()
        proc.communicate()


CPU_SPIN = """
import time
count = 0
while True:
    count += 1
"""


def test_freezing_stops_a_cpu_bound_process_and_thawing_resumes_it(domain):
    box = domain.sandbox("spinner")
    proc = start_in(box, CPU_SPIN)
    try:
        time.sleep(0.5)
        assert not box.is_frozen()
        first = box.freeze()
        assert (first.frozen, first.changed) == (True, True)
        assert box.is_frozen()
        assert (box.dirs["memory"] / "cgroup.freeze").read_text().strip() == "1"
        assert box.freeze().changed is False
        frozen_cpu = box.reading().cpu_usage_s
        time.sleep(1.0)
        assert box.reading().cpu_usage_s - frozen_cpu < 0.02  # no progress while frozen
        assert proc.poll() is None
        thawed = box.thaw()
        assert (thawed.frozen, thawed.changed) == (False, True)
        assert not box.is_frozen()
        time.sleep(1.0)
        assert box.reading().cpu_usage_s - frozen_cpu > 0.2  # runs again
        assert box.held_s() >= 1.0
    finally:
        box.kill_all()
        proc.communicate()


FORK_AND_HIDE = """
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(120)
        os._exit(0)
    time.sleep(120)
    os._exit(0)
time.sleep(0.5)
print('forked', flush=True)
time.sleep(120)
"""


def test_kill_all_empties_the_cgroup_through_cgroup_kill_frozen_or_not(domain):
    box = domain.sandbox("forker")
    proc = start_in(box, FORK_AND_HIDE)
    try:
        assert proc.stdout.readline().strip() == b"forked"
        pids = box.pids()
        assert len(pids) == 3  # the parent, its child in a new session, the grandchild
        box.freeze()
        box.kill_all(timeout_s=10)
        assert box.pids() == []
        assert not box.is_frozen()
        proc.communicate(timeout=10)
        assert proc.returncode == -9
        deadline = time.monotonic() + 10
        while any(is_alive(pid) for pid in pids):
            assert time.monotonic() < deadline, f"still alive: {pids}"
            time.sleep(0.05)
        assert read_keyed(box.dirs["memory"] / "cgroup.events")["populated"] == 0
    finally:
        proc.kill()
        proc.communicate()


def test_cpu_max_caps_the_sandbox(domain):
    box = domain.sandbox("capped")
    cpu_max = box.dirs["cpu"] / "cpu.max"
    box.set_cpu_quota(0.2)
    assert cpu_max.read_text().split() == ["20000", "100000"]
    proc = start_in(box, CPU_SPIN)
    try:
        start_cpu, start = box.reading().cpu_usage_s, time.monotonic()
        time.sleep(2.0)
        used_s = box.reading().cpu_usage_s - start_cpu
        wall_s = time.monotonic() - start
        assert used_s <= 0.2 * wall_s + 0.15
        assert read_keyed(box.dirs["cpu"] / "cpu.stat")["nr_throttled"] > 0
        box.set_cpu_quota(None)
        assert cpu_max.read_text().split() == ["max", "100000"]
    finally:
        box.kill_all()
        proc.communicate()


def test_pids_max_caps_the_number_of_tasks(domain):
    box = domain.sandbox("forks")
    box.set_max_pids(20)
    assert (box.dirs["pids"] / "pids.max").read_text().strip() == "20"
    proc = start_in(box, FORK_LOOP)
    try:
        assert int(proc.stdout.readline()) == 19  # the parent holds the 20th slot
        assert len(box.pids()) <= 20
        assert read_keyed(box.dirs["pids"] / "pids.events")["max"] > 0
        box.set_max_pids(None)
        assert (box.dirs["pids"] / "pids.max").read_text().strip() == "max"
    finally:
        box.kill_all()
        proc.communicate()


def test_reset_peak_restarts_the_mark_for_this_cgroups_readings(domain, tmp_path):
    domain.set_budget(None)
    box = domain.sandbox("peaky")
    go = tmp_path / "go"
    proc = start_in(box, "import os, time\nb = bytearray(48 * 1024 * 1024)\n"
                         "for i in range(0, len(b), 4096): b[i] = 1\n"
                         "del b\nprint('freed', flush=True)\n"
                         f"while not os.path.exists({str(go)!r}): time.sleep(0.01)\n"
                         "b = bytearray(16 * 1024 * 1024)\n"
                         "for i in range(0, len(b), 4096): b[i] = 1\n"
                         "print('again', flush=True)\ntime.sleep(60)")
    try:
        assert proc.stdout.readline().strip() == b"freed"
        before = box.reading()
        assert before.peak_bytes - before.usage_bytes > 40 * MIB
        assert box.reset_peak() is True
        after = box.reading()
        assert after.peak_bytes - after.usage_bytes < 4 * MIB
        # the kernel's reset is per open file: a plain read still sees the whole mark
        whole = int((box.dirs["memory"] / "memory.peak").read_text())
        assert whole - after.usage_bytes > 40 * MIB
        go.touch()
        assert proc.stdout.readline().strip() == b"again"
        grown = box.reading()
        assert 12 * MIB < grown.peak_bytes - after.usage_bytes < 40 * MIB
        box.close()  # the reset's file closes: readings see the whole mark again
        assert box.reading().peak_bytes >= whole
    finally:
        box.kill_all()
        proc.communicate()


def test_remove_kills_removes_and_closes_every_kept_file(domain):
    box = domain.sandbox("doomed")
    proc = start_in(box, SLEEP)
    box.sample()
    assert box.reset_peak() is True
    assert {Path(f).name for f in cgroup_files_open(domain.name)} >= {"memory.peak",
                                                                      "memory.current"}
    box.remove()
    proc.communicate(timeout=10)
    assert proc.returncode == -9
    assert not box.exists()
    assert cgroup_files_open(domain.name) == []
    box.remove()  # idempotent
    with pytest.raises(HostError):
        box.sample()
    domain.remove()
    domain.remove()
    assert leftovers(domain.name) == []
