"""Per-sandbox memory-growth estimation for the execution gate (pure state).

The estimator only folds samples it is given; it never reads a clock. Each
sandbox's growth rate is an EWMA over *valid* intervals only. An interval is
invalid when the gate changed the sandbox's permission during it (a frozen
sandbox does not grow, a thawed one catches up), when the sandbox was held
throughout (a v1 freeze that has not settled still gains CPU time, and its flat
memory would read as "no growth": a mispredicted grower held long enough would be
let go under red as "no projected growth" and OOM-killed), or when the
sandbox gained no CPU time (it was not running, so its flat memory says nothing
about its growth).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tenon.policy.config import PolicyConfig


@dataclass(frozen=True, slots=True)
class SandboxSample:
    """One observation of a sandbox's cgroup, taken by the runtime at `now`."""

    sandbox_id: str
    now: float
    usage_bytes: int
    cpu_usage_s: float
    allowed: bool
    """Whether the gate let the sandbox run when this sample was taken."""


class GrowthState(enum.IntEnum):
    """Gate-visible state of a sandbox; the value is also its tie-break rank.

    RESIDENT: estimated growth within the resident band and not grown recently.
    COOLING: within the band now, but grew above it within `cooling_after_s`
        (recently grew, now flat); still treated as zero demand.
    GROWING: above the band (or no valid sample yet: bootstrap) and allowed.
    PAUSED_GROWING: above the band (or bootstrap) and currently held by the gate.

    Among sandboxes competing for slots, GROWING ranks before PAUSED_GROWING:
    keeping a running sandbox running avoids freeze/thaw churn and lets it finish
    and release memory sooner.
    """

    RESIDENT = 0
    COOLING = 1
    GROWING = 2
    PAUSED_GROWING = 3


@dataclass(frozen=True, slots=True)
class GrowthEstimate:
    sandbox_id: str
    rate_bytes_per_s: float | None
    """EWMA growth rate; None until the first valid interval (bootstrap)."""
    last_growth_at: float | None
    """Last time a valid interval's estimate was above the resident band."""
    allowed: bool
    """Permission in the latest sample."""
    num_valid_intervals: int = 0


def classify(estimate: GrowthEstimate, now: float, config: PolicyConfig) -> GrowthState:
    rate = estimate.rate_bytes_per_s
    if rate is None or rate > config.resident_band_bytes_per_s:
        return GrowthState.GROWING if estimate.allowed else GrowthState.PAUSED_GROWING
    last = estimate.last_growth_at
    if last is not None and now - last < config.cooling_after_s:
        return GrowthState.COOLING
    return GrowthState.RESIDENT


def projected_demand_bytes(estimate: GrowthEstimate, config: PolicyConfig) -> int:
    """Demand over the horizon: bootstrap until a valid sample, then max(rate*horizon, 0).

    A sandbox within the resident band has zero demand by definition: growth that
    small is absorbed by the safety margin S, and gating it would only add churn.
    """
    rate = estimate.rate_bytes_per_s
    if rate is None:
        return config.bootstrap_demand_bytes
    if rate <= config.resident_band_bytes_per_s:
        return 0
    return max(int(rate * config.horizon_s), 0)


class GrowthEstimator:
    """Folds samples into per-sandbox estimates; the only mutable part of the gate."""

    def __init__(self, config: PolicyConfig) -> None:
        self._config = config
        self._last: dict[str, SandboxSample] = {}
        self._estimates: dict[str, GrowthEstimate] = {}

    def observe(self, samples: Iterable[SandboxSample]) -> None:
        alpha = self._config.ewma_alpha
        band = self._config.resident_band_bytes_per_s
        for cur in samples:
            sid = cur.sandbox_id
            prev = self._last.get(sid)
            old = self._estimates.get(sid)
            self._last[sid] = cur
            if old is None:
                old = GrowthEstimate(sid, None, None, cur.allowed)
            valid = (
                prev is not None
                and cur.now > prev.now
                and prev.allowed
                and cur.allowed
                and cur.cpu_usage_s > prev.cpu_usage_s
            )
            if not valid or prev is None:
                if old.allowed != cur.allowed:  # else unchanged: estimates are immutable
                    old = GrowthEstimate(
                        sid,
                        old.rate_bytes_per_s,
                        old.last_growth_at,
                        cur.allowed,
                        old.num_valid_intervals,
                    )
                self._estimates[sid] = old
                continue
            rate_now = (cur.usage_bytes - prev.usage_bytes) / (cur.now - prev.now)
            if old.rate_bytes_per_s is None:
                rate = rate_now
            else:
                rate = alpha * rate_now + (1.0 - alpha) * old.rate_bytes_per_s
            last_growth = cur.now if rate > band else old.last_growth_at
            self._estimates[sid] = GrowthEstimate(
                sid, rate, last_growth, cur.allowed, old.num_valid_intervals + 1
            )

    def forget(self, sandbox_id: str) -> None:
        """Drop a sandbox that was torn down; a rebuilt one starts from bootstrap."""
        self._last.pop(sandbox_id, None)
        self._estimates.pop(sandbox_id, None)

    @property
    def estimates(self) -> Mapping[str, GrowthEstimate]:
        return self._estimates
