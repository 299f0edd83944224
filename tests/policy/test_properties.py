from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tenon.policy import (
    AdmissionController,
    AimdBudget,
    ChargeNotHeld,
    PolicyConfig,
    Pressure,
    choose_reclaim,
)
from tenon.policy.gate import gate_demand_bytes
from tenon.policy.residency import IdleSandbox

from .factories import MIB, gate_decision, make_estimate, make_idle, make_request

CONFIG = PolicyConfig()
rates = st.one_of(st.none(), st.floats(-64 * MIB, 512 * MIB, allow_nan=False))
estimates_st = st.lists(st.tuples(rates, st.booleans()), max_size=40)
levels = st.sampled_from(list(Pressure))


def _estimates(items: list[tuple[float | None, bool]]):
    return {
        f"sb-{i}": make_estimate(f"sb-{i}", rate, 0.0, allowed)
        for i, (rate, allowed) in enumerate(items)
    }


@given(
    estimates_st,
    levels,
    st.integers(0, 2048 * MIB),
    st.integers(1, 4),
    st.dictionaries(st.sampled_from([f"sb-{i}" for i in range(40)]), st.floats(0, 10)),
    st.integers(0, 2048 * MIB),
    st.dictionaries(st.sampled_from([f"sb-{i}" for i in range(40)]),
                    st.integers(-64 * MIB, 512 * MIB)),
    st.dictionaries(st.sampled_from([f"sb-{i}" for i in range(40)]), st.floats(0, 10)),
    st.frozensets(st.sampled_from([f"sb-{i}" for i in range(40)])),
)
def test_gate_invariants(items, level, headroom, b, denied_since, free, caps,
                         outgrown_since, pending) -> None:
    ests = _estimates(items)
    now = 10.0
    d = gate_decision(ests, level, headroom, now, CONFIG, budget_b=b, denied_since=denied_since,
                    growth_caps=caps, free_bytes=free, outgrown_since=outgrown_since,
                    pending=pending)
    assert d.allowed | d.denied == frozenset(ests)
    assert not d.allowed & d.denied
    demand = {s: gate_demand_bytes(ests[s], caps.get(s), CONFIG) for s in ests}
    # Outgrown growers are served in the order they outgrew: one is let grow only into the
    # room H leaves after the demands of those ahead of it (liveness aside: see below).
    order = sorted((s for s in ests if s in outgrown_since and demand[s] > 0
                    and caps.get(s, 1) <= 0 and ests[s].rate_bytes_per_s is not None),
                   key=lambda s: (outgrown_since[s], s))
    for i, s in enumerate(order):
        ahead = sum(demand[o] for o in order[:i])
        if ahead and ahead + demand[s] > headroom:
            assert s in d.denied
            assert "outgrew its prediction after" in d.reasons[s]
    queued = {s for s in d.denied if "outgrew its prediction after" in d.reasons[s]}
    if level is Pressure.GREEN:
        # Green holds only sandboxes already held that outgrew their prediction (a measured
        # rate, cap <= 0) and whose demand exceeds H, and those waiting for earlier ones.
        for s in d.denied - queued:
            assert s in denied_since
            assert caps.get(s, 1) <= 0
            assert ests[s].rate_bytes_per_s is not None
            assert demand[s] > headroom
        for s in d.allowed:
            outgrown = s in caps and caps[s] <= 0 and ests[s].rate_bytes_per_s is not None
            if s in denied_since and outgrown and demand[s] > headroom and s not in order[1:]:
                # Released only by liveness: alone among running growers (a start not yet
                # launched has no measured rate and waits for room too), overdue, no room.
                assert not [o for o in d.allowed if o != s and demand[o] > 0
                            and ests[o].allowed and ests[o].rate_bytes_per_s is not None]
                assert now - denied_since[s] >= CONFIG.overdue_after_s
        return
    positive = [s for s in d.allowed if demand[s] > 0]
    # Starts wait while a sandbox holding memory is held past overdue (not for its turn).
    starving = [s for s in d.denied if s not in pending and s not in queued and demand[s] > 0
                and s in denied_since and now - denied_since[s] >= CONFIG.overdue_after_s]
    if starving:
        assert not [s for s in positive if s in pending]
    probes = [s for s in positive if "probe" in d.reasons[s] and "fits" not in d.reasons[s]]
    if probes:
        # The one allowance beyond H: a lone probe when nothing fits, either the grower that
        # was already running or one that waited past the overdue threshold.
        assert positive == probes  # alone: nothing else grows (plateaus may run on)
        assert len(probes) == 1
        probe = probes[0]
        was_running = ests[probe].allowed
        overdue = probe in denied_since and now - denied_since[probe] >= CONFIG.overdue_after_s
        assert was_running or overdue
        return
    assert sum(demand[s] for s in positive) <= headroom
    above_line = [s for s in positive if "above the yellow line" in d.reasons[s]]
    if level is Pressure.RED:
        assert not above_line
        assert len(positive) <= 1
    else:
        assert sum(demand[s] for s in above_line) <= free
        assert len(positive) - len(above_line) <= b


