"""The execution loop: sample every running sandbox each period, step the policy, act.

One `tick` reads the domain and each running action's cgroup into a frozen
`TickSnapshot`, calls `ExecutionPolicy.step` (policy/execution.py) for the period's
`TickPlan`, and carries it out: launches held starts, holds and releases sandboxes through
the gate actuator (host/actuator.py: the cgroup freezer, or the sched_ext scheduler), throttles
(AgentCgroup on v1), and records the decisions. The results go back to the policy through
`ExecutionPolicy.launched` and `ended`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from tenon.errors import HostError
from tenon.host.actuator import FreezerActuator, GateActuator
from tenon.host.types import CgroupVersion, MemoryReading
from tenon.policy.config import PolicyConfig
from tenon.policy.execution import (
    ActionObs,
    ExecutionPolicy,
    GateChange,
    Throttle,
    TickPlan,
    TickSnapshot,
    known_budget_bytes,
    pressure_of,
)
from tenon.policy.gate import GateController, GateDecision
from tenon.policy.growth import SandboxSample
from tenon.policy.pressure import PressureState
from tenon.predict.base import ActionContext, Prediction
from tenon.runtime.events import EventLog
from tenon.runtime.results import ActionStats
from tenon.sandbox.base import DomainMeter, SandboxMeter

logger = logging.getLogger(__name__)

THROTTLE_CPU_FRACTION = 0.1  # AgentCgroup on v1: CPU share of a Low sandbox over its mark
ACTUATE_WAIT_S = 0.02  # how long one hold/release may hold the loop before it moves on


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
    def started(self) -> bool:
        """In the gate's view: its sandbox is live and its exec has not returned."""
        return self.meter is not None and not self.done

    @property
    def pending(self) -> bool:
        """Ready in a live sandbox, held before its exec began (it holds no memory yet)."""
        return self.started and not self.launched

    @property
    def usage_bytes(self) -> int:
        return self.last_usage_bytes

    def observed(self) -> ActionObs:
        """What the policy sees of it (frozen)."""
        return ActionObs(
            self.action_id, self.agent_id, self.gate_id, self.prediction, self.charge_bytes,
            self.ready_at, self.started, self.launched, self.allowed, self.held_since,
            self.last_usage_bytes, None if self.stats is None else self.stats.start_bytes,
            None if self.stats is None else self.stats.peak_bytes,
            self.peak_passed, self.profiled_peak_bytes, self.throttled)


@dataclass(frozen=True, slots=True)
class Observation:
    """One period's observation: the policy's snapshot and the records it was taken of."""

    snapshot: TickSnapshot
    started: list[RunningAction]
    num_admitted: int


