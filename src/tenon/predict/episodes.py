"""Workflows as the predictors learn from them: the actions in order, each with what it measured.

`Episode.contexts` replays one workflow causally: step i's `ActionContext` holds the command
and class of step i and the measured figures of steps 0..i-1 only, exactly what the runtime's
admission path has when step i is ready. Training rows and evaluation rows both come from
here, so neither can see an action's own figures or a later action.

`predict` sits below `replay`, so traces are read by attribute (`episodes_from_trace`) and the
trace module is imported for type checking only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tenon.predict.base import ActionContext, MeasuredAction

if TYPE_CHECKING:
    from tenon.replay.trace import Trace, Workflow

__all__ = [
    "Episode",
    "episode_from_workflow",
    "episodes_from_trace",
    "episodes_from_traces",
    "trace_workflow_id",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Episode:
    """One workflow: its scope and its actions, oldest first, with their measured figures."""

    workflow_id: str
    family: str | None
    task_prompt: str | None
    actions: tuple[MeasuredAction, ...]
    task: str | None = None

    def has_heavy(self, heavy_peak_bytes: int) -> bool:
        return any(m.peak_bytes > heavy_peak_bytes for m in self.actions)

    def contexts(self) -> Iterator[tuple[ActionContext, MeasuredAction]]:
        """(what is known before step i, what step i measured) for every step, in order."""
        for index, measured in enumerate(self.actions):
            context = ActionContext(
                self.workflow_id,
                measured.command,
                measured.action_class,
                index,
                self.family,
                self.task_prompt,
                self.actions[:index],
                self.task,
            )
            yield context, measured


def episode_from_workflow(workflow: Workflow) -> Episode:
    actions = tuple(
        MeasuredAction(
            step.action.action_class,
            step.action.memory.avg_bytes,
            step.action.memory.peak_bytes,
            step.action.duration_s,
            step.action.command,
        )
        for step in workflow.steps
    )
    return Episode(workflow.id, workflow.family, workflow.task_prompt, actions, workflow.task)


def episodes_from_trace(trace: Trace) -> list[Episode]:
    return [episode_from_workflow(workflow) for workflow in trace.workflows]


def episodes_from_traces(traces: Iterable[Trace]) -> list[Episode]:
    """All workflows of several traces; a workflow id seen twice keeps its first copy."""
    seen: set[str] = set()
    episodes: list[Episode] = []
    for trace in traces:
        for episode in episodes_from_trace(trace):
            if episode.workflow_id in seen:
                logger.warning("workflow %s appears twice; keeping the first", episode.workflow_id)
                continue
            seen.add(episode.workflow_id)
            episodes.append(episode)
    return episodes


def trace_workflow_id(workflow_id: str) -> str:
    """The trace's workflow id of a bench submission `<trace workflow id>#<copy>`."""
    base, sep, copy = workflow_id.rpartition("#")
    return base if sep and copy.isdigit() else workflow_id
