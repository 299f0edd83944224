"""The `forest` predictor: random forests over causal features.

One multi-output `RandomForestRegressor` predicts log(1 + MiB) of an action's average and
peak memory (log, because demands span five orders of magnitude and a 20 MiB miss on a
`grep` matters as much as a 200 MiB miss on a test suite); a `RandomForestClassifier`
predicts whether its peak will exceed the heavy threshold. An action is flagged heavy when
the classifier says so with probability >= `heavy_probability` or the predicted peak is
above the threshold. With no heavy action in the training data there is no classifier, and
only the regressor can flag one.

A repeat of a heavy command is heavy (`repeat_heavy`): when an earlier action with the same
`command_key` (an agent re-running its test suite, flags and pipes aside) peaked above the
threshold, in the same workflow or, as observed at run time, in a peer workflow (another
attempt at the same task; without a task, the same family), the action is flagged heavy and its
predicted peak is at least that earlier peak. An action the OOM killer ended counts as heavy:
it was the largest thing in a full domain, and its measured peak is a floor, not its need.
Heavy actions are a handful in thousands, so the forests average them away; a heavy run of
the same command is the best evidence there is that the next one is heavy too.

Inference goes through `FlatForest` (about a millisecond for one action), not scikit-learn's
`predict`. The trees change only when retrained; `observe` keeps only the heavy runs, and
they are not saved with the model.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from sklearn.ensemble import (  # type: ignore[import-untyped]
    RandomForestClassifier,
    RandomForestRegressor,
)

from tenon.errors import ConfigError
from tenon.predict.base import ActionContext, MeasuredAction, Prediction
from tenon.predict.classify import command_key
from tenon.predict.features import MIB, FeatureBuilder
from tenon.predict.trees import FlatForest

__all__ = ["ForestConfig", "ForestPredictor"]

logger = logging.getLogger(__name__)


class ForestConfig(BaseModel):
    """How the forests are built; chosen by cross-validation inside a training split."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_trees: int = Field(
        default=50,
        ge=1,
        le=500,
        description="Trees per forest; inference time grows with it.",
    )
    min_samples_leaf: int = Field(default=2, ge=1, description="Regressor leaf size.")
    max_features: float = Field(
        default=0.33, gt=0, le=1, description="Fraction of the columns each split considers."
    )
    max_text_features: int = Field(
        default=256, ge=0, description="TF-IDF vocabulary size; 0 turns text features off."
    )
    trajectory_length: int = Field(
        default=3, ge=0, description="Earlier commands whose words join the text features."
    )
    min_family_workflows: int = Field(
        default=2,
        ge=1,
        description="A family gets its own column once this many training workflows have it.",
    )
    heavy_probability: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="Classifier probability from which an action is flagged heavy.",
    )
    repeat_heavy: bool = Field(
        default=True,
        description="Flag a re-run of a command that was heavy earlier in the workflow heavy, "
        "predicting at least that earlier peak.",
    )
    seed: int = Field(default=0, description="Random state of both forests.")


