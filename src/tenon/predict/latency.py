"""How long one `predict` call takes, one action at a time, as the admission path calls it."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tenon.errors import ConfigError
from tenon.predict.base import Predictor
from tenon.predict.episodes import Episode

__all__ = ["Latency", "time_predictions"]

logger = logging.getLogger(__name__)

_WARMUP_CALLS = 20


@dataclass(frozen=True, slots=True)
class Latency:
    median_ms: float
    p99_ms: float
    num_calls: int


def time_predictions(
    predictor: Predictor, episodes: Sequence[Episode], *, repeats: int = 3
) -> Latency:
    """Time `predict` on every action's causal context, `repeats` passes, after a warm-up."""
    if repeats < 1:
        raise ConfigError(f"repeats must be at least 1, got {repeats}")
    contexts = [context for episode in episodes for context, _ in episode.contexts()]
    if not contexts:
        raise ConfigError("no actions to time")
    for context in contexts[:_WARMUP_CALLS]:
        predictor.predict(context)
    elapsed_ns = []
    for _ in range(repeats):
        for context in contexts:
            start = time.perf_counter_ns()
            predictor.predict(context)
            elapsed_ns.append(time.perf_counter_ns() - start)
    elapsed_ms = np.array(elapsed_ns, dtype=np.float64) / 1e6
    return Latency(
        median_ms=round(float(np.median(elapsed_ms)), 4),
        p99_ms=round(float(np.percentile(elapsed_ms, 99)), 4),
        num_calls=len(elapsed_ns),
    )
