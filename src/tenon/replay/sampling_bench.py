"""Benchmark of the execution loop's sampling on real sandboxes (backs `tenon bench sampling`).

Materializes N real sandboxes in a fresh domain, registers each as a running action, and
runs the execution loop's tick (read every cgroup, compute pressure, fold samples into the
gate, decide, actuate) every control period for a fixed time. The figure is the
controller process's CPU time over that window as a percentage of one core.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
import uuid
from pathlib import Path

from tenon.host.domain import WorkloadDomain
from tenon.policy.config import PolicyConfig
from tenon.predict.base import Prediction
from tenon.runtime.events import EventLog
from tenon.runtime.execution import ExecutionLoop, RunningAction
from tenon.sandbox.base import Sandbox, SandboxSpec
from tenon.sandbox.registry import make_backend

logger = logging.getLogger(__name__)

MATERIALIZE_BATCH = 10


async def bench_sampling(
    *,
    num_sandboxes: int = 100,
    seconds: float = 10.0,
    backend: str = "process",
    state_dir: Path = Path("/var/lib/tenon"),
    image: str = "tenon-base:bookworm",
) -> dict[str, float | int]:
    if num_sandboxes <= 0 or seconds <= 0:
        raise ValueError("num_sandboxes and seconds must be positive")
    config = PolicyConfig()
    domain = WorkloadDomain.open(f"tenon-bench-{uuid.uuid4().hex[:8]}",
                                 budget_bytes=8 * 1024 * 1024 * 1024)
    sandboxes: list[Sandbox] = []
    try:
        impl = make_backend(backend, domain, state_dir)
        with tempfile.TemporaryDirectory(prefix="tenon-bench-", dir=state_dir) as tmp:
            for start in range(0, num_sandboxes, MATERIALIZE_BATCH):
                specs = []
                for i in range(start, min(start + MATERIALIZE_BATCH, num_sandboxes)):
                    workspace = Path(tmp) / f"ws-{i}"
                    workspace.mkdir()
                    specs.append(SandboxSpec(sandbox_id=f"sb-{i:04d}", image=image,
                                             workspace=workspace))
                sandboxes += await asyncio.gather(*(impl.materialize(s) for s in specs))
            actions = []
            for sandbox in sandboxes:
                action = RunningAction(f"a-{sandbox.spec.sandbox_id}", sandbox.spec.sandbox_id,
                                       Prediction(64 << 20, 128 << 20), 0, 0.0)
                action.meter = sandbox.cgroup
                action.gate_id = sandbox.spec.sandbox_id
                actions.append(action)
            loop = ExecutionLoop(domain=domain, config=config,
                                 events=EventLog(None, time.monotonic), use_gate=True,
                                 agentcgroup=False, now=time.monotonic)
            num_ticks = 0
            cpu_start, wall_start = time.process_time(), time.monotonic()
            deadline = wall_start + seconds
            next_tick = wall_start
            while time.monotonic() < deadline:
                await loop.tick(time.monotonic(), actions)
                num_ticks += 1
                next_tick += config.control_period_s
                await asyncio.sleep(max(next_tick - time.monotonic(), 0.0))
            cpu_s = time.process_time() - cpu_start
            wall_s = time.monotonic() - wall_start
    finally:
        outcomes = await asyncio.gather(*(s.destroy() for s in sandboxes), return_exceptions=True)
        for sandbox, outcome in zip(sandboxes, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                logger.warning("destroy of %s failed: %r", sandbox.spec.sandbox_id, outcome)
        domain.remove()
    return {
        "sandboxes": num_sandboxes,
        "cpu_pct_of_one_core": round(100.0 * cpu_s / wall_s, 2),
        "seconds": round(wall_s, 2),
        "ticks": num_ticks,
        "period_ms": config.control_period_s * 1000,
    }