def test_overdue_head_probes_alone_when_nothing_fits() -> None:
    ests = _estimates([(400 * MIB, False), (300 * MIB, False)])
    fresh = gate_decision(ests, Pressure.RED, 10 * MIB, 10.0, CONFIG, budget_b=1,
                        denied_since={"sb-0": 9.0, "sb-1": 8.5})
    assert fresh.allowed == frozenset()  # waited 1-1.5 s: not overdue yet, nothing fits H
    late = gate_decision(ests, Pressure.RED, 10 * MIB, 12.0, CONFIG, budget_b=1,
                       denied_since={"sb-0": 9.0, "sb-1": 8.5})
    assert late.allowed == frozenset({"sb-1"})  # both overdue: the smaller demand goes first
    assert "overdue probe" in late.reasons["sb-1"]
    # A sandbox at its plateau frees its memory only when its action ends: it does not keep
    # the probe from running (a 36 s one kept two held test runs waiting on the replay).
    ests["plateau"] = make_estimate("plateau", 0.0, 0.0, True)
    beside = gate_decision(ests, Pressure.RED, 10 * MIB, 12.0, CONFIG, budget_b=1,
                         denied_since={"sb-0": 9.0, "sb-1": 8.5})
    assert beside.allowed == frozenset({"sb-1", "plateau"})
    # ...unless its end would make the room: then the probe waits for it, but only for
    # `plateau_patience_s` (at 3x a test run 0.1 GiB short waited 32 s for 40 s actions).
    # The probe then overshoots H only into the safety margin S: a larger shortfall keeps
    # waiting for the plateau's end (two growers' peaks would meet).
    gives = {"plateau": 400 * MIB}
    near = 300 * MIB - CONFIG.safety_margin_bytes  # sb-1's 300 MiB fits in H + S
    patience_over = 8.5 + CONFIG.plateau_patience_s + 0.1

    def decide(now: float, headroom: int):
        return gate_decision(ests, Pressure.RED, headroom, now, CONFIG, budget_b=1,
                           denied_since={"sb-0": 9.0, "sb-1": 8.5}, gives_back=gives)

    assert decide(12.0, near).allowed == frozenset({"plateau"})
    waited = decide(patience_over, near)
    assert waited.allowed == frozenset({"sb-1", "plateau"})
    assert "overdue probe" in waited.reasons["sb-1"]
    assert decide(patience_over, near - 1).allowed == frozenset({"plateau"})


