"""The replay bench: a trace under a memory budget, every policy one after another.

    tenon bench --trace T --budget 3GiB --policies tenon,eager,static-4 --qps 16 --speed 10

Every policy replays the same schedule on the same backend, in its own fresh workload
domain, through the same runtime. The run directory gets `<policy>/events.jsonl` for each
policy, `summary.json` (rewritten after every policy, so an interrupted bench keeps what
finished), `table.md` and the plots (`tenon report RUN_DIR` redraws them).

`via` chooses how workflows reach the runtime: `Agent.run` in-process (`replay.driver`), or
E2B sandboxes driven with the official SDK through the E2B-compatible server wrapped around
the same runtime (real backends only); `both` runs each policy both ways, the second as
`<policy>@e2b`, so the API's cost shows side by side. The service sits above the replay, so
the E2B driver is handed in (`run_bench(..., e2b_driver=...)`; the CLI passes
`service.replay_e2b.replay_via_e2b`).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import statistics
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from tenon.clock import FakeClock, run_simulated
from tenon.errors import ConfigError
from tenon.policy.baselines import PolicyKind, parse_policy
from tenon.policy.config import PolicyConfig
from tenon.predict.base import Predictor
from tenon.predict.online import OnlinePredictor
from tenon.predict.static import StaticPredictor
from tenon.replay.cpu import CpuMark, controller_seconds, cpu_spent
from tenon.replay.driver import WorkflowRecord, replay
from tenon.replay.loadprog import SCRATCH_DIR
from tenon.replay.loop_lag import LoopLag
from tenon.replay.predictors import crossfit_trace_predictor, oracle_predictor, recorded_actions
from tenon.replay.schedule import (
    Submission,
    copies_of,
    make_schedule,
    makespan_bound_s,
    memory_bound_s,
    oversubscription,
)
from tenon.replay.trace import Trace, load_trace
from tenon.runtime.boundary import BoundaryTally
from tenon.runtime.controller import Runtime
from tenon.runtime.residency import run_inline
from tenon.sandbox.sim import SimBackend, SimDomain
from tenon.units import format_bytes

logger = logging.getLogger(__name__)

SUMMARY_FILE = "summary.json"
VIA_CHOICES = ("inproc", "e2b", "both")


class WorkflowDriver(Protocol):
    """Drives the schedule's workflows against an open runtime: one record per submission,
    in the order given, and the figures the driver adds to the policy's summary (none
    in-process; the API's overhead per command through the E2B front door)."""

    def __call__(
        self,
        runtime: Runtime,
        submissions: Sequence[Submission],
        *,
        speed: float,
        image_dir: Path,
        max_retries: int,
        on_done: Callable[[WorkflowRecord], None] | None,
    ) -> Awaitable[tuple[list[WorkflowRecord], dict[str, Any]]]: ...


async def drive_in_process(
    runtime: Runtime,
    submissions: Sequence[Submission],
    *,
    speed: float,
    image_dir: Path,
    max_retries: int,
    on_done: Callable[[WorkflowRecord], None] | None,
) -> tuple[list[WorkflowRecord], dict[str, Any]]:
    """Each workflow an `Agent.run` in this process (`replay.driver.replay`)."""
    del image_dir  # the runtime's backend already has its image
    records = await replay(runtime, submissions, speed=speed, max_retries=max_retries,
                           on_done=on_done)
    return records, {}


