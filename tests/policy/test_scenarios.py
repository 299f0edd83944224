from __future__ import annotations

import pydantic
import pytest

from tenon.errors import ConfigError
from tenon.policy import (
    GateController,
    LifecycleSlots,
    PolicyConfig,
    Pressure,
    Residency,
    ResidencySnapshot,
    classify_pressure,
    parse_policy,
    residency_decision,
)
from tenon.policy.admission import AdmissionController, Prediction, past_peak_charge
from tenon.policy.pressure import red_line_bytes, yellow_line_bytes
from tenon.replay.gate_bench import bench_gate

from .factories import MIB, gate_decision, make_config, make_idle, make_request, make_sample


def _run(gate: GateController, ids, steps, level, headroom, start=0.0, grow=32 * MIB):
    """Fake time loop: every allowed sandbox grows `grow` per second of CPU."""
    usage = dict.fromkeys(ids, 64 * MIB)
    cpu = dict.fromkeys(ids, 0.0)
    allowed = set(ids)
    decision = None
    for k in range(steps):
        now = start + k * 0.1
        for s in allowed:
            usage[s] += int(grow * 0.1)
            cpu[s] += 0.1
        gate.observe(make_sample(s, now, usage[s], cpu[s], s in allowed) for s in ids)
        decision = gate.decide(level(now) if callable(level) else level, headroom, now)
        allowed = set(decision.allowed)
    return decision


def test_synchronized_burst_under_yellow_runs_at_most_b() -> None:
    gate = GateController(PolicyConfig())
    ids = [f"sb-{i}" for i in range(20)]
    d = _run(gate, ids, 30, Pressure.YELLOW, 1024 * MIB)
    assert d is not None
    assert len(d.allowed) <= d.budget_b == gate.aimd.b


def test_growing_sandbox_held_under_red_while_one_probe_runs() -> None:
    gate = GateController(PolicyConfig())
    d = _run(gate, ["a", "b", "c"], 30, Pressure.RED, 512 * MIB)
    assert d is not None
    assert len(d.allowed) == 1
    assert len(d.denied) == 2


def test_recovery_to_green_grows_b_back() -> None:
    config = PolicyConfig()
    gate = GateController(config)
    gate.decide(Pressure.GREEN, 0, 0.0)
    for t in range(1, 16):
        gate.decide(Pressure.GREEN, 0, float(t))
    assert gate.aimd.b == 4  # 1 + 3 steps of 5 s
    gate.decide(Pressure.YELLOW, 0, 16.0)
    assert gate.aimd.b == 2
    gate.decide(Pressure.RED, 0, 16.1)
    assert gate.aimd.b == 1
    ids = ["x", "y", "z"]
    d = _run(gate, ids, 60, Pressure.GREEN, 0, start=17.0)
    assert d is not None
    assert gate.aimd.b == 2  # +1 after 5 s of continuous green
    assert d.allowed == frozenset(ids)


def test_ewma_ignores_invalid_intervals() -> None:
    gate = GateController(PolicyConfig())
    gate.observe([make_sample("s", 0.0, 100 * MIB, 0.0, True)])
    assert gate.estimates["s"].rate_bytes_per_s is None  # bootstrap
    gate.observe([make_sample("s", 0.1, 110 * MIB, 0.0, True)])  # no CPU gained
    gate.observe([make_sample("s", 0.2, 120 * MIB, 0.1, False)])  # permission change
    assert gate.estimates["s"].rate_bytes_per_s is None
    gate.observe([make_sample("s", 0.3, 120 * MIB, 0.2, False)])  # held throughout
    assert gate.estimates["s"].rate_bytes_per_s is None
    gate.observe([make_sample("s", 0.4, 120 * MIB, 0.3, True)])  # permission change
    gate.observe([make_sample("s", 0.5, 121 * MIB, 0.4, True)])  # valid: 10 MiB/s
    assert gate.estimates["s"].rate_bytes_per_s == pytest.approx(10 * MIB)
    gate.observe([make_sample("s", 0.6, 131 * MIB, 0.5, True)])  # valid: 100 MiB/s
    assert gate.estimates["s"].rate_bytes_per_s == pytest.approx(0.35 * 100 * MIB + 0.65 * 10 * MIB)
    # an unsettled freeze: CPU time still rises while held, memory flat; not "no growth"
    gate.observe([make_sample("s", 0.7, 131 * MIB, 0.6, False)])
    for k in range(8, 30):
        gate.observe([make_sample("s", k / 10, 131 * MIB, k / 10, False)])
    assert gate.estimates["s"].rate_bytes_per_s == pytest.approx(0.35 * 100 * MIB + 0.65 * 10 * MIB)


