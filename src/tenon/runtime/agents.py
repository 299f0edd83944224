"""The controller's per-agent state, the lifecycle-operation limit and a wake-up signal."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import Any

from tenon.policy.baselines import AgentCgroupClass
from tenon.policy.reclaim import AgentObs
from tenon.policy.residency import LifecycleSlots
from tenon.predict.base import MeasuredAction
from tenon.runtime.execution import RunningAction

GAP_EWMA_ALPHA = 0.5  # weight of the newest model wait in an agent's predicted wait


class Phase(enum.Enum):
    """Where an agent's sandbox is in its life; the one place the runtime records it."""

    NEW = "new"
    """No sandbox made yet: its first action materializes one."""
    RESIDENT = "resident"
    """A live sandbox."""
    TORN_DOWN = "torn_down"
    """Its recovery record is committed and no sandbox is live: its next action rebuilds."""
    CLOSED = "closed"
    """Closed (or left for the next runtime): nothing drives it any more."""

    def after_teardown(self) -> Phase:
        return self if self is Phase.CLOSED else Phase.TORN_DOWN

    def after_rebuild(self) -> Phase:
        """A first sandbox or a rebuilt one is live (unless the agent closed meanwhile)."""
        return self if self is Phase.CLOSED else Phase.RESIDENT


@dataclass
class AgentState:
    """One logical agent as the controller tracks it (the durable part is in the records)."""

    agent_id: str
    image: str
    family: str | None
    task_prompt: str | None
    profile_peak_bytes: int | None
    created_at: float
    workflow: str | None = None
    """The caller's name for the workflow this agent runs (predictors key on it)."""
    task: str | None = None
    """The task the workflow attempts; predictors share measurements between its attempts."""
    history: list[MeasuredAction] = field(default_factory=list)
    rank_at: float | None = None
    """Its place in admission's line (`ActionRequest.rank_at`): when its next action would
    have been ready had Tenon never made it wait; None until first ranked."""
    delayed_s: float = 0.0
    """How long Tenon has made this agent's actions wait to start (queued, rebuilding,
    held), in all."""
    phase: Phase = Phase.NEW
    root_made: bool = False
    """A persistent root exists (made with the first sandbox, by a workspace edit, or
    restored): closing cleans it up."""
    restartable: bool = False  # the last boundary's fail-closed check
    restart_reason: str | None = None  # what that check said
    idle_bytes: int = 0  # what the sandbox held when its last action ended (idle: constant)
    busy: bool = False  # an action is between ready and done
    action: RunningAction | None = None  # that action, while it is between ready and done
    alongside: int = 0  # commands running next to the action in flight (`run_alongside`)
    failed_reason: str | None = None
    """Its workflow attempt failed (an OOM kill, a lost sandbox, a blocked restore): it
    refuses further actions, whatever its phase."""
    lifecycle: asyncio.Task[Any] | None = None  # teardown or rebuild in flight
    blocked_reason: str | None = None  # the last rebuild failed (RecoveryError) and why
    last_done_at: float | None = None
    predicted_wait_s: float | None = None  # EWMA of the waits between actions (model calls)
    agentcgroup_class: AgentCgroupClass | None = None
    backend_config: dict[str, Any] | None = None
    """Its own backend config (the runtime's with its network policy) when it has one."""

    def note_ready(self, now: float) -> None:
        if self.last_done_at is not None:
            wait = max(now - self.last_done_at, 0.0)
            prev = self.predicted_wait_s
            self.predicted_wait_s = (
                wait if prev is None else GAP_EWMA_ALPHA * wait + (1 - GAP_EWMA_ALPHA) * prev
            )

    def note_done(self, now: float) -> None:
        self.last_done_at = now

    @property
    def materialized(self) -> bool:
        """A first sandbox was made (there is a workspace and a record); False once closed."""
        return self.phase in (Phase.RESIDENT, Phase.TORN_DOWN)

    @property
    def torn_down(self) -> bool:
        return self.phase is Phase.TORN_DOWN

    @property
    def closed(self) -> bool:
        return self.phase is Phase.CLOSED

    @property
    def rank(self) -> float:
        return self.created_at if self.rank_at is None else self.rank_at

    def observed(self) -> AgentObs:
        """What the policy sees of it (frozen)."""
        resident = (self.phase is Phase.RESIDENT and self.lifecycle is None
                    and self.failed_reason is None and self.alongside == 0)
        return AgentObs(self.agent_id, self.restartable, resident, self.busy, self.torn_down,
                        self.closed, self.lifecycle is not None, self.idle_bytes, self.rank,
                        self.last_done_at, self.predicted_wait_s)

    @property
    def idle(self) -> bool:
        """Resident, between actions (nothing runs alongside either), and not already in a
        lifecycle operation."""
        return (self.materialized and not self.torn_down and not self.busy and not self.closed
                and self.lifecycle is None and self.failed_reason is None
                and self.alongside == 0)


class Lifecycle:
    """At most `limit` teardowns and rebuilds in flight (threads `LifecycleSlots`)."""

    def __init__(self, limit: int) -> None:
        self.slots = LifecycleSlots(limit)

    def try_acquire(self) -> bool:
        taken = self.slots.acquire()
        if taken is None:
            return False
        self.slots = taken
        return True

    def release(self) -> None:
        self.slots = self.slots.release()

    @property
    def in_flight(self) -> int:
        return self.slots.in_flight


class Waker:
    """Wakes every waiter when something changed (a tick, a release, a finished teardown)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self) -> None:
        await self._event.wait()
