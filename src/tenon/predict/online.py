"""The `online` predictor: static per-class figures, raised by what was measured so far.

For an action of class C, the predicted peak is the largest of: the static figure for C, the
largest peak C reached earlier in the same workflow, and the largest peak C reached in any
peer workflow that completed an action before. Peers are the workflows on the same task when
the task is known (`ActionContext.peer_key`), else the same family (e.g. a repository): one
repository's tasks differ (a test suite that needs a gigabyte in one task would make every
test run of its other tasks "heavy", queued for memory it never uses). The average is raised
the same way with the mean of those measurements. It learns during a run (`observe`
after each action, and `observe_running` when a running action crosses the heavy line) from
nothing but what other actions measured, so it never sees the action it predicts: a test
suite that needed a gigabyte once is expected to need it again.
"""

from __future__ import annotations

import logging
from collections import defaultdict

from tenon.predict.base import ActionContext, MeasuredAction, Prediction, Predictor

logger = logging.getLogger(__name__)


class OnlinePredictor:
    """`base` raised by what the run measured; `base` is the static predictor by default,
    or any other (the bench's `online-forest` puts the cross-fitted forest under it)."""

    def __init__(self, base: Predictor, *, heavy_peak_bytes: int | None = None,
                 name: str = "online") -> None:
        self._base = base
        self.name = name
        if heavy_peak_bytes is None:
            heavy_peak_bytes = getattr(base, "heavy_peak_bytes", 1024 * 1024 * 1024)
        self._heavy_peak_bytes = heavy_peak_bytes
        self._peer_peak: dict[tuple[str, str], int] = {}
        self._peer_avgs: dict[tuple[str, str], list[int]] = defaultdict(list)

    def predict(self, context: ActionContext) -> Prediction:
        base = self._base.predict(context)
        klass = context.action_class
        own = [m for m in context.history if m.action_class == klass]
        key = (context.peer_key, klass)
        peaks = [base.peak_bytes, *(m.peak_bytes for m in own)]
        avgs = [base.avg_bytes]
        if key in self._peer_peak:
            peaks.append(self._peer_peak[key])
            peer_avgs = self._peer_avgs.get(key)
            if peer_avgs:  # none yet when only a running peak was heard
                avgs.append(sum(peer_avgs) // len(peer_avgs))
        if own:
            avgs.append(sum(m.avg_bytes for m in own) // len(own))
        peak = max(peaks)
        avg = min(max(avgs), peak)
        return Prediction(avg, peak, heavy_risk=base.heavy_risk or peak > self._heavy_peak_bytes)

    def observe_running(self, context: ActionContext, peak_bytes: int) -> None:
        """An action still running has reached `peak_bytes` (the runtime reports crossing
        the heavy line): peers expect that peak from now on, not from when it ends."""
        key = (context.peer_key, context.action_class)
        self._peer_peak[key] = max(self._peer_peak.get(key, 0), peak_bytes)

    def observe(self, context: ActionContext, measured: MeasuredAction) -> None:
        key = (context.peer_key, measured.action_class)
        self._peer_peak[key] = max(self._peer_peak.get(key, 0), measured.peak_bytes)
        self._peer_avgs[key].append(measured.avg_bytes)
