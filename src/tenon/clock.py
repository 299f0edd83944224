"""Injected time: the runtime and loops read time only through a Clock."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from collections.abc import Awaitable
from typing import Protocol, TypeVar

T = TypeVar("T")
_IDLE_TURNS = 20  # event-loop turns with no progress before the clock jumps


class Clock(Protocol):
    """Monotonic seconds and an awaitable sleep."""

    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """Real monotonic time."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(seconds, 0.0))


class FakeClock:
    """A clock that only moves when told (or, with autojump, when every task sleeps).

    `sleep()` parks the caller until `advance()` moves time past its deadline.
    With `autojump=True`, `run_until_idle()`-style driving is done by `advance_to_next()`.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._seq), fut))
        await fut

    def advance(self, seconds: float) -> None:
        """Move time forward and wake every sleeper whose deadline has passed."""
        if seconds < 0:
            raise ValueError(f"cannot move a clock backwards by {seconds}")
        self._now += seconds
        while self._sleepers and self._sleepers[0][0] <= self._now:
            _, _, fut = heapq.heappop(self._sleepers)
            if not fut.done():
                fut.set_result(None)

    def next_deadline(self) -> float | None:
        """The earliest pending sleeper's deadline, if any."""
        while self._sleepers and self._sleepers[0][2].done():
            heapq.heappop(self._sleepers)
        return self._sleepers[0][0] if self._sleepers else None

    def advance_to_next(self) -> bool:
        """Jump to the earliest deadline; False when nobody sleeps."""
        deadline = self.next_deadline()
        if deadline is None:
            return False
        self.advance(max(deadline - self._now, 0.0))
        return True


async def run_simulated(main: Awaitable[T], clock: FakeClock, *, max_time_s: float = 3600.0) -> T:
    """Run `main` on `clock`, jumping time to the next sleeper whenever every task is waiting.

    The event loop is given a few turns between jumps so that everything runnable at the
    current instant runs first; work must not wait on real threads (pass inline runners),
    or it would see time jump under it. Raises TimeoutError past `max_time_s` of clock time.
    """
    task = asyncio.ensure_future(main)
    start = clock.now()
    while not task.done():
        for _ in range(_IDLE_TURNS):
            await asyncio.sleep(0)
            if task.done():
                break
        else:
            if not clock.advance_to_next():
                await asyncio.sleep(0.001)  # nobody sleeps on the clock: real I/O is pending
            if clock.now() - start > max_time_s:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise TimeoutError(f"simulation passed {max_time_s} s of clock time")
    return task.result()
