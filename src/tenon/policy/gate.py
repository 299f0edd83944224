"""The execution gate (the paper's Algorithm 1): which sandboxes may run now.

`decide_gate` is a pure function of (estimates, AIMD budget, denial times,
pressure, headroom, now, config). `GateController` is the thin stateful shell
that folds samples, steps the AIMD budget and remembers denial times.

Invariants (property-tested):
- green allows every sandbox, except one already held that outgrew its prediction and
  whose measured demand exceeds H (until waiting cannot help: see below), and one that
  outgrew its prediction after others still growing whose demands leave it no room in H
  (`outgrown_queue`);
- at every level, a sandbox that outgrew its prediction grows only into the room H leaves
  after the demands of those that outgrew theirs earlier and still grow;
- the allowed positive demands sum to at most H; under yellow, beyond those that fit
  in the headroom above the yellow line, at most b more; under red at most one;
- liveness: when no positive-demand sandbox fits H and no other sandbox grows (those at
  their plateau may run on; their ends are waited for at most `plateau_patience_s` when
  the smallest demand fits in H + S), exactly one still runs alone as a probe: the one
  already running, else one denied for at least `overdue_after_s` (the only allowance
  beyond H);
- a denied sandbox stays denied at least `min_denial_wait_s` unless green;
- under yellow and red, while a sandbox holding memory is denied past `overdue_after_s`,
  no start (`pending`) is allowed.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from tenon.policy.config import PolicyConfig
from tenon.policy.growth import (
    GrowthEstimate,
    GrowthEstimator,
    SandboxSample,
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


class Why(enum.Enum):
    """Why the gate allowed or denied a sandbox this period (the events carry the text)."""

    NO_GROWTH = "no projected growth"
    GREEN = "green: all allowed"
    OUTGROWN_OVER_HEADROOM = "outgrew its prediction; its demand does not fit H"
    OUTGROWN_BEHIND = "outgrew its prediction after another; no room left behind it"
    MIN_WAIT = "denied less than min_denial_wait_s ago"
    FITS_ABOVE_LINE = "its demand fits above the yellow line"
    SLOTS_TAKEN = "every growth slot taken"
    NO_FIT = "its demand does not fit the headroom left"
    SLOT = "a growth slot (a probe under red)"
    WAITS_FOR_STARVING = "a start waits for a grower held past overdue"
    RUNNING_PROBE = "liveness: the running probe continues"
    OVERDUE_PROBE = "liveness: an overdue probe"


@dataclass(frozen=True, slots=True)
class Verdict:
    allowed: bool
    why: Why
    text: str
    """The reason with its figures, for the event log."""


# Verdicts are immutable: sandboxes whose verdict reads the same share one object.
_NO_GROWTH = Verdict(True, Why.NO_GROWTH, Why.NO_GROWTH.value)
_GREEN = Verdict(True, Why.GREEN, Why.GREEN.value)


class _Reasons(Mapping[str, str]):
    """Each sandbox's reason text, read from its verdict when asked (not copied)."""

    __slots__ = ("_verdicts",)

    def __init__(self, verdicts: Mapping[str, Verdict]) -> None:
        self._verdicts = verdicts

    def __getitem__(self, sid: str) -> str:
        return self._verdicts[sid].text

    def __iter__(self) -> Iterator[str]:
        return iter(self._verdicts)

    def __len__(self) -> int:
        return len(self._verdicts)