def test_unknown_config_key_is_rejected_by_name() -> None:
    with pytest.raises(pydantic.ValidationError, match="ewma_alfa"):
        make_config(ewma_alfa=0.3)


def test_pressure_red_takes_priority() -> None:
    config = PolicyConfig()
    budget = 4096 * MIB
    margin = config.safety_margin(budget)
    red_line = red_line_bytes(budget, config)
    yellow_line = yellow_line_bytes(budget, config)
    assert classify_pressure(budget, 0, 0, config).level is Pressure.GREEN
    in_yellow = int((red_line + yellow_line) / 2)
    yellow = classify_pressure(budget, budget - margin - in_yellow, 0, config)
    assert yellow.level is Pressure.YELLOW
    in_red = int(red_line / 2)
    red = classify_pressure(budget, budget - margin - in_red, budget, config)
    assert red.level is Pressure.RED  # physical red wins over everything


def test_predicted_growth_raises_yellow_never_red() -> None:
    config = PolicyConfig()
    budget = 4096 * MIB
    margin = config.safety_margin(budget)
    promised_to_yellow = budget - margin - int(yellow_line_bytes(budget, config)) + MIB
    assert classify_pressure(budget, 0, promised_to_yellow, config).level is Pressure.YELLOW
    assert classify_pressure(budget, 0, budget, config).level is Pressure.YELLOW
    assert classify_pressure(budget, 0, 100 * MIB, config).level is Pressure.GREEN


def test_the_reserves_scale_with_the_budget() -> None:
    """S is a fraction of the budget up to its cap, and the regions are fractions: what
    Tenon holds back (S plus both regions) is the same share of a small budget as of a
    large one, until S reaches its cap."""
    config = PolicyConfig()
    assert config.safety_margin(8 << 30) == config.safety_margin_bytes  # capped
    assert config.safety_margin(1 << 30) == int((1 << 30) * config.safety_margin_fraction)

    def held_back_share(budget: int) -> float:
        return (config.safety_margin(budget) + yellow_line_bytes(budget, config)) / budget

    assert held_back_share(1536 * MIB) == pytest.approx(held_back_share(1 << 30))
    assert held_back_share(1536 * MIB) < 0.25  # the paper's reserves: 42%
    assert held_back_share(8 << 30) < held_back_share(1536 * MIB)
    # the first byte of yellow is where H meets the yellow line
    budget = 1536 * MIB
    first_yellow = budget - config.safety_margin(budget) - int(yellow_line_bytes(budget, config))
    assert classify_pressure(budget, first_yellow - MIB, 0, config).level is Pressure.GREEN
    assert classify_pressure(budget, first_yellow + MIB, 0, config).level is Pressure.YELLOW


def test_residency_never_tears_down_resident_only() -> None:
    snap = ResidencySnapshot(make_idle(restartable=False), Pressure.RED, LifecycleSlots(2))
    assert residency_decision(snap, 0.0, PolicyConfig()).action is Residency.RETAIN
    snap = ResidencySnapshot(make_idle(predicted_wait_s=60), Pressure.GREEN, LifecycleSlots(2))
    assert residency_decision(snap, 0.0, PolicyConfig()).action is Residency.TEAR_DOWN


def test_policy_names() -> None:
    assert parse_policy("static-4").max_workflows == 4
    assert not parse_policy("tenon-no-gate").use_gate
    with pytest.raises(ConfigError, match="unknown policy"):
        parse_policy("fifo")


def test_bench_gate_reports_the_recorded_keys() -> None:
    # The figure itself is a benchmark (tenon bench gate), recorded in bench/results.
    result = bench_gate(50, 5)
    assert set(result) == {"sandboxes", "decide_ms_p50", "decide_ms_p99"}
    assert result["sandboxes"] == 50
    assert 0 < result["decide_ms_p50"] <= result["decide_ms_p99"]


def test_admission_serves_the_oldest_workflow_first_then_readiness() -> None:
    config = make_config()
    ctl = AdmissionController(config, window_bytes=250 * MIB)
    # w-new's action became ready first, but w-old started earlier: w-old goes first
    ctl.submit(make_request("new-1", "w-new", 100 * MIB, 100 * MIB, ready_at=1.0,
                            rank_at=0.5))
    ctl.submit(make_request("old-2", "w-old", 100 * MIB, 100 * MIB, ready_at=2.0,
                            rank_at=0.0))
    ctl.submit(make_request("old-1", "w-old", 100 * MIB, 100 * MIB, ready_at=1.5,
                            rank_at=0.0))
    admitted = [d.action_id for d in ctl.decide(now=3.0, headroom_bytes=10 * 1024 * MIB)]
    assert admitted == ["old-1", "old-2"]  # the window holds two; w-new waits
    ctl.release("old-1")
    assert [d.action_id for d in ctl.decide(now=3.0, headroom_bytes=10 * 1024 * MIB)] == [
        "new-1"]


