"""Residency at action boundaries: retain or tear down idle sandboxes, and rebuild.

The restart-safety check happens elsewhere (fail closed); here a sandbox is
either `restartable` or not, and a non-restartable (resident_only) sandbox is
never chosen for teardown. Lifecycle operations (teardowns and rebuilds) are
bounded by `LifecycleSlots`, an immutable count the caller threads through.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from tenon.policy.config import PolicyConfig
from tenon.policy.pressure import Pressure


class Residency(enum.Enum):
    RETAIN = "retain"
    TEAR_DOWN = "tear_down"


class Rebuild(enum.Enum):
    START = "start"
    WAIT = "wait"


@dataclass(frozen=True, slots=True)
class LifecycleSlots:
    """How many lifecycle operations are in flight, out of `limit`."""

    limit: int
    in_flight: int = 0

    @property
    def num_free(self) -> int:
        return max(self.limit - self.in_flight, 0)

    def acquire(self) -> LifecycleSlots | None:
        """The slots after taking one, or None when all are taken."""
        if self.in_flight >= self.limit:
            return None
        return LifecycleSlots(self.limit, self.in_flight + 1)

    def release(self) -> LifecycleSlots:
        if self.in_flight <= 0:
            raise ValueError("no lifecycle operation in flight to release")
        return LifecycleSlots(self.limit, self.in_flight - 1)


@dataclass(frozen=True, slots=True)
class IdleSandbox:
    """An idle sandbox at an action boundary, as residency sees it."""

    sandbox_id: str
    working_set_bytes: int
    restartable: bool
    """False means resident_only: it may be gated but never torn down."""
    predicted_wait_s: float = 0.0
    """Predicted time until the agent's next action is ready (the model wait)."""
    rank_at: float = 0.0
    """The workflow's place in admission's line (`ActionRequest.rank_at`: its readiness less
    the delay Tenon has made it wait). Admission serves the smallest first, so the largest
    ranks' sandboxes are the ones that will sit idle the longest."""
    queued: bool = False
    """Its agent's next action is ready and waiting for admission (known to be waiting)."""


@dataclass(frozen=True, slots=True)
class ResidencySnapshot:
    sandbox: IdleSandbox
    pressure: Pressure
    slots: LifecycleSlots


@dataclass(frozen=True, slots=True)
class ResidencyDecision:
    sandbox_id: str
    action: Residency
    reason: str


@dataclass(frozen=True, slots=True)
class RebuildDecision:
    sandbox_id: str
    action: Rebuild
    reason: str


def residency_decision(
    snapshot: ResidencySnapshot, now: float, config: PolicyConfig
) -> ResidencyDecision:
    """Decide at action-done whether the idle sandbox should be torn down."""
    del now  # decisions here depend on predicted durations, not on absolute time
    box = snapshot.sandbox
    sid = box.sandbox_id
    if not box.restartable:
        return ResidencyDecision(sid, Residency.RETAIN, "resident_only: never torn down")
    if snapshot.slots.num_free == 0:
        return ResidencyDecision(sid, Residency.RETAIN, "lifecycle slots all in flight")
    if snapshot.pressure is Pressure.GREEN:
        cost_s = config.teardown_cost_s + config.rebuild_cost_s
        if box.predicted_wait_s > cost_s:
            return ResidencyDecision(
                sid,
                Residency.TEAR_DOWN,
                f"green: wait {box.predicted_wait_s:.1f}s amortizes teardown+rebuild {cost_s:.1f}s",
            )
        return ResidencyDecision(
            sid,
            Residency.RETAIN,
            f"green: wait {box.predicted_wait_s:.1f}s does not amortize {cost_s:.1f}s",
        )
    return ResidencyDecision(
        sid, Residency.TEAR_DOWN, f"{snapshot.pressure.name.lower()}: reclaim restartable idle"
    )


def reclaim_key(box: IdleSandbox) -> tuple[float, int, str]:
    """Victim order: the last-ranked workflow first (the youngest, when no peers say how
    much work is left), then the largest working set, then id.

    The last-ranked workflow is the last that admission serves, so its sandbox stays idle the
    longest: the memory a teardown frees stays free, and the rebuild is a long way off.
    Largest-first alone takes whichever agent has just finished an action, whose next one
    is ready a moment later: every such teardown is followed at once by a rebuild, and the
    churn costs the host CPU without freeing memory for long.
    """
    return (-box.rank_at, -box.working_set_bytes, box.sandbox_id)


def choose_reclaim(
    idle_sandboxes: Iterable[IdleSandbox],
    pressure: Pressure,
    needed_bytes: int,
    *,
    max_count: int | None = None,
    min_idle_s: float = 0.0,
    spare_short_waits: bool = False,
) -> list[str]:
    """Restartable idle sandboxes to tear down until `needed_bytes`: first those that will
    wait long (queued for admission, or predicted away at least `min_idle_s`), then the
    others, each in `reclaim_key` order (last-ranked workflow first). A sandbox whose agent
    is back in a third of a second frees nothing worth a teardown and a rebuild; with
    `spare_short_waits` (the caller passes it under yellow) those are not taken at all.

    Nothing under green; never a resident_only sandbox; at most `max_count`
    (pass the free lifecycle slots).
    """
    if pressure is Pressure.GREEN or needed_bytes <= 0:
        return []

    def waits_long(box: IdleSandbox) -> bool:
        return box.queued or box.predicted_wait_s >= min_idle_s

    boxes = [b for b in idle_sandboxes
             if b.restartable and (waits_long(b) or not spare_short_waits)]
    chosen: list[str] = []
    freed_bytes = 0
    for box in sorted(boxes, key=lambda b: (not waits_long(b), reclaim_key(b))):
        if freed_bytes >= needed_bytes or (max_count is not None and len(chosen) >= max_count):
            break
        chosen.append(box.sandbox_id)
        freed_bytes += box.working_set_bytes
    return chosen


def rebuild_decision(
    sandbox_id: str,
    *,
    next_action_ready: bool,
    predicted_ready_in_s: float | None,
    pressure: Pressure,
    slots: LifecycleSlots,
    config: PolicyConfig,
) -> RebuildDecision:
    """Rebuild a torn-down sandbox when its next action is ready (or predictively).

    None is started under red; a predictive rebuild (before the action is ready,
    when it is predicted ready within the rebuild time) only under green.
    """
    if pressure is Pressure.RED:
        return RebuildDecision(sandbox_id, Rebuild.WAIT, "red: no rebuild started")
    if slots.num_free == 0:
        return RebuildDecision(sandbox_id, Rebuild.WAIT, "lifecycle slots all in flight")
    if next_action_ready:
        return RebuildDecision(sandbox_id, Rebuild.START, "next action is ready")
    if (
        pressure is Pressure.GREEN
        and predicted_ready_in_s is not None
        and predicted_ready_in_s <= config.rebuild_cost_s
    ):
        return RebuildDecision(
            sandbox_id,
            Rebuild.START,
            f"green: predictive, ready in {predicted_ready_in_s:.1f}s <= rebuild "
            f"{config.rebuild_cost_s:.1f}s",
        )
    return RebuildDecision(sandbox_id, Rebuild.WAIT, "next action not ready")
