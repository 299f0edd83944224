"""The structured event log: one JSON object per line, every decision and observation.

Each event has `t` (the runtime clock, seconds since the runtime started), `kind`, and
kind-specific fields. Lines are written whole and flushed, so a crash loses at most the
event being written and a reader (`tenon report`) can follow a live run. A full disk does
not stop the controller: the first write error is logged, counted and later events are
dropped (the count is in `num_dropped`). Subscribers (`subscribe`) are handed every event
as it is emitted; one that raises is logged and never stops the emit.
"""

from __future__ import annotations

import gzip
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

logger = logging.getLogger(__name__)


class EventLog:
    """Append-only JSON-lines log; `path=None` keeps events in memory only (`events`)."""

    def __init__(
        self, path: Path | None, now: Callable[[], float], *, keep_in_memory: bool = False
    ) -> None:
        self.path = path
        self._now = now
        self._t0 = now()
        self._file: IO[str] | None = None
        self.num_dropped = 0
        self.events: list[dict[str, Any]] | None = [] if keep_in_memory or path is None else None
        self._subscribers: list[Callable[[dict[str, Any]], None]] = []
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", encoding="utf-8")

    def elapsed(self) -> float:
        """The `t` an event emitted now would carry (seconds since the log started)."""
        return round(self._now() - self._t0, 4)

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"t": self.elapsed(), "kind": kind, **fields}
        if self.events is not None:
            self.events.append(event)
        if self._file is not None:
            try:
                self._file.write(json.dumps(event, separators=(",", ":"), default=str) + "\n")
                self._file.flush()
            except OSError as exc:
                if self.num_dropped == 0:
                    logger.error("event log %s: write failed, dropping events: %s", self.path, exc)
                self.num_dropped += 1
        for callback in tuple(self._subscribers):
            try:
                callback(event)
            except Exception:  # an observer's bug must not reach the controller
                logger.exception("event subscriber %r failed on %s", callback, kind)
        return event

    def subscribe(self, callback: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
        """Hand every later event to `callback` (synchronously, in the emitting task; it
        must be cheap and must not mutate the event). Returns the call that unsubscribes."""
        self._subscribers.append(callback)

        def unsubscribe() -> None:
            if callback in self._subscribers:
                self._subscribers.remove(callback)

        return unsubscribe

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        """In-memory events of one kind (tests, summaries)."""
        return [e for e in self.events or [] if e["kind"] == kind]

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError as exc:
                logger.error("event log %s: close failed: %s", self.path, exc)
            self._file = None


def read_events(path: Path) -> list[dict[str, Any]]:
    """Load an event log (gzipped if its name ends in .gz, as recorded results keep them); a
    torn last line (a crash mid-write) is skipped, any other bad line raises ValueError naming
    the line."""
    events = []
    if path.suffix == ".gz":
        lines = gzip.decompress(path.read_bytes()).decode("utf-8").splitlines()
    else:
        lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number == len(lines):
                logger.warning("%s:%d: torn last line skipped", path, number)
                continue
            raise ValueError(f"{path}:{number}: not a JSON event: {exc}") from None
    return events
