"""Factories with keyword defaults for policy tests."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tenon.policy import (
    ActionRequest,
    GrowthEstimate,
    IdleSandbox,
    PolicyConfig,
    Prediction,
    SandboxSample,
)
from tenon.policy.gate import GateDecision, GateView, decide_gate
from tenon.policy.pressure import Pressure

MIB = 1024 * 1024


def make_config(**overrides: object) -> PolicyConfig:
    return PolicyConfig.model_validate(overrides)


def make_sample(
    sandbox_id: str = "sb-0",
    now: float = 0.0,
    usage_bytes: int = 64 * MIB,
    cpu_usage_s: float = 0.0,
    allowed: bool = True,
) -> SandboxSample:
    return SandboxSample(sandbox_id, now, usage_bytes, cpu_usage_s, allowed)


def make_estimate(
    sandbox_id: str = "sb-0",
    rate_bytes_per_s: float | None = 32 * MIB,
    last_growth_at: float | None = 0.0,
    allowed: bool = True,
) -> GrowthEstimate:
    return GrowthEstimate(sandbox_id, rate_bytes_per_s, last_growth_at, allowed)


def make_request(
    action_id: str = "a-0",
    workflow_id: str = "w-0",
    avg_bytes: int = 100 * MIB,
    peak_bytes: int = 200 * MIB,
    ready_at: float = 0.0,
    rank_at: float | None = None,
) -> ActionRequest:
    return ActionRequest(action_id, workflow_id, Prediction(avg_bytes, peak_bytes), ready_at,
                         rank_at)


def make_idle(
    sandbox_id: str = "sb-0",
    working_set_bytes: int = 100 * MIB,
    restartable: bool = True,
    predicted_wait_s: float = 0.0,
) -> IdleSandbox:
    return IdleSandbox(sandbox_id, working_set_bytes, restartable, predicted_wait_s)


def gate_decision(
    estimates: Mapping[str, GrowthEstimate],
    level: Pressure,
    headroom_bytes: int,
    now: float,
    config: PolicyConfig,
    **view: Any,
) -> GateDecision:
    """`decide_gate` over a `GateView` built from keyword defaults."""
    return decide_gate(GateView(estimates, level, headroom_bytes, now, **view), config)
