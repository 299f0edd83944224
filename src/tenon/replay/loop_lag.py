"""How late an event loop runs: a probe task's lag, sampled while a block runs, and the
nearest-rank percentiles the bench summaries report."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence

__all__ = ["LoopLag", "percentile", "rounded_ms"]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank q-th percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def rounded_ms(value_s: float | None) -> float | None:
    """Seconds as milliseconds to the microsecond; None stays None."""
    return None if value_s is None else round(value_s * 1000, 3)


class LoopLag:
    """How late the event loop runs a task that sleeps `period_s`, sampled for as long as
    the block runs: a saturated loop delays every reply the server sends as much."""

    def __init__(self, period_s: float = 0.05) -> None:
        self.period_s = period_s
        self.lags_s: list[float] = []

    async def _probe(self) -> None:
        while True:
            began = time.monotonic()
            await asyncio.sleep(self.period_s)
            self.lags_s.append(max(time.monotonic() - began - self.period_s, 0.0))

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[LoopLag]:
        task = asyncio.ensure_future(self._probe())
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def summary(self) -> dict[str, float | None]:
        return {"loop_lag_p50_ms": rounded_ms(percentile(self.lags_s, 50)),
                "loop_lag_p99_ms": rounded_ms(percentile(self.lags_s, 99))}