@dataclass(frozen=True, slots=True)
class GateView:
    """Everything one period's gate decision sees (frozen; built by `GateController`).

    `growth_caps` bounds demands by the admitted predictions (see `gate_demand_bytes`).
    `free_bytes` is the part of H above the yellow line: under yellow, growers whose
    demands fit there run as they would under green, and the b slots are for growth that
    digs into the yellow region. Yellow is mostly *predicted* risk (admitted actions may
    still grow); physical room above the line is not at risk, and without this rule a busy
    domain would serialize every action's start through one slot. Red has no such room
    (H is below the red line). `reclaimable_bytes` is memory that can come back without
    any grower running (idle sandboxes that are being or can be torn down).
    `outgrown_since` is when each sandbox was first seen past its prediction's bound
    (`outgrown_queue`); without it outgrown ones are not ordered. `gives_back` is what each
    sandbox's running action holds beyond where it started: memory its end frees, so
    waiting for a sandbox at its plateau can help a held grower. `pending` are actions held
    before their start (they hold no memory yet): under yellow and red they come after
    sandboxes that do, overdue or not. `stalled_since` is when each sandbox was first
    denied outside green since it last had no demand (a probe's brief runs do not reset
    it, as they reset `denied_since`); it bounds the wait for plateaus to end, and
    defaults to `denied_since`. `margin_bytes` is the domain's safety margin S (H + S is
    the room under the limit itself); None: the config's cap, `safety_margin_bytes`.
    """

    estimates: Mapping[str, GrowthEstimate]
    level: Pressure
    headroom_bytes: int
    now: float
    budget_b: int = 1
    denied_since: Mapping[str, float] = field(default_factory=dict)
    growth_caps: Mapping[str, int] = field(default_factory=dict)
    free_bytes: int = 0
    reclaimable_bytes: int = 0
    outgrown_since: Mapping[str, float] = field(default_factory=dict)
    gives_back: Mapping[str, int] = field(default_factory=dict)
    pending: frozenset[str] = frozenset()
    stalled_since: Mapping[str, float] | None = None
    margin_bytes: int | None = None

    def demand_bytes(self, sid: str, config: PolicyConfig) -> int:
        return gate_demand_bytes(self.estimates[sid], self.growth_caps.get(sid), config)


@dataclass(frozen=True, slots=True)
class GateDecision:
    verdicts: Mapping[str, Verdict]
    budget_b: int
    """Slots for positive-demand sandboxes this period (b in yellow, 1 in red)."""
    pressure: Pressure
    headroom_bytes: int
    outgrown_waiting: frozenset[str] = frozenset()
    """Denied only to wait for sandboxes that outgrew their prediction earlier."""
    starving: frozenset[str] = frozenset()
    """Holding memory and denied past `overdue_after_s` for room (not for their turn among
    outgrown growers): while any is, no start launches."""
    allowed: frozenset[str] = field(init=False)
    denied: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:  # read per sandbox by callers: computed once
        allowed = frozenset([sid for sid, v in self.verdicts.items() if v.allowed])
        object.__setattr__(self, "allowed", allowed)
        object.__setattr__(self, "denied", frozenset(self.verdicts).difference(allowed))

    @property
    def reasons(self) -> Mapping[str, str]:
        return _Reasons(self.verdicts)


_Candidate = tuple[bool, bool, bool, int, str]
"""A positive-demand sandbox competing for room under yellow or red:
(paused, pending, on_time, demand_bytes, sid).

The fields are in serving order, so candidates sort as plain tuples (a plain tuple, not a
named one: one is built per sandbox every period): growers already running first (not
`paused`), then sandboxes holding memory before starts that hold none (not `pending`);
then overdue first (not `on_time`), smaller demand, id (unique: the order is total).
A positive demand is growth above the resident band (or bootstrap), so `classify` puts
the sandbox in `GrowthState.GROWING` when allowed and `PAUSED_GROWING` when held: `paused`
is its growth state's rank.
"""


