"""Cross-fitted predictors for the replay bench: no workflow is predicted by a model that saw it.

The bench replays the same workflows it would learn from. `crossfit_predictor` splits the
episodes into folds (as `evaluate_folds` does), fits one predictor per fold on the other
folds, and sends each action to the predictor whose training set left its workflow out. Bench
submissions are named `<trace workflow id>#<copy>`; an id not among the episodes goes to a
predictor fitted on every workflow. (`replay.predictors` cross-fits over a trace.)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from tenon.predict.base import ActionContext, MeasuredAction, Prediction, Predictor
from tenon.predict.episodes import Episode, trace_workflow_id
from tenon.predict.forest import ForestConfig
from tenon.predict.model import DEFAULT_HEAVY_PEAK_BYTES, fit_predictor
from tenon.predict.splits import workflow_folds

__all__ = ["CrossFitPredictor", "crossfit_predictor"]

logger = logging.getLogger(__name__)


class CrossFitPredictor:
    """Dispatches on the workflow id to the predictor that did not train on that workflow."""

    def __init__(
        self, name: str, by_workflow: Mapping[str, Predictor], fallback: Predictor
    ) -> None:
        self.name = name
        self._by_workflow = dict(by_workflow)
        self._fallback = fallback

    def predictor_for(self, workflow_id: str) -> Predictor:
        return self._by_workflow.get(trace_workflow_id(workflow_id), self._fallback)

    def predict(self, context: ActionContext) -> Prediction:
        return self.predictor_for(context.workflow_id).predict(context)

    def observe(self, context: ActionContext, measured: MeasuredAction) -> None:
        """Hands the measured figures to every fold's predictor: what a workflow measured at
        run time is news to all of them, not only the one predicting it."""
        for predictor in self._predictors():
            predictor.observe(context, measured)

    def observe_running(self, context: ActionContext, peak_bytes: int) -> None:
        """Hands a running action's peak to every fold's predictor, as `observe` does."""
        for predictor in self._predictors():
            predictor.observe_running(context, peak_bytes)

    def _predictors(self) -> list[Predictor]:
        """Every fold's predictor and the fallback, each once."""
        return list({id(p): p for p in (*self._by_workflow.values(), self._fallback)}.values())


def crossfit_predictor(
    episodes: Sequence[Episode],
    *,
    folds: int = 5,
    seed: int = 0,
    kind: str = "forest",
    heavy_peak_bytes: int = DEFAULT_HEAVY_PEAK_BYTES,
    config: ForestConfig | None = None,
) -> Predictor:
    """`kind` (static, history or forest) fitted `folds` times, each leaving one fold out."""
    fallback = fit_predictor(episodes, kind, heavy_peak_bytes=heavy_peak_bytes, config=config)
    by_workflow: dict[str, Predictor] = {}
    if len(episodes) < 2:
        logger.warning("one workflow: nothing to cross-fit with, it is predicted in-sample")
        return CrossFitPredictor(kind, by_workflow, fallback)
    groups = workflow_folds(
        episodes,
        num_folds=min(folds, len(episodes)),
        seed=seed,
        heavy_peak_bytes=heavy_peak_bytes,
    )
    for index, held_out in enumerate(groups):
        train = [e for other, group in enumerate(groups) if other != index for e in group]
        predictor = fit_predictor(train, kind, heavy_peak_bytes=heavy_peak_bytes, config=config)
        for episode in held_out:
            by_workflow[episode.workflow_id] = predictor
    logger.info("cross-fitted %s on %d workflows in %d folds", kind, len(episodes), len(groups))
    return CrossFitPredictor(kind, by_workflow, fallback)