class BenchConfig(BaseModel):
    """One bench invocation; unknown fields are rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    trace: Path = Field(description="Trace file (tenon-trace JSON lines).")
    budget_bytes: int = Field(gt=0, description="Memory budget of the workload domain.")
    policies: list[str] = Field(min_length=1, description="Policies, run one after another.")
    backend: Literal["process", "docker", "sim"] = "process"
    speed: float = Field(default=1.0, gt=0, description="Divides model waits and durations.")
    qps: float | None = Field(default=None, gt=0, description="Burst rate; None: trace times.")
    window_s: float = Field(default=10.0, gt=0, description="Burst length at `qps`.")
    num_workflows: int | None = Field(default=None, gt=0, description="Override the count.")
    copies: int | None = Field(default=None, gt=0, description="A synchronized burst: this "
                               "many copies of the workflow `of`, submitted together.")
    of: str | None = Field(default=None, description="The workflow `copies` repeats.")
    max_retries: int = Field(default=5, ge=0, description="Re-runs of a failed attempt.")
    predictor: Literal["online", "static", "history", "forest", "online-forest",
                       "oracle"] = Field(
        default="online", description="Tenon's predictor. online: the trace's per-class "
        "figures raised by what each workflow and family measured during the run; static, "
        "history, forest: `tenon predict`'s predictors, cross-fitted on the trace so that a "
        "workflow is predicted by a model trained without it; online-forest: the cross-fitted "
        "forest raised during the run the way online raises the per-class figures; oracle: "
        "each action's own recorded figures (an ablation: what better prediction could "
        "still gain).")
    policy_config: dict[str, Any] = Field(default_factory=dict,
                                          description="PolicyConfig overrides.")
    state_dir: Path = Path("/var/lib/tenon")
    out_dir: Path = Field(description="Run directory for events, summary, table and plots.")
    via: Literal["inproc", "e2b", "both"] = Field(
        default="inproc", description="How workflows drive the runtime. inproc: `Agent.run`; "
        "e2b: each workflow an E2B sandbox driven with the official SDK through the "
        "E2B-compatible server on loopback (summaries add the API's overhead per command); "
        "both: every policy in-process, then as `<policy>@e2b` through the API.")
    gate_actuator: Literal["auto", "scx", "freezer"] = Field(
        default="auto", description="How the execution gate holds sandboxes on a real backend. "
        "auto: the sched_ext scheduler where the host can run it, else the cgroup freezer; "
        "scx: sched_ext or fail; freezer: the cgroup freezer. Each policy's summary records "
        "the actuator used and any fallback.")


def check_via(via: str, backend: str) -> None:
    """Refuse a `--via` this bench does not offer, or e2b on the simulator."""
    if via not in VIA_CHOICES:
        raise ConfigError(f"--via: expected one of {', '.join(VIA_CHOICES)}, got {via!r}")
    if via != "inproc" and backend == "sim":
        raise ConfigError(f"--via {via}: the simulator is not offered through the E2B API; "
                          "use --backend process or docker")


# The policies a careful operator would configure instead of Tenon: a static limit on
# concurrent workflows, or reservation by profiled peak.
BASELINE_KINDS = (PolicyKind.STATIC, PolicyKind.RESERVATION)


def schedule_of(config: BenchConfig, trace: Trace) -> list[Submission]:
    """The submissions the config asks for: a synchronized burst of copies of one workflow,
    a burst at `qps`, or the trace's own times."""
    if (config.copies is None) != (config.of is None):
        raise ConfigError("--copies and --of go together: K copies of workflow WF")
    if config.copies is not None and config.of is not None:
        return copies_of(trace.workflows, config.of, config.copies)
    return make_schedule(trace.workflows, qps=config.qps, window_s=config.window_s,
                         speed=config.speed, num_workflows=config.num_workflows)


def yardsticks(summary: dict[str, Any]) -> None:
    """Judge every policy run so far against the bound and mark the best safe baseline.

    The bound is the largest of the floor (the `unconstrained` run, when there is one), the
    memory bound and the longest workflow's own length: no policy can beat it. A run is
    safe when it completed every workflow with no OOM kill; the best safe baseline is the
    fastest safe run of the policies an operator would configure instead (static-N,
    reservation). `cpu_vs_floor` is a run's host CPU over the floor's, for the same work."""
    runs = summary["policies"]
    floor = runs.get("unconstrained", {}).get("makespan_s")
    summary["floor_makespan_s"] = floor
    bound = max(summary["makespan_bound_s"], summary["memory_bound_s"], floor or 0.0)
    summary["bound_s"] = round(bound, 3)
    floor_cpu = runs.get("unconstrained", {}).get("cpu", {}).get("host_s")
    for figures in runs.values():
        figures["vs_bound"] = round(figures["makespan_s"] / bound, 3) if bound > 0 else None
        host_cpu = figures.get("cpu", {}).get("host_s")
        figures["cpu_vs_floor"] = (round(host_cpu / floor_cpu, 3)
                                   if host_cpu is not None and floor_cpu else None)
        figures["safe"] = (figures["completed"] == summary["workflows"]
                           and figures["oom_events"] == 0)
    safe = [(figures["makespan_s"], name) for name, figures in runs.items()
            if figures["safe"] and parse_policy(name.split("@")[0]).kind in BASELINE_KINDS]
    summary["best_safe_baseline"] = min(safe)[1] if safe else None


def check_budget(submissions: Sequence[Submission], budget_bytes: int) -> None:
    """Refuse a budget smaller than the largest single action replayed: it could never
    run."""
    workflows = {sub.workflow.id: sub.workflow for sub in submissions}.values()
    worst = max(((s.action.memory.peak_bytes, w.id, i) for w in workflows
                 for i, s in enumerate(w.steps)), default=(0, "", 0), key=lambda t: t[0])
    if worst[0] > budget_bytes:
        raise ConfigError(
            f"--budget {format_bytes(budget_bytes)} is smaller than the largest single "
            f"action: workflow {worst[1]} step {worst[2]} peaks at {format_bytes(worst[0])} "
            f"({worst[0]} B); raise the budget"
        )


