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
    return max(budget_bytes - usage_bytes - config.safety_margin(budget_bytes), 0)


def red_line_bytes(budget_bytes: int, config: PolicyConfig) -> float:
    """H at or below this is red: the lowest `red_fraction` of the budget."""
    return config.red_fraction * budget_bytes


def yellow_line_bytes(budget_bytes: int, config: PolicyConfig) -> float:
    """H at or below this is yellow (or red): the next `yellow_fraction` above the red line.
    Growth above it is not at risk."""
    return red_line_bytes(budget_bytes, config) + config.yellow_fraction * budget_bytes


def classify_pressure(
    budget_bytes: int,
    usage_bytes: int,
    predicted_growth_bytes: int,
    config: PolicyConfig,
) -> PressureState:
    """Classify pressure; red is checked first, so it takes priority over yellow.

    The regions are fractions of the budget: red is the lowest `red_fraction` of headroom,
    yellow the next `yellow_fraction`. Red is physical: H itself is in the red region.
    Yellow is H in the yellow region, or the growth already promised to admitted actions
    (their predicted peaks less what they hold) bringing H into red or yellow. Predicted
    growth alone never makes red: admission deliberately fills the window with predicted
    peaks, and holding everyone to one probe on a prediction would serialize the domain.
    """
    h_bytes = headroom_bytes(budget_bytes, usage_bytes, config)
    effective = max(h_bytes - max(predicted_growth_bytes, 0), 0)
    red_line = red_line_bytes(budget_bytes, config)
    yellow_line = yellow_line_bytes(budget_bytes, config)
    if h_bytes <= red_line:
        level = Pressure.RED
        reason = f"headroom {h_bytes} B <= red line {red_line:.0f} B"
    elif h_bytes <= yellow_line:
        level = Pressure.YELLOW
        reason = f"headroom {h_bytes} B <= yellow line {yellow_line:.0f} B"
    elif effective <= yellow_line:
        level = Pressure.YELLOW
        reason = (f"headroom {h_bytes} B less predicted growth {predicted_growth_bytes} B "
                  f"<= yellow line {yellow_line:.0f} B")
    else:
        level = Pressure.GREEN
        reason = f"headroom {effective} B (after predicted growth) above yellow line"
    return PressureState(level, h_bytes, effective, reason)
