"""Workflow-level admission for the baselines that decide per workflow, not per action.

`static-N` admits at most N workflows at once; `reservation` admits a workflow while the
profiled lifetime peaks of the admitted ones fit the budget; everything else (Tenon, eager,
agentcgroup) admits a workflow at once, except that Tenon keeps at most `max_live` live
(`BackendCapacity.max_live_workflows`: what the backend can serve). The decisions are the pure
functions of `policy.baselines`; this is the queue of waiting callers around them.
"""

from __future__ import annotations

import asyncio
import logging

from tenon.errors import ConfigError
from tenon.policy.baselines import (
    PolicyKind,
    PolicySpec,
    WorkflowRequest,
    reservation_admit,
    static_admit,
)

logger = logging.getLogger(__name__)


class WorkflowGate:
    """FIFO of workflows waiting to start; `enter` returns once the policy admits one."""

    def __init__(self, spec: PolicySpec, budget_bytes: int | None, *,
                 max_live: int | None = None) -> None:
        if spec.kind is PolicyKind.RESERVATION and budget_bytes is None:
            raise ConfigError("the reservation policy needs a budget")
        self._spec = spec
        self._budget_bytes = budget_bytes
        self._max_live = max_live
        self._queue: list[tuple[WorkflowRequest, asyncio.Future[None]]] = []
        self._running: dict[str, int] = {}  # workflow id -> profiled peak

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    def check(self, profiled_peak_bytes: int | None) -> None:
        """Refuse a workflow the policy cannot place, before it waits."""
        if self._spec.kind is PolicyKind.RESERVATION and profiled_peak_bytes is None:
            raise ConfigError(
                "the reservation policy needs each workflow's profiled peak "
                "(create_agent(profile_peak_bytes=...))"
            )

    async def enter(self, request: WorkflowRequest) -> None:
        self.check(request.profiled_peak_bytes)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((request, future))
        self._pump()
        try:
            await future
        except asyncio.CancelledError:
            self._queue = [(r, f) for r, f in self._queue if f is not future]
            if future.done() and not future.cancelled():
                self.leave(request.workflow_id)  # admitted just as the caller gave up
            raise

    def adopt(self, workflow_id: str, profiled_peak_bytes: int) -> None:
        """Count a workflow that was running before a controller restart, without a wait."""
        self._running[workflow_id] = max(profiled_peak_bytes, 0)

    def leave(self, workflow_id: str) -> None:
        """The workflow ended (completed, failed or abandoned): its place goes to the next."""
        self._running.pop(workflow_id, None)
        self._pump()

    def _pump(self) -> None:
        queued = [r for r, _ in self._queue]
        kind = self._spec.kind
        if kind is PolicyKind.STATIC:
            assert self._spec.max_workflows is not None
            admitted = static_admit(queued, len(self._running), self._spec.max_workflows)
        elif kind is PolicyKind.RESERVATION:
            assert self._budget_bytes is not None
            admitted = reservation_admit(
                queued, sum(self._running.values()), self._budget_bytes
            )
        elif self._max_live is not None:
            admitted = static_admit(queued, len(self._running), self._max_live)
        else:
            admitted = [r.workflow_id for r in queued]
        chosen = set(admitted)
        remaining = []
        for request, future in self._queue:
            if request.workflow_id in chosen and not future.done():
                self._running[request.workflow_id] = max(request.profiled_peak_bytes, 0)
                future.set_result(None)
            else:
                remaining.append((request, future))
        self._queue = remaining
