"""Train the three predictors on workflows, and save or load them as one model file.

    model = train_model(episodes)  # a trace's: replay.predictors.episodes_from_trace
    save_model(model, "predictor.joblib")
    forest = load_model("predictor.joblib").predictor("forest")

The file is joblib: a small header (format, feature version, heavy threshold, library
versions) around the pickled model. `load_model` reads the header first and refuses a model
whose feature version (or scikit-learn version) differs from this code's with `ModelError`
naming both, before it unpickles anything built from those features. Like any pickle, a model
file runs code when loaded: load only files you made.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, get_args

import joblib  # type: ignore[import-untyped]
import sklearn  # type: ignore[import-untyped]

from tenon.errors import ConfigError, ModelError
from tenon.predict.base import MeasuredAction, Predictor
from tenon.predict.episodes import Episode
from tenon.predict.features import FEATURE_VERSION, MIB
from tenon.predict.forest import ForestConfig, ForestPredictor
from tenon.predict.history import HistoryPredictor
from tenon.predict.static import StaticPredictor

__all__ = [
    "DEFAULT_HEAVY_PEAK_BYTES",
    "PREDICTOR_KINDS",
    "PredictorKind",
    "PredictorModel",
    "fit_predictor",
    "load_model",
    "save_model",
    "train_model",
]

logger = logging.getLogger(__name__)

MODEL_FORMAT: Final = "tenon-predictor"
DEFAULT_HEAVY_PEAK_BYTES: Final = 1024 * MIB
PredictorKind = Literal["static", "history", "forest"]
PREDICTOR_KINDS: Final[tuple[PredictorKind, ...]] = get_args(PredictorKind)


@dataclass(frozen=True)
class PredictorModel:
    """The three predictors fitted on the same workflows, and what they were fitted on."""

    heavy_peak_bytes: int
    static_table: dict[str, tuple[int, int]]
    """(avg_bytes, peak_bytes) per action class, as `StaticPredictor.fit` made them."""
    forest: ForestPredictor
    train_workflows: tuple[str, ...]
    feature_version: int = FEATURE_VERSION

    def predictor(self, kind: str) -> Predictor:
        if kind == "static":
            return self.static()
        if kind == "history":
            return HistoryPredictor(self.static())
        if kind == "forest":
            return self.forest
        raise ConfigError(f"unknown predictor {kind!r}; known: {', '.join(PREDICTOR_KINDS)}")

    def static(self) -> StaticPredictor:
        return StaticPredictor(self.static_table, heavy_peak_bytes=self.heavy_peak_bytes)

    def predictors(self) -> dict[str, Predictor]:
        return {kind: self.predictor(kind) for kind in PREDICTOR_KINDS}


def _measured(episodes: Sequence[Episode]) -> list[MeasuredAction]:
    return [m for episode in episodes for m in episode.actions]


def _check_kind(kind: str) -> None:
    if kind not in PREDICTOR_KINDS:
        raise ConfigError(f"unknown predictor {kind!r}; known: {', '.join(PREDICTOR_KINDS)}")


def fit_static(episodes: Sequence[Episode], *, heavy_peak_bytes: int) -> StaticPredictor:
    """Per class: mean average and 90th-percentile peak (as the replay bench's static)."""
    return StaticPredictor.fit(_measured(episodes), heavy_peak_bytes=heavy_peak_bytes)


def fit_predictor(
    episodes: Sequence[Episode],
    kind: str,
    *,
    heavy_peak_bytes: int = DEFAULT_HEAVY_PEAK_BYTES,
    config: ForestConfig | None = None,
) -> Predictor:
    """One predictor of `kind` (static, history or forest) fitted on `episodes`."""
    _check_kind(kind)
    if not episodes:
        raise ConfigError("cannot fit a predictor on zero workflows")
    if kind == "forest":
        rows = [row for episode in episodes for row in episode.contexts()]
        return ForestPredictor.fit(rows, heavy_peak_bytes=heavy_peak_bytes, config=config)
    static = fit_static(episodes, heavy_peak_bytes=heavy_peak_bytes)
    return static if kind == "static" else HistoryPredictor(static)


def train_model(
    episodes: Sequence[Episode],
    *,
    heavy_peak_bytes: int = DEFAULT_HEAVY_PEAK_BYTES,
    config: ForestConfig | None = None,
) -> PredictorModel:
    """Fit static (whose table history falls back to) and forest on the same workflows."""
    if heavy_peak_bytes <= 0:
        raise ConfigError(f"heavy threshold must be positive, got {heavy_peak_bytes} B")
    static = fit_predictor(episodes, "static", heavy_peak_bytes=heavy_peak_bytes)
    forest = fit_predictor(episodes, "forest", heavy_peak_bytes=heavy_peak_bytes, config=config)
    assert isinstance(static, StaticPredictor)
    assert isinstance(forest, ForestPredictor)
    return PredictorModel(
        heavy_peak_bytes=heavy_peak_bytes,
        static_table=dict(static.table),
        forest=forest,
        train_workflows=tuple(e.workflow_id for e in episodes),
    )


def save_model(model: PredictorModel, path: str | os.PathLike[str]) -> Path:
    """Write atomically (a temporary file renamed into place); returns the path."""
    payload = io.BytesIO()
    joblib.dump(model, payload)
    header: dict[str, Any] = {
        "format": MODEL_FORMAT,
        "feature_version": model.feature_version,
        "sklearn_version": sklearn.__version__,
        "heavy_peak_bytes": model.heavy_peak_bytes,
        "num_train_workflows": len(model.train_workflows),
        "payload": payload.getvalue(),
    }
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        joblib.dump(header, tmp, compress=3)
        tmp.replace(target)
    except OSError as exc:
        raise ModelError(f"{target}: cannot write model: {exc}") from exc
    logger.info("wrote predictor model to %s", target)
    return target


def load_model(path: str | os.PathLike[str]) -> PredictorModel:
    """Read a model file; `ModelError` if it is missing, unreadable or of another version."""
    source = Path(path)
    if not source.is_file():
        raise ModelError(f"{source}: no such model file")
    try:
        header = joblib.load(source)
    except Exception as exc:  # joblib/pickle raise many types for a corrupt file
        raise ModelError(f"{source}: cannot read model: {exc}") from exc
    if not isinstance(header, dict) or header.get("format") != MODEL_FORMAT:
        raise ModelError(f"{source}: not a Tenon predictor model (expected {MODEL_FORMAT!r})")
    if header.get("feature_version") != FEATURE_VERSION:
        raise ModelError(
            f"{source}: model has feature version {header.get('feature_version')}, this Tenon "
            f"builds feature version {FEATURE_VERSION}; retrain it with `tenon predict train`"
        )
    if header.get("sklearn_version") != sklearn.__version__:
        raise ModelError(
            f"{source}: model was saved with scikit-learn {header.get('sklearn_version')}, "
            f"this is {sklearn.__version__}; retrain it with `tenon predict train`"
        )
    try:
        model = joblib.load(io.BytesIO(header["payload"]))
    except Exception as exc:
        raise ModelError(f"{source}: cannot read model payload: {exc}") from exc
    if not isinstance(model, PredictorModel):
        raise ModelError(f"{source}: payload is a {type(model).__name__}, not a model")
    return model
