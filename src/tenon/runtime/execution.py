"""The execution loop: sample every running sandbox each period, decide, actuate the gate.

One `tick` reads the domain and each running action's cgroup, feeds the per-action
statistics, computes pressure, and (for policies with the gate) folds the samples into the
`GateController` and publishes its allow/deny by freezing and thawing cgroups. The
AgentCgroup baseline's v1 throttling is actuated here too. The loop itself is thin: every
decision is in `policy/`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tenon.errors import HostError
from tenon.host.types import CgroupVersion, MemoryReading
from tenon.policy.admission import Prediction
from tenon.policy.baselines import AgentCgroupSandbox, agentcgroup_actions
from tenon.policy.config import PolicyConfig
from tenon.policy.gate import GateController, GateDecision
from tenon.policy.growth import SandboxSample
from tenon.policy.pressure import PressureState, classify_pressure
from tenon.runtime.events import EventLog
from tenon.runtime.results import ActionStats
from tenon.sandbox.base import DomainMeter, SandboxMeter

logger = logging.getLogger(__name__)

THROTTLE_CPU_FRACTION = 0.1  # AgentCgroup on v1: CPU share of a Low sandbox over its mark


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

    done: bool = False  # its exec returned: the gate no longer touches its sandbox

    @property
    def started(self) -> bool:
        return self.meter is not None and not self.done


def predicted_growth_bytes(actions: Iterable[RunningAction]) -> int:
    """Predicted remaining growth of admitted actions: peak less what each sandbox holds."""
    return sum(max(a.prediction.peak_bytes - a.last_usage_bytes, 0) for a in actions)


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
    ) -> None:
        self._domain = domain
        self._config = config
        self._events = events
        self._use_gate = use_gate
        self._agentcgroup = agentcgroup
        self.gate = GateController(config)
        self.last_pressure: PressureState | None = None
        self.last_decision: GateDecision | None = None
        self._last_logged: tuple[Any, ...] = ()
        self.num_ticks = 0

    def pressure(self, actions: Iterable[RunningAction], reading: MemoryReading) -> PressureState:
        budget = self._domain.budget_bytes
        if budget is None:
            budget = reading.usage_bytes + 2 * self._config.safety_margin_bytes + (1 << 40)
        return classify_pressure(
            budget, reading.usage_bytes, predicted_growth_bytes(actions), self._config
        )

    def free_bytes(self, pressure: PressureState) -> int:
        """Headroom above the yellow line (growth there is not at risk)."""
        budget = self._domain.budget_bytes or 0
        yellow_line = (self._config.red_fraction + self._config.yellow_fraction) * budget
        return max(int(pressure.headroom_bytes - yellow_line), 0)

    def start_action(self, action: RunningAction) -> None:
        """A fresh action starts from bootstrap demand: its sandbox's past says nothing."""
        self.gate.forget(action.gate_id)

    def end_action(self, action: RunningAction) -> None:
        """The action's exec returned. Called synchronously right after, so no tick can act
        on the sandbox in between: the next action may already be starting in it."""
        action.done = True
        self.gate.forget(action.gate_id)

    async def tick(self, now: float, actions: list[RunningAction]) -> PressureState:
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
            self._gate(now, started, samples, pressure)
        if self._agentcgroup and self._domain.version is CgroupVersion.V1:
            self._throttle_v1(started)
        key = (pressure.level, len(started), sum(not a.allowed for a in started))
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
                held=sum(not a.allowed for a in started),
                oom_kills=domain_reading.num_oom_kills,
            )
        return pressure

    def _gate(
        self,
        now: float,
        started: list[RunningAction],
        samples: list[SandboxSample],
        pressure: PressureState,
    ) -> None:
        self.gate.observe(samples)
        caps = {a.gate_id: a.prediction.peak_bytes - a.last_usage_bytes for a in started}
        decision = self.gate.decide(pressure.level, pressure.headroom_bytes, now, caps,
                                    free_bytes=self.free_bytes(pressure))
        self.last_decision = decision
        changes = [
            (a, a.gate_id in decision.allowed)
            for a in started
            if (a.gate_id in decision.allowed) != a.allowed
            and (a.gate_id in decision.allowed or a.gate_id in decision.denied)
        ]
        if not changes:
            return
        self._actuate(changes)
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
                    action.meter.thaw()
                else:
                    action.meter.freeze()
                action.allowed = allow
            except (HostError, OSError) as exc:
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
                if not action.allowed:
                    action.meter.thaw()
                    action.allowed = True
                if action.throttled:
                    action.meter.set_cpu_quota(None)
                    action.throttled = False
            except (HostError, OSError) as exc:
                logger.warning("release of %s failed: %r", action.gate_id, exc)
