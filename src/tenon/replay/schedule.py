"""When each workflow of a replay is submitted: an offered-load burst, or the trace's times.

A burst at `qps` for `window_s` submits `round(qps * window_s)` workflows, one every 1/qps
seconds, cycling through the trace's workflows in order when more are needed than the trace
has (each copy is its own workflow instance). Without `qps`, every workflow is submitted at
its trace time. `speed` divides every time: submit times, model waits, action durations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tenon.errors import ConfigError
from tenon.replay.trace import Workflow


@dataclass(frozen=True)
class Submission:
    instance: str
    """Unique per submitted copy: `<workflow id>#<copy>`."""
    workflow: Workflow
    submit_s: float
    """Seconds after the replay starts (already divided by speed)."""


def make_schedule(
    workflows: Sequence[Workflow],
    *,
    qps: float | None,
    window_s: float = 10.0,
    speed: float = 1.0,
    num_workflows: int | None = None,
) -> list[Submission]:
    if not workflows:
        raise ConfigError("the trace has no workflows")
    if speed <= 0:
        raise ConfigError(f"--speed must be positive, got {speed}")
    if qps is None:
        chosen = list(workflows)[: num_workflows or None]
        return [Submission(f"{w.id}#0", w, w.submit_s / speed) for w in chosen]
    if qps <= 0 or window_s <= 0:
        raise ConfigError(f"--qps and --window must be positive, got {qps} and {window_s}")
    count = num_workflows if num_workflows is not None else max(round(qps * window_s), 1)
    if count <= 0:
        raise ConfigError(f"the number of workflows must be positive, got {count}")
    subs = []
    for i in range(count):
        workflow = workflows[i % len(workflows)]
        subs.append(Submission(f"{workflow.id}#{i // len(workflows)}", workflow, i / qps))
    return subs


def copies_of(workflows: Sequence[Workflow], workflow_id: str, copies: int) -> list[Submission]:
    """A synchronized burst: `copies` copies of one workflow, all submitted at once, so that
    their peaks line up."""
    if copies <= 0:
        raise ConfigError(f"--copies must be positive, got {copies}")
    chosen = [w for w in workflows if w.id == workflow_id]
    if not chosen:
        known = ", ".join(w.id for w in list(workflows)[:5])
        raise ConfigError(f"--of: no workflow {workflow_id!r} in the trace (e.g. {known})")
    return [Submission(f"{workflow_id}#{i}", chosen[0], 0.0) for i in range(copies)]


def memory_bound_s(submissions: Sequence[Submission], speed: float, budget_bytes: int, *,
                   idle_resident: bool = False) -> float:
    """The makespan no schedule within `budget_bytes` can beat: the replay's memory-time
    area over the budget. Each action holds its recorded average for its duration (at
    `speed`); with `idle_resident`, each sandbox also holds what its action left resident
    through the model wait that follows (as when idle sandboxes are never torn down)."""
    area = 0.0
    for sub in submissions:
        steps = sub.workflow.steps
        for i, step in enumerate(steps):
            memory = step.action.memory
            area += memory.avg_bytes * step.action.duration_s / speed
            if idle_resident and i + 1 < len(steps):
                area += memory.resident_after_bytes * steps[i + 1].model_wait_s / speed
    return area / budget_bytes


def oversubscription(submissions: Sequence[Submission], budget_bytes: int) -> float:
    """Sum of the submitted workflows' profiled peaks over the budget."""
    return sum(s.workflow.profiled_peak_bytes for s in submissions) / budget_bytes


def makespan_bound_s(submissions: Sequence[Submission], speed: float) -> float:
    """The makespan no policy can beat: the latest a submission's own length (its model
    waits and recorded action durations, divided by `speed`) ends after its submit time.

    It ignores everything that only makes a replay slower (sandbox starts, CPU, memory), so
    it is the reference for how far a policy is from ideal, not a target it can reach.
    """
    return max((s.submit_s + own_length_s(s.workflow, speed) for s in submissions),
               default=0.0)


def own_length_s(workflow: Workflow, speed: float) -> float:
    """The workflow alone on an idle host: its model waits and recorded durations at `speed`."""
    return sum(step.model_wait_s + step.action.duration_s for step in workflow.steps) / speed