def gate_demand_bytes(
    estimate: GrowthEstimate, cap_bytes: int | None, config: PolicyConfig
) -> int:
    """A sandbox's demand for the gate: projected growth over the horizon, bounded by its
    admitted prediction.

    `cap_bytes` is what the prediction says the action still has to grow (predicted peak
    less current usage), or None without a prediction. Before the first valid sample the
    prediction *is* the demand (the fixed bootstrap demand only stands in without one).
    Afterwards the projection is capped by it: the EWMA remembers a ramp for a second after
    it ends, and a held sandbox's estimate cannot decay at all, so without the cap a
    sandbox at its peak would look like a fast grower indefinitely. A cap <= 0 means the
    action outgrew its prediction, which is then no guide: while it still grows, its demand
    is its measured projection or `outgrown_demand_fraction` of its overshoot, whichever is
    larger (between holds, a sandbox far past its prediction measures a projection much
    smaller than what it still takes, and released on that alone it fills the headroom
    within a period). The liveness probe keeps a stale estimate from holding everything
    forever.
    Demand within the resident band over the horizon is zero, as for a measured rate.
    """
    bootstrap = config.bootstrap_demand_bytes
    if estimate.rate_bytes_per_s is None:
        demand = bootstrap if cap_bytes is None or cap_bytes <= 0 else cap_bytes
    else:
        demand = projected_demand_bytes(estimate, config)
        if demand > 0 and cap_bytes is not None and cap_bytes > 0:
            demand = min(demand, cap_bytes)
        elif demand > 0 and cap_bytes is not None:  # outgrown and still growing
            demand = max(demand, int(config.outgrown_demand_fraction * -cap_bytes))
    if cap_bytes is not None and demand <= config.resident_band_bytes_per_s * config.horizon_s:
        return 0
    return demand


def is_outgrown(estimate: GrowthEstimate, cap_bytes: int | None) -> bool:
    """It grew past its prediction's bound (cap <= 0) and its growth is measured."""
    return cap_bytes is not None and cap_bytes <= 0 and estimate.rate_bytes_per_s is not None


def outgrown_queue(
    estimates: Mapping[str, GrowthEstimate],
    demands: Mapping[str, int],
    headroom_bytes: int,
    outgrown_since: Mapping[str, float],
    growth_caps: Mapping[str, int],
) -> dict[str, str]:
    """Sandboxes that outgrew their prediction and must wait for ones that outgrew theirs
    earlier, with the reason.

    Served in the order they outgrew (then id): each may grow only if its demand fits H
    after the demands of the earlier ones still growing. A misprediction is typically a
    task whose copies all run the same large step. Thawed together whenever the domain
    turns green and frozen together when it does not, each would hold half the memory the
    other needs, until the one let go as a probe is OOM-killed and its workflow retried.
    In order, the later one waits frozen near its predicted size, so the earlier one can
    have the domain.
    """
    order = sorted(
        (sid for sid, est in estimates.items()
         if sid in outgrown_since and demands.get(sid, 0) > 0
         and is_outgrown(est, growth_caps.get(sid))),
        key=lambda s: (outgrown_since[s], s))
    waiting: dict[str, str] = {}
    ahead = 0
    first = ""
    for sid in order:
        demand = demands[sid]
        if ahead and ahead + demand > headroom_bytes:
            waiting[sid] = (f"outgrew its prediction after {first}: demand {demand} B does "
                            f"not fit headroom {headroom_bytes} B left after {ahead} B "
                            "ahead of it")
        first = first or sid
        ahead += demand
    return waiting


def decide_gate(view: GateView, config: PolicyConfig) -> GateDecision:
    """Decide who runs for the next control period; O(n log n), one sort."""
    queued = outgrown_queue(
        view.estimates,
        {sid: view.demand_bytes(sid, config) for sid in view.outgrown_since
         if sid in view.estimates},
        view.headroom_bytes, view.outgrown_since, view.growth_caps,
    ) if view.outgrown_since else {}
    if view.level is Pressure.GREEN:
        return _decide_green(view, config, queued)
    return _decide_pressed(view, config, queued)


def _decide_green(view: GateView, config: PolicyConfig,
                  queued: Mapping[str, str]) -> GateDecision:
    kept = _outgrown_kept_under_green(view, config, waiting=queued)
    held_long = frozenset(sid for sid in kept
                          if view.now - view.denied_since[sid] >= config.overdue_after_s)
    verdicts = dict.fromkeys(view.estimates, _GREEN)
    verdicts.update(kept)
    verdicts.update({sid: Verdict(False, Why.OUTGROWN_BEHIND, f"green: {why}")
                     for sid, why in queued.items()})
    return GateDecision(verdicts, view.budget_b, view.level, view.headroom_bytes,
                        frozenset(queued), held_long)


