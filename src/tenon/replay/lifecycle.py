"""Lifecycle benchmark: materialize -> exec `true` -> dematerialize, median of n."""

from __future__ import annotations

import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from tenon.sandbox.base import SandboxBackend, SandboxSpec


def _median_ms(samples_s: list[float]) -> float:
    return round(statistics.median(samples_s) * 1000.0, 2)


async def bench_lifecycle(
    backend: SandboxBackend, *, image: str, num_runs: int = 10
) -> dict[str, Any]:
    """Time each lifecycle step of `backend`; returns medians in milliseconds."""
    if num_runs < 1:
        raise ValueError(f"num_runs must be at least 1, got {num_runs}")
    materialize_s: list[float] = []
    exec_s: list[float] = []
    destroy_s: list[float] = []
    with tempfile.TemporaryDirectory(prefix="tenon-bench-") as tmp:
        for i in range(num_runs):
            workspace = Path(tmp) / f"ws{i}"
            workspace.mkdir()
            spec = SandboxSpec(
                sandbox_id=f"bench-{uuid.uuid4().hex[:10]}", image=image, workspace=workspace
            )
            t0 = time.perf_counter()
            sandbox = await backend.materialize(spec)
            t1 = time.perf_counter()
            try:
                result = await sandbox.exec("true", timeout_s=30)
                t2 = time.perf_counter()
                if result.exit_code != 0:
                    raise RuntimeError(f"`true` exited {result.exit_code}: {result.output!r}")
            finally:
                t3 = time.perf_counter()
                await sandbox.destroy()
                t4 = time.perf_counter()
            materialize_s.append(t1 - t0)
            exec_s.append(t2 - t1)
            destroy_s.append(t4 - t3)
    return {
        "backend": backend.name,
        "materialize_ms": _median_ms(materialize_s),
        "exec_ms": _median_ms(exec_s),
        "dematerialize_ms": _median_ms(destroy_s),
    }
