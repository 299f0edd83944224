"""The predictor interface the runtime's admission path calls.

A predictor sees only what is known before an action starts (`ActionContext`: the command,
its class, the workflow's scope and the measured figures of its earlier actions) and returns
a `Prediction` (average, peak, heavy risk). After the action completes, the runtime hands the
measured figures back through `observe`, so later predictions can use them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tenon.policy.admission import Prediction

__all__ = ["ActionContext", "LearningPredictor", "MeasuredAction", "Prediction", "Predictor"]


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
    """Predicts one action's memory demand; `name` identifies it in logs and results."""

    name: str

    def predict(self, context: ActionContext) -> Prediction: ...


class LearningPredictor(Predictor, Protocol):
    """A predictor that learns from each completed action (the runtime calls `observe`)."""

    def observe(self, context: ActionContext, measured: MeasuredAction) -> None: ...
