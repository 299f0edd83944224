"""One control period's decisions: `ControlPolicy.step(snapshot) -> Plan`.

The runtime observes into a frozen `ControlSnapshot` (the domain's budget and usage, every
admitted action, every agent, the lifecycle slots), calls `step`, acts on the `Plan`
(gate changes and launches, throttles, charges shrunk past their peaks, teardowns,
predictive rebuilds, each with its reason) and hands results back through
`ExecutionPolicy.launched`/`ended` and the admission calls. At an action's end,
`after_action` decides its idle sandbox's residency (a `BoundaryPlan`). The policy holds decision
state only: the gate's estimates, the AIMD budget, admission's queues and charges. It does
no I/O and reads no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tenon.policy.admission import AdmissionController, past_peak_charge
from tenon.policy.config import PolicyConfig
from tenon.policy.execution import (
    ActionObs,
    ExecutionPolicy,
    TickPlan,
    TickSnapshot,
    pressure_of,
)
from tenon.policy.pressure import Pressure, PressureState
from tenon.policy.reclaim import (
    AgentObs,
    TeardownOrder,
    WaitingWork,
    choose_victims,
    predictive_rebuilds,
    reclaim_deficit_bytes,
    reclaimable_bytes,
)
from tenon.policy.residency import (
    IdleSandbox,
    LifecycleSlots,
    Residency,
    ResidencyDecision,
    ResidencySnapshot,
    residency_decision,
)


@dataclass(frozen=True, slots=True)
class ControlSnapshot:
    tick: TickSnapshot
    """The domain and every admitted action (`reclaimable_bytes` is filled in by `step`)."""
    agents: tuple[AgentObs, ...]
    queued: frozenset[str]
    """Agents whose next action waits for admission."""
    slots: LifecycleSlots


@dataclass(frozen=True, slots=True)
class PeakRelease:
    """A running action passed its peak: its charge shrinks to what it holds."""

    action: ActionObs
    charge_bytes: int
    freed_bytes: int
    admitted_total_bytes: int


@dataclass(frozen=True, slots=True)
class BoundaryPlan:
    """An action's end: whether its idle sandbox stays, and the teardowns that follow."""

    pressure: PressureState
    residency: ResidencyDecision
    teardowns: tuple[TeardownOrder, ...] = ()
    reclaim: bool = False
    """Under pressure: the idle sandboxes compete (`ControlPolicy.reclaim` picks them)."""


@dataclass(frozen=True, slots=True)
class Plan:
    tick: TickPlan
    peak_releases: tuple[PeakRelease, ...] = ()
    teardowns: tuple[TeardownOrder, ...] = ()
    rebuilds: tuple[str, ...] = ()
    """Torn-down agents to rebuild ahead of their next action (predicted soon)."""

    @property
    def pressure(self) -> PressureState:
        return self.tick.pressure


