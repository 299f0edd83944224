"""Predictors built from a trace: its workflows as episodes, cross-fitted and in-sample
predictors over them, and the oracle of recorded figures.

`predict` knows nothing of traces (it sits below `replay`); this is where a trace's
workflows become the `Episode`s and recorded figures the predictors take.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from tenon.predict.base import MeasuredAction, Predictor
from tenon.predict.crossfit import crossfit_predictor
from tenon.predict.episodes import Episode
from tenon.predict.forest import ForestConfig
from tenon.predict.model import DEFAULT_HEAVY_PEAK_BYTES, fit_predictor
from tenon.predict.oracle import OraclePredictor
from tenon.replay.trace import Trace, Workflow

__all__ = [
    "crossfit_trace_predictor",
    "episode_from_workflow",
    "episodes_from_trace",
    "episodes_from_traces",
    "oracle_predictor",
    "recorded_actions",
    "trace_predictor",
]

logger = logging.getLogger(__name__)


def recorded_actions(workflow: Workflow) -> tuple[MeasuredAction, ...]:
    """Every step's recorded figures, in order, as the predictors see measured actions."""
    return tuple(
        MeasuredAction(
            step.action.action_class,
            step.action.memory.avg_bytes,
            step.action.memory.peak_bytes,
            step.action.duration_s,
            step.action.command,
        )
        for step in workflow.steps
    )


def episode_from_workflow(workflow: Workflow) -> Episode:
    return Episode(workflow.id, workflow.family, workflow.task_prompt,
                   recorded_actions(workflow), workflow.task)


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


def crossfit_trace_predictor(
    trace: Trace,
    *,
    folds: int = 5,
    seed: int = 0,
    kind: str = "forest",
    heavy_peak_bytes: int = DEFAULT_HEAVY_PEAK_BYTES,
    config: ForestConfig | None = None,
) -> Predictor:
    """`kind` cross-fitted over the trace's workflows (`predict.crossfit`): no workflow is
    predicted by a model that trained on it."""
    return crossfit_predictor(episodes_from_trace(trace), folds=folds, seed=seed, kind=kind,
                              heavy_peak_bytes=heavy_peak_bytes, config=config)


def trace_predictor(
    trace: Trace,
    *,
    kind: str = "forest",
    heavy_peak_bytes: int = DEFAULT_HEAVY_PEAK_BYTES,
    config: ForestConfig | None = None,
) -> Predictor:
    """`kind` fitted on every workflow of `trace` (in-sample when the bench replays it)."""
    return fit_predictor(
        episodes_from_trace(trace), kind, heavy_peak_bytes=heavy_peak_bytes, config=config
    )


def oracle_predictor(workflows: Mapping[str, Workflow], *,
                     heavy_peak_bytes: int = DEFAULT_HEAVY_PEAK_BYTES) -> OraclePredictor:
    """The oracle of each workflow instance's recorded figures (keys are the instances the
    runtime names, `<workflow id>#<copy>` in a replay)."""
    return OraclePredictor({instance: recorded_actions(workflow)
                            for instance, workflow in workflows.items()},
                           heavy_peak_bytes=heavy_peak_bytes)
