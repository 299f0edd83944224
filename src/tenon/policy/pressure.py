"""Pressure level of the workload domain from its headroom (pure)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tenon.policy.config import PolicyConfig


class Pressure(enum.IntEnum):
    """Ordered so that a larger value is more pressure (GREEN < YELLOW < RED)."""

    GREEN = 0
    YELLOW = 1
    RED = 2


@dataclass(frozen=True, slots=True)
class PressureState:
    level: Pressure
    headroom_bytes: int
    """H = max(limit - usage - S, 0), before subtracting predicted growth."""
    effective_headroom_bytes: int
    """H minus the predicted remaining growth of admitted actions (never below 0)."""
    reason: str


def headroom_bytes(budget_bytes: int, usage_bytes: int, config: PolicyConfig) -> int:
    """Usable headroom H = max(limit - usage - S, 0)."""
    return max(budget_bytes - usage_bytes - config.safety_margin_bytes, 0)


def classify_pressure(
    budget_bytes: int,
    usage_bytes: int,
    predicted_growth_bytes: int,
    config: PolicyConfig,
) -> PressureState:
    """Classify pressure; red is checked first so it takes priority over yellow.

    The regions are measured on the effective headroom (H less the growth already
    promised to admitted actions) as fractions of the budget: red is the lowest
    `red_fraction`, yellow the next `yellow_fraction`.
    """
    h_bytes = headroom_bytes(budget_bytes, usage_bytes, config)
    effective = max(h_bytes - max(predicted_growth_bytes, 0), 0)
    red_line = config.red_fraction * budget_bytes
    yellow_line = red_line + config.yellow_fraction * budget_bytes
    if effective <= red_line:
        level = Pressure.RED
        reason = f"effective headroom {effective} B <= red line {red_line:.0f} B"
    elif effective <= yellow_line:
        level = Pressure.YELLOW
        reason = f"effective headroom {effective} B <= yellow line {yellow_line:.0f} B"
    else:
        level = Pressure.GREEN
        reason = f"effective headroom {effective} B above yellow line {yellow_line:.0f} B"
    return PressureState(level, h_bytes, effective, reason)
