"""The execution loop's policy: one `step(snapshot) -> TickPlan` per control period.

In the shape of vLLM's v1 scheduler: the runtime observes every running sandbox into a
frozen `TickSnapshot`, `ExecutionPolicy.step` decides (pressure, the gate's verdicts, which
held starts launch, AgentCgroup's throttling) and returns a `TickPlan`; the runtime acts on
it and hands the results back through `launched` and `ended`. Between ticks, `start`
decides whether a fresh action launches at once or waits for the next step.

The policy keeps only decision state (growth estimates, the AIMD budget, denial times, the
room handed out this period); it does no I/O and reads no clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from tenon.policy.admission import is_heavy
from tenon.policy.baselines import AgentCgroupSandbox, agentcgroup_actions
from tenon.policy.config import PolicyConfig
from tenon.policy.gate import GateController, GateDecision, gate_demand_bytes
from tenon.policy.growth import GrowthEstimate, SandboxSample
from tenon.policy.pressure import Pressure, PressureState, classify_pressure, yellow_line_bytes
from tenon.predict.base import Prediction


class ActionView(Protocol):
    """What the policy reads of an admitted action: a frozen `ActionObs` in a snapshot, or
    the runtime's live record between periods (read only, never kept)."""

    @property
    def action_id(self) -> str: ...
    @property
    def gate_id(self) -> str: ...
    @property
    def prediction(self) -> Prediction: ...
    @property
    def started(self) -> bool: ...
    @property
    def launched(self) -> bool: ...
    @property
    def pending(self) -> bool: ...
    @property
    def usage_bytes(self) -> int: ...
    @property
    def charge_bytes(self) -> int: ...
    @property
    def peak_passed(self) -> bool: ...


class ActionObs(NamedTuple):
    """One admitted action as the runtime observed it this period (a tuple: the runtime
    makes one per action per period)."""

    action_id: str
    agent_id: str
    gate_id: str
    """The sandbox id the gate knows it by ("" before its sandbox is live)."""
    prediction: Prediction
    charge_bytes: int
    ready_at: float
    started: bool
    """Its sandbox is live and its exec has not returned."""
    launched: bool
    """Its exec began; a started action not launched is held before its start (pending)."""
    allowed: bool
    held_since: float | None
    usage_bytes: int
    """Its sandbox's usage at the last sample."""
    start_bytes: int | None = None
    """Its sandbox's usage when it started (None before)."""
    peak_bytes: int | None = None
    """The highest usage sampled since it started (None before)."""
    peak_passed: bool = False
    profiled_peak_bytes: int | None = None
    throttled: bool = False

    @property
    def pending(self) -> bool:
        return self.started and not self.launched



@dataclass(frozen=True, slots=True)
class TickSnapshot:
    now: float
    budget_bytes: int
    """The domain's limit (`known_budget_bytes` when the domain has none)."""
    usage_bytes: int
    actions: tuple[ActionObs, ...]
    samples: tuple[SandboxSample, ...]
    """This period's samples of the started actions' sandboxes (a vanished one has none)."""
    reclaimable_bytes: int = 0
    """Memory that can come back without a held grower running (idle, being torn down)."""
    num_oom_kills: int = 0
    """OOM kills in the domain so far (recorded, not decided on)."""


@dataclass(frozen=True, slots=True)
class GateChange:
    action: ActionObs
    allow: bool
    launch: bool
    """A held start goes: the runtime launches its exec (and samples its baseline)."""
    reason: str


@dataclass(frozen=True, slots=True)
class Throttle:
    action: ActionObs
    throttle_cpu: bool
    reason: str


@dataclass(frozen=True, slots=True)
class TickPlan:
    pressure: PressureState
    changes: tuple[GateChange, ...] = ()
    throttles: tuple[Throttle, ...] = ()
    budget_b: int = 0
    reclaimable_bytes: int = 0
    """The snapshot's, as the gate decided with it (recorded with the sample)."""