class ForestPredictor:
    """Random-forest regressors for average and peak, a classifier for heavy risk."""

    name = "forest"

    def __init__(
        self,
        features: FeatureBuilder,
        regressor: FlatForest,
        classifier: FlatForest | None,
        *,
        heavy_peak_bytes: int,
        config: ForestConfig,
    ) -> None:
        self.features = features
        self.regressor = regressor
        self.classifier = classifier
        self.heavy_peak_bytes = heavy_peak_bytes
        self.config = config
        self._heavy_runs: dict[str, dict[str, int]] = {}
        """peer key (task, else family) -> command_key -> the highest heavy peak observed at
        run time."""

    def __getstate__(self) -> dict[str, object]:
        state = self.__dict__.copy()
        state["_heavy_runs"] = {}  # a model file carries what was trained, not a run's memory
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_heavy_runs", {})

    @classmethod
    def fit(
        cls,
        rows: Sequence[tuple[ActionContext, MeasuredAction]],
        *,
        heavy_peak_bytes: int,
        config: ForestConfig | None = None,
    ) -> ForestPredictor:
        """Fit on (context, what that action measured) rows, e.g. from `Episode.contexts`."""
        config = config or ForestConfig()
        if not rows:
            raise ConfigError("cannot fit the forest predictor on zero actions")
        contexts = [context for context, _ in rows]
        features = FeatureBuilder(
            heavy_peak_bytes=heavy_peak_bytes,
            max_text_features=config.max_text_features,
            trajectory_length=config.trajectory_length,
            min_family_workflows=config.min_family_workflows,
        ).fit(contexts)
        x = features.transform(contexts)
        avg_mib = np.array([m.avg_bytes for _, m in rows], dtype=np.float64) / MIB
        peak_mib = np.array([m.peak_bytes for _, m in rows], dtype=np.float64) / MIB
        regressor = RandomForestRegressor(
            n_estimators=config.num_trees,
            min_samples_leaf=config.min_samples_leaf,
            max_features=config.max_features,
            random_state=config.seed,
            n_jobs=1,
        ).fit(x, np.log1p(np.column_stack([avg_mib, peak_mib])))
        heavy = np.array([m.peak_bytes > heavy_peak_bytes for _, m in rows])
        classifier = None
        if heavy.any() and not heavy.all():
            classifier = FlatForest(
                RandomForestClassifier(
                    n_estimators=config.num_trees,
                    max_features=config.max_features,
                    random_state=config.seed,
                    n_jobs=1,
                ).fit(x, heavy)
            )
        else:
            logger.info("no heavy classifier: %d of %d actions are heavy", heavy.sum(), len(rows))
        return cls(
            features,
            FlatForest(regressor),
            classifier,
            heavy_peak_bytes=heavy_peak_bytes,
            config=config,
        )

    def predict(self, context: ActionContext) -> Prediction:
        return self.predict_many([context])[0]

    def predict_many(self, contexts: Sequence[ActionContext]) -> list[Prediction]:
        """The same as `predict` on each context, in one pass over the trees."""
        x = self.features.transform(contexts)
        log_mib = self.regressor.predict(x)
        figures_bytes = np.expm1(np.maximum(log_mib, 0.0)) * MIB
        if self.classifier is not None:
            heavy_probability = self.classifier.predict(x)[:, 1]
        else:
            heavy_probability = np.zeros(len(contexts))
        predictions = []
        for context, (avg, peak), probability in zip(
            contexts, figures_bytes, heavy_probability, strict=True
        ):
            peak_bytes = int(peak)
            if self.config.repeat_heavy:
                peak_bytes = max(peak_bytes, self._heavy_repeat_peak(context))
            avg_bytes = min(int(avg), peak_bytes)
            heavy_risk = bool(
                probability >= self.config.heavy_probability or peak_bytes > self.heavy_peak_bytes
            )
            predictions.append(Prediction(avg_bytes, peak_bytes, heavy_risk))
        return predictions

    def _heavy_repeat_peak(self, context: ActionContext) -> int:
        """The highest heavy peak of an earlier run of this command (in the workflow, or
        observed in a peer workflow: same task, else same family), or 0."""
        heavy = [(floor, m) for m in context.history if (floor := self._heavy_floor(m))]
        in_peers = self._heavy_runs.get(context.peer_key, {})
        if not heavy and not in_peers:
            return 0  # the common case: no shell parsing on the admission path
        key = command_key(context.command)
        peak = max((p for p, m in heavy if command_key(m.command) == key), default=0)
        return max(peak, in_peers.get(key, 0))

    def _heavy_floor(self, measured: MeasuredAction) -> int:
        """What a measured action says the next run of its command may need, if heavy."""
        if measured.peak_bytes > self.heavy_peak_bytes:
            return measured.peak_bytes
        if measured.oom_killed:
            return self.heavy_peak_bytes + 1
        return 0

    def observe(self, context: ActionContext, measured: MeasuredAction) -> None:
        """Remember a heavy run (or an OOM-killed one) by peer key (task, else family) and
        command.

        The workflow's own history reaches `predict` through the context; this is for its
        peers, which run at the same time or later.
        """
        if not self.config.repeat_heavy or not (context.task or context.family):
            return
        floor = self._heavy_floor(measured)
        if floor:
            runs = self._heavy_runs.setdefault(context.peer_key, {})
            key = command_key(context.command)
            runs[key] = max(runs.get(key, 0), floor)

    def observe_running(self, context: ActionContext, peak_bytes: int) -> None:
        """Learns nothing from a running action: a heavy run is remembered when it ends
        (`observe`), with the peak it reached."""
