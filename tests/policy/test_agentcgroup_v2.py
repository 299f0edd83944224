"""AgentCgroup's pure decisions: per-tool-call memory.high marks on v2, tightened for Low
sandboxes while the domain shows pressure (PSI stall growth or usage near the limit) and
relaxed after the protection window; the v1 approximation throttles CPU over the mark."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tenon.policy.baselines import (
    AgentCgroupClass,
    AgentCgroupDomainObs,
    AgentCgroupPlan,
    AgentCgroupSandbox,
    AgentCgroupState,
    agentcgroup_actions,
    agentcgroup_pressure,
    agentcgroup_v2_step,
)
from tenon.policy.config import PolicyConfig

MIB = 1 << 20
BUDGET = 2048 * MIB
MARK = 400 * MIB
CONFIG = PolicyConfig()


def make_box(sandbox_id: str = "low-a", *, peak_mib: int = 100,
             usage_mib: int = 50) -> AgentCgroupSandbox:
    return AgentCgroupSandbox(sandbox_id, peak_mib * MIB, usage_mib * MIB)


def make_domain(*, usage_mib: int = 500, limit_mib: int | None = 2048,
                psi_us: int | None = 1000) -> AgentCgroupDomainObs:
    return AgentCgroupDomainObs(usage_mib * MIB, None if limit_mib is None else limit_mib * MIB,
                                psi_us)


def step(boxes=None, domain=None, state=None, now: float = 10.0,
         config: PolicyConfig = CONFIG, budget: int = BUDGET) -> AgentCgroupPlan:
    return agentcgroup_v2_step(
        boxes if boxes is not None else [make_box("low-a"), make_box("high-a", peak_mib=900)],
        domain or make_domain(), state or AgentCgroupState(psi_some_total_us=1000), budget,
        now, config)


def marks_of(plan: AgentCgroupPlan) -> dict[str, int | None]:
    return {m.sandbox_id: m.high_mark_bytes for m in plan.marks}


def test_without_pressure_low_sandboxes_get_the_per_tool_call_mark_and_high_none() -> None:
    plan = step()
    assert marks_of(plan) == {"high-a": None, "low-a": MARK}
    assert [m.klass for m in plan.marks] == [AgentCgroupClass.HIGH, AgentCgroupClass.LOW]
    assert not any(m.throttle_cpu for m in plan.marks)  # v2 throttles in the kernel
    assert plan.trigger is None
    assert plan.state == AgentCgroupState(None, 1000)


def test_psi_stall_growth_tightens_low_marks_to_an_equal_share_of_half_the_limit() -> None:
    boxes = [make_box("low-a"), make_box("low-b"), make_box("low-c"),
             make_box("high-a", peak_mib=900)]
    plan = step(boxes, make_domain(psi_us=1800), now=10.0)
    share = BUDGET // 2 // 3  # about 341 MiB, under the 400 MiB mark
    assert marks_of(plan) == {"high-a": None, "low-a": share, "low-b": share, "low-c": share}
    assert plan.trigger == "psi some +800 us"
    assert plan.state == AgentCgroupState(10.0, 1800)


def test_a_share_above_the_mark_keeps_the_mark() -> None:
    plan = step([make_box()], make_domain(limit_mib=8192, psi_us=5000), budget=8192 * MIB)
    assert plan.trigger is not None
    assert marks_of(plan) == {"low-a": MARK}


def test_usage_near_the_limit_is_pressure_without_psi() -> None:
    near = make_domain(usage_mib=int(0.85 * 2048) + 1, psi_us=None)
    three = [make_box("low-a"), make_box("low-b"), make_box("low-c")]
    plan = step(three, near, state=AgentCgroupState())
    assert plan.trigger is not None
    assert plan.trigger.startswith("usage 85%")
    assert set(marks_of(plan).values()) == {BUDGET // 2 // 3}
    below = make_domain(usage_mib=int(0.85 * 2048) - 8, psi_us=None)
    assert step([make_box()], below, state=AgentCgroupState()).trigger is None
    unlimited = make_domain(usage_mib=4096, limit_mib=None, psi_us=None)
    assert agentcgroup_pressure(unlimited, None, CONFIG) is None


def test_no_psi_baseline_or_no_growth_is_no_pressure() -> None:
    assert step(state=AgentCgroupState()).trigger is None  # the first reading sets the baseline
    assert step(domain=make_domain(psi_us=1000)).trigger is None


def test_the_window_holds_the_tight_marks_then_relaxes_and_checks_afresh() -> None:
    boxes = [make_box("low-a"), make_box("low-b"), make_box("low-c"), make_box("low-d")]
    tight = BUDGET // 2 // 4
    first = step(boxes, make_domain(psi_us=2000), now=10.0)
    assert first.state.protected_since == 10.0
    # within the window: still tight, no new trigger, and the baseline stays where it was
    # (stalls during the window are weighed once it ends)
    held = step(boxes, make_domain(psi_us=2600), state=first.state, now=10.9)
    assert set(marks_of(held).values()) == {tight}
    assert held.trigger is None
    assert held.state == AgentCgroupState(10.0, 2000)
    # the window is over: normal marks again, and the PSI seen now is the new baseline
    relaxed = step(boxes, make_domain(psi_us=2600), state=held.state, now=11.0)
    assert set(marks_of(relaxed).values()) == {MARK}
    assert relaxed.state == AgentCgroupState(None, 2600)
    calm = step(boxes, make_domain(psi_us=2600), state=relaxed.state, now=11.1)
    assert set(marks_of(calm).values()) == {MARK}
    again = step(boxes, make_domain(psi_us=2700), state=calm.state, now=11.2)
    assert set(marks_of(again).values()) == {tight}
    assert again.state.protected_since == 11.2


def test_the_window_and_share_come_from_the_config() -> None:
    config = PolicyConfig(agentcgroup_protection_window_s=5.0,
                          agentcgroup_low_share_fraction=0.25)
    boxes = [make_box("low-a"), make_box("low-b")]
    first = step(boxes, make_domain(psi_us=2000), now=0.0, config=config)
    assert marks_of(first) == {"low-a": BUDGET // 8, "low-b": BUDGET // 8}
    later = step(boxes, make_domain(psi_us=2000), state=first.state, now=4.9, config=config)
    assert marks_of(later) == marks_of(first)
    after = step(boxes, make_domain(psi_us=2000), state=later.state, now=5.0, config=config)
    assert set(marks_of(after).values()) == {MARK}
    with pytest.raises(ValidationError):
        PolicyConfig(agentcgroup_low_share_fraction=1.5)
    with pytest.raises(ValidationError):
        PolicyConfig(agentcgroup_protection_window_s=0)


def test_v1_keeps_throttling_cpu_of_low_sandboxes_over_the_mark() -> None:
    boxes = [make_box("low-over", usage_mib=450), make_box("low-under", usage_mib=100),
             make_box("high-a", peak_mib=900, usage_mib=800)]
    actions = {a.sandbox_id: a for a in agentcgroup_actions(boxes, BUDGET, 1, CONFIG)}
    assert actions["low-over"].throttle_cpu
    assert not actions["low-under"].throttle_cpu
    assert not actions["high-a"].throttle_cpu
    assert actions["low-over"].high_mark_bytes == MARK
    assert not any(a.throttle_cpu for a in agentcgroup_actions(boxes, BUDGET, 2, CONFIG))
