"""The execution loop: sample every running sandbox each period, decide, actuate the gate.

One `tick` reads the domain and each running action's cgroup, feeds the per-action
statistics, computes pressure, and (for policies with the gate) folds the samples into the
`GateController` and publishes its allow/deny by freezing and thawing cgroups. The
AgentCgroup baseline's v1 throttling is actuated here too. The loop itself is thin: every
decision is in `policy/`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tenon.errors import HostError
from tenon.host.types import CgroupVersion, MemoryReading
from tenon.policy.admission import Prediction, is_heavy
from tenon.policy.baselines import AgentCgroupSandbox, agentcgroup_actions
from tenon.policy.config import PolicyConfig
from tenon.policy.gate import GateController, GateDecision, gate_demand_bytes
from tenon.policy.growth import GrowthEstimate, SandboxSample
from tenon.policy.pressure import Pressure, PressureState, classify_pressure
from tenon.predict.base import ActionContext
from tenon.runtime.events import EventLog
from tenon.runtime.results import ActionStats
from tenon.sandbox.base import DomainMeter, SandboxMeter

logger = logging.getLogger(__name__)

THROTTLE_CPU_FRACTION = 0.1  # AgentCgroup on v1: CPU share of a Low sandbox over its mark
ACTUATE_WAIT_S = 0.02  # how long one freeze/thaw may hold the loop before it moves on


@dataclass
class RunningAction:
    """An action between admission and completion, as both loops see it."""

    action_id: str
    agent_id: str
    prediction: Prediction
    charge_bytes: int
    ready_at: float
    meter: SandboxMeter | None = None  # set once its sandbox is resident and it starts
    gate_id: str = ""  # the sandbox id the gate knows it by
    stats: ActionStats | None = None
    allowed: bool = True
    last_usage_bytes: int = 0
    profiled_peak_bytes: int | None = None  # AgentCgroup class input
    throttled: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    context: ActionContext | None = None  # what it was predicted from (re-predicted queued)

    done: bool = False  # its exec returned: the gate no longer touches its sandbox
    launched: bool = False  # its exec began (before that it waits for the gate: pending)
    launch: asyncio.Future[None] | None = None  # resolved when the gate lets it start
    held_since: float | None = None  # when `start_action` held it before its start
    peak_passed: bool = False  # its charge shrank to what it holds (`past_peak_charge`)
    heavy_reported_bytes: int = 0  # the peak the predictor last heard of mid-run

    @property
    def growth_peak_bytes(self) -> int:
        """The level it is expected to grow to: its charge once past its peak."""
        if self.peak_passed:
            return min(self.charge_bytes, self.prediction.peak_bytes)
        return self.prediction.peak_bytes

    @property
    def started(self) -> bool:
        """In the gate's view: its sandbox is live and its exec has not returned."""
        return self.meter is not None and not self.done

    @property
    def pending(self) -> bool:
        """Ready in a live sandbox, held before its exec began (it holds no memory yet)."""
        return self.started and not self.launched


def predicted_growth_bytes(actions: Iterable[RunningAction]) -> int:
    """Predicted remaining growth of admitted actions: peak (the charge, once past it) less
    what each sandbox holds.

    Actions held before their start are left out: they cannot grow until the gate lets
    them start, and it checks their demand when it does. Counting them made the pressure
    that held them (a self-inflicted yellow).
    """
    return sum(max(a.growth_peak_bytes - a.last_usage_bytes, 0)
               for a in actions if not a.pending)


