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
