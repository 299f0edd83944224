"""The controller's per-agent state, the lifecycle-operation limit and a wake-up signal."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tenon.policy.baselines import AgentCgroupClass
from tenon.policy.residency import LifecycleSlots
from tenon.predict.base import MeasuredAction

if TYPE_CHECKING:
    from tenon.runtime.execution import RunningAction

GAP_EWMA_ALPHA = 0.5  # weight of the newest model wait in an agent's predicted wait


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
    """Its place in admission's line (`ActionRequest.rank_at`); None until first ranked,
    then `created_at` moved earlier by the work its peers showed is left."""
    materialized: bool = False  # a first sandbox was made (there is a workspace and record)
    root_made: bool = False  # a persistent root exists (made by a sandbox or a workspace edit)
    torn_down: bool = False  # the record is committed and no sandbox is live
    restartable: bool = False  # the last boundary's fail-closed check
    restart_reason: str | None = None  # what that check said
    idle_bytes: int = 0  # what the sandbox held when its last action ended (idle: constant)
    busy: bool = False  # an action is between ready and done
    action: RunningAction | None = None  # that action, while it is between ready and done
    alongside: int = 0  # commands running next to the action in flight (`run_alongside`)
    closed: bool = False
    failed_reason: str | None = None
    lifecycle: asyncio.Task[Any] | None = None  # teardown or rebuild in flight
    blocked_reason: str | None = None  # the last rebuild failed (RecoveryError) and why
    last_done_at: float | None = None
    predicted_wait_s: float | None = None  # EWMA of the waits between actions (model calls)
    agentcgroup_class: AgentCgroupClass | None = None
    mark_applied_to: int | None = None

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
    def rank(self) -> float:
        return self.created_at if self.rank_at is None else self.rank_at

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