def test_a_heavy_action_is_charged_its_predicted_peak_and_a_second_waits_for_room() -> None:
    """In an empty window the water level charges about the average. A heavy action's start
    waits for its peak, so at that charge light work and a second heavy one whose peak
    cannot fit beside it were admitted into the room it needs."""
    gib = 1024 * MIB
    ctl = AdmissionController(make_config(), window_bytes=3 * gib)
    ctl.submit(make_request("test-1", "w-a", 180 * MIB, 1600 * MIB, ready_at=0.0))
    ctl.submit(make_request("test-2", "w-b", 180 * MIB, 1800 * MIB, ready_at=0.5))
    ctl.submit(make_request("light", "w-c", 100 * MIB, 100 * MIB, ready_at=1.0))
    decisions = ctl.decide(now=2.0, headroom_bytes=3 * gib)
    assert [(d.action_id, d.heavy) for d in decisions] == [("test-1", True), ("light", False)]
    assert decisions[0].charge_bytes == 1600 * MIB
    assert ctl.decide(now=3.0, headroom_bytes=3 * gib) == []  # 1.8 GiB does not fit beside
    ctl.release("test-1")
    assert [d.charge_bytes for d in ctl.decide(now=4.0, headroom_bytes=3 * gib)] == [
        1800 * MIB]


def test_a_heavy_action_is_admitted_on_window_room_and_bootstrap_headroom() -> None:
    """A heavy action takes its predicted peak from the logical window, but needs only
    bootstrap headroom to be admitted: the gate meters what it grows, and idle memory is
    reclaimed as far as it does."""
    gib = 1024 * MIB
    ctl = AdmissionController(make_config(), window_bytes=2 * gib)
    ctl.submit(make_request("test", "w-a", 180 * MIB, 1600 * MIB, ready_at=0.0))
    ctl.submit(make_request("light", "w-b", 450 * MIB, 450 * MIB, ready_at=0.5))
    decisions = ctl.decide(now=1.0, headroom_bytes=400 * MIB)
    # the light one does not fit the window beside the heavy charge
    assert [(d.action_id, d.charge_bytes) for d in decisions] == [("test", 1600 * MIB)]
    assert ctl.stuck_charge(1.0, 400 * MIB, waited_s=0.0) == 0


def test_admission_never_holds_more_than_the_action_cap() -> None:
    ctl = AdmissionController(make_config(), window_bytes=1 << 40, max_admitted_actions=2)
    for i in range(4):
        ctl.submit(make_request(f"a-{i}", f"w-{i}", 10 * MIB, 10 * MIB, ready_at=float(i)))
    assert [d.action_id for d in ctl.decide(now=5.0, headroom_bytes=1 << 40)] == ["a-0", "a-1"]
    assert ctl.decide(now=6.0, headroom_bytes=1 << 40) == []
    ctl.release("a-0")
    assert [d.action_id for d in ctl.decide(now=7.0, headroom_bytes=1 << 40)] == ["a-2"]


def test_an_overdue_light_action_keeps_its_room_from_the_ones_behind_it() -> None:
    """A 900 MiB light action (no heavy credit) that does not fit: before overdue, a small
    one behind it takes the gap; once overdue, the gap stays for it."""
    ctl = AdmissionController(make_config(overdue_after_s=3.0), window_bytes=1000 * MIB)
    ctl.submit(make_request("running", "w-r", 400 * MIB, 400 * MIB, ready_at=0.0))
    assert [d.action_id for d in ctl.decide(now=0.0, headroom_bytes=1 << 40)] == ["running"]
    ctl.submit(make_request("big", "w-big", 900 * MIB, 900 * MIB, ready_at=1.0))
    ctl.submit(make_request("small-1", "w-s1", 50 * MIB, 50 * MIB, ready_at=1.5))
    assert [d.action_id for d in ctl.decide(now=2.0, headroom_bytes=1 << 40)] == ["small-1"]
    ctl.submit(make_request("small-2", "w-s2", 50 * MIB, 50 * MIB, ready_at=3.5))
    assert ctl.decide(now=4.5, headroom_bytes=1 << 40) == []  # "big" is overdue: no gap
    ctl.release("running")
    ctl.release("small-1")
    assert [d.action_id for d in ctl.decide(now=5.0, headroom_bytes=1 << 40)] == [
        "big", "small-2"]