class ExecutionLoop:
    """Holds the gate's state; `tick` is called once per control period by the runtime."""

    def __init__(
        self,
        *,
        domain: DomainMeter,
        config: PolicyConfig,
        events: EventLog,
        use_gate: bool,
        agentcgroup: bool,
        now: Callable[[], float],
    ) -> None:
        self._domain = domain
        self._config = config
        self._events = events
        self._use_gate = use_gate
        self._agentcgroup = agentcgroup
        self._now = now
        self.gate = GateController(config)
        self.last_pressure: PressureState | None = None
        self.last_decision: GateDecision | None = None
        self._last_logged: tuple[Any, ...] = ()
        self._free_left = 0  # room above the yellow line not yet handed out this period
        self._starving: frozenset[str] = frozenset()  # `GateDecision.starving`, last tick
        self.num_ticks = 0
        self._num_launched = 0  # actions whose exec began and has not returned

    def pressure(self, actions: Iterable[RunningAction], reading: MemoryReading) -> PressureState:
        budget = self._domain.budget_bytes
        if budget is None:
            budget = reading.usage_bytes + 2 * self._config.safety_margin_bytes + (1 << 40)
        return classify_pressure(
            budget, reading.usage_bytes, predicted_growth_bytes(actions), self._config
        )

    def growth_cap(self, action: RunningAction) -> int:
        """What the action's prediction (with slack) says it may still grow.

        A heavy start launched on bootstrap room (`_launch_demand`) is held to its prediction
        only once its growth is measured: frozen on the prediction alone at the first tick,
        before its exec ran at all, a test run that needed 30 MiB waited for room for 1.9 GiB."""
        config = self._config
        if action.launched and self._starts_metered(action):
            estimate = self.gate.estimates.get(action.gate_id)
            if estimate is None or estimate.rate_bytes_per_s is None:
                return config.bootstrap_demand_bytes
        bound = action.prediction.peak_bytes * (1.0 + config.prediction_slack_fraction)
        return int(bound) + config.bootstrap_demand_bytes - action.last_usage_bytes

    def free_bytes(self, pressure: PressureState) -> int:
        """Headroom above the yellow line (growth there is not at risk)."""
        budget = self._domain.budget_bytes or 0
        yellow_line = (self._config.red_fraction + self._config.yellow_fraction) * budget
        return max(int(pressure.headroom_bytes - yellow_line), 0)

    def starving_demand_bytes(self, actions: Iterable[RunningAction], now: float) -> int:
        """The gate demand of sandboxes it has denied for at least `overdue_after_s`.

        Admission keeps this much of H back. Otherwise a held grower that needs more than
        the room left (typically one that outgrew its prediction) never runs: each action
        that finishes frees room, admission hands it to the next light action, and the held
        one waits for the domain to drain. Reserving its demand is what heavy credit does
        for a queued heavy action, applied to one already running.
        """
        denied_since = self.gate.denied_since
        estimates = self.gate.estimates
        overdue_after = self._config.overdue_after_s
        total = 0
        for action in actions:
            since = denied_since.get(action.gate_id)
            if not action.started or since is None or now - since < overdue_after:
                continue
            estimate = estimates.get(action.gate_id)
            if estimate is None:
                estimate = GrowthEstimate(action.gate_id, None, None, False)
            total += gate_demand_bytes(estimate, self.growth_cap(action), self._config)
        return total

    def start_action(self, action: RunningAction) -> bool:
        """A fresh action enters the gate's view from bootstrap demand (its sandbox's past
        says nothing). True when it may start at once; otherwise it is pending and a tick
        resolves `action.launch` when the gate lets it start.

        Holding an action *before* it starts costs nothing, while freezing it mid-growth
        keeps what it has allocated: a new action starts only when its demand fits the room
        above the yellow line left this period, else the gate decides it with the others at
        the next tick. Green included: one green period used to launch every held start at
        once, which pushed the domain into yellow with all of them frozen half-allocated.
        """
        self.gate.forget(action.gate_id)
        pressure = self.last_pressure
        if not self._use_gate or pressure is None:
            return self._launch(action)
        demand = self.start_demand_bytes(action)
        if demand > 0 and self._starving:
            pass  # held: a grower frozen past overdue waits for the room (`_gate`)
        elif demand <= 0 or (pressure.level is not Pressure.RED
                           and self._launch_demand(action, demand) <= self._free_left) or (
                pressure.level is Pressure.GREEN and not self._num_launched):
            self._free_left -= max(demand, 0)  # the whole demand: no other start takes it
            return self._launch(action)
        action.allowed = False
        action.held_since = self._now()
        action.launch = asyncio.get_running_loop().create_future()
        return False

    def _launch_demand(self, action: RunningAction, demand: int) -> int:
        """The room a start needs to launch: its demand, or for a start predicted heavy
        the bootstrap demand (`PolicyConfig.hold_heavy_starts` says why). The gate then
        meters its measured growth, and reclaim gives idle memory back only as far as it
        grows. The caller still takes its whole demand from this period's room, so no other
        start launches into it beside it."""
        if self._starts_metered(action):
            return min(demand, self._config.bootstrap_demand_bytes)
        return demand

    def _starts_metered(self, action: RunningAction) -> bool:
        return not self._config.hold_heavy_starts and is_heavy(action.prediction, self._config)

    def launch_demand_bytes(self, action: RunningAction) -> int:
        """The room a held start needs to launch (`_launch_demand`)."""
        return self._launch_demand(action, self.start_demand_bytes(action))

    def start_demand_bytes(self, action: RunningAction) -> int:
        """What a not yet started action is expected to grow: its prediction (with slack)."""
        return gate_demand_bytes(GrowthEstimate(action.gate_id, None, None, False),
                                 self.growth_cap(action), self._config)

    def _ration_starts(self, now: float, started: list[RunningAction],
                       decision: GateDecision, pressure: PressureState,
                       free_bytes: int) -> set[str]:
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

    def _launch(self, action: RunningAction) -> bool:
        if not action.launched:
            self._num_launched += 1
        action.launched, action.allowed = True, True
        if action.launch is not None and not action.launch.done():
            action.launch.set_result(None)
        # A baseline sample at launch: the first tick then measures a real growth rate
        # instead of guessing with bootstrap demand for one more period.
        assert action.meter is not None
        try:
            usage_bytes, cpu_usage_s = action.meter.sample()
        except (HostError, OSError):
            return True
        self.gate.observe([SandboxSample(action.gate_id, self._now(), usage_bytes,
                                         cpu_usage_s, True)])
        return True

    def end_action(self, action: RunningAction) -> None:
        """The action's exec returned. Called synchronously right after, so no tick can act
        on the sandbox in between: the next action may already be starting in it."""
        if action.launched and not action.done:
            self._num_launched -= 1
        action.done = True
        self.gate.forget(action.gate_id)

    async def tick(self, now: float, actions: list[RunningAction], *,
                   reclaimable_bytes: int = 0) -> PressureState:
        self.num_ticks += 1
        started = [a for a in actions if a.started]
        samples: list[SandboxSample] = []
        for action in started:
            assert action.meter is not None
            try:
                usage_bytes, cpu_usage_s = action.meter.sample()
            except (HostError, OSError) as exc:  # the sandbox vanished between listing and read
                logger.debug("sample of %s failed: %r", action.gate_id, exc)
                continue
            action.last_usage_bytes = usage_bytes
            if action.stats is not None:
                action.stats.add(now, usage_bytes)
            samples.append(
                SandboxSample(action.gate_id, now, usage_bytes, cpu_usage_s, action.allowed)
            )
        domain_reading = self._domain.reading()
        pressure = self.pressure(actions, domain_reading)
        self.last_pressure = pressure
        # Everything from picking `started` to actuating runs without an await: an action
        # that ends meanwhile could otherwise see its sandbox frozen after it returned.
        if self._use_gate:
            self._gate(now, started, samples, pressure, reclaimable_bytes)
        if self._agentcgroup and self._domain.version is CgroupVersion.V1:
            self._throttle_v1(started)
        held = sum(not a.allowed for a in started)
        key = (pressure.level, len(started), held)
        if key != self._last_logged or self.num_ticks % 10 == 0:
            self._last_logged = key
            self._events.emit(
                "sample",
                usage_bytes=domain_reading.usage_bytes,
                budget_bytes=self._domain.budget_bytes,
                headroom_bytes=pressure.headroom_bytes,
                effective_headroom_bytes=pressure.effective_headroom_bytes,
                pressure=pressure.level.name.lower(),
                running=len(started),
                admitted=len(actions),
                held=held,
                pending=sum(a.pending for a in started),
                oom_kills=domain_reading.num_oom_kills,
                reclaimable_bytes=reclaimable_bytes,
            )
        return pressure

    def _gate(
        self,
        now: float,
        started: list[RunningAction],
        samples: list[SandboxSample],
        pressure: PressureState,
        reclaimable_bytes: int,
    ) -> None:
        self.gate.observe(samples)
        caps = {a.gate_id: self.growth_cap(a) for a in started}
        free = self.free_bytes(pressure)
        gives_back = {a.gate_id: max(a.last_usage_bytes - a.stats.start_bytes, 0)
                      for a in started if a.stats is not None}
        pending = frozenset(a.gate_id for a in started if a.pending)
        decision = self.gate.decide(pressure.level, pressure.headroom_bytes, now, caps,
                                    free_bytes=free, reclaimable_bytes=reclaimable_bytes,
                                    gives_back=gives_back, pending=pending)
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
        kept = self._ration_starts(now, started, decision, pressure, free)
        if self._starving:
            kept |= {a.gate_id for a in started if a.pending and a.gate_id in decision.allowed}
        changes = [
            (a, a.gate_id in decision.allowed)
            for a in started
            if (a.gate_id in decision.allowed) != a.allowed and a.gate_id not in kept
            and (a.gate_id in decision.allowed or a.gate_id in decision.denied)
        ]
        if not changes:
            return
        for action, allow in changes:
            if action.pending and allow:
                self._launch(action)  # its launch sample overrides this tick's held one
        self._actuate([(a, allow) for a, allow in changes if a.launched])
        for action, allow in changes:
            self._events.emit(
                "gate",
                action_id=action.action_id,
                agent_id=action.agent_id,
                allowed=allow,
                reason=decision.reasons.get(action.gate_id, ""),
                pressure=pressure.level.name.lower(),
                budget_b=decision.budget_b,
                headroom_bytes=pressure.headroom_bytes,
            )

    @staticmethod
    def _actuate(changes: list[tuple[RunningAction, bool]]) -> None:
        for action, allow in changes:
            assert action.meter is not None
            try:
                if allow:
                    action.meter.thaw(timeout_s=ACTUATE_WAIT_S)
                else:
                    action.meter.freeze(timeout_s=ACTUATE_WAIT_S)
                action.allowed = allow
            except HostError as exc:
                # Requested but not settled yet: a task in uninterruptible sleep (runc setting
                # up a Docker exec, a tmpfs write) delays the v1 freezer. The kernel finishes
                # the transition; waiting for it here stalled the whole loop 5 s per sandbox.
                action.allowed = allow
                logger.debug("gate: %s of %s not settled: %s", "thaw" if allow else "freeze",
                             action.gate_id, exc)
            except OSError as exc:
                logger.warning("gate: %s of %s failed: %r", "thaw" if allow else "freeze",
                               action.gate_id, exc)

    def _throttle_v1(self, started: list[RunningAction]) -> None:
        """AgentCgroup on v1: a Low sandbox over its mark runs at a tenth of a CPU."""
        by_id = {a.gate_id: a for a in started if a.profiled_peak_bytes is not None}
        boxes = [
            AgentCgroupSandbox(a.gate_id, a.profiled_peak_bytes or 0, a.last_usage_bytes)
            for a in by_id.values()
        ]
        budget = self._domain.budget_bytes or 0
        for decided in agentcgroup_actions(boxes, budget, 1, self._config):
            action = by_id[decided.sandbox_id]
            if decided.throttle_cpu == action.throttled:
                continue
            assert action.meter is not None
            fraction = THROTTLE_CPU_FRACTION if decided.throttle_cpu else None
            try:
                action.meter.set_cpu_quota(fraction)
            except (HostError, OSError) as exc:
                logger.warning("throttle of %s failed: %r", action.gate_id, exc)
                continue
            action.throttled = decided.throttle_cpu
            self._events.emit("throttle", action_id=action.action_id, agent_id=action.agent_id,
                              throttled=action.throttled, reason=decided.reason)

    def release_all(self, actions: Iterable[RunningAction]) -> None:
        """Thaw and unthrottle (an ended action, or everything at shutdown)."""
        for action in actions:
            if action.meter is None:
                continue
            try:
                if action.pending:
                    self._launch(action)  # shutdown: the waiter raises AgentClosed itself
                elif not action.allowed:
                    action.meter.thaw()
                    action.allowed = True
                if action.throttled:
                    action.meter.set_cpu_quota(None)
                    action.throttled = False
            except (HostError, OSError) as exc:
                logger.warning("release of %s failed: %r", action.gate_id, exc)
