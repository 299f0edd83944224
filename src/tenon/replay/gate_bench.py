"""Micro-benchmark of the gate decision (backs `tenon bench gate`): wall time of
`GateController.decide` over many sandboxes, measured outside the pure policy package.

Garbage collection is left on, as in the runtime, and watched: a collection that runs
during a timed decision (a full one walks every live object of the process) is counted
and timed, so a slow tail can be told apart from the decision's own cost. The thread's
CPU time is taken beside the wall time: a decision whose wall time far exceeds its CPU
time waited for a core (another process ran), which says nothing about the gate.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any

from tenon.policy.config import MIB, PolicyConfig
from tenon.policy.gate import GateController
from tenon.policy.growth import SandboxSample
from tenon.policy.pressure import Pressure


def _percentile(sorted_ms: list[float], q: float) -> float:
    index = min(int(q * (len(sorted_ms) - 1) + 0.5), len(sorted_ms) - 1)
    return sorted_ms[index]


@dataclass
class _GcWatch:
    """Collections that start while `timing` is set: how many per generation, how long."""

    timing: bool = False
    collections: list[int] = field(default_factory=lambda: [0, 0, 0])
    gc_s: float = 0.0
    _started_at: float | None = None

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start" and self.timing:
            self.collections[info["generation"]] += 1
            self._started_at = time.perf_counter()
        elif phase == "stop" and self._started_at is not None:
            self.gc_s += time.perf_counter() - self._started_at
            self._started_at = None


def bench_gate(num_sandboxes: int = 1000, iterations: int = 200) -> dict[str, float | int]:
    """Time `GateController.decide` for `num_sandboxes` mixed-growth sandboxes under yellow:
    p50 and p99 of the timed decisions."""
    full = bench_gate_detail(num_sandboxes, iterations)
    return {key: full[key] for key in ("sandboxes", "decide_ms_p50", "decide_ms_p99")}


def bench_gate_detail(num_sandboxes: int = 1000,
                      iterations: int = 200) -> dict[str, float | int]:
    """`bench_gate` with the slowest decision, the CPU time of the decisions, the garbage
    collections that ran during timed decisions (per generation, and their total time), and
    the slowest decision that no collection interrupted."""
    if num_sandboxes <= 0 or iterations <= 0:
        raise ValueError("num_sandboxes and iterations must be positive")
    config = PolicyConfig()
    gate = GateController(config)
    period_s = config.control_period_s
    watch = _GcWatch()
    timings_ms: list[float] = []
    cpu_ms: list[float] = []
    clean_ms: list[float] = []  # decisions no collection ran during
    allowed: frozenset[str] = frozenset()
    ids = [f"sb-{i:05d}" for i in range(num_sandboxes)]
    gc.callbacks.append(watch)
    try:
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
            watch.timing = step >= 2  # the first two decisions warm up
            num_before = sum(watch.collections)
            start_cpu = time.thread_time()
            start = time.perf_counter()
            decision = gate.decide(level, 512 * MIB, now)
            elapsed_ms = (time.perf_counter() - start) * 1000.0
            elapsed_cpu_ms = (time.thread_time() - start_cpu) * 1000.0
            watch.timing = False
            allowed = decision.allowed
            if step >= 2:
                timings_ms.append(elapsed_ms)
                cpu_ms.append(elapsed_cpu_ms)
                if sum(watch.collections) == num_before:
                    clean_ms.append(elapsed_ms)
    finally:
        gc.callbacks.remove(watch)
    timings_ms.sort()
    cpu_ms.sort()
    return {
        "sandboxes": num_sandboxes,
        "decide_ms_p50": round(_percentile(timings_ms, 0.50), 4),
        "decide_ms_p99": round(_percentile(timings_ms, 0.99), 4),
        "decide_ms_max": round(timings_ms[-1], 4),
        "decide_ms_max_without_gc": round(max(clean_ms, default=0.0), 4),
        "decide_cpu_ms_p50": round(_percentile(cpu_ms, 0.50), 4),
        "decide_cpu_ms_p99": round(_percentile(cpu_ms, 0.99), 4),
        "gc_gen0_during_decisions": watch.collections[0],
        "gc_gen1_during_decisions": watch.collections[1],
        "gc_gen2_during_decisions": watch.collections[2],
        "gc_ms_during_decisions": round(watch.gc_s * 1000.0, 4),
    }