def profiled_static_predictor(trace: Trace, config: PolicyConfig) -> StaticPredictor:
    """Per-class figures from the trace's profiles, as an operator configures them."""
    measured = [m for w in trace.workflows for m in recorded_actions(w)]
    return StaticPredictor.fit(measured, heavy_peak_bytes=config.heavy_peak_bytes)


def summarize(records: list[WorkflowRecord], peak_memory_bytes: int,
              tally: BoundaryTally | None = None) -> dict[str, Any]:
    latencies = [r.latency_s for r in records]
    share = None if tally is None or tally.share is None else round(tally.share, 4)
    lifecycle = {} if tally is None else {
        "teardowns": tally.num_teardowns, "rebuilds": tally.num_rebuilds,
        "lifecycle_s": round(tally.lifecycle_s, 2)}
    return {
        "makespan_s": round(max((r.end_s for r in records), default=0.0), 3),
        "p50_latency_s": round(statistics.median(latencies), 3) if latencies else 0.0,
        "peak_memory_bytes": int(peak_memory_bytes),
        "oom_events": sum(r.oom_events for r in records),
        "timeouts": sum(r.timeouts for r in records),
        "attempts": sum(r.attempts for r in records),
        "failed_attempts": sum(r.failed_attempts for r in records),
        "completed": sum(r.completed for r in records),
        "restartable_share": share,  # of the action boundaries the restart-safe check judged
        **lifecycle,
    }


async def run_policy(
    config: BenchConfig,
    policy: str,
    submissions: list[Submission],
    predictor: Predictor,
    on_done: Callable[[WorkflowRecord], None] | None = None,
    *,
    drive: WorkflowDriver = drive_in_process,
    run_name: str | None = None,
) -> dict[str, Any]:
    """Replay the schedule under one policy in a fresh domain; the summary figures. `drive`
    runs the workflows on a real backend (the simulator always runs them in-process);
    events go to `out_dir/<run_name>` (the policy's name by default)."""
    run_dir = config.out_dir / (run_name or policy)
    (run_dir / "events.jsonl").unlink(missing_ok=True)  # a rerun into the same directory
    policy_config = PolicyConfig.model_validate(config.policy_config)
    kwargs: dict[str, Any] = {"policy": policy, "config": policy_config,
                              "predictor": predictor}
    budget = None if parse_policy(policy).unlimited_memory else config.budget_bytes
    if config.backend == "sim":
        return await _run_sim(config, run_dir, submissions, kwargs, on_done, budget)
    from tenon.runtime.open import gate_actuator_for, open_runtime

    # The load program keeps the memory an action leaves behind in SCRATCH_DIR: declared
    # disposable, so it is charged to the sandbox and dropped at teardown, as recorded.
    kwargs["backend_config"] = {"disposable": [SCRATCH_DIR]}
    api: dict[str, Any] = {}
    lag = LoopLag()
    before = CpuMark.now()
    actuator = gate_actuator_for(policy, config.gate_actuator)
    kwargs["gate_actuator"] = actuator
    try:
        async with open_runtime(budget_bytes=budget, backend=config.backend,
                                state_dir=config.state_dir, run_dir=run_dir, **kwargs) as rt, \
                lag.running():
            records, api = await drive(rt, submissions, speed=config.speed,
                                       image_dir=config.state_dir,
                                       max_retries=config.max_retries, on_done=on_done)
            reading = rt.domain.reading()
    finally:
        actuator.close()  # idempotent: the runtime closes it when it got that far
    cpu = cpu_spent(before, CpuMark.now(), reading.cpu_usage_s)
    gate = {"name": actuator.name, "preference": config.gate_actuator,
            "fallback": actuator.fallback_reason}
    return {**summarize(records, reading.peak_bytes, rt.boundary.tally), "cpu": cpu,
            **lag.summary(), **api, "gate_actuator": gate}


def runs_of(config: BenchConfig) -> list[tuple[str, str, bool]]:
    """(run name, policy, through the E2B API) for each replay, in order: with `via`
    both, each policy in-process and then as `<policy>@e2b`."""
    runs = []
    for name in config.policies:
        if config.via in ("inproc", "both"):
            runs.append((name, name, False))
        if config.via == "e2b":
            runs.append((name, name, True))
        elif config.via == "both":
            runs.append((f"{name}@e2b", name, True))
    return runs


