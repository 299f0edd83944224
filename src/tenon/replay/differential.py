"""A differential check that residency is invisible to the agent.

A script (a scripted agent run: a list of commands with timeouts) runs twice through a
`ResidencyManager` on one backend. Run A never tears the sandbox down (memory
unconstrained). Run B calls `teardown()` after every action, so the sandbox is torn down
at every boundary the fail-closed check allows and rebuilt for the next action. Every
action must give the same exit code, timed-out flag and output in both runs.

A divergence is excused only when B ran that action in a sandbox that never crossed a
teardown (every boundary before it was kept resident): residency cannot have caused it.
A step may declare its boundary resident-only by design (a live server, a /dev/shm
file) with a fragment the check's reason must contain; every other boundary must be torn
down. The restartable share is the torn-down fraction of B's boundaries.

Run the built-in corpus: `python -m tenon.replay.differential --backend process
--backend docker --json bench/results/differential.json` (as root).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tenon.host.diskfs import DiskLimits
from tenon.replay import standalone
from tenon.replay.differential_script import Script, Step
from tenon.runtime.residency import ResidencyManager, TeardownOutcome
from tenon.sandbox.base import ExecIO
from tenon.state.statedir import DEFAULT_STATE_DIR

logger = logging.getLogger(__name__)

DEFAULT_IMAGE = "tenon-base:bookworm"
COMPARED = ("exit_code", "timed_out", "output")


@dataclass(frozen=True)
class Boundary:
    """What run B's teardown did after a step."""

    outcome: TeardownOutcome
    reason: str


@dataclass(frozen=True)
class StepResult:
    exit_code: int
    output: str
    timed_out: bool
    boundary: Boundary | None = None  # run B only


@dataclass(frozen=True)
class RunResult:
    script: str
    torn_down_each: bool  # run B
    steps: tuple[StepResult, ...]

    @property
    def num_torn_down(self) -> int:
        return sum(1 for s in self.steps if s.boundary and s.boundary.outcome == "torn_down")

    @property
    def restartable_share(self) -> float | None:
        """Torn-down fraction of the boundaries; None for run A (it has none)."""
        if not self.torn_down_each:
            return None
        return self.num_torn_down / len(self.steps)


@dataclass(frozen=True)
class Divergence:
    """A step whose result differs between run A (resident) and run B (torn down)."""

    index: int
    command: str
    field: str
    resident: object
    torn_down: object
    excused: bool  # every boundary before it was kept resident in B

    def describe(self) -> str:
        return (f"step {self.index} ({_short(self.command)}): {self.field} differs: "
                f"resident run {self.resident!r}, torn-down run {self.torn_down!r}"
                + (" (excused: no teardown before it)" if self.excused else ""))


@dataclass(frozen=True)
class Comparison:
    script: str
    divergences: tuple[Divergence, ...]
    # Steps that did not do what the script expects and boundaries whose outcome is not
    # the designed one, each described in one line.
    problems: tuple[str, ...]
    num_boundaries: int
    num_torn_down: int
    num_resident_by_design: int

    @property
    def restartable_share(self) -> float:
        return self.num_torn_down / self.num_boundaries

    @property
    def ok(self) -> bool:
        return not self.problems and all(d.excused for d in self.divergences)

    def first_failure(self) -> str | None:
        """The first unexcused divergence or boundary problem, in one line; None if ok."""
        for divergence in self.divergences:
            if not divergence.excused:
                return f"{self.script}: {divergence.describe()}"
        if self.problems:
            return f"{self.script}: {self.problems[0]}"
        return None