def known_budget_bytes(budget_bytes: int | None, usage_bytes: int, config: PolicyConfig) -> int:
    """The budget pressure is computed against: a domain without a limit counts as one
    far above its usage (always green)."""
    if budget_bytes is not None:
        return budget_bytes
    return usage_bytes + 2 * config.safety_margin_bytes + (1 << 40)


def growth_peak_bytes(action: ActionView) -> int:
    """The level an action is expected to grow to: its predicted peak, or its charge once
    past its peak."""
    if action.peak_passed:
        return min(action.charge_bytes, action.prediction.peak_bytes)
    return action.prediction.peak_bytes


def predicted_growth_bytes(actions: Iterable[ActionView]) -> int:
    """Predicted remaining growth of admitted actions: peak (the charge, once past it) less
    what each sandbox holds. Actions held before their start are left out: they cannot
    grow until the gate lets them start, and it checks their demand when it does (counting
    them would make the pressure that holds them)."""
    return sum(max(growth_peak_bytes(a) - a.usage_bytes, 0) for a in actions if not a.pending)


def pressure_of(budget_bytes: int, usage_bytes: int, actions: Iterable[ActionView],
                config: PolicyConfig) -> PressureState:
    return classify_pressure(budget_bytes, usage_bytes, predicted_growth_bytes(actions), config)


