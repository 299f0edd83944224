"""Honest evaluation: causal replay of held-out workflows.

Each workflow is replayed in order: step i is predicted from a context holding steps < i as
history (`Episode.contexts`), then the measured figures are handed to `observe` (as the
runtime does) and join the history. Predictors are trained on other workflows only:

- `evaluate_split`: one stratified workflow-level split (train / test);
- `evaluate_folds`: k-fold cross-validation; every workflow is predicted once, by the model
  of the fold that left it out, and the predictions are pooled before scoring;
- `learning_curve`: the same folds with each training set cut to a fraction of its
  workflows, to show whether more data would help.

Scores are of the predicted *peak*, since admission reserves the peak:

- `mae_mib`: mean absolute error of the peak, MiB;
- `p90_ape_pct`: 90th percentile of |predicted - measured| / max(measured, 16 MiB), percent.
  The floor keeps near-empty actions (a quarter of them measure under 10 MiB, some 0 B) from
  dividing by almost nothing; 16 MiB is the runtime's bootstrap demand;
- `heavy_precision_pct` / `heavy_recall_pct`: of actions flagged heavy (`heavy_risk`), the
  share whose measured peak is above the threshold, and of those, the share flagged. None
  (JSON null) when nothing was flagged or nothing was heavy: a ratio of zero cases.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from tenon.errors import ConfigError
from tenon.predict.base import MeasuredAction, Prediction, Predictor
from tenon.predict.episodes import Episode
from tenon.predict.features import MIB
from tenon.predict.forest import ForestConfig
from tenon.predict.model import PREDICTOR_KINDS, PredictorModel, train_model
from tenon.predict.splits import split_workflows, workflow_folds

__all__ = [
    "APE_FLOOR_MIB",
    "Evaluation",
    "Scores",
    "evaluate_folds",
    "evaluate_model",
    "evaluate_split",
    "learning_curve",
    "replay",
    "score",
]

logger = logging.getLogger(__name__)

APE_FLOOR_MIB: Final = 16.0

Outcomes = list[tuple[Prediction, MeasuredAction]]


@dataclass(frozen=True, slots=True)
class Scores:
    mae_mib: float
    p90_ape_pct: float
    heavy_precision_pct: float | None
    heavy_recall_pct: float | None
    avg_mae_mib: float
    """Mean absolute error of the predicted average (not in the JSON; printed)."""
    num_actions: int
    num_heavy: int
    num_flagged: int

    def as_json(self) -> dict[str, float | None]:
        """Exactly the four published figures."""
        return {
            "mae_mib": self.mae_mib,
            "p90_ape_pct": self.p90_ape_pct,
            "heavy_precision_pct": self.heavy_precision_pct,
            "heavy_recall_pct": self.heavy_recall_pct,
        }


def score(outcomes: Outcomes, *, heavy_peak_bytes: int) -> Scores:
    if not outcomes:
        raise ConfigError("nothing to score: no actions were predicted")
    predicted_mib = np.array([p.peak_bytes for p, _ in outcomes], dtype=np.float64) / MIB
    measured_mib = np.array([m.peak_bytes for _, m in outcomes], dtype=np.float64) / MIB
    avg_error_mib = np.abs(
        np.array([p.avg_bytes - m.avg_bytes for p, m in outcomes], dtype=np.float64) / MIB
    )
    error_mib = np.abs(predicted_mib - measured_mib)
    ape_pct = 100.0 * error_mib / np.maximum(measured_mib, APE_FLOOR_MIB)
    heavy = np.array([m.peak_bytes > heavy_peak_bytes for _, m in outcomes])
    flagged = np.array([p.heavy_risk for p, _ in outcomes])
    hits = int((heavy & flagged).sum())
    return Scores(
        mae_mib=round(float(error_mib.mean()), 2),
        p90_ape_pct=round(float(np.percentile(ape_pct, 90)), 1),
        heavy_precision_pct=_ratio_pct(hits, int(flagged.sum())),
        heavy_recall_pct=_ratio_pct(hits, int(heavy.sum())),
        avg_mae_mib=round(float(avg_error_mib.mean()), 2),
        num_actions=len(outcomes),
        num_heavy=int(heavy.sum()),
        num_flagged=int(flagged.sum()),
    )


def _ratio_pct(part: int, whole: int) -> float | None:
    return round(100.0 * part / whole, 1) if whole else None


def replay(predictor: Predictor, episodes: Sequence[Episode]) -> Outcomes:
    """Predict every action of every workflow causally, in order; (prediction, measured)."""
    outcomes: Outcomes = []
    for episode in episodes:
        for context, measured in episode.contexts():
            outcomes.append((predictor.predict(context), measured))
            predictor.observe(context, measured)
    return outcomes


@dataclass(frozen=True, slots=True)
class Evaluation:
    """Scores per predictor, and how many workflows were trained on and tested."""

    scores: dict[str, Scores]
    train_workflows: int
    test_workflows: int

    def as_json(self) -> dict[str, Any]:
        return {
            "predictors": {name: s.as_json() for name, s in self.scores.items()},
            "train_workflows": self.train_workflows,
            "test_workflows": self.test_workflows,
        }


def _evaluation(
    outcomes: Mapping[str, Outcomes], heavy_peak_bytes: int, num_train: int, num_test: int
) -> Evaluation:
    scores = {name: score(o, heavy_peak_bytes=heavy_peak_bytes) for name, o in outcomes.items()}
    return Evaluation(scores, num_train, num_test)


def evaluate_model(model: PredictorModel, episodes: Sequence[Episode]) -> Evaluation:
    """Every predictor of `model` replayed on `episodes` (the caller ensures they are new)."""
    outcomes = {name: replay(p, episodes) for name, p in model.predictors().items()}
    return _evaluation(outcomes, model.heavy_peak_bytes, len(model.train_workflows), len(episodes))


def evaluate_split(
    episodes: Sequence[Episode],
    *,
    heavy_peak_bytes: int,
    test_fraction: float = 0.3,
    seed: int = 0,
    config: ForestConfig | None = None,
) -> Evaluation:
    """Train on one side of a stratified workflow split, replay the other."""
    train, test = split_workflows(
        episodes, test_fraction=test_fraction, seed=seed, heavy_peak_bytes=heavy_peak_bytes
    )
    model = train_model(train, heavy_peak_bytes=heavy_peak_bytes, config=config)
    return evaluate_model(model, test)


def _fold_outcomes(
    folds: Sequence[Sequence[Episode]],
    *,
    heavy_peak_bytes: int,
    config: ForestConfig | None,
    train_fraction: float = 1.0,
    seed: int = 0,
) -> tuple[dict[str, Outcomes], list[int]]:
    """Pooled outcomes of every fold's held-out workflows; the training sizes used."""
    rng = random.Random(seed)
    pooled: dict[str, Outcomes] = {kind: [] for kind in PREDICTOR_KINDS}
    train_sizes = []
    for index, test in enumerate(folds):
        train = [e for other, fold in enumerate(folds) if other != index for e in fold]
        if train_fraction < 1.0:
            train = rng.sample(train, max(1, round(len(train) * train_fraction)))
        model = train_model(train, heavy_peak_bytes=heavy_peak_bytes, config=config)
        train_sizes.append(len(train))
        for name, predictor in model.predictors().items():
            pooled[name] += replay(predictor, test)
    return pooled, train_sizes