def _decide_pressed(view: GateView, config: PolicyConfig,
                    queued: Mapping[str, str]) -> GateDecision:
    """Yellow and red: growers fit above the yellow line, then b slots (one under red)."""
    slots = view.budget_b if view.level is Pressure.YELLOW else 1
    verdicts, candidates, longest_wait = _sort_out(view, config, queued)
    _hand_out_room(view, slots, candidates, verdicts)
    starving = [sid for _, pending, on_time, _, sid in candidates
                if not pending and not on_time and not verdicts[sid].allowed]
    if starving:
        # A grower frozen past overdue holds what it has allocated and waits for room:
        # starts (holding nothing yet) wait for it, or they take that room one by one.
        name = view.level.name.lower()
        waits = Verdict(False, Why.WAITS_FOR_STARVING,
                        f"{name}: waits for {starving[0]}, held past overdue")
        for sid in view.pending:
            verdict = verdicts.get(sid)
            if verdict is not None and verdict.allowed:
                verdicts[sid] = waits
        candidates = [c for c in candidates if not c[1]]  # not pending
    _liveness_probe(view, config, candidates, verdicts, longest_wait)
    return GateDecision(verdicts, slots, view.level, view.headroom_bytes,
                        frozenset(queued), frozenset(starving))


def _sort_out(view: GateView, config: PolicyConfig, queued: Mapping[str, str],
              ) -> tuple[dict[str, Verdict], list[_Candidate], float]:
    """The verdicts that need no room (no growth, queued behind an outgrown one, within
    the minimum denial wait), the candidates for room in their order, and the longest
    stall among the candidates."""
    now = view.now
    denied_since = view.denied_since
    stalled_since = denied_since if view.stalled_since is None else view.stalled_since
    name = view.level.name.lower()
    min_wait = config.min_denial_wait_s
    overdue_after = config.overdue_after_s
    pending = view.pending
    caps = view.growth_caps
    min_waits: dict[float, Verdict] = {}  # sandboxes denied at the same time share one
    verdicts: dict[str, Verdict] = {}
    candidates: list[_Candidate] = []
    longest_wait = 0.0
    for sid, est in view.estimates.items():
        demand = gate_demand_bytes(est, caps.get(sid), config)
        if demand <= 0:
            verdicts[sid] = _NO_GROWTH
            continue
        if sid in queued:
            verdicts[sid] = Verdict(False, Why.OUTGROWN_BEHIND, f"{name}: {queued[sid]}")
            continue
        since = denied_since.get(sid)
        waited = None if since is None else now - since
        if waited is not None and waited < min_wait:
            verdict = min_waits.get(waited)
            if verdict is None:
                verdict = min_waits[waited] = Verdict(
                    False, Why.MIN_WAIT, f"denied {waited:.2f}s ago; waits {min_wait:.2f}s")
            verdicts[sid] = verdict
            continue
        stalled = now - stalled_since.get(sid, now)
        if stalled > longest_wait:
            longest_wait = stalled
        candidates.append((not est.allowed, sid in pending,
                           waited is None or waited < overdue_after, demand, sid))
    # Growers already running go first: taking a slot from a sandbox mid-growth to hand it
    # to an overdue one freezes both with half their memory allocated, and rotating probes
    # this way lets none finish. Overdue ones get the next slot that frees. Then sandboxes
    # holding memory, before starts that hold none: a start given the slot takes the room
    # a frozen grower waits for.
    candidates.sort()
    return verdicts, candidates, longest_wait