class ExecutionPolicy:
    """The gate's decision state across periods; `step` once per control period."""

    def __init__(self, config: PolicyConfig, *, use_gate: bool, throttle_v1: bool) -> None:
        self._config = config
        self._use_gate = use_gate
        self._throttle_v1 = throttle_v1
        self.gate = GateController(config)
        self.last_pressure: PressureState | None = None
        self.last_decision: GateDecision | None = None
        self._free_left = 0  # room above the yellow line not yet handed out this period
        self._starving: frozenset[str] = frozenset()  # `GateDecision.starving`, last step
        self._num_launched = 0  # actions whose exec began and has not returned
        self._budget_bytes = 0

    # -- one period -------------------------------------------------------------------

    def step(self, snap: TickSnapshot) -> TickPlan:
        self._budget_bytes = snap.budget_bytes
        pressure = pressure_of(snap.budget_bytes, snap.usage_bytes, snap.actions, self._config)
        self.last_pressure = pressure
        started = [a for a in snap.actions if a.started]
        changes: tuple[GateChange, ...] = ()
        budget_b = 0
        if self._use_gate:
            changes, budget_b = self._gate(snap, started, pressure)
        throttles = self._throttles(started, snap.budget_bytes) if self._throttle_v1 else ()
        return TickPlan(pressure, changes, throttles, budget_b, snap.reclaimable_bytes)

    def _gate(self, snap: TickSnapshot, started: list[ActionObs],
              pressure: PressureState) -> tuple[tuple[GateChange, ...], int]:
        self.gate.observe(snap.samples)
        caps = {a.gate_id: self.growth_cap(a) for a in started}
        free = self.free_bytes(pressure)
        gives_back = {a.gate_id: max(a.usage_bytes - a.start_bytes, 0)
                      for a in started if a.start_bytes is not None}
        pending = frozenset(a.gate_id for a in started if a.pending)
        decision = self.gate.decide(pressure.level, pressure.headroom_bytes, snap.now, caps,
                                    free_bytes=free, reclaimable_bytes=snap.reclaimable_bytes,
                                    gives_back=gives_back, pending=pending,
                                    margin_bytes=self._config.safety_margin(snap.budget_bytes))
        # A grower frozen past overdue (it holds what it has allocated) is waited for:
        # no start launches until it runs again, or starts take the room it needs.
        self._starving = decision.starving
        self.last_decision = decision
        estimates = self.gate.estimates
        rationed = pressure.level is Pressure.GREEN  # held starts: `_ration_starts` counts them
        self._free_left = free - sum(
            gate_demand_bytes(estimates[a.gate_id], caps[a.gate_id], self._config)
            for a in started
            if a.gate_id in decision.allowed and a.gate_id in estimates
            and not (a.pending and rationed))
        kept = self._ration_starts(snap.now, started, decision, pressure, free)
        if self._starving:
            kept |= {a.gate_id for a in started if a.pending and a.gate_id in decision.allowed}
        allowed, denied, reasons = decision.allowed, decision.denied, decision.reasons
        changes = tuple(
            GateChange(a, a.gate_id in allowed, a.pending and a.gate_id in allowed,
                       reasons.get(a.gate_id, ""))
            for a in started
            if (a.gate_id in allowed) != a.allowed and a.gate_id not in kept
            and (a.gate_id in allowed or a.gate_id in denied))
        return changes, decision.budget_b

    def _ration_starts(self, now: float, started: list[ActionObs], decision: GateDecision,
                       pressure: PressureState, free_bytes: int) -> set[str]:
        """Held starts the gate allowed under green that do not fit the room left above the
        yellow line: they stay held this period, oldest first served.

        An overdue one (held `overdue_after_s`) may dig into the yellow region as long as it
        fits H; and when nothing at all has launched, the oldest starts regardless (it
        could otherwise never run if its prediction exceeds the room of an empty domain).
        """
        if pressure.level is not Pressure.GREEN:
            return set()
        pending = sorted((a for a in started if a.pending and a.gate_id in decision.allowed),
                         key=lambda a: (a.ready_at, a.action_id))
        if not pending:
            return set()
        headroom_left = pressure.headroom_bytes - (free_bytes - self._free_left)
        idle_domain = not self._num_launched
        denied_since = self.gate.denied_since
        kept: set[str] = set()
        for action in pending:
            demand = self.start_demand_bytes(action)
            held_since = now if action.held_since is None else action.held_since
            since = denied_since.get(action.gate_id, held_since)
            overdue = now - since >= self._config.overdue_after_s
            fits = self._launch_demand(action, demand) <= self._free_left
            if fits or (overdue and demand <= headroom_left) or idle_domain:
                self._free_left -= max(demand, 0)
                headroom_left -= max(demand, 0)
                idle_domain = False
            else:
                kept.add(action.gate_id)
        return kept

    def _throttles(self, started: list[ActionObs], budget_bytes: int) -> tuple[Throttle, ...]:
        """AgentCgroup on v1: a Low sandbox over its mark runs at a tenth of a CPU."""
        by_id = {a.gate_id: a for a in started if a.profiled_peak_bytes is not None}
        boxes = [AgentCgroupSandbox(a.gate_id, a.profiled_peak_bytes or 0, a.usage_bytes)
                 for a in by_id.values()]
        return tuple(
            Throttle(by_id[d.sandbox_id], d.throttle_cpu, d.reason)
            for d in agentcgroup_actions(boxes, budget_bytes, 1, self._config)
            if d.throttle_cpu != by_id[d.sandbox_id].throttled)

    # -- between periods: a start, and the results the runtime hands back ---------------

    def start(self, action: ActionObs) -> bool:
        """A fresh action enters the gate's view from bootstrap demand (its sandbox's past
        says nothing). True when it may launch at once; otherwise it is held and a later
        step launches it.

        Holding an action *before* it starts costs nothing, while freezing it mid-growth
        keeps what it has allocated: a new action starts only when its demand fits the room
        above the yellow line left this period, else the gate decides it with the others at
        the next step. Green included: launching every held start in one green period
        pushes the domain into yellow with all of them frozen half-allocated.
        """
        self.gate.forget(action.gate_id)
        pressure = self.last_pressure
        if not self._use_gate or pressure is None:
            return True
        demand = self.start_demand_bytes(action)
        if demand > 0 and self._starving:
            return False  # a grower frozen past overdue waits for the room first
        if demand <= 0 or (pressure.level is not Pressure.RED
                           and self._launch_demand(action, demand) <= self._free_left) or (
                pressure.level is Pressure.GREEN and not self._num_launched):
            self._free_left -= max(demand, 0)  # the whole demand: no other start takes it
            return True
        return False

    def launched(self, gate_id: str, baseline: SandboxSample | None) -> None:
        """An action's exec began. Its baseline sample lets the next step measure a real
        growth rate instead of guessing with bootstrap demand for one more period."""
        self._num_launched += 1
        if baseline is not None:
            self.gate.observe([baseline])

    def ended(self, gate_id: str, *, was_launched: bool) -> None:
        """An action's exec returned: the gate forgets its sandbox (the next action in it
        starts from bootstrap demand)."""
        if was_launched:
            self._num_launched -= 1
        self.gate.forget(gate_id)

    # -- demands ------------------------------------------------------------------------

    def growth_cap(self, action: ActionView) -> int:
        """What the action's prediction (with slack) says it may still grow.

        A heavy start launched on bootstrap room (`_launch_demand`) is held to its prediction
        only once its growth is measured: frozen on the prediction alone before its exec ran
        at all, it would wait for room for its whole predicted peak."""
        config = self._config
        if action.launched and self._starts_metered(action):
            estimate = self.gate.estimates.get(action.gate_id)
            if estimate is None or estimate.rate_bytes_per_s is None:
                return config.bootstrap_demand_bytes
        bound = action.prediction.peak_bytes * (1.0 + config.prediction_slack_fraction)
        return int(bound) + config.bootstrap_demand_bytes - action.usage_bytes

    def free_bytes(self, pressure: PressureState) -> int:
        """Headroom above the yellow line (growth there is not at risk)."""
        line = yellow_line_bytes(self._budget_bytes, self._config)
        return max(int(pressure.headroom_bytes - line), 0)

    def starving_demand_bytes(self, actions: Iterable[ActionView], now: float) -> int:
        """The gate demand of sandboxes it has denied for at least `overdue_after_s`.

        Admission keeps this much of H back. Otherwise a held grower that needs more than
        the room left (typically one that outgrew its prediction) never runs: each action
        that finishes frees room, admission hands it to the next light action, and the held
        one waits for the domain to drain. Reserving its demand is what heavy credit does
        for a queued heavy action, applied to one already running.
        """
        denied_since = self.gate.denied_since
        estimates = self.gate.estimates
        total = 0
        for action in actions:
            since = denied_since.get(action.gate_id)
            if (not action.started or since is None
                    or now - since < self._config.overdue_after_s):
                continue
            estimate = estimates.get(action.gate_id)
            if estimate is None:
                estimate = GrowthEstimate(action.gate_id, None, None, False)
            total += gate_demand_bytes(estimate, self.growth_cap(action), self._config)
        return total

    def start_demand_bytes(self, action: ActionView) -> int:
        """What a not yet started action is expected to grow: its prediction (with slack)."""
        return gate_demand_bytes(GrowthEstimate(action.gate_id, None, None, False),
                                 self.growth_cap(action), self._config)

    def launch_demand_bytes(self, action: ActionView) -> int:
        """The room a held start needs to launch (`_launch_demand`)."""
        return self._launch_demand(action, self.start_demand_bytes(action))

    def _launch_demand(self, action: ActionView, demand: int) -> int:
        """The room a start needs to launch: its demand, or for a start predicted heavy the
        bootstrap demand (heavy predictions are often false: see
        `AdmissionController.heavy_physical_bytes`). The gate then meters its measured
        growth, and reclaim gives idle memory back only as far as it grows.
        The caller still takes its whole demand from this period's room, so no other start
        launches into it beside it."""
        if self._starts_metered(action):
            return min(demand, self._config.bootstrap_demand_bytes)
        return demand

    def _starts_metered(self, action: ActionView) -> bool:
        return is_heavy(action.prediction, self._config)

