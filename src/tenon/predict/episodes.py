"""Workflows as the predictors learn from them: the actions in order, each with what it measured.

`Episode.contexts` replays one workflow causally: step i's `ActionContext` holds the command
and class of step i and the measured figures of steps 0..i-1 only, exactly what the runtime's
admission path has when step i is ready. Training rows and evaluation rows both come from
here, so neither can see an action's own figures or a later action.

`predict` sits below `replay` and never reads a trace: `replay.predictors` turns a trace's
workflows into episodes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

from tenon.predict.base import ActionContext, MeasuredAction

__all__ = ["Episode", "trace_workflow_id"]

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


def trace_workflow_id(workflow_id: str) -> str:
    """The trace's workflow id of a bench submission `<trace workflow id>#<copy>`."""
    base, sep, copy = workflow_id.rpartition("#")
    return base if sep and copy.isdigit() else workflow_id
