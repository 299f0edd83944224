"""The `history` predictor: the previous action's measured demand.

Memory figures are levels (what the sandbox holds, resident files included), so the last
action's average and peak are a fair guess for the next one; a workflow's first action has no
previous one and gets the static per-class figures instead. This is the baseline a learned
predictor has to beat.
"""

from __future__ import annotations

import logging

from tenon.predict.base import ActionContext, MeasuredAction, Prediction
from tenon.predict.static import StaticPredictor

__all__ = ["HistoryPredictor"]

logger = logging.getLogger(__name__)


class HistoryPredictor:
    name = "history"

    def __init__(self, fallback: StaticPredictor) -> None:
        self.fallback = fallback
        self.heavy_peak_bytes = fallback.heavy_peak_bytes

    def predict(self, context: ActionContext) -> Prediction:
        if not context.history:
            return self.fallback.predict(context)
        last = context.history[-1]
        peak_bytes = max(last.peak_bytes, last.avg_bytes)
        return Prediction(last.avg_bytes, peak_bytes, heavy_risk=peak_bytes > self.heavy_peak_bytes)

    def observe(self, context: ActionContext, measured: MeasuredAction) -> None:
        """Learns nothing across workflows: a workflow's own history reaches `predict`
        through its context."""

    def observe_running(self, context: ActionContext, peak_bytes: int) -> None:
        """Learns nothing during a run."""