def test_an_action_queued_past_the_starvation_limit_goes_ahead_of_every_rank() -> None:
    """Rank order lets a stream of better-ranked actions pass a last-ranked one for as long
    as the stream lasts; after `starvation_after_s` it goes first."""
    ctl = AdmissionController(make_config(starvation_after_s=30.0), window_bytes=100 * MIB)
    ctl.submit(make_request("last", "w-last", 100 * MIB, 100 * MIB, ready_at=0.0,
                            rank_at=50.0))
    for i, now in enumerate((0.0, 10.0, 20.0, 29.0, 31.0)):
        ctl.submit(make_request(f"s-{i}", f"w-{i}", 100 * MIB, 100 * MIB, ready_at=now,
                                rank_at=float(i)))
        admitted = [d.action_id for d in ctl.decide(now=now, headroom_bytes=1 << 40)]
        ctl.release(admitted[0])
        assert admitted == (["last"] if now >= 30.0 else [f"s-{i}"])


def test_a_queue_held_by_the_action_cap_is_not_stuck_on_memory() -> None:
    """Reclaiming idle sandboxes for a queue the cap holds frees memory nobody may take, and
    costs a rebuild later."""
    ctl = AdmissionController(make_config(), window_bytes=1 << 40, max_admitted_actions=1)
    ctl.submit(make_request("running", "w-r", 10 * MIB, 10 * MIB, ready_at=0.0))
    assert [d.action_id for d in ctl.decide(now=0.0, headroom_bytes=1 << 40)] == ["running"]
    ctl.submit(make_request("queued", "w-q", 500 * MIB, 500 * MIB, ready_at=0.0))
    assert ctl.stuck_charge(10.0, 100 * MIB, waited_s=3.0) == 0
    ctl.release("running")
    assert ctl.stuck_charge(10.0, 100 * MIB, waited_s=3.0) == 500 * MIB


def test_admission_without_workflow_age_is_fifo_by_readiness() -> None:
    ctl = AdmissionController(make_config(), window_bytes=150 * MIB)
    ctl.submit(make_request("late", "w-a", 100 * MIB, 100 * MIB, ready_at=2.0))
    ctl.submit(make_request("early", "w-b", 100 * MIB, 100 * MIB, ready_at=1.0))
    assert [d.action_id for d in ctl.decide(now=3.0, headroom_bytes=1 << 40)] == ["early"]


def test_a_charge_shrinks_once_the_action_has_passed_its_peak() -> None:
    config = make_config()
    predicted = Prediction(200 * MIB, 1600 * MIB)

    def passed(peak: int, usage: int, **kw: object) -> int | None:
        cfg = make_config(**kw) if kw else config
        return past_peak_charge(1000 * MIB, predicted, start_bytes=20 * MIB, peak_bytes=peak,
                                usage_bytes=usage, config=cfg)

    # rose to 1.5 GiB and fell back to 30 MiB: it holds its predicted average from now on
    assert passed(1500 * MIB, 30 * MIB) == 200 * MIB
    # fell back, but above the average: it keeps what it holds
    assert passed(1500 * MIB, 700 * MIB) == 700 * MIB
    assert passed(1500 * MIB, 800 * MIB) is None  # still above half its peak
    assert passed(700 * MIB, 30 * MIB) is None  # never came near its predicted peak
    assert passed(20 * MIB, 20 * MIB) is None  # never grew
    assert passed(1500 * MIB, 30 * MIB, peak_release_fraction=0.0) is None  # turned off

    ctl = AdmissionController(config, window_bytes=1200 * MIB)
    ctl.submit(make_request("heavy", "w-h", 1000 * MIB, 1000 * MIB))
    ctl.submit(make_request("light", "w-l", 300 * MIB, 300 * MIB, ready_at=0.1))
    first = ctl.decide(now=1.0, headroom_bytes=1 << 40)
    assert [d.action_id for d in first] == ["heavy"]  # the light one does not fit beside it
    assert ctl.shrink("heavy", 200 * MIB) == first[0].charge_bytes - 200 * MIB
    assert ctl.shrink("heavy", 900 * MIB) == 0  # a charge never grows back
    assert [d.action_id for d in ctl.decide(now=1.0, headroom_bytes=1 << 40)] == ["light"]
    assert ctl.release("heavy") == 200 * MIB


