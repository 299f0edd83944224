"""The predictor interface the runtime's admission path calls.

A predictor sees only what is known before an action starts (`ActionContext`: the command,
its class, the workflow's scope and the measured figures of its earlier actions) and returns
a `Prediction` (average, peak, heavy risk), which admission (`policy.admission`) charges.
After the action completes, the runtime hands the measured figures back through `observe`,
and while a running action crosses the heavy line it reports the peak so far through
`observe_running`, so later predictions can use them. A predictor that does not learn
during a run implements both as no-ops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["ActionContext", "MeasuredAction", "Prediction", "Predictor"]


@dataclass(frozen=True, slots=True)
class Prediction:
    """One action's predicted memory demand (bytes), as admission charges it."""

    avg_bytes: int
    peak_bytes: int
    heavy_risk: bool = False
    """The predictor flags this action as possibly heavy regardless of its peak."""


@dataclass(frozen=True, slots=True)
class MeasuredAction:
    """What an action measured once it completed (bytes and seconds)."""

    action_class: str
    avg_bytes: int
    peak_bytes: int
    duration_s: float
    command: str = ""
    """The command text the action ran (the `forest` predictor's trajectory features)."""
    oom_killed: bool = False
    """The OOM killer ended it: `peak_bytes` is where it was stopped, not what it needed."""


@dataclass(frozen=True, slots=True)
class ActionContext:
    """Everything a predictor may look at for one action, all known before it starts."""

    workflow_id: str
    command: str
    action_class: str
    step_index: int
    family: str | None = None
    task_prompt: str | None = None
    history: tuple[MeasuredAction, ...] = field(default_factory=tuple)
    """Earlier actions of the same workflow, oldest first."""
    task: str | None = None
    """The task the workflow attempts (a SWE-bench instance, an RL rollout's problem).
    Workflows on one task (retries, rollouts, replayed copies) repeat each other's actions;
    workflows of one family (a repository) may attempt very different tasks."""

    @property
    def peer_key(self) -> str:
        """Whose measurements stand in for this workflow's own before it has any: workflows
        on the same task when the task is known, else the same family."""
        if self.task:
            return "task:" + self.task
        return "family:" + (self.family or "")


class Predictor(Protocol):
    """Predicts one action's memory demand and hears what actions measured; `name`
    identifies it in logs and results."""

    name: str

    def predict(self, context: ActionContext) -> Prediction:
        """The demand of the action `context` describes, from what is known before it starts."""
        ...

    def observe(self, context: ActionContext, measured: MeasuredAction) -> None:
        """The action `context` described has completed and measured `measured` (not called
        for an action whose sandbox died: it measured nothing about the action)."""
        ...

    def observe_running(self, context: ActionContext, peak_bytes: int) -> None:
        """The action `context` describes is still running and has reached `peak_bytes`
        (reported when it crosses the heavy line, and again each time it grows by a tenth),
        so peers can expect that peak before it ends."""
        ...
