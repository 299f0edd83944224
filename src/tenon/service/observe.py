"""A read-only snapshot of one runtime for the observers (`/metrics`, the live view).

`observe(runtime)` reads the domain's cgroup, each resident sandbox's cgroup and the
controller's in-memory state; it changes nothing and never raises for a sandbox that
vanished between listing and reading (its memory is then None). It must run on the
runtime's event loop: the controller's dicts are only consistent between awaits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tenon.errors import HostError
from tenon.policy.pressure import red_line_bytes, yellow_line_bytes

if TYPE_CHECKING:
    from tenon.runtime.controller import Runtime

RESIDENCY_STATES = ("new", "resident", "busy", "frozen", "torn_down", "resident_only",
                    "failed", "blocked")
"""Every state `Runtime.residency_of` reports a sandbox in."""

PRESSURE_STATES = ("green", "yellow", "red")


@dataclass(frozen=True, slots=True)
class SandboxView:
    agent_id: str
    state: str
    """One of `RESIDENCY_STATES`."""
    memory_bytes: int | None
    """The sandbox cgroup's usage; None when no sandbox is resident (or it vanished)."""
    restartable: bool
    reason: str | None
    """Why it is in its state where that says something: the failure, the last boundary's
    restart-safety verdict."""


@dataclass(frozen=True, slots=True)
class HeldAction:
    """An action the gate holds: before its start (`start`) or frozen mid-run (`frozen`)."""

    action_id: str
    agent_id: str
    kind: str
    held_for_s: float | None
    """How long it has been held before its start (None when frozen mid-run)."""


@dataclass(frozen=True, slots=True)
class QueuedAction:
    action_id: str
    agent_id: str
    waited_s: float
    predicted_peak_bytes: int


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The runtime at one instant. Byte lines are in usage terms: usage at or above
    `yellow_from_bytes` is the yellow region, at or above `red_from_bytes` the red one."""

    t_s: float
    """The event log's time (`EventLog.elapsed`): events and snapshots share it."""
    usage_bytes: int
    peak_bytes: int
    budget_bytes: int | None
    num_oom_kills: int
    pressure: str
    pressure_reason: str
    headroom_bytes: int
    yellow_from_bytes: int | None
    red_from_bytes: int | None
    sandboxes: tuple[SandboxView, ...]
    queued: tuple[QueuedAction, ...]
    held: tuple[HeldAction, ...]
    admitted_bytes: int | None
    window_bytes: int | None
    restartable_share: float | None
    num_boundaries: int
    num_restartable_boundaries: int
    num_lifecycle_in_flight: int

    def count_by_state(self) -> dict[str, int]:
        """Sandboxes per state, every state present (0 where none)."""
        counts = dict.fromkeys(RESIDENCY_STATES, 0)
        for box in self.sandboxes:
            counts[box.state] = counts.get(box.state, 0) + 1
        return counts


def region_lines(runtime: Runtime) -> tuple[int | None, int | None]:
    """(yellow_from_bytes, red_from_bytes): the usage at which pressure turns yellow and
    red by headroom alone (`policy.pressure.classify_pressure`); None without a budget."""
    budget = runtime.domain.budget_bytes
    if budget is None:
        return None, None
    base = budget - runtime.config.safety_margin(budget)
    yellow = base - yellow_line_bytes(budget, runtime.config)
    red = base - red_line_bytes(budget, runtime.config)
    return max(int(yellow), 0), max(int(red), 0)


def _memory_of(runtime: Runtime, agent_id: str) -> int | None:
    sandbox = runtime.residency.sandbox_for(agent_id)
    if sandbox is None:
        return None
    try:
        return int(sandbox.cgroup.reading().usage_bytes)
    except (OSError, HostError):  # torn down between the lookup and the read
        return None


def observe(runtime: Runtime) -> Snapshot:
    """The runtime now (see the module docstring for where it may be called)."""
    now = runtime.clock.now()
    reading = runtime.domain.reading()
    pressure = runtime.execution.pressure(runtime.actions.values(), reading)
    held: list[HeldAction] = []
    for action in list(runtime.actions.values()):
        if not action.started or action.allowed:
            continue
        if action.pending:
            since = action.held_since
            held.append(HeldAction(action.action_id, action.agent_id, "start",
                                   None if since is None else max(now - since, 0.0)))
        else:
            held.append(HeldAction(action.action_id, action.agent_id, "frozen", None))
    sandboxes = []
    for state in list(runtime.agents.values()):
        if state.closed:
            continue  # on its way out: no longer a sandbox to show
        box_state = runtime.residency_of(state.agent_id)
        reason = state.failed_reason or state.restart_reason
        sandboxes.append(SandboxView(state.agent_id, box_state,
                                     _memory_of(runtime, state.agent_id),
                                     state.restartable, reason))
    admission = runtime.admission
    queued: tuple[QueuedAction, ...] = ()
    if admission is not None:
        queued = tuple(QueuedAction(r.action_id, r.workflow_id, max(now - r.ready_at, 0.0),
                                    r.prediction.peak_bytes) for r in admission.queued)
    tally = runtime.boundary.tally
    yellow_from, red_from = region_lines(runtime)
    return Snapshot(
        t_s=runtime.events.elapsed(),
        usage_bytes=reading.usage_bytes,
        peak_bytes=reading.peak_bytes,
        budget_bytes=runtime.domain.budget_bytes,
        num_oom_kills=reading.num_oom_kills,
        pressure=pressure.level.name.lower(),
        pressure_reason=pressure.reason,
        headroom_bytes=pressure.headroom_bytes,
        yellow_from_bytes=yellow_from,
        red_from_bytes=red_from,
        sandboxes=tuple(sorted(sandboxes, key=lambda s: s.agent_id)),
        queued=queued,
        held=tuple(held),
        admitted_bytes=None if admission is None else admission.admitted_total_bytes,
        window_bytes=None if admission is None else admission.window_bytes,
        restartable_share=tally.share,
        num_boundaries=tally.num_checked,
        num_restartable_boundaries=tally.num_restartable,
        num_lifecycle_in_flight=runtime.lifecycle.in_flight,
    )
