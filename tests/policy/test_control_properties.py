"""Properties of one control period's plan (`ControlPolicy.step`) and of the decisions it is
made of: reclaim, predictive rebuilds, launches, charges past their peaks."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tenon.policy import AdmissionController, PolicyConfig, Pressure
from tenon.policy.control import ControlPolicy, ControlSnapshot
from tenon.policy.execution import ActionObs, ExecutionPolicy, TickSnapshot
from tenon.policy.growth import SandboxSample
from tenon.policy.pressure import classify_pressure, yellow_line_bytes
from tenon.policy.reclaim import (
    AgentObs,
    WaitingWork,
    predictive_rebuilds,
    reclaim_candidates,
    reclaim_deficit_bytes,
)
from tenon.policy.residency import LifecycleSlots
from tenon.predict.base import Prediction

from .factories import MIB

CONFIG = PolicyConfig()
GIB = 1024 * MIB


def make_agent(agent_id: str = "ag-0", *, restartable: bool = True, resident: bool = True,
               busy: bool = False, torn_down: bool = False, closed: bool = False,
               in_lifecycle: bool = False, idle_bytes: int = 100 * MIB, rank: float = 0.0,
               last_done_at: float | None = 0.0,
               predicted_wait_s: float | None = 10.0) -> AgentObs:
    return AgentObs(agent_id, restartable, resident, busy, torn_down, closed, in_lifecycle,
                    idle_bytes, rank, last_done_at, predicted_wait_s)


def make_action(action_id: str = "a-0", *, agent_id: str | None = None,
                avg_bytes: int = 50 * MIB, peak_bytes: int = 200 * MIB,
                charge_bytes: int | None = None, started: bool = True, launched: bool = True,
                allowed: bool = True, held_since: float | None = None,
                usage_bytes: int = 50 * MIB, start_bytes: int | None = 10 * MIB,
                peak_seen_bytes: int | None = None, ready_at: float = 0.0) -> ActionObs:
    return ActionObs(action_id, agent_id or f"ag-{action_id}", f"sb-{action_id}",
                     Prediction(avg_bytes, peak_bytes),
                     charge_bytes if charge_bytes is not None else peak_bytes, ready_at,
                     started, launched, allowed, held_since, usage_bytes, start_bytes,
                     peak_seen_bytes if peak_seen_bytes is not None else usage_bytes)


agents_st = st.lists(
    st.builds(make_agent, restartable=st.booleans(), resident=st.booleans(),
              busy=st.booleans(), torn_down=st.booleans(), closed=st.booleans(),
              in_lifecycle=st.booleans(), idle_bytes=st.integers(0, 2 * GIB),
              rank=st.floats(0, 100), last_done_at=st.one_of(st.none(), st.floats(0, 20)),
              predicted_wait_s=st.one_of(st.none(), st.floats(0, 30))),
    max_size=20,
).map(lambda agents: [make_agent(f"ag-{i}", restartable=a.restartable, resident=a.resident,
                                 busy=a.busy, torn_down=a.torn_down, closed=a.closed,
                                 in_lifecycle=a.in_lifecycle, idle_bytes=a.idle_bytes,
                                 rank=a.rank, last_done_at=a.last_done_at,
                                 predicted_wait_s=a.predicted_wait_s)
                      for i, a in enumerate(agents)])
actions_st = st.lists(
    st.builds(make_action, peak_bytes=st.integers(MIB, 2 * GIB),
              started=st.booleans(), launched=st.booleans(), allowed=st.booleans(),
              held_since=st.one_of(st.none(), st.floats(0, 10)),
              usage_bytes=st.integers(0, 2 * GIB)),
    max_size=12,
).map(lambda actions: [ActionObs(f"a-{i}", f"ag-x{i}", f"sb-{i}", *astuple_tail(a))
                       for i, a in enumerate(actions)])


def astuple_tail(a: ActionObs) -> tuple:
    return (a.prediction, a.charge_bytes, a.ready_at, a.started, a.launched and a.started,
            a.allowed, a.held_since, a.usage_bytes, a.start_bytes, a.peak_bytes)


@given(agents_st, st.sets(st.integers(0, 19)))
def test_reclaim_takes_only_restartable_resident_sandboxes_between_actions_or_queued(
    agents: list[AgentObs], queued_idx: set[int],
) -> None:
    queued = frozenset(f"ag-{i}" for i in queued_idx)
    for agent in reclaim_candidates(agents, queued):
        assert agent.restartable
        assert agent.resident
        assert not agent.busy or agent.agent_id in queued


@given(st.integers(0, 4 * GIB), st.integers(0, 4 * GIB), st.integers(0, GIB),
       st.integers(0, GIB))
def test_the_deficit_grows_with_waiting_work_and_shrinks_with_headroom(
    usage: int, waiting_bytes: int, more: int, freed: int,
) -> None:
    budget = 4 * GIB
    pressure = classify_pressure(budget, min(usage, budget), 0, CONFIG)
    less_pressure = classify_pressure(budget, max(min(usage, budget) - freed, 0), 0, CONFIG)
    base = reclaim_deficit_bytes(pressure, budget, WaitingWork(waiting_bytes, 0, 0, 0), CONFIG)
    assert reclaim_deficit_bytes(pressure, budget, WaitingWork(waiting_bytes, more, 0, 0),
                                 CONFIG) == base + more or more == 0
    assert reclaim_deficit_bytes(less_pressure, budget, WaitingWork(waiting_bytes, 0, 0, 0),
                                 CONFIG) <= base


@given(agents_st, st.sampled_from(list(Pressure)), st.integers(1, 4), st.integers(0, 4),
       st.floats(0, 40))
def test_predictive_rebuilds_only_under_green_on_free_slots_for_torn_down_idle_agents(
    agents: list[AgentObs], level: Pressure, limit: int, in_flight: int, now: float,
) -> None:
    slots = LifecycleSlots(limit, min(in_flight, limit))
    chosen, left = predictive_rebuilds(agents, level, now, slots, CONFIG)
    if level is not Pressure.GREEN:
        assert chosen == []
    assert len(chosen) <= slots.num_free
    assert left.in_flight == slots.in_flight + len(chosen)
    by_id = {a.agent_id: a for a in agents}
    for agent_id in chosen:
        agent = by_id[agent_id]
        assert agent.torn_down
        assert not agent.busy
        assert not agent.closed
        assert not agent.in_lifecycle


def make_policy(*, use_gate: bool = True, use_residency: bool = True,
                window_bytes: int = 4 * GIB) -> ControlPolicy:
    execution = ExecutionPolicy(CONFIG, use_gate=use_gate, throttle_v1=False)
    admission = AdmissionController(CONFIG, window_bytes)
    return ControlPolicy(CONFIG, execution, admission, use_gate=use_gate,
                         use_residency=use_residency)


def snapshot(actions: list[ActionObs], agents: list[AgentObs], *, usage_bytes: int,
             budget_bytes: int = 4 * GIB, now: float = 10.0, slots: LifecycleSlots | None = None,
             queued: frozenset[str] = frozenset()) -> ControlSnapshot:
    samples = tuple(SandboxSample(a.gate_id, now, a.usage_bytes, 0.0, a.allowed)
                    for a in actions if a.started)
    tick = TickSnapshot(now, budget_bytes, usage_bytes, tuple(actions), samples)
    return ControlSnapshot(tick, tuple(agents), queued, slots or LifecycleSlots(2))


@settings(max_examples=200, deadline=None)
@given(actions_st, agents_st, st.integers(0, 4 * GIB), st.integers(1, 4), st.integers(0, 4))
def test_a_plan_stays_within_its_slots_and_changes_only_started_actions(
    actions: list[ActionObs], agents: list[AgentObs], usage: int, limit: int, in_flight: int,
) -> None:
    policy = make_policy()
    slots = LifecycleSlots(limit, min(in_flight, limit))
    snap = snapshot(actions, agents, usage_bytes=usage, slots=slots)
    plan = policy.step(snap)
    assert len(plan.teardowns) + len(plan.rebuilds) <= slots.num_free
    if plan.pressure.level is not Pressure.GREEN:
        assert plan.rebuilds == ()
    candidates = {a.agent_id for a in reclaim_candidates(agents, snap.queued)}
    assert {t.agent_id for t in plan.teardowns} <= candidates
    assert not {t.agent_id for t in plan.teardowns} & set(plan.rebuilds)
    started = {a.action_id for a in actions if a.started}
    for change in plan.tick.changes:
        assert change.action.action_id in started
        assert change.allow != change.action.allowed  # only what changes is in the plan
        assert not change.launch or (change.allow and change.action.pending)


def test_under_red_a_fresh_start_with_growth_ahead_waits_for_the_next_period() -> None:
    policy = make_policy()
    running = make_action("run", usage_bytes=3900 * MIB, peak_bytes=3900 * MIB)
    plan = policy.step(snapshot([running], [], usage_bytes=3900 * MIB))
    assert plan.pressure.level is Pressure.RED
    fresh = make_action("new", launched=False, usage_bytes=0, start_bytes=None)
    assert not policy.execution.start(fresh)
    # no growth ahead (its sandbox already holds its predicted peak): it launches
    assert policy.execution.start(make_action("none", launched=False, peak_bytes=0,
                                              usage_bytes=14 * MIB, start_bytes=None))


def test_a_charge_past_its_peak_shrinks_once_to_what_the_sandbox_holds() -> None:
    policy = make_policy()
    admission = policy.admission
    assert admission is not None
    admission.submit(make_request_for("spike", peak_bytes=1600 * MIB, avg_bytes=100 * MIB))
    [admitted] = admission.decide(0.0, 4 * GIB)
    spiked = make_action("spike", avg_bytes=100 * MIB, peak_bytes=1600 * MIB,
                         charge_bytes=admitted.charge_bytes, start_bytes=20 * MIB,
                         peak_seen_bytes=1500 * MIB, usage_bytes=300 * MIB)
    plan = policy.step(snapshot([spiked], [], usage_bytes=300 * MIB))
    [release] = plan.peak_releases
    assert release.charge_bytes == 300 * MIB
    assert release.freed_bytes == admitted.charge_bytes - 300 * MIB
    assert admission.admitted_total_bytes == 300 * MIB
    still_up = make_action("spike", avg_bytes=100 * MIB, peak_bytes=1600 * MIB,
                           charge_bytes=admitted.charge_bytes, start_bytes=20 * MIB,
                           peak_seen_bytes=1500 * MIB, usage_bytes=1400 * MIB)
    assert make_policy().step(snapshot([still_up], [], usage_bytes=1400 * MIB)
                              ).peak_releases == ()


def test_under_yellow_idle_sandboxes_go_last_ranked_first_for_queued_work() -> None:
    """The domain is in yellow with work queued: reclaim tears down as many idle sandboxes
    as the deficit needs, the last-ranked workflow's first, one per free slot."""
    policy = make_policy(window_bytes=8 * GIB)
    admission = policy.admission
    assert admission is not None
    admission.submit(make_request_for("queued", peak_bytes=600 * MIB, avg_bytes=600 * MIB))
    agents = [make_agent(f"ag-{i}", idle_bytes=400 * MIB, rank=float(i), predicted_wait_s=60.0)
              for i in range(4)]
    config = PolicyConfig()
    yellow_line = int(yellow_line_bytes(4 * GIB, config))
    usage = 4 * GIB - config.safety_margin(4 * GIB) - (yellow_line - 80 * MIB)
    plan = policy.step(snapshot([], agents, usage_bytes=usage, slots=LifecycleSlots(3)))
    assert plan.pressure.level is Pressure.YELLOW
    # H is 80 MiB under the yellow line with 600 MiB queued: 680 MiB short, which takes
    # two 400 MiB sandboxes
    assert [t.agent_id for t in plan.teardowns] == ["ag-3", "ag-2"]
    assert all("yellow: reclaim for" in t.why for t in plan.teardowns)


def make_request_for(action_id: str, *, peak_bytes: int, avg_bytes: int):
    from .factories import make_request

    return make_request(action_id, f"w-{action_id}", avg_bytes, peak_bytes, ready_at=0.0)