def _short(command: str, limit: int = 80) -> str:
    flat = " ".join(command.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


async def run_script(manager: ResidencyManager, script: Script, *, agent_id: str,
                     image: str = DEFAULT_IMAGE, teardown_each: bool) -> RunResult:
    """Run `script` as a fresh agent; with `teardown_each`, tear down after every action.

    The agent is finished (sandbox destroyed, workspace deleted) whatever happens.
    """
    results: list[StepResult] = []
    await manager.start(agent_id, image, dict(script.config))
    try:
        for step in script.steps:
            io = None if step.user is None else ExecIO(user=step.user)
            result = await manager.exec(agent_id, step.command, timeout_s=step.timeout_s, io=io)
            boundary = None
            if teardown_each:
                teardown = await manager.teardown(agent_id)
                boundary = Boundary(teardown.outcome, teardown.reason)
            results.append(StepResult(result.exit_code, result.output, result.timed_out,
                                      boundary))
    finally:
        await manager.finish(agent_id)
    return RunResult(script.name, teardown_each, tuple(results))


def compare(script: Script, resident: RunResult, torn_down: RunResult) -> Comparison:
    """Every divergence between the runs, every step of either run that did not do what the
    script expects, and every boundary of B not as designed."""
    if len(resident.steps) != len(script.steps) or len(torn_down.steps) != len(script.steps):
        raise ValueError(f"script {script.name!r}: runs do not cover every step")
    divergences: list[Divergence] = []
    problems: list[str] = []
    crossed_teardown = False
    for index, (step, a, b) in enumerate(zip(script.steps, resident.steps, torn_down.steps,
                                             strict=True)):
        divergences.extend(
            Divergence(index, step.command, name, getattr(a, name), getattr(b, name),
                       excused=not crossed_teardown)
            for name in COMPARED if getattr(a, name) != getattr(b, name))
        for label, run in (("resident", a), ("torn-down", b)):
            if (problem := _step_problem(step, run)) is not None:
                problems.append(f"step {index} ({_short(step.command)}) in the {label} run: "
                                f"{problem}")
        if b.boundary is None:
            raise ValueError(f"script {script.name!r}: run B has no boundary after step {index}")
        problem = _boundary_problem(step, b.boundary)
        if problem is not None:
            problems.append(f"boundary after step {index} ({_short(step.command)}): {problem}")
        crossed_teardown = crossed_teardown or b.boundary.outcome != "kept_resident"
    return Comparison(
        script=script.name, divergences=tuple(divergences), problems=tuple(problems),
        num_boundaries=len(script.steps), num_torn_down=torn_down.num_torn_down,
        num_resident_by_design=sum(1 for s in script.steps if s.resident_because))


def _step_problem(step: Step, result: StepResult) -> str | None:
    if result.timed_out != step.expect_timed_out:
        return (f"timed out: {result.timed_out}, expected {step.expect_timed_out}; "
                f"output {_short(result.output, 200)!r}")
    if step.expect_exit is not None and result.exit_code != step.expect_exit:
        return (f"exit code {result.exit_code}, expected {step.expect_exit}; "
                f"output {_short(result.output, 200)!r}")
    return None


def _boundary_problem(step: Step, boundary: Boundary) -> str | None:
    if step.resident_because is None:
        if boundary.outcome != "torn_down":
            return f"should be restartable, was {boundary.outcome}: {boundary.reason}"
        return None
    if boundary.outcome != "kept_resident":
        return (f"should be resident-only ({step.resident_because}), "
                f"was {boundary.outcome}: {boundary.reason}")
    if step.resident_because.lower() not in boundary.reason.lower():
        return (f"kept resident, but the reason does not name "
                f"{step.resident_because!r}: {boundary.reason}")
    return None


async def differential(manager: ResidencyManager, script: Script, *,
                       image: str = DEFAULT_IMAGE) -> tuple[RunResult, RunResult, Comparison]:
    """Run A (resident) then B (torn down at every boundary) and compare them."""
    suffix = uuid.uuid4().hex[:6]
    resident = await run_script(manager, script, agent_id=f"diff-{suffix}-a", image=image,
                                teardown_each=False)
    torn_down = await run_script(manager, script, agent_id=f"diff-{suffix}-b", image=image,
                                 teardown_each=True)
    return resident, torn_down, compare(script, resident, torn_down)


@contextlib.asynccontextmanager
async def open_manager(backend: str, *, state_dir: Path = DEFAULT_STATE_DIR,
                       budget_bytes: int | None = None) -> AsyncIterator[ResidencyManager]:
    """A ResidencyManager on a real backend with workspaces as the runtime makes them
    (each agent's root its own filesystem), all removed on exit."""
    async with standalone.open_manager(backend, state_dir=state_dir, budget_bytes=budget_bytes,
                                       prefix="tenon-diff", limits=DiskLimits()) as (manager, _):
        yield manager


async def run_corpus(backend: str, scripts: Sequence[Script], *,
                     state_dir: Path = DEFAULT_STATE_DIR) -> list[Comparison]:
    async with open_manager(backend, state_dir=state_dir) as manager:
        return [(await differential(manager, script))[2] for script in scripts]


def summarize(backend: str, comparisons: Sequence[Comparison]) -> dict[str, Any]:
    """One backend's figures for the results file."""
    num_boundaries = sum(c.num_boundaries for c in comparisons)
    num_torn_down = sum(c.num_torn_down for c in comparisons)
    num_by_design = sum(c.num_resident_by_design for c in comparisons)
    return {
        "backend": backend,
        "ok": all(c.ok for c in comparisons),
        "num_boundaries": num_boundaries,
        "num_torn_down": num_torn_down,
        "num_resident_by_design": num_by_design,
        "restartable_share": round(num_torn_down / num_boundaries, 4),
        "restartable_share_of_designed_restartable": round(
            num_torn_down / (num_boundaries - num_by_design), 4),
        "scripts": [{**{k: v for k, v in asdict(c).items() if k != "divergences"},
                     "restartable_share": round(c.restartable_share, 4),
                     "ok": c.ok, "first_failure": c.first_failure()} for c in comparisons],
    }


def main(argv: list[str] | None = None) -> int:
    from tenon.replay.differential_corpus import corpus

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", action="append", choices=("process", "docker"),
                        help="repeat for several (default: process)")
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    backends = args.backend or ["process"]
    command = "python -m tenon.replay.differential " + " ".join(
        f"--backend {b}" for b in backends) + (f" --json {args.json}" if args.json else "")
    summaries = [summarize(b, asyncio.run(run_corpus(b, corpus(), state_dir=args.state_dir)))
                 for b in backends]
    text = json.dumps({"command": command, "backends": summaries}, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0 if all(s["ok"] for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