def evaluate_folds(
    episodes: Sequence[Episode],
    *,
    heavy_peak_bytes: int,
    num_folds: int = 5,
    seed: int = 0,
    config: ForestConfig | None = None,
) -> Evaluation:
    """k-fold cross-validation; `train_workflows` is the smallest fold's training set."""
    folds = workflow_folds(
        episodes, num_folds=num_folds, seed=seed, heavy_peak_bytes=heavy_peak_bytes
    )
    pooled, train_sizes = _fold_outcomes(folds, heavy_peak_bytes=heavy_peak_bytes, config=config)
    return _evaluation(pooled, heavy_peak_bytes, min(train_sizes), len(episodes))


def learning_curve(
    episodes: Sequence[Episode],
    *,
    heavy_peak_bytes: int,
    fractions: Sequence[float] = (0.25, 0.5, 0.75, 1.0),
    num_folds: int = 5,
    seed: int = 0,
    config: ForestConfig | None = None,
) -> list[tuple[float, Evaluation]]:
    """(fraction, k-fold scores), each fold's training workflows cut to that fraction."""
    if not fractions or any(not 0.0 < f <= 1.0 for f in fractions):
        raise ConfigError(f"training fractions must be in (0, 1], got {list(fractions)}")
    folds = workflow_folds(
        episodes, num_folds=num_folds, seed=seed, heavy_peak_bytes=heavy_peak_bytes
    )
    points = []
    for fraction in fractions:
        pooled, train_sizes = _fold_outcomes(
            folds,
            heavy_peak_bytes=heavy_peak_bytes,
            config=config,
            train_fraction=fraction,
            seed=seed,
        )
        evaluation = _evaluation(pooled, heavy_peak_bytes, min(train_sizes), len(episodes))
        points.append((fraction, evaluation))
    return points
