"""Micro-benchmark of the gate decision (backs `tenon bench gate`): wall time of
`GateController.decide` over many sandboxes, measured outside the pure policy package."""

from __future__ import annotations

import time

from tenon.policy.config import MIB, PolicyConfig
from tenon.policy.gate import GateController
from tenon.policy.growth import SandboxSample
from tenon.policy.pressure import Pressure


def _percentile(sorted_ms: list[float], q: float) -> float:
    index = min(int(q * (len(sorted_ms) - 1) + 0.5), len(sorted_ms) - 1)
    return sorted_ms[index]


def bench_gate(num_sandboxes: int = 1000, iterations: int = 200) -> dict[str, float | int]:
    """Time `GateController.decide` for `num_sandboxes` mixed-growth sandboxes under yellow."""
    if num_sandboxes <= 0 or iterations <= 0:
        raise ValueError("num_sandboxes and iterations must be positive")
    config = PolicyConfig()
    gate = GateController(config)
    period_s = config.control_period_s
    now = 0.0
    timings_ms: list[float] = []
    allowed: frozenset[str] = frozenset()
    ids = [f"sb-{i:05d}" for i in range(num_sandboxes)]
    for step in range(iterations + 2):
        now = step * period_s
        gate.observe(
            SandboxSample(
                sid,
                now,
                usage_bytes=int(64 * MIB + (i % 7) * MIB * step * period_s * 3),
                cpu_usage_s=step * period_s,
                allowed=step == 0 or sid in allowed,
            )
            for i, sid in enumerate(ids)
        )
        level = Pressure.YELLOW if step % 10 else Pressure.RED
        start = time.perf_counter()
        decision = gate.decide(level, 512 * MIB, now)
        elapsed_ms = (time.perf_counter() - start) * 1000.0
        allowed = decision.allowed
        if step >= 2:
            timings_ms.append(elapsed_ms)
    timings_ms.sort()
    return {
        "sandboxes": num_sandboxes,
        "decide_ms_p50": round(_percentile(timings_ms, 0.50), 4),
        "decide_ms_p99": round(_percentile(timings_ms, 0.99), 4),
    }