def test_green_keeps_a_held_grower_that_outgrew_its_prediction_while_it_does_not_fit() -> None:
    from .factories import make_estimate

    config = PolicyConfig()
    ests = {"big": make_estimate("big", 800 * MIB, 9.9, False),  # measured: 800 MiB over 1 s
            "light": make_estimate("light", 32 * MIB, 9.9, False)}
    caps = {"big": -10 * MIB, "light": 100 * MIB}  # big is past its predicted peak

    def decide(headroom, *, since=9.0, reclaimable=0, ids=("big", "light")):
        return gate_decision({s: ests[s] for s in ids}, Pressure.GREEN, headroom, 10.0, config,
                           budget_b=1, denied_since={s: since for s in ids},
                           growth_caps=caps, reclaimable_bytes=reclaimable)

    d = decide(400 * MIB)
    assert d.denied == {"big"}
    assert d.allowed == {"light"}
    assert "outgrew its prediction" in d.reasons["big"]
    assert decide(900 * MIB).allowed == {"big", "light"}  # its demand fits H
    # Green never freezes a running sandbox: only one already held is kept.
    running = gate_decision(ests, Pressure.GREEN, 400 * MIB, 10.0, config, budget_b=1,
                          denied_since={}, growth_caps=caps)
    assert running.allowed == {"big", "light"}
    # Liveness: alone, overdue, and no idle memory to reclaim: waiting cannot help.
    assert decide(400 * MIB, since=9.0, ids=("big",)).denied == {"big"}  # not yet overdue
    assert decide(400 * MIB, since=5.0, ids=("big",)).allowed == {"big"}
    assert decide(400 * MIB, since=5.0, reclaimable=1024 * MIB, ids=("big",)).denied == {"big"}


@pytest.mark.parametrize("fraction", [1.0, 0.0])
def test_an_outgrown_grower_demands_at_least_its_overshoot_while_it_grows(
    fraction: float,
) -> None:
    from tenon.policy.gate import gate_demand_bytes

    from .factories import make_estimate

    config = make_config(outgrown_demand_fraction=fraction)
    growing = make_estimate("big", 80 * MIB, 9.9, False)  # 80 MiB a horizon between holds
    overshoot = 1000 * MIB  # 1.1 GiB used, predicted ~100 MiB
    demand = gate_demand_bytes(growing, -overshoot, config)
    assert demand == (overshoot if fraction else 80 * MIB)
    # at its plateau it demands nothing, however far it outgrew its prediction
    assert gate_demand_bytes(make_estimate("big", 1 * MIB, 5.0, True), -overshoot, config) == 0
    # within its prediction the cap still bounds the projection
    assert gate_demand_bytes(growing, 50 * MIB, config) == 50 * MIB

    # Yellow with 700 MiB of headroom, 400 MiB of it above the yellow line: the measured
    # rate alone fits there; the overshoot does not fit at all, so it stays held.
    decision = gate_decision({"big": growing}, Pressure.YELLOW, 700 * MIB, 10.0, config,
                           budget_b=1, denied_since={"big": 8.0},
                           growth_caps={"big": -overshoot}, free_bytes=400 * MIB)
    assert ("big" in decision.denied) == bool(fraction)


def test_a_probe_let_go_past_plateau_patience_keeps_running() -> None:
    """A grower with no room, beside an action at its plateau whose end would make it: the
    gate waits `plateau_patience_s` for that end, then lets the grower run as the probe and
    keeps it running. The probe's own brief runs must not restart the wait (at 3x on the
    replay a test run then grew for 0.2 s every 5 s, for 27 s)."""
    config = PolicyConfig()
    gate = GateController(config)
    usage = {"grower": 64 * MIB, "plateau": 512 * MIB}
    cpu = {"grower": 0.3, "plateau": 0.3}
    allowed = {"grower", "plateau"}
    ran_at: list[float] = []
    for k in range(-3, 0):  # both measured first: the plateau's rate is 0, not unknown
        gate.observe(make_sample(s, k * 0.1, usage[s], (k + 3) * 0.1, True) for s in usage)
    for k in range(200):
        now = k * 0.1
        for s in allowed:
            cpu[s] += 0.1
        if "grower" in allowed:
            usage["grower"] += 8 * MIB
        gate.observe(make_sample(s, now, usage[s], cpu[s], s in allowed) for s in usage)
        decision = gate.decide(Pressure.YELLOW, 16 * MIB, now,
                               gives_back={"plateau": 448 * MIB})
        allowed = set(decision.allowed)
        assert "plateau" in allowed  # no projected growth: never held
        if "grower" in allowed:
            ran_at.append(now)
    assert min(t for t in ran_at if t > 1.0) >= config.plateau_patience_s  # it waited first
    after = [t for t in ran_at if t >= config.plateau_patience_s + 1.0]
    assert len(after) >= 0.9 * (20.0 - config.plateau_patience_s - 1.0) / 0.1
