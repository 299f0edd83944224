"""The execution gate (the paper's Algorithm 1): which sandboxes may run now.

`decide_gate` is a pure function of (estimates, AIMD budget, denial times,
pressure, headroom, now, config). `GateController` is the thin stateful shell
that folds samples, steps the AIMD budget and remembers denial times.

Invariants (property-tested):
- green allows every sandbox;
- under yellow at most b positive-demand sandboxes are allowed and their
  demands sum to at most H; under red at most one, and only if it fits H;
- liveness: when no positive-demand sandbox fits H and no other sandbox runs, exactly one
  still runs alone as a probe: the one already running, else one denied for at least
  `overdue_after_s` (the only allowance beyond H);
- a denied sandbox stays denied at least `min_denial_wait_s` unless green.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tenon.policy.config import PolicyConfig
from tenon.policy.growth import (
    GrowthEstimate,
    GrowthEstimator,
    GrowthState,
    SandboxSample,
    classify,
    projected_demand_bytes,
)
from tenon.policy.pressure import Pressure


@dataclass(frozen=True, slots=True)
class AimdBudget:
    """Yellow budget b: halved on each pressure increase, +1 per period of green."""

    b: int
    last_level: Pressure
    green_since: float | None
    """Start of the current stretch of green not yet turned into +1 steps."""

    @classmethod
    def initial(cls, config: PolicyConfig) -> AimdBudget:
        return cls(config.yellow_b0, Pressure.GREEN, None)

    def step(self, level: Pressure, now: float, config: PolicyConfig) -> AimdBudget:
        b = self.b
        green_since = self.green_since
        if level > self.last_level:
            b = max(1, b // 2)
        if level is Pressure.GREEN:
            if green_since is None:
                green_since = now
            period = config.aimd_increase_after_s
            num_steps = int((now - green_since) // period)
            if num_steps > 0:
                b = min(config.yellow_bmax, b + num_steps)
                green_since += num_steps * period
        else:
            green_since = None
        return AimdBudget(max(1, min(b, config.yellow_bmax)), level, green_since)


@dataclass(frozen=True, slots=True)
class GateDecision:
    allowed: frozenset[str]
    denied: frozenset[str]
    budget_b: int
    """Slots for positive-demand sandboxes this period (b in yellow, 1 in red)."""
    pressure: Pressure
    headroom_bytes: int
    reasons: Mapping[str, str]


def decide_gate(
    estimates: Mapping[str, GrowthEstimate],
    level: Pressure,
    headroom_bytes: int,
    now: float,
    config: PolicyConfig,
    *,
    budget_b: int,
    denied_since: Mapping[str, float],
    growth_caps: Mapping[str, int] | None = None,
) -> GateDecision:
    """Decide who runs for the next control period; O(n log n), one sort.

    `growth_caps` bounds a sandbox's projected demand by what its admitted prediction says
    it still has to grow (predicted peak less current usage): the EWMA remembers a ramp for
    a second after it ends, and a held sandbox's estimate cannot decay at all, so without
    the cap a sandbox at its peak would look like a fast grower indefinitely. A cap <= 0
    (the sandbox reached its prediction) leaves it the bootstrap demand: it still takes a
    growth slot, so yellow and red still bound how many such sandboxes grow at once.
    """
    if level is Pressure.GREEN:
        return GateDecision(
            frozenset(estimates),
            frozenset(),
            budget_b,
            level,
            headroom_bytes,
            dict.fromkeys(estimates, "green: all allowed"),
        )
    slots = budget_b if level is Pressure.YELLOW else 1
    allowed: list[str] = []
    denied: list[str] = []
    reasons: dict[str, str] = {}
    # (not overdue, state rank, demand, id): overdue first, then state, smaller demand, id.
    candidates: list[tuple[bool, int, int, str]] = []
    min_wait = config.min_denial_wait_s
    overdue_after = config.overdue_after_s
    caps = growth_caps or {}
    for sid, est in estimates.items():
        demand = projected_demand_bytes(est, config)
        cap = caps.get(sid)
        if cap is not None and demand > 0:
            demand = min(demand, cap if cap > 0 else config.bootstrap_demand_bytes)
        if demand <= 0:
            allowed.append(sid)
            reasons[sid] = "no projected growth"
            continue
        since = denied_since.get(sid)
        waited = None if since is None else now - since
        if waited is not None and waited < min_wait:
            denied.append(sid)
            reasons[sid] = f"denied {waited:.2f}s ago; waits {min_wait:.2f}s"
            continue
        overdue = waited is not None and waited >= overdue_after
        candidates.append((not overdue, int(classify(est, now, config)), demand, sid))
    candidates.sort()
    used_bytes = 0
    num_admitted = 0
    for not_overdue, _rank, demand, sid in candidates:
        if num_admitted >= slots:
            denied.append(sid)
            reasons[sid] = f"{level.name.lower()}: all {slots} growth slots taken"
        elif used_bytes + demand > headroom_bytes:
            denied.append(sid)
            reasons[sid] = (
                f"{level.name.lower()}: demand {demand} B does not fit "
                f"headroom left {headroom_bytes - used_bytes} B"
            )
        else:
            used_bytes += demand
            num_admitted += 1
            allowed.append(sid)
            kind = "probe" if level is Pressure.RED else f"slot {num_admitted}/{slots}"
            reasons[sid] = f"{level.name.lower()} {kind}: demand {demand} B fits" + (
                "" if not_overdue else " (overdue)"
            )
    if not allowed and candidates:
        # Liveness: no grower fits H and nothing else runs, so nothing can finish and free
        # memory while everyone is held. One runs alone: the probe already running keeps
        # running (rotating probes every period would let none of them finish), else the
        # head once it has waited past the overdue threshold. The safety margin S absorbs
        # its overshoot until the next period re-decides. The one allowance beyond H.
        running = [c for c in candidates if c[1] == GrowthState.GROWING]
        chosen = running[0] if running else candidates[0] if not candidates[0][0] else None
        if chosen is not None:
            sid = chosen[3]
            denied.remove(sid)
            allowed.append(sid)
            kind = "running probe continues" if running else "overdue probe"
            reasons[sid] = f"{level.name.lower()} {kind}: nothing else may grow"
    return GateDecision(
        frozenset(allowed), frozenset(denied), slots, level, headroom_bytes, reasons
    )


def growth_state(estimate: GrowthEstimate, now: float, config: PolicyConfig) -> GrowthState:
    """Re-exported for callers that log states alongside decisions."""
    return classify(estimate, now, config)


class GateController:
    """Stateful shell: observe samples, then decide once per control period."""

    def __init__(self, config: PolicyConfig) -> None:
        self._config = config
        self._estimator = GrowthEstimator(config)
        self._aimd = AimdBudget.initial(config)
        self._denied_since: dict[str, float] = {}

    @property
    def config(self) -> PolicyConfig:
        return self._config

    @property
    def aimd(self) -> AimdBudget:
        return self._aimd

    @property
    def estimates(self) -> Mapping[str, GrowthEstimate]:
        return self._estimator.estimates

    @property
    def denied_since(self) -> Mapping[str, float]:
        return self._denied_since

    def observe(self, samples: Iterable[SandboxSample]) -> None:
        self._estimator.observe(samples)

    def forget(self, sandbox_id: str) -> None:
        self._estimator.forget(sandbox_id)
        self._denied_since.pop(sandbox_id, None)

    def decide(
        self,
        pressure_level: Pressure,
        headroom_bytes: int,
        now: float,
        growth_caps: Mapping[str, int] | None = None,
    ) -> GateDecision:
        self._aimd = self._aimd.step(pressure_level, now, self._config)
        decision = decide_gate(
            self._estimator.estimates,
            pressure_level,
            headroom_bytes,
            now,
            self._config,
            budget_b=self._aimd.b,
            denied_since=self._denied_since,
            growth_caps=growth_caps,
        )
        # A denial's start time is kept across consecutive denials, so waits accumulate
        # toward "overdue"; an allowed sandbox's clock resets.
        previous = self._denied_since
        self._denied_since = {sid: previous.get(sid, now) for sid in decision.denied}
        return decision
