"""The `static` predictor: fixed figures per action class.

The defaults are deliberately coarse (a test run or an install needs more than a `grep`);
`StaticPredictor.fit` replaces them with per-class averages and high percentiles of
measured actions, and a caller may pass its own table.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from tenon.errors import ConfigError
from tenon.predict.base import ActionContext, MeasuredAction, Prediction
from tenon.predict.classify import ACTION_CLASSES

logger = logging.getLogger(__name__)

MIB = 1024 * 1024

DEFAULT_TABLE: Mapping[str, tuple[int, int]] = {
    "test_runner": (300 * MIB, 700 * MIB),
    "package_install": (250 * MIB, 600 * MIB),
    "compiler": (300 * MIB, 800 * MIB),
    "interpreter": (120 * MIB, 300 * MIB),
    "vcs": (40 * MIB, 100 * MIB),
    "file_edit": (16 * MIB, 32 * MIB),
    "search": (32 * MIB, 64 * MIB),
    "file_read": (16 * MIB, 32 * MIB),
    "other": (64 * MIB, 160 * MIB),
}
"""(avg_bytes, peak_bytes) per action class."""


class StaticPredictor:
    """Per-class (avg, peak); unknown classes fall back to "other"."""

    name = "static"

    def __init__(
        self,
        table: Mapping[str, tuple[int, int]] | None = None,
        *,
        heavy_peak_bytes: int = 1024 * MIB,
    ) -> None:
        merged = dict(DEFAULT_TABLE)
        for klass, (avg, peak) in (table or {}).items():
            if klass not in ACTION_CLASSES:
                raise ConfigError(f"unknown action class {klass!r}; known: {list(ACTION_CLASSES)}")
            if avg < 0 or peak < avg:
                raise ConfigError(f"class {klass}: need 0 <= avg <= peak, got {avg}, {peak}")
            merged[klass] = (int(avg), int(peak))
        self.table: dict[str, tuple[int, int]] = merged
        self.heavy_peak_bytes = heavy_peak_bytes

    def predict(self, context: ActionContext) -> Prediction:
        avg, peak = self.table.get(context.action_class, self.table["other"])
        return Prediction(avg, peak, heavy_risk=peak > self.heavy_peak_bytes)

    def observe(self, context: ActionContext, measured: MeasuredAction) -> None:
        """Learns nothing during a run: the table changes only through `fit`."""

    def observe_running(self, context: ActionContext, peak_bytes: int) -> None:
        """Learns nothing during a run."""

    @classmethod
    def fit(
        cls,
        measured: Iterable[MeasuredAction],
        *,
        peak_quantile: float = 0.9,
        heavy_peak_bytes: int = 1024 * MIB,
    ) -> StaticPredictor:
        """Per class: mean of the averages, `peak_quantile` of the peaks (defaults elsewhere)."""
        if not 0.0 < peak_quantile <= 1.0:
            raise ConfigError(f"peak_quantile must be in (0, 1], got {peak_quantile}")
        by_class: dict[str, list[MeasuredAction]] = {}
        for m in measured:
            by_class.setdefault(m.action_class, []).append(m)
        table: dict[str, tuple[int, int]] = {}
        for klass, rows in by_class.items():
            if klass not in ACTION_CLASSES:
                continue
            avg = sum(r.avg_bytes for r in rows) // len(rows)
            peaks = sorted(r.peak_bytes for r in rows)
            peak = peaks[min(int(peak_quantile * len(peaks)), len(peaks) - 1)]
            table[klass] = (avg, max(peak, avg))
        return cls(table, heavy_peak_bytes=heavy_peak_bytes)


class FixedPredictor:
    """One prediction for every action (tests, and callers that know their workload)."""

    name = "fixed"

    def __init__(self, avg_bytes: int, peak_bytes: int, *, heavy_risk: bool = False) -> None:
        if avg_bytes < 0 or peak_bytes < avg_bytes:
            raise ConfigError(f"need 0 <= avg <= peak, got {avg_bytes}, {peak_bytes}")
        self._prediction = Prediction(avg_bytes, peak_bytes, heavy_risk)

    def predict(self, context: ActionContext) -> Prediction:
        del context
        return self._prediction

    def observe(self, context: ActionContext, measured: MeasuredAction) -> None:
        """Learns nothing: the prediction is fixed."""

    def observe_running(self, context: ActionContext, peak_bytes: int) -> None:
        """Learns nothing: the prediction is fixed."""