@given(st.lists(levels, max_size=60), st.floats(0.05, 3.0))
def test_aimd_b_bounds_and_halving(seq, dt) -> None:
    budget = AimdBudget.initial(CONFIG)
    now = 0.0
    for level in seq:
        now += dt
        nxt = budget.step(level, now, CONFIG)
        assert 1 <= nxt.b <= CONFIG.yellow_bmax
        if level > budget.last_level:
            assert nxt.b == max(1, budget.b // 2)
        budget = nxt


@given(
    st.lists(st.tuples(st.integers(0, 900), st.integers(0, 900)), max_size=30), st.integers(0, 4096)
)
def test_charge_released_exactly_once(sizes, headroom_mib) -> None:
    ac = AdmissionController(CONFIG, 2048 * MIB)
    for i, (avg, extra) in enumerate(sizes):
        ac.submit(make_request(f"a{i}", avg_bytes=avg * MIB, peak_bytes=(avg + extra) * MIB))
    admitted = ac.decide(1.0, headroom_mib * MIB)
    assert sum(d.charge_bytes for d in admitted) == ac.admitted_total_bytes
    for d in admitted:
        assert ac.release(d.action_id) == d.charge_bytes
        with pytest.raises(ChargeNotHeld):
            ac.release(d.action_id)
    assert ac.admitted_total_bytes == 0


@settings(max_examples=30, deadline=None)
@given(st.integers(50, 400), st.integers(1, 5), st.integers(1200, 1900))
def test_heavy_never_starved_by_light_stream(light_mib, light_duration_steps, heavy_mib) -> None:
    ac = AdmissionController(CONFIG, 2048 * MIB)
    ac.submit(make_request("heavy", avg_bytes=heavy_mib * MIB, peak_bytes=heavy_mib * MIB))
    running: dict[str, int] = {}
    heavy_admitted_at = None
    for step in range(2000):
        now = step * 0.1
        ac.submit(
            make_request(
                f"l{step}", avg_bytes=light_mib * MIB, peak_bytes=light_mib * MIB, ready_at=now
            )
        )
        for aid, end in list(running.items()):
            if end <= step:
                ac.release(aid)
                del running[aid]
        for d in ac.decide(now, 4096 * MIB):
            if d.action_id == "heavy":
                heavy_admitted_at = now
            else:
                running[d.action_id] = step + light_duration_steps
        if heavy_admitted_at is not None:
            break
    assert heavy_admitted_at is not None


def test_reclaim_takes_the_youngest_workflow_first_then_the_largest() -> None:
    """Admission serves the oldest workflow first: the youngest's sandbox idles longest."""
    old_big = IdleSandbox("old-big", 500 * MIB, True, rank_at=1.0)
    young_small = IdleSandbox("young-small", 50 * MIB, True, rank_at=9.0)
    young_big = IdleSandbox("young-big", 80 * MIB, True, rank_at=9.0)
    boxes = [old_big, young_small, young_big]
    assert choose_reclaim(boxes, Pressure.YELLOW, 60 * MIB) == ["young-big"]
    assert choose_reclaim(boxes, Pressure.RED, 100 * MIB) == ["young-big", "young-small"]
    assert choose_reclaim(boxes, Pressure.RED, 200 * MIB) == [
        "young-big", "young-small", "old-big"]


@given(
    st.lists(st.tuples(st.integers(0, 2000), st.booleans()), max_size=30),
    levels,
    st.integers(0, 8000),
)
def test_resident_only_never_reclaimed(boxes, level, needed_mib) -> None:
    idle = [make_idle(f"sb-{i}", ws * MIB, r) for i, (ws, r) in enumerate(boxes)]
    chosen = set(choose_reclaim(idle, level, needed_mib * MIB))
    assert all(b.restartable for b in idle if b.sandbox_id in chosen)
    if level is Pressure.GREEN:
        assert not chosen


def test_starts_wait_for_a_grower_frozen_past_overdue() -> None:
    """Under yellow a held grower that does not fit keeps its place: a start that holds no
    memory yet does not take the slot and the room it waits for. Without a frozen grower
    past overdue the start goes."""
    ests = {"grower": make_estimate("grower", 400 * MIB, 9.0, False),
            "start": make_estimate("start", None, None, False)}

    def decide(grower_since: float):
        return gate_decision(ests, Pressure.YELLOW, 300 * MIB, 10.0, CONFIG, budget_b=1,
                           denied_since={"grower": grower_since},
                           growth_caps={"grower": 800 * MIB, "start": 64 * MIB},
                           reclaimable_bytes=1024 * MIB, pending=frozenset({"start"}))

    held = decide(grower_since=5.0)  # denied 5 s: overdue
    assert held.denied == {"grower", "start"}
    assert "waits for grower" in held.reasons["start"]
    fresh = decide(grower_since=9.5)  # denied 0.5 s: not yet overdue
    assert "start" in fresh.allowed