def _hand_out_room(view: GateView, slots: int, candidates: list[_Candidate],
                   verdicts: dict[str, Verdict]) -> None:
    """In order: room above the yellow line first (yellow only), then a slot while the
    demand fits what is left of H."""
    name = view.level.name.lower()
    headroom = view.headroom_bytes
    free_left = max(min(view.free_bytes, headroom), 0) if view.level is Pressure.YELLOW else 0
    slots_taken = Verdict(False, Why.SLOTS_TAKEN, f"{name}: all {slots} growth slots taken")
    used_bytes = 0
    num_slotted = 0
    for _, _, on_time, demand, sid in candidates:
        if used_bytes + demand <= free_left:
            used_bytes += demand
            verdicts[sid] = Verdict(True, Why.FITS_ABOVE_LINE,
                                    f"{name}: demand {demand} B fits above the yellow line"
                                    f"{'' if on_time else ' (overdue)'}")
        elif num_slotted >= slots:
            verdicts[sid] = slots_taken
        elif used_bytes + demand > headroom:
            verdicts[sid] = Verdict(False, Why.NO_FIT,
                                    f"{name}: demand {demand} B does not fit headroom left "
                                    f"{headroom - used_bytes} B")
        else:
            used_bytes += demand
            num_slotted += 1
            kind = "probe" if view.level is Pressure.RED else f"slot {num_slotted}/{slots}"
            verdicts[sid] = Verdict(True, Why.SLOT, f"{name} {kind}: demand {demand} B fits"
                                                    f"{'' if on_time else ' (overdue)'}")


def _liveness_probe(view: GateView, config: PolicyConfig, candidates: list[_Candidate],
                    verdicts: dict[str, Verdict], longest_wait: float) -> None:
    """When no grower fits H, nothing else grows, and even tearing down every idle
    sandbox and waiting for the actions at their plateau to end would not make room for
    one, waiting cannot help: one runs alone. It is the one closest to done (smallest
    demand; it frees its memory soonest), among those already running if any (rotating
    probes every period would let none finish), else among those waiting past the overdue
    threshold. The safety margin S absorbs its overshoot until the next period re-decides:
    the one allowance beyond H.

    Plateaus' ends are waited for at most `plateau_patience_s`, and only while the
    smallest demand does not fit under the limit itself (H + S): a larger shortfall keeps
    waiting for them, or two growers' peaks would meet.
    """
    # Only candidates can hold a verdict that lets them grow (the rest have no growth or
    # are denied), so "does anything grow" is asked of them alone.
    if not candidates or any(verdicts[sid].allowed for *_, sid in candidates):
        return
    smallest = min(demand for _, _, _, demand, _ in candidates)
    plateaus = sum(bytes_ for sid, bytes_ in view.gives_back.items()
                   if sid in verdicts and verdicts[sid].allowed)
    if (longest_wait >= config.plateau_patience_s
            and smallest <= view.headroom_bytes + (config.safety_margin_bytes
                                                   if view.margin_bytes is None
                                                   else view.margin_bytes)):
        plateaus = 0
    if view.headroom_bytes + view.reclaimable_bytes + plateaus >= smallest:
        return
    running = [(demand, sid) for paused, _, _, demand, sid in candidates if not paused]
    pool = running or [(demand, sid) for _, _, on_time, demand, sid in candidates
                       if not on_time]
    if not pool:
        return
    _, chosen = min(pool)
    name = view.level.name.lower()
    if running:
        verdicts[chosen] = Verdict(True, Why.RUNNING_PROBE,
                                   f"{name} running probe continues: nothing else may grow")
    else:
        verdicts[chosen] = Verdict(True, Why.OVERDUE_PROBE,
                                   f"{name} overdue probe: nothing else may grow")


