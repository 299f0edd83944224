"""Run workflows through the real runtime on the simulated host, in simulated time.

The scenario tests and quick policy sweeps use this: the same `Runtime`, policies and event
log as a real run, over `sandbox.sim` and a `FakeClock`, so a burst that takes minutes on a
real host runs in well under a second, identically every time.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tenon.clock import FakeClock, run_simulated
from tenon.host.types import CgroupVersion
from tenon.policy.config import PolicyConfig
from tenon.predict.base import Predictor
from tenon.runtime.controller import Runtime
from tenon.runtime.residency import run_inline
from tenon.runtime.results import ActionResult
from tenon.sandbox.sim import SimBackend, SimDomain, sim_load_command


@dataclass(frozen=True)
class SimAction:
    avg_bytes: int
    peak_bytes: int
    duration_s: float
    resident_after_bytes: int = 0
    model_wait_s: float = 0.0  # the model call before this action
    action_class: str | None = None

    def command(self) -> str:
        return sim_load_command(self.avg_bytes, self.peak_bytes, self.duration_s,
                                self.resident_after_bytes)


@dataclass(frozen=True)
class SimWorkflow:
    actions: Sequence[SimAction]
    submit_s: float = 0.0
    family: str | None = None

    @property
    def peak_bytes(self) -> int:
        return max((a.peak_bytes for a in self.actions), default=0)


@dataclass
class WorkflowRun:
    submitted_at: float
    finished_at: float = 0.0
    results: list[ActionResult] = field(default_factory=list)

    @property
    def completed(self) -> bool:
        return bool(self.results) and not any(r.outcome.fails_attempt for r in self.results)


@dataclass
class SimReport:
    runs: list[WorkflowRun]
    makespan_s: float
    num_oom_kills: int
    peak_bytes: int
    events: list[dict[str, Any]]
    runtime: Runtime

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == kind]


Hook = Callable[[Runtime, SimDomain, FakeClock], Awaitable[None]]


def simulate(
    workflows: Sequence[SimWorkflow],
    *,
    budget_bytes: int,
    policy: str = "tenon",
    config: PolicyConfig | None = None,
    predictor: Predictor | None = None,
    version: CgroupVersion = CgroupVersion.V2,
    action_timeout_s: float = 3600.0,
    during: Hook | None = None,
    max_time_s: float = 36_000.0,
) -> SimReport:
    """Submit each workflow at its submit time, run its actions in order (no retries)."""
    clock = FakeClock()
    domain = SimDomain(budget_bytes, version=version)
    backend = SimBackend(domain, clock)

    async def main(state_dir: Path) -> SimReport:
        runtime = Runtime(domain=domain, backend=backend, state_dir=state_dir, policy=policy,
                          config=config, clock=clock, predictor=predictor, keep_events=True,
                          blocking=run_inline)
        runs = [WorkflowRun(w.submit_s) for w in workflows]

        async def one(workflow: SimWorkflow, run: WorkflowRun) -> None:
            await clock.sleep(workflow.submit_s)
            agent = await runtime.create_agent(image="sim", family=workflow.family,
                                               profile_peak_bytes=workflow.peak_bytes)
            try:
                for action in workflow.actions:
                    await clock.sleep(action.model_wait_s)
                    result = await agent.run(action.command(), timeout=action_timeout_s,
                                             action_class=action.action_class)
                    run.results.append(result)
                    if result.outcome.fails_attempt:
                        break
            finally:
                await agent.close()
                run.finished_at = clock.now()

        async with runtime:
            tasks = [one(w, r) for w, r in zip(workflows, runs, strict=True)]
            if during is not None:
                hook = asyncio.ensure_future(during(runtime, domain, clock))
            await asyncio.gather(*tasks)
            if during is not None:
                hook.cancel()
        events = list(runtime.events.events or [])
        return SimReport(runs, max((r.finished_at for r in runs), default=0.0),
                         domain.num_oom_kills, domain.peak_bytes, events, runtime)

    async def driver() -> SimReport:
        with tempfile.TemporaryDirectory(prefix="tenon-sim-") as tmp:
            return await run_simulated(main(Path(tmp)), clock, max_time_s=max_time_s)

    return asyncio.run(driver())