class ExecutionLoop:
    """Observes and acts for the execution policy; `tick` once per control period."""

    def __init__(
        self,
        *,
        domain: DomainMeter,
        config: PolicyConfig,
        events: EventLog,
        use_gate: bool,
        agentcgroup: bool,
        now: Callable[[], float],
        actuator: GateActuator | None = None,
    ) -> None:
        """`actuator` holds and releases sandboxes (default: the cgroup freezer); the loop
        owns it from here and `close` closes it."""
        self._domain = domain
        self.actuator: GateActuator = actuator or FreezerActuator()
        self._config = config
        self._events = events
        self._now = now
        self.policy = ExecutionPolicy(
            config, use_gate=use_gate,
            throttle_v1=agentcgroup and domain.version is CgroupVersion.V1)
        self._last_logged: tuple[Any, ...] = ()
        self.num_ticks = 0

    @property
    def gate(self) -> GateController:
        return self.policy.gate

    @property
    def last_pressure(self) -> PressureState | None:
        return self.policy.last_pressure

    @property
    def last_decision(self) -> GateDecision | None:
        return self.policy.last_decision

    def pressure(self, actions: Iterable[RunningAction], reading: MemoryReading) -> PressureState:
        budget = known_budget_bytes(self._domain.budget_bytes, reading.usage_bytes, self._config)
        return pressure_of(budget, reading.usage_bytes, actions, self._config)

    def starving_demand_bytes(self, actions: Iterable[RunningAction], now: float) -> int:
        return self.policy.starving_demand_bytes(actions, now)

    def launch_demand_bytes(self, action: RunningAction) -> int:
        return self.policy.launch_demand_bytes(action)

    def start_action(self, action: RunningAction) -> bool:
        """True when the action may launch at once (`ExecutionPolicy.start`); otherwise it
        is pending and a tick resolves `action.launch` when the gate lets it start."""
        if self.policy.start(action.observed()):
            return self._launch(action)
        action.allowed = False
        action.held_since = self._now()
        action.launch = asyncio.get_running_loop().create_future()
        return False

    def _launch(self, action: RunningAction) -> bool:
        first = not action.launched
        action.launched, action.allowed = True, True
        if action.launch is not None and not action.launch.done():
            action.launch.set_result(None)
        assert action.meter is not None
        baseline: SandboxSample | None = None
        try:
            usage_bytes, cpu_usage_s = action.meter.sample()
            baseline = SandboxSample(action.gate_id, self._now(), usage_bytes, cpu_usage_s,
                                     True)
        except (HostError, OSError):
            pass
        if first:
            self.policy.launched(action.gate_id, baseline)
        elif baseline is not None:
            self.policy.gate.observe([baseline])
        return True

    def end_action(self, action: RunningAction) -> None:
        """The action's exec returned. Called synchronously right after, so no tick can act
        on the sandbox in between: the next action may already be starting in it."""
        self.policy.ended(action.gate_id, was_launched=action.launched and not action.done)
        action.done = True

    def observe(self, now: float, actions: list[RunningAction]) -> Observation:
        """Sample every started action's sandbox and the domain (one period's observing)."""
        self.num_ticks += 1
        started = [a for a in actions if a.started]
        samples = self._sample(now, started)
        return Observation(self.snapshot(now, actions, self._domain.reading(), tuple(samples)),
                           started, len(actions))

    def snapshot(self, now: float, actions: Iterable[RunningAction], reading: MemoryReading,
                 samples: tuple[SandboxSample, ...] = ()) -> TickSnapshot:
        """The frozen view the policy decides on (at a boundary: no new samples)."""
        budget = known_budget_bytes(self._domain.budget_bytes, reading.usage_bytes, self._config)
        return TickSnapshot(now, budget, reading.usage_bytes,
                            tuple([a.observed() for a in actions]), samples,
                            num_oom_kills=reading.num_oom_kills)

    def act(self, plan: TickPlan, seen: Observation) -> None:
        """Carry out the period's gate changes and throttles, and record the sample.

        Everything from observing to actuating runs without an await: an action that ends
        meanwhile could otherwise see its sandbox frozen after it returned."""
        if plan.changes or plan.throttles:  # most periods change nothing
            by_id = {a.action_id: a for a in seen.started}
            self._act_on_gate(plan, by_id)
            self._act_on_throttles(plan.throttles, by_id)
        self._check_actuator()
        self._record(seen.snapshot, plan.pressure, seen.started, seen.num_admitted,
                     plan.reclaimable_bytes)

    async def tick(self, now: float, actions: list[RunningAction], *,
                   reclaimable_bytes: int = 0) -> PressureState:
        """Observe, step the execution policy alone, act (the sampling benchmark's loop;
        the runtime steps the whole `ControlPolicy`)."""
        seen = self.observe(now, actions)
        plan = self.policy.step(replace(seen.snapshot, reclaimable_bytes=reclaimable_bytes))
        self.act(plan, seen)
        return plan.pressure

    def _sample(self, now: float, started: list[RunningAction]) -> list[SandboxSample]:
        # Runs for every started action every period, so the loop keeps to locals.
        samples: list[SandboxSample] = []
        append = samples.append
        for action in started:
            meter = action.meter
            assert meter is not None
            try:
                usage_bytes, cpu_usage_s = meter.sample()
            except (HostError, OSError) as exc:  # the sandbox vanished between listing and read
                logger.debug("sample of %s failed: %r", action.gate_id, exc)
                continue
            action.last_usage_bytes = usage_bytes
            stats = action.stats
            if stats is not None:
                stats.add(now, usage_bytes)
            append(SandboxSample(action.gate_id, now, usage_bytes, cpu_usage_s, action.allowed))
        return samples

    def _act_on_gate(self, plan: TickPlan, by_id: dict[str, RunningAction]) -> None:
        changes: list[tuple[RunningAction, GateChange]] = [
            (by_id[c.action.action_id], c) for c in plan.changes]
        for action, change in changes:
            if change.launch:
                self._launch(action)  # its launch sample overrides this tick's held one
        self._actuate([(a, c.allow) for a, c in changes if a.launched])
        for action, change in changes:
            self._events.emit(
                "gate",
                action_id=action.action_id,
                agent_id=action.agent_id,
                allowed=change.allow,
                reason=change.reason,
                pressure=plan.pressure.level.name.lower(),
                budget_b=plan.budget_b,
                headroom_bytes=plan.pressure.headroom_bytes,
            )

    def _record(self, snap: TickSnapshot, pressure: PressureState,
                started: list[RunningAction], num_admitted: int,
                reclaimable_bytes: int) -> None:
        held = sum(not a.allowed for a in started)
        key = (pressure.level, len(started), held)
        if key == self._last_logged and self.num_ticks % 10 != 0:
            return
        self._last_logged = key
        self._events.emit(
            "sample",
            usage_bytes=snap.usage_bytes,
            budget_bytes=self._domain.budget_bytes,
            headroom_bytes=pressure.headroom_bytes,
            effective_headroom_bytes=pressure.effective_headroom_bytes,
            pressure=pressure.level.name.lower(),
            running=len(started),
            admitted=num_admitted,
            held=held,
            pending=sum(a.pending for a in started),
            oom_kills=snap.num_oom_kills,
            reclaimable_bytes=reclaimable_bytes,
        )

    def _actuate(self, changes: list[tuple[RunningAction, bool]]) -> None:
        actuator = self.actuator
        for action, allow in changes:
            assert action.meter is not None
            try:
                if allow:
                    actuator.release(action.meter, timeout_s=ACTUATE_WAIT_S)
                else:
                    actuator.hold(action.meter, timeout_s=ACTUATE_WAIT_S)
                action.allowed = allow
            except HostError as exc:
                # Requested but not settled yet: a task in uninterruptible sleep (runc setting
                # up a Docker exec, a tmpfs write) delays the v1 freezer. The kernel finishes
                # the transition; waiting for it here would stall the whole loop per sandbox.
                action.allowed = allow
                logger.debug("gate: %s of %s not settled: %s", "thaw" if allow else "freeze",
                             action.gate_id, exc)
            except OSError as exc:
                logger.warning("gate: %s of %s failed: %r", "release" if allow else "hold",
                               action.gate_id, exc)

    def _check_actuator(self) -> None:
        """The actuator's upkeep each period (long sched_ext holds become freezes); a fallback
        to the freezer is recorded the one time it happens."""
        try:
            reason = self.actuator.check()
        except (HostError, OSError) as exc:
            logger.warning("gate actuator check failed: %r", exc)
            return
        if reason is not None:
            self._events.emit("gate_actuator_fallback", actuator=self.actuator.name,
                              reason=reason)

    def _act_on_throttles(self, throttles: tuple[Throttle, ...],
                          by_id: dict[str, RunningAction]) -> None:
        for decided in throttles:
            action = by_id[decided.action.action_id]
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
                    self.actuator.release(action.meter)
                    action.allowed = True
                if action.throttled:
                    action.meter.set_cpu_quota(None)
                    action.throttled = False
            except (HostError, OSError) as exc:
                logger.warning("release of %s failed: %r", action.gate_id, exc)

    def close(self) -> None:
        """Close the gate actuator (unloads the sched_ext scheduler); after `release_all`."""
        try:
            self.actuator.close()
        except (HostError, OSError) as exc:
            logger.warning("closing gate actuator %s failed: %r", self.actuator.name, exc)