def _outgrown_kept_under_green(view: GateView, config: PolicyConfig, *,
                               waiting: Mapping[str, str]) -> dict[str, Verdict]:
    """Held sandboxes that stay held under green: those that outgrew their prediction and
    whose measured demand exceeds H. `waiting` (held for outgrowing after others) neither
    counts as growing nor is let go here.

    Green is computed from predictions, and an action that outgrew its own says nothing
    more to the pressure level: the domain can look green while a frozen grower far past
    its prediction waits, and releasing it with everything else lets it take the room
    others need. Only a sandbox already held is kept (green never freezes a running one),
    and only while its demand does not fit H.

    Liveness: when nothing else runs and grows (a held start waits for room too, so it
    does not count: counting it would deadlock the two), it has waited `overdue_after_s`
    and neither tearing down every idle sandbox nor the end of every other running action
    would make room, waiting cannot help: the smallest goes.
    """
    estimates, caps = view.estimates, view.growth_caps
    kept: dict[str, tuple[int, float]] = {}
    for sid, since in view.denied_since.items():
        est = estimates.get(sid)
        if est is None or sid in waiting or not is_outgrown(est, caps.get(sid)):
            continue
        demand = gate_demand_bytes(est, caps.get(sid), config)
        if demand > view.headroom_bytes:
            kept[sid] = (demand, since)
    if kept and not any(  # measured and running: a start not yet launched is not
            est.allowed and est.rate_bytes_per_s is not None
            and sid not in kept and sid not in waiting
            and gate_demand_bytes(est, caps.get(sid), config) > 0
            for sid, est in estimates.items()):
        sid = min(kept, key=lambda s: (kept[s][0], s))
        demand, since = kept[sid]
        ends_free = sum(view.gives_back.get(s, 0) for s in view.estimates
                        if s not in kept and s not in waiting)
        if (view.now - since >= config.overdue_after_s
                and demand > view.headroom_bytes + view.reclaimable_bytes + ends_free):
            del kept[sid]
    return {sid: Verdict(False, Why.OUTGROWN_OVER_HEADROOM,
                         f"green: outgrew its prediction; demand {demand} B does not fit "
                         f"headroom {view.headroom_bytes} B")
            for sid, (demand, _since) in kept.items()}


class GateController:
    """Stateful shell: observe samples, then decide once per control period."""

    def __init__(self, config: PolicyConfig) -> None:
        self._config = config
        self._estimator = GrowthEstimator(config)
        self._aimd = AimdBudget.initial(config)
        self._denied_since: dict[str, float] = {}
        self._outgrown_since: dict[str, float] = {}
        self._stalled_since: dict[str, float] = {}

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

    @property
    def outgrown_since(self) -> Mapping[str, float]:
        return self._outgrown_since

    def observe(self, samples: Iterable[SandboxSample]) -> None:
        self._estimator.observe(samples)

    def forget(self, sandbox_id: str) -> None:
        self._estimator.forget(sandbox_id)
        self._denied_since.pop(sandbox_id, None)
        self._outgrown_since.pop(sandbox_id, None)
        self._stalled_since.pop(sandbox_id, None)

    def decide(
        self,
        pressure_level: Pressure,
        headroom_bytes: int,
        now: float,
        growth_caps: Mapping[str, int] | None = None,
        free_bytes: int = 0,
        reclaimable_bytes: int = 0,
        gives_back: Mapping[str, int] | None = None,
        pending: frozenset[str] = frozenset(),
        margin_bytes: int | None = None,
    ) -> GateDecision:
        self._aimd = self._aimd.step(pressure_level, now, self._config)
        caps = growth_caps or {}
        estimates = self._estimator.estimates
        previous_outgrown = self._outgrown_since
        self._outgrown_since = {  # only a sandbox with a cap <= 0 can have outgrown it
            sid: previous_outgrown.get(sid, now) for sid, cap in caps.items()
            if cap <= 0 and sid in estimates and is_outgrown(estimates[sid], cap)}
        decision = decide_gate(GateView(
            estimates, pressure_level, headroom_bytes, now, budget_b=self._aimd.b,
            denied_since=self._denied_since, growth_caps=caps, free_bytes=free_bytes,
            reclaimable_bytes=reclaimable_bytes, outgrown_since=self._outgrown_since,
            gives_back=gives_back or {}, pending=pending, stalled_since=self._stalled_since,
            margin_bytes=margin_bytes,
        ), self._config)
        # A stall lasts from the first denial outside green until green or no demand.
        if pressure_level is Pressure.GREEN:
            self._stalled_since = {}
        else:
            stalled = self._stalled_since
            denied, verdicts = decision.denied, decision.verdicts
            self._stalled_since = {
                sid: stalled.get(sid, now) for sid in estimates
                if sid in denied or (sid in stalled and verdicts[sid].why is not Why.NO_GROWTH)}
        # A denial's start time is kept across consecutive denials, so waits accumulate
        # toward "overdue"; an allowed sandbox's clock resets.
        previous = self._denied_since
        self._denied_since = {sid: previous.get(sid, now) for sid in decision.denied}
        return decision
