"""AgentCgroup on a real cgroup v2 kernel (the test VM): the pure policy's marks written as
memory.high each period, driven by the domain's memory PSI. A Low sandbox that allocates
past its mark is throttled, not OOM-killed, while its pressure rises."""

from __future__ import annotations

import time
import uuid

import pytest
from test_domain_real import GROW, leftovers, real_layout_or_skip, start_in

from tenon.host.cgroupfs import read_keyed
from tenon.host.domain import WorkloadDomain
from tenon.host.types import CgroupVersion
from tenon.policy.baselines import (
    AgentCgroupClass,
    AgentCgroupDomainObs,
    AgentCgroupSandbox,
    AgentCgroupState,
    agentcgroup_class,
    agentcgroup_v2_step,
)
from tenon.policy.config import PolicyConfig
from tenon.units import MIB

pytestmark = pytest.mark.vm

BUDGET_BYTES = 256 * MIB
MARK_BYTES = 48 * MIB
CONFIG = PolicyConfig(agentcgroup_low_high_mark_bytes=MARK_BYTES,
                      agentcgroup_low_share_fraction=0.125)  # under pressure: 32 MiB
TIGHT_BYTES = BUDGET_BYTES // 8


def test_a_low_sandbox_past_its_mark_is_throttled_not_killed_and_its_pressure_rises():
    if real_layout_or_skip().version is not CgroupVersion.V2:
        pytest.skip("needs a pure cgroup v2 hierarchy")
    domain = WorkloadDomain.open(f"tenon-acg-{uuid.uuid4().hex[:8]}", budget_bytes=BUDGET_BYTES)
    try:
        box = domain.sandbox("low")
        peak_bytes = 16 * MIB  # its profile: Low
        assert agentcgroup_class(peak_bytes, BUDGET_BYTES, CONFIG) is AgentCgroupClass.LOW
        # Unthrottled, GROW (about 200 MiB/s) would pass the 256 MiB budget within two
        # seconds and be OOM-killed.
        proc = start_in(box, GROW)
        state, written, seen_marks, triggers = AgentCgroupState(), None, [], []
        start = time.monotonic()
        try:
            while time.monotonic() - start < 8.0:  # 0.1 s periods, as the runtime runs them
                reading, pressure = domain.reading(), domain.pressure()
                assert pressure is not None
                plan = agentcgroup_v2_step(
                    [AgentCgroupSandbox("low", peak_bytes, box.reading().usage_bytes)],
                    AgentCgroupDomainObs(reading.usage_bytes, reading.limit_bytes,
                                         pressure.some_total_us),
                    state, BUDGET_BYTES, time.monotonic(), CONFIG)
                state = plan.state
                if plan.trigger is not None:
                    triggers.append(plan.trigger)
                [mark] = plan.marks
                if mark.high_mark_bytes != written:
                    box.set_memory_high(mark.high_mark_bytes)
                    written = mark.high_mark_bytes
                seen_marks.append(int((box.dirs["memory"] / "memory.high").read_text()))
                time.sleep(0.1)
            assert proc.poll() is None, "the Low sandbox was killed, not throttled"
            usage = box.reading()
            assert usage.num_oom_kills == 0
            assert usage.usage_bytes < MARK_BYTES + 48 * MIB, usage  # held near its mark
            assert read_keyed(box.dirs["memory"] / "memory.events")["high"] > 0
            sandbox_pressure = box.pressure()
            assert sandbox_pressure is not None
            assert sandbox_pressure.some_total_us > 0
            # the PSI growth tightened the mark, and the window's end let it back
            assert seen_marks[0] == MARK_BYTES
            assert any(t.startswith("psi some +") for t in triggers)
            assert TIGHT_BYTES in seen_marks
            tightened = seen_marks.index(TIGHT_BYTES)
            assert MARK_BYTES in seen_marks[tightened:]
        finally:
            box.kill_all()
            proc.communicate()
    finally:
        domain.remove()
    assert leftovers(domain.name) == []
