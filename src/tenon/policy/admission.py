"""Water-level admission of actions against a logical window and physical headroom.

Each admitted light action holds a logical charge `(1-a)*avg + a*peak` with
`a = clamp(admitted_total / window, 0, 1)`; a heavy one holds at least its predicted peak
(`admission_charge`). The charge is set at admission and released
exactly once at completion; it only ever shrinks in between, when the action has passed
its peak (`past_peak_charge`). Light and heavy actions queue separately but share
the window, each served in rank order (the workflow Tenon has delayed most first;
`ActionRequest.rank_at`). The first ready heavy action accrues
protected credit at `heavy_credit_rate_bytes_per_s` (beta); light actions may not admit into that
credit, so once it covers the heavy action's charge, light admissions stop
eating the room it needs and it is admitted as soon as running actions release.
After the logical check, a charge must also fit the physical headroom H.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from tenon.errors import TenonError
from tenon.policy.config import PolicyConfig
from tenon.predict.base import Prediction


class ChargeNotHeld(TenonError, KeyError):
    """A release named an action that holds no charge (never admitted, or released)."""


@dataclass(frozen=True, slots=True)
class ActionRequest:
    action_id: str
    workflow_id: str
    prediction: Prediction
    ready_at: float
    rank_at: float | None = None
    """The workflow's place in line: when this action would have been ready had Tenon never
    made the workflow wait. Queues serve the smallest rank first, then readiness; None
    ranks by readiness alone."""

    @property
    def queue_key(self) -> tuple[float, float]:
        rank = self.ready_at if self.rank_at is None else self.rank_at
        return (rank, self.ready_at)


@dataclass(frozen=True, slots=True)
class AdmitDecision:
    action_id: str
    workflow_id: str
    charge_bytes: int
    heavy: bool
    reason: str


def water_level_charge(prediction: Prediction, admitted_total_bytes: int, window_bytes: int) -> int:
    """`(1-a)*avg + a*peak` with `a = clamp(admitted/window, 0, 1)`."""
    a = min(max(admitted_total_bytes / window_bytes, 0.0), 1.0) if window_bytes > 0 else 1.0
    avg = max(prediction.avg_bytes, 0)
    peak = max(prediction.peak_bytes, avg)
    return int(round((1.0 - a) * avg + a * peak))


def admission_charge(prediction: Prediction, admitted_total_bytes: int, window_bytes: int,
                     *, heavy: bool) -> int:
    """The water-level charge; for a heavy action at least its predicted peak.

    The execution gate will not start an action until its predicted peak fits, so a heavy
    one admitted at a water-level charge near its average (the window is nearly empty) holds
    less of the window than it waits for: light actions are admitted into the room its start
    needs, so it waits long after admission to start, and a second heavy action whose peak
    cannot fit beside the first is admitted too, so both are held in turn and each takes
    several times its own length.
    """
    charge = water_level_charge(prediction, admitted_total_bytes, window_bytes)
    return max(charge, prediction.peak_bytes) if heavy else charge


def past_peak_charge(charge_bytes: int, prediction: Prediction, *, start_bytes: int,
                     peak_bytes: int, usage_bytes: int, config: PolicyConfig) -> int | None:
    """The charge of a running action that has passed its peak, or None if it has not.

    Passed: its sandbox rose to at least `f` of the predicted peak and has since fallen to
    at most `f` of the peak it reached (f = `peak_release_fraction`). A test run that
    spikes to a gigabyte in its first seconds and then idles would otherwise hold room in
    the window it no longer uses, and light work queues behind it. The new
    charge is what the sandbox holds, at least the predicted average. If it grows again,
    the execution gate holds it when there is no room, as for any misprediction.
    """
    f = config.peak_release_fraction
    if f <= 0 or peak_bytes <= start_bytes:
        return None
    if peak_bytes < f * prediction.peak_bytes or usage_bytes > f * peak_bytes:
        return None
    charge = max(usage_bytes, prediction.avg_bytes)
    return charge if charge < charge_bytes else None


def is_heavy(prediction: Prediction, config: PolicyConfig) -> bool:
    return prediction.heavy_risk or prediction.peak_bytes > config.heavy_peak_bytes


class AdmissionController:
    """Queues ready actions and admits them; `decide` is deterministic given `now`."""

    def __init__(self, config: PolicyConfig, window_bytes: int, *,
                 max_admitted_actions: int | None = None) -> None:
        """`max_admitted_actions`: what the backend serves well at once
        (`BackendCapacity`); None: memory alone limits admission."""
        if window_bytes <= 0:
            raise ValueError(f"window_bytes must be positive, got {window_bytes}")
        if max_admitted_actions is not None and max_admitted_actions < 1:
            raise ValueError(f"max_admitted_actions must be at least 1, got "
                             f"{max_admitted_actions}")
        self._config = config
        self._max_admitted = max_admitted_actions
        self._window_bytes = window_bytes
        self._light: list[ActionRequest] = []
        self._heavy: list[ActionRequest] = []
        self._charges: dict[str, int] = {}
        self._admitted_total_bytes = 0
        self._credit_since: dict[str, float] = {}

    @property
    def window_bytes(self) -> int:
        return self._window_bytes

    def set_window(self, window_bytes: int) -> None:
        """Move the window (the budget changed); charges already held stay as they are."""
        if window_bytes <= 0:
            raise ValueError(f"window_bytes must be positive, got {window_bytes}")
        self._window_bytes = window_bytes

    @property
    def admitted_total_bytes(self) -> int:
        return self._admitted_total_bytes

    @property
    def charges(self) -> Mapping[str, int]:
        return self._charges

    @property
    def queued(self) -> tuple[ActionRequest, ...]:
        return tuple(self._heavy) + tuple(self._light)

    @property
    def num_queued(self) -> int:
        return len(self._heavy) + len(self._light)

    def submit(self, req: ActionRequest) -> None:
        if req.action_id in self._charges or any(q.action_id == req.action_id for q in self.queued):
            raise ValueError(f"action {req.action_id!r} is already queued or admitted")
        queue = self._heavy if is_heavy(req.prediction, self._config) else self._light
        queue.append(req)
        # Rank first, then readiness (stable: submission order breaks ties). Readiness alone
        # makes a workflow wait once per action behind every other's, so the longest one
        # collects the most waits and ends last; ranking by readiness less the delay a
        # workflow has had spreads the delay over all of them.
        queue.sort(key=lambda r: r.queue_key)

    @property
    def at_capacity(self) -> bool:
        """As many actions are admitted as the backend serves well at once."""
        return self._max_admitted is not None and len(self._charges) >= self._max_admitted

    def update_prediction(self, action_id: str, prediction: Prediction) -> bool:
        """Give a queued action a new prediction (it may move between the light and heavy
        queues); False if it is not queued."""
        for queue in (self._heavy, self._light):
            for req in queue:
                if req.action_id == action_id:
                    self.withdraw(action_id)
                    self.submit(replace(req, prediction=prediction))
                    return True
        return False

    def stuck_charge(self, now: float, headroom_bytes: int, *, waited_s: float) -> int:
        """The charge of the first queued action, ready at least `waited_s`, that the
        logical window would take but `headroom_bytes` cannot (0 if there is none, or if
        the action cap is what holds the queue: memory would not let it in any sooner)."""
        if self.at_capacity:
            return 0
        for req in self.queued:
            if now - req.ready_at < waited_s:
                continue
            heavy = is_heavy(req.prediction, self._config)
            charge = admission_charge(req.prediction, self._admitted_total_bytes,
                                      self._window_bytes, heavy=heavy)
            physical = self.heavy_physical_bytes(charge) if heavy else charge
            fits_window = self._admitted_total_bytes + charge <= self._window_bytes
            if fits_window and physical > headroom_bytes:
                return physical
        return 0

    def withdraw(self, action_id: str) -> bool:
        """Drop a queued, not yet admitted action (its caller gave up); False if not queued."""
        for queue in (self._heavy, self._light):
            for i, req in enumerate(queue):
                if req.action_id == action_id:
                    del queue[i]
                    self._credit_since.pop(action_id, None)
                    return True
        return False

    def release(self, action_id: str) -> int:
        """Release an admitted action's charge exactly once; returns the charge."""
        charge = self._charges.pop(action_id, None)
        if charge is None:
            raise ChargeNotHeld(f"action {action_id!r} holds no charge (released twice?)")
        self._admitted_total_bytes -= charge
        return charge

    def shrink(self, action_id: str, charge_bytes: int) -> int:
        """Lower an admitted action's charge (never raise it); returns the bytes freed."""
        held = self._charges.get(action_id)
        if held is None:
            raise ChargeNotHeld(f"action {action_id!r} holds no charge")
        freed = max(held - max(charge_bytes, 0), 0)
        self._charges[action_id] = held - freed
        self._admitted_total_bytes -= freed
        return freed

    def heavy_credit_bytes(self, now: float) -> float:
        """Protected credit of the oldest ready heavy action (0 if there is none)."""
        head = self._heavy_head(now)
        if head is None:
            return 0.0
        since = self._credit_since.get(head.action_id, now)
        return self._config.heavy_credit_rate_bytes_per_s * max(now - since, 0.0)

    def _promote_starved(self, now: float) -> None:
        """Actions queued `starvation_after_s` or longer go first, oldest ready first; the
        rest keep rank order. Ranks estimate the work left and can be wrong for long: a
        workflow ahead of its peers has no peer to show it, and one ranked last while the
        host stays full waits without bound."""
        limit = self._config.starvation_after_s

        def key(req: ActionRequest) -> tuple[float, ...]:
            if now - req.ready_at >= limit:
                return (0.0, req.ready_at)
            return (1.0, *req.queue_key)

        self._heavy.sort(key=key)
        self._light.sort(key=key)

    def _heavy_head(self, now: float) -> ActionRequest | None:
        if self._heavy and self._heavy[0].ready_at <= now:
            return self._heavy[0]
        return None

    def heavy_physical_bytes(self, charge: int) -> int:
        """The headroom a heavy action needs to be admitted: the bootstrap demand (at most
        its charge).

        Its logical charge is still its predicted peak, so light actions are not admitted
        into the room it may grow into. But the gate starts it on the bootstrap demand and
        meters what it does grow, and reclaim gives idle memory back to a held grower:
        physical room for a whole predicted peak would be made for growth that a falsely
        predicted heavy action never does (heavy predictions come from a peer's largest run)."""
        return min(charge, self._config.bootstrap_demand_bytes)

    def _fits(self, charge: int, reserved: float, physical_left: int, *,
              physical_bytes: int | None = None) -> str | None:
        """None if it fits; otherwise the reason it does not. `physical_bytes` is the
        headroom it needs (its charge unless given)."""
        physical = charge if physical_bytes is None else physical_bytes
        if self._admitted_total_bytes + charge + reserved > self._window_bytes:
            if self._admitted_total_bytes == 0 and reserved == 0 and physical <= physical_left:
                return None  # alone it may exceed the window, or it could never run
            return (
                f"logical: {self._admitted_total_bytes} + {charge} + reserved "
                f"{reserved:.0f} > window {self._window_bytes}"
            )
        if physical + reserved > physical_left:
            return f"physical: {physical} + reserved {reserved:.0f} > headroom {physical_left}"
        return None

    def _admit(self, req: ActionRequest, charge: int, heavy: bool, why: str) -> AdmitDecision:
        self._charges[req.action_id] = charge
        self._admitted_total_bytes += charge
        return AdmitDecision(req.action_id, req.workflow_id, charge, heavy, why)

    def decide(self, now: float, headroom_bytes: int) -> list[AdmitDecision]:
        """Admit what fits now; the rest stays queued. Never raises for "doesn't fit"."""
        decisions: list[AdmitDecision] = []
        physical_left = max(headroom_bytes, 0)
        reserved = 0.0
        if self.at_capacity:
            return decisions
        self._promote_starved(now)
        head = self._heavy_head(now)
        if head is not None:
            self._credit_since.setdefault(head.action_id, now)
            charge = admission_charge(
                head.prediction, self._admitted_total_bytes, self._window_bytes, heavy=True
            )
            physical = self.heavy_physical_bytes(charge)
            if self._fits(charge, 0.0, physical_left, physical_bytes=physical) is None:
                self._heavy.pop(0)
                self._credit_since.pop(head.action_id, None)
                decisions.append(self._admit(head, charge, True, "heavy head: fits"))
                physical_left -= physical
            else:
                reserved = min(self.heavy_credit_bytes(now), float(charge))
        remaining: list[ActionRequest] = []
        overdue_held = False
        for req in self._light:
            if req.ready_at > now:
                remaining.append(req)
                continue
            charge = water_level_charge(
                req.prediction, self._admitted_total_bytes, self._window_bytes
            )
            if self.at_capacity:
                remaining.append(req)
            elif self._fits(charge, reserved, physical_left) is None:
                decisions.append(self._admit(req, charge, False, "light: fits"))
                physical_left -= charge
            else:
                remaining.append(req)
                if not overdue_held and now - req.ready_at >= self._config.overdue_after_s:
                    # The first overdue light action that does not fit keeps its room from
                    # the ones behind it: one below the heavy line earns no credit, and
                    # without this small ones would take every gap and starve it.
                    reserved += charge
                    overdue_held = True
        self._light = remaining
        return decisions


def admission_headroom_bytes(headroom_bytes: int, starving_bytes: int, budget_bytes: int | None,
                             *, nothing_can_free: bool) -> int:
    """The physical headroom admission may hand out: H less the demand of growers held past
    overdue (they get room first; see `ExecutionPolicy.starving_demand_bytes`).

    Liveness: when nothing runs, nothing is being torn down and nothing idle can be,
    waiting cannot free memory, so only the logical window applies.
    """
    headroom = max(headroom_bytes - starving_bytes, 0)
    if nothing_can_free:
        headroom = max(headroom, budget_bytes or headroom)
    return headroom
