"""How much work a workflow has left: what its peers and finished workflows showed.

Admission serves workflows in rank order and reclaim tears down the last-ranked first. A
workflow's rank is its start time moved earlier by the work expected to be still ahead of
it, so a workflow that will run long goes before one about to finish (least slack first).
Rank by start time alone (oldest first) lets a young attempt at a long task starve behind
every older workflow and then run its long remainder by itself at the end: on the real 8x
replay one such attempt waited 98 s for a 30 MiB action and finished last, at 227 s, with
169 s of its life spent queued.

Nothing here knows the future. A step's cost is what the runtime measured (the model wait
before the step plus the step's run time). The work expected after step `k` is:

- from a peer (another attempt at the same task) that got past step `k`: what it spent
  after its own step `k`, plus, if it has not finished, the typical residual at the step it
  has reached; the largest over such peers;
- with no such peer: the typical residual at step `k`, the median of the work that finished
  workflows of any task still did after their step `k`, among those that had one (0 while
  none has).

Without the residual, the leading attempt of every task had nothing known ahead of it and
ranked behind all of its followers: it stalled, and with it what the followers could learn.
"""

from __future__ import annotations

import logging
import statistics
from collections import OrderedDict, deque

__all__ = ["PeerProgress"]

logger = logging.getLogger(__name__)

MAX_PEERS_PER_TASK = 32
"""Attempts remembered per task (the most recently active ones): a service runs for weeks."""
MAX_FINISHED = 256
"""Finished workflows the residual is taken over (the most recent ones)."""


class PeerProgress:
    """Cumulative step costs per attempt, grouped by task; `remaining_s` reads them."""

    def __init__(self, max_peers_per_task: int = MAX_PEERS_PER_TASK,
                 max_finished: int = MAX_FINISHED) -> None:
        if max_peers_per_task < 1 or max_finished < 1:
            raise ValueError("max_peers_per_task and max_finished must be at least 1, got "
                             f"{max_peers_per_task} and {max_finished}")
        self._max_peers = max_peers_per_task
        # cum[i] is the cost of steps 0..i-1; one list per attempt, shared by both maps
        self._live: dict[str, list[float]] = {}
        self._tasks: dict[str, OrderedDict[str, list[float]]] = {}
        self._done: set[str] = set()  # attempts that finished their workflow
        self._finished: deque[list[float]] = deque(maxlen=max_finished)

    def observe(self, task: str | None, attempt: str, step_index: int, cost_s: float) -> None:
        """Attempt `attempt` (at `task`, None if unknown) completed step `step_index`, which
        cost `cost_s`. Steps arrive in order; a repeated or skipped index raises."""
        if cost_s < 0:
            raise ValueError(f"step cost must not be negative, got {cost_s}")
        cum = self._live.get(attempt)
        if cum is None:  # a new attempt (an id used again starts over)
            self._done.discard(attempt)
            cum = self._live[attempt] = [0.0]
            if task is not None:
                peers = self._tasks.setdefault(task, OrderedDict())
                peers[attempt] = cum
                while len(peers) > self._max_peers:
                    gone, _ = peers.popitem(last=False)
                    self._done.discard(gone)
        if step_index != len(cum) - 1:
            raise ValueError(f"{attempt}: step {step_index} observed after {len(cum) - 1} steps")
        cum.append(cum[-1] + cost_s)
        if task is not None:
            self._tasks[task].move_to_end(attempt)

    def finish(self, attempt: str, *, complete: bool) -> None:
        """The attempt's workflow ended; `complete` if it ran to its end (a failed attempt
        was cut short: it says nothing about how long workflows run)."""
        cum = self._live.pop(attempt, None)
        if cum is None:
            return
        if complete:
            self._done.add(attempt)
            self._finished.append(cum)

    def residual_s(self, step_index: int) -> float:
        """The median work finished workflows did after their step `step_index`, among those
        that had one (0 if none)."""
        rest = [cum[-1] - cum[step_index] for cum in self._finished if len(cum) - 1 > step_index]
        return statistics.median(rest) if rest else 0.0

    def remaining_s(self, task: str | None, attempt: str, step_index: int) -> float:
        """Seconds of work expected from step `step_index` on (see the module docstring)."""
        best: float | None = None
        for peer, cum in (self._tasks.get(task, {}) if task is not None else {}).items():
            reached = len(cum) - 1
            if peer == attempt or reached <= step_index:
                continue
            ahead = cum[-1] - cum[step_index]
            if peer not in self._done:
                ahead += self.residual_s(reached)
            best = ahead if best is None else max(best, ahead)
        return self.residual_s(step_index) if best is None else best
