"""Which idle sandboxes to tear down, which to rebuild ahead of their action, and which
running actions' charges to shrink: pure functions over the agents and actions as observed.

The runtime asks at every control period (`ControlPolicy.step`) and at an action boundary
under pressure (`ControlPolicy.reclaim`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from tenon.policy.config import PolicyConfig
from tenon.policy.pressure import Pressure, PressureState, yellow_line_bytes
from tenon.policy.residency import (
    IdleSandbox,
    LifecycleSlots,
    Rebuild,
    choose_reclaim,
    rebuild_decision,
)


class AgentObs(NamedTuple):
    """One agent as the runtime observed it (its sandbox's phase and its activity; a tuple:
    the runtime makes one per agent per period)."""

    agent_id: str
    restartable: bool
    """The last boundary's fail-closed check said its sandbox may be torn down."""
    resident: bool
    """A live sandbox, no lifecycle operation in flight, not failed, nothing alongside."""
    busy: bool
    """An action is between ready and done."""
    torn_down: bool
    closed: bool
    in_lifecycle: bool
    """A teardown or rebuild is in flight."""
    idle_bytes: int
    """What its sandbox held when its last action ended (idle: constant)."""
    rank: float
    last_done_at: float | None = None
    predicted_wait_s: float | None = None

    @property
    def idle(self) -> bool:
        """Resident and between actions."""
        return self.resident and not self.busy

    @property
    def ready_in_s(self) -> float | None:
        """How long until its next action is predicted ready (None if unknown)."""
        if self.predicted_wait_s is None or self.last_done_at is None:
            return None
        return self.last_done_at + self.predicted_wait_s

    def idle_for(self, now: float) -> float:
        """How much longer its model wait is predicted to last (0 if unknown)."""
        at = self.ready_in_s
        return 0.0 if at is None else at - now


@dataclass(frozen=True, slots=True)
class TeardownOrder:
    agent_id: str
    why: str


@dataclass(frozen=True, slots=True)
class WaitingWork:
    """Work that waits for memory, as reclaim sizes it (bytes)."""

    held_starts_bytes: int
    """Launch demand of starts held before their exec (past overdue, under green)."""
    stuck_bytes: int
    """A queued action the logical window would take but the headroom cannot."""
    starving_bytes: int
    """Demand of growers held past overdue."""
    queued_bytes: int
    """Predicted averages of ready queued actions, up to the room the window has (only
    outside green)."""

    @property
    def total_bytes(self) -> int:
        return (self.held_starts_bytes + self.stuck_bytes + self.starving_bytes
                + self.queued_bytes)


def reclaim_candidates(agents: Iterable[AgentObs], queued: frozenset[str]) -> list[AgentObs]:
    """Agents whose resident sandbox may be torn down now: restartable, between actions (in
    a model wait) or with the next action still queued for admission (its sandbox runs
    nothing until then, and a queued action may wait long)."""
    return [a for a in agents if a.restartable and a.resident
            and (not a.busy or a.agent_id in queued)]


def reclaimable_bytes(agents: Sequence[AgentObs], queued: frozenset[str]) -> int:
    """Memory that can come back without a held grower running: what reclaim candidates
    hold, and sandboxes whose teardown is in flight."""
    in_flight = sum(a.idle_bytes for a in agents if a.in_lifecycle and not a.torn_down)
    return in_flight + sum(a.idle_bytes for a in reclaim_candidates(agents, queued))


def reclaim_deficit_bytes(pressure: PressureState, budget_bytes: int, waiting: WaitingWork,
                          config: PolicyConfig) -> int:
    """How much physical headroom is missing: the yellow line plus the work waiting for
    memory, less H (positive: that much must come back)."""
    line = yellow_line_bytes(budget_bytes, config)
    return int(line + waiting.total_bytes - pressure.headroom_bytes) + 1


def choose_victims(agents: Sequence[AgentObs], queued: frozenset[str], *, now: float,
                   level: Pressure, actual: Pressure, needed_bytes: int,
                   slots: LifecycleSlots, config: PolicyConfig) -> list[str]:
    """Idle sandboxes to tear down for `needed_bytes`, last-ranked workflow first, at most
    one per free lifecycle slot. Under red, or for work held past overdue (`level` raised
    to yellow from an `actual` green), short model waits may go too."""
    idle = [IdleSandbox(a.agent_id, a.idle_bytes, True, a.idle_for(now), rank_at=a.rank,
                        queued=a.agent_id in queued)
            for a in reclaim_candidates(agents, queued)]
    return choose_reclaim(idle, level, needed_bytes, max_count=slots.num_free,
                          min_idle_s=config.reclaim_min_idle_s,
                          spare_short_waits=actual is Pressure.YELLOW)


def predictive_rebuilds(agents: Iterable[AgentObs], level: Pressure, now: float,
                        slots: LifecycleSlots, config: PolicyConfig,
                        ) -> tuple[list[str], LifecycleSlots]:
    """Under green, torn-down agents whose next action is predicted soon, each on a
    lifecycle slot; the slots left."""
    chosen: list[str] = []
    if level is not Pressure.GREEN:
        return chosen, slots
    for agent in agents:
        if not agent.torn_down or agent.busy or agent.closed or agent.in_lifecycle:
            continue
        at = agent.ready_in_s
        if at is None:
            continue
        decision = rebuild_decision(agent.agent_id, next_action_ready=False,
                                    predicted_ready_in_s=at - now, pressure=level,
                                    slots=slots, config=config)
        taken = slots.acquire() if decision.action is Rebuild.START else None
        if taken is not None:
            slots = taken
            chosen.append(agent.agent_id)
    return chosen, slots