class ControlPolicy:
    """Tenon's (or a baseline's) decisions for one runtime."""

    def __init__(self, config: PolicyConfig, execution: ExecutionPolicy,
                 admission: AdmissionController | None, *, use_gate: bool,
                 use_residency: bool) -> None:
        self._config = config
        self.execution = execution
        self.admission = admission
        self._use_gate = use_gate
        self._use_residency = use_residency

    def reclaimable_bytes(self, agents: tuple[AgentObs, ...], queued: frozenset[str]) -> int:
        if not self._use_residency:
            return 0
        return reclaimable_bytes(agents, queued)

    def step(self, snap: ControlSnapshot) -> Plan:
        """The period's plan, in order: the gate (verdicts, held starts let go), charges past
        their peaks (admission's window shrinks now), reclaim as the domain stands after
        this period's launches, then predictive rebuilds on the lifecycle slots left."""
        reclaimable = self.reclaimable_bytes(snap.agents, snap.queued)
        tick = self.execution.step(replace(snap.tick, reclaimable_bytes=reclaimable))
        releases = self._release_passed_peaks(snap.tick.actions)
        if not self._use_residency:
            return Plan(tick, releases)
        launched = {c.action.action_id for c in tick.changes if c.launch}
        actions = tuple(a._replace(launched=True, allowed=True) if a.action_id in launched
                        else a for a in snap.tick.actions)
        after = replace(snap, tick=replace(snap.tick, actions=actions))
        teardowns = self.reclaim(after, tick.pressure)
        slots = snap.slots
        for _ in teardowns:
            slots = slots.acquire() or slots
        rebuilds, _slots = predictive_rebuilds(snap.agents, tick.pressure.level, snap.tick.now,
                                               slots, self._config)
        return Plan(tick, releases, teardowns, tuple(rebuilds))

    def _release_passed_peaks(self, actions: tuple[ActionObs, ...]) -> tuple[PeakRelease, ...]:
        """Shrink the charge of every running action that has passed its peak."""
        admission = self.admission
        if admission is None:
            return ()
        releases = []
        for a in actions:
            if a.peak_passed or a.start_bytes is None or a.peak_bytes is None or not (
                    a.launched and a.started):
                continue
            charge = past_peak_charge(a.charge_bytes, a.prediction, start_bytes=a.start_bytes,
                                      peak_bytes=a.peak_bytes, usage_bytes=a.usage_bytes,
                                      config=self._config)
            if charge is None:
                continue
            freed = admission.shrink(a.action_id, charge)
            releases.append(PeakRelease(a, charge, freed, admission.admitted_total_bytes))
        return tuple(releases)

    def after_action(self, tick: TickSnapshot, slots: LifecycleSlots,
                     box: IdleSandbox) -> BoundaryPlan:
        """Action-done, the restart-safe check made: retain the idle sandbox or tear it down.

        Under green a teardown must amortize its cost over the model wait. Under pressure
        the idle sandboxes compete (`reclaim`): the last-ranked workflows' go first (they
        wait longest for admission), as many as the physical deficit needs, this one
        included if it is among them."""
        pressure = pressure_of(tick.budget_bytes, tick.usage_bytes, tick.actions, self._config)
        decision = residency_decision(ResidencySnapshot(box, pressure.level, slots),
                                      tick.now, self._config)
        if decision.action is not Residency.TEAR_DOWN:
            return BoundaryPlan(pressure, decision)
        if pressure.level is Pressure.GREEN:
            return BoundaryPlan(pressure, decision,
                                (TeardownOrder(box.sandbox_id, decision.reason),))
        return BoundaryPlan(pressure, decision, reclaim=True)

    def reclaim(self, snap: ControlSnapshot, pressure: PressureState,
                ) -> tuple[TeardownOrder, ...]:
        """Under yellow or red, or under green while starts or growers are held past
        overdue, tear down restartable idle sandboxes (also those whose next action is
        still queued), last-ranked workflow first, until the physical headroom covers the
        yellow line plus what waiting work needs.

        The deficit is physical: H against the line plus the gate's demand of actions held
        before their start, the demand of growers held past overdue, and the predicted
        averages of actions waiting for admission, up to the room the logical window has.
        Idle memory is given back for work that is ready, not for growth nobody asked for:
        that would only trade memory for rebuilds.
        """
        if snap.slots.num_free == 0:
            return ()
        now = snap.tick.now
        level = pressure.level
        waiting = self._waiting_work(snap, pressure)
        if waiting is None:
            return ()
        if level is Pressure.GREEN:
            level = Pressure.YELLOW  # held work past overdue: reclaim as under yellow
        needed = reclaim_deficit_bytes(pressure, snap.tick.budget_bytes, waiting, self._config)
        if needed <= 0:
            return ()
        chosen = choose_victims(snap.agents, snap.queued, now=now, level=level,
                                actual=pressure.level, needed_bytes=needed, slots=snap.slots,
                                config=self._config)
        why = pressure.level.name.lower()
        if level != pressure.level:
            why += (f": held or stuck work (starts {waiting.held_starts_bytes} B, queue "
                    f"{waiting.stuck_bytes} B, growers {waiting.starving_bytes} B)")
        return tuple(TeardownOrder(agent_id, f"{why}: reclaim for {needed} B")
                     for agent_id in chosen)

    def _waiting_work(self, snap: ControlSnapshot, pressure: PressureState,
                      ) -> WaitingWork | None:
        """What waits for memory; None under green when nothing waits past overdue.

        Green promises no room above the yellow line, so under green only work held past
        overdue gets room: starts held that long (not the brief holds of start rationing,
        which would double the teardowns), growers held that long, and a queued action
        whose charge fits the logical window but not the physical headroom plus what
        running actions give back when they end (where their ends do free the room,
        reclaiming for it only trades memory for rebuilds).
        """
        now, actions = snap.tick.now, snap.tick.actions
        execution, admission = self.execution, self.admission
        held = [a for a in actions if a.pending]
        starving = execution.starving_demand_bytes(actions, now) if self._use_gate else 0
        stuck = 0
        if pressure.level is Pressure.GREEN:
            overdue = self._config.overdue_after_s
            held = [a for a in held if a.held_since is not None
                    and now - a.held_since >= overdue]
            gives_back = sum(max(a.usage_bytes - a.start_bytes, 0) for a in actions
                             if a.start_bytes is not None)
            stuck = 0 if admission is None else admission.stuck_charge(
                now, pressure.headroom_bytes + gives_back, waited_s=overdue)
            if not held and not stuck and not starving:
                return None
        # a start predicted heavy launches on bootstrap room: room for its whole prediction
        # is made only as far as it grows, as for any grower
        held_bytes = sum(execution.launch_demand_bytes(a) for a in held)
        queued_bytes = 0
        if admission is not None and pressure.level is not Pressure.GREEN:
            # Only as much queued work as the logical window lets in can use freed memory:
            # behind a full window a teardown frees room nobody may take, and costs a
            # rebuild later.
            queued = sum(r.prediction.avg_bytes for r in admission.queued if r.ready_at <= now)
            room = 0 if admission.at_capacity else (
                admission.window_bytes - admission.admitted_total_bytes)
            queued_bytes = min(queued, max(room, 0))
        return WaitingWork(held_bytes, stuck, starving, queued_bytes)