async def _run_sim(config: BenchConfig, run_dir: Path, submissions: list[Submission],
                   kwargs: dict[str, Any], on_done: Callable[[WorkflowRecord], None] | None,
                   budget_bytes: int | None) -> dict[str, Any]:
    clock = FakeClock()
    domain = SimDomain(budget_bytes)

    async def main(state: Path) -> dict[str, Any]:
        rt = Runtime(domain=domain, backend=SimBackend(domain, clock), state_dir=state,
                     clock=clock, blocking=run_inline, event_log=run_dir / "events.jsonl",
                     **kwargs)
        before = controller_seconds()
        async with rt:
            records = await replay(rt, submissions, speed=config.speed,
                                   max_retries=config.max_retries, on_done=on_done)
        return {**summarize(records, domain.peak_bytes, rt.boundary.tally),
                "cpu": {"controller_s": round(controller_seconds() - before, 2)}}

    with tempfile.TemporaryDirectory(prefix="tenon-sim-") as tmp:
        return await run_simulated(main(Path(tmp)), clock, max_time_s=7 * 86_400)


def write_summary(out_dir: Path, summary: dict[str, Any]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / SUMMARY_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    tmp.replace(path)
    return path


async def run_bench(
    config: BenchConfig,
    *,
    on_policy_start: Callable[[str, int], None] | None = None,
    on_done: Callable[[str, WorkflowRecord], None] | None = None,
    e2b_driver: WorkflowDriver | None = None,
) -> dict[str, Any]:
    """Run every policy; the summary (also in `out_dir/summary.json` after each policy).
    `e2b_driver` runs the workflows through the E2B API (`via` e2b or both)."""
    for name in config.policies:
        parse_policy(name)  # unknown names fail before anything runs
    check_via(config.via, config.backend)
    if config.via != "inproc" and e2b_driver is None:
        raise ConfigError(f"--via {config.via}: no E2B driver was given to the bench")
    PolicyConfig.model_validate(config.policy_config)
    trace = load_trace(config.trace)
    submissions = schedule_of(config, trace)
    check_budget(submissions, config.budget_bytes)
    policy_config = PolicyConfig.model_validate(config.policy_config)
    static = profiled_static_predictor(trace, policy_config)
    heavy = policy_config.heavy_peak_bytes
    kind = config.predictor.removeprefix("online-")
    fitted: Predictor = static
    if kind == "oracle":
        fitted = oracle_predictor({s.instance: s.workflow for s in submissions},
                                  heavy_peak_bytes=heavy)
    elif kind != "online":
        fitted = crossfit_trace_predictor(trace, kind=kind, heavy_peak_bytes=heavy)

    def new_predictor() -> Predictor:  # fresh per policy: nothing learnt carries over
        if config.predictor.startswith("online"):
            return OnlinePredictor(copy.deepcopy(fitted), heavy_peak_bytes=heavy,
                                   name=config.predictor)
        return copy.deepcopy(fitted)  # the forest remembers heavy runs it observes

    summary: dict[str, Any] = {
        "budget_bytes": config.budget_bytes,
        "oversubscription": round(oversubscription(submissions, config.budget_bytes), 3),
        "workflows": len(submissions),
        "makespan_bound_s": round(makespan_bound_s(submissions, config.speed), 3),
        "memory_bound_s": round(memory_bound_s(submissions, config.speed,
                                               config.budget_bytes), 3),
        "memory_bound_resident_s": round(memory_bound_s(
            submissions, config.speed, config.budget_bytes, idle_resident=True), 3),
        "floor_makespan_s": None,
        "bound_s": None,
        "best_safe_baseline": None,
        "policies": {},
        "meta": {"trace": str(config.trace), "backend": config.backend, "speed": config.speed,
                 "qps": config.qps, "window_s": config.window_s,
                 "max_retries": config.max_retries, "policy_config": config.policy_config,
                 "predictor": config.predictor, "via": config.via, "copies": config.copies,
                 "of": config.of, "gate_actuator": config.gate_actuator, "complete": False},
    }
    write_summary(config.out_dir, summary)
    for name, policy, via_e2b in runs_of(config):
        if on_policy_start is not None:
            on_policy_start(name, len(submissions))
        done = None if on_done is None else (lambda r, name=name: on_done(name, r))
        drive = e2b_driver if via_e2b and e2b_driver is not None else drive_in_process
        try:
            result = await run_policy(config, policy, submissions, new_predictor(), done,
                                      drive=drive, run_name=name)
        except asyncio.CancelledError:
            summary["meta"]["interrupted_during"] = name
            write_summary(config.out_dir, summary)
            raise
        summary["policies"][name] = result
        yardsticks(summary)
        write_summary(config.out_dir, summary)
    summary["meta"]["complete"] = True
    write_summary(config.out_dir, summary)
    return summary
