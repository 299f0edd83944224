"""The live view: `GET /live` (a page, no build step, no network) and `GET /live/state`.

The state is the runtime now (`observe`), the domain memory series of the last
`window_s` (sampled every `period_s` by a background task), the teardowns and rebuilds of
that window (the chart's marks) and the latest decisions with their reasons (from the
event log, through `EventLog.subscribe`). Times are the event
log's (`t`, seconds since the runtime started), so samples and decisions share an axis.

The sampler starts with the app's lifespan (`LiveView.lifespan`) or at the first request,
whichever comes first, and stops at `stop()` or when the runtime stops (its
`runtime_stop` event). Everything runs on the runtime's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from tenon.errors import HostError
from tenon.service.observe import observe

if TYPE_CHECKING:
    from tenon.runtime.controller import Runtime

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"
STATIC_FILES = {"live.js": "text/javascript", "live.css": "text/css"}

SAMPLER_TASK_NAME = "tenon-live-sampler"

DECISION_KINDS = frozenset({
    "admit", "gate", "start_held", "residency", "teardown", "rebuild", "rebuild_wait",
    "materialize", "oom_kill", "throttle", "workspace_full", "window",
})
"""Events that record a decision of the controller (or a kill it answers to)."""

MARK_KINDS = frozenset({"teardown", "rebuild"})
"""Decisions the chart marks on its time axis, over its whole window."""
MAX_MARKS = 5000


def describe(event: dict[str, Any]) -> dict[str, Any]:
    """One decision as the page lists it: when, what, about whom, and why."""
    kind = event["kind"]
    what, why = kind, event.get("reason")
    if kind == "admit":
        what = f"admit ({'heavy' if event.get('heavy') else 'light'})"
    elif kind == "gate":
        what = "thaw" if event.get("allowed") else "freeze"
    elif kind == "start_held":
        what, why = "hold start", "the gate has no room for its start yet"
    elif kind == "residency":
        what = f"residency: {event.get('decision')}"
        if event.get("eligibility"):
            why = f"{why}; restart check: {event['eligibility']}"
    elif kind == "teardown":
        what = f"teardown: {event.get('outcome')}"
        why = f"{event.get('why')}; {why}" if event.get("why") else why
    elif kind == "rebuild":
        what = "rebuild (predictive)" if event.get("predictive") else "rebuild"
        why = why or ("next action predicted soon" if event.get("predictive")
                      else "next action is ready")
    elif kind == "materialize":
        what, why = "materialize", "first action of a new sandbox"
    elif kind == "oom_kill":
        what, why = "OOM kill", f"{event.get('num_kills')} kill(s) in {event.get('sandbox_id')}"
    elif kind == "throttle":
        what = "throttle" if event.get("throttled") else "unthrottle"
    elif kind == "window":
        what, why = "window", f"budget now {event.get('budget_bytes')} B"
    return {"t": event["t"], "kind": kind, "decision": what, "reason": why or "",
            "agent_id": event.get("agent_id"), "action_id": event.get("action_id")}


class LiveView:
    """The live view of one runtime: its memory series, its recent decisions, its routes."""

    def __init__(self, runtime: Runtime, *, period_s: float = 1.0, window_s: float = 300.0,
                 max_decisions: int = 50) -> None:
        if period_s <= 0 or window_s < period_s or max_decisions < 1:
            raise ValueError(f"live view: need 0 < period_s <= window_s and max_decisions >= 1,"
                             f" got {period_s}, {window_s}, {max_decisions}")
        self._runtime = runtime
        self.period_s = period_s
        self.window_s = window_s
        self._series: deque[tuple[float, int]] = deque(maxlen=int(window_s / period_s) + 1)
        self._decisions: deque[dict[str, Any]] = deque(maxlen=max_decisions)
        self._marks: deque[tuple[float, str, str | None]] = deque(maxlen=MAX_MARKS)
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        self._unsubscribe = runtime.events.subscribe(self._on_event)

    # -- the sampler ------------------------------------------------------------------

    def start(self) -> None:
        """Start sampling (idempotent; never after `stop` or the runtime's stop)."""
        if self._task is None and not self._stopped:
            self._task = asyncio.get_running_loop().create_task(
                self._sample_every_period(), name=SAMPLER_TASK_NAME)

    async def stop(self) -> None:
        self._stopped = True
        self._unsubscribe()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    @contextlib.asynccontextmanager
    async def lifespan(self, app: object) -> AsyncIterator[None]:
        """A Starlette lifespan: sample while the app is up."""
        del app
        self.start()
        try:
            yield
        finally:
            await self.stop()

    def sample(self) -> None:
        """Add the domain's usage now to the series (the oldest beyond the window drop)."""
        try:
            usage = self._runtime.domain.reading().usage_bytes
        except (OSError, HostError) as exc:  # the domain went with the runtime
            logger.debug("live view sample failed: %r", exc)
            return
        self._series.append((self._runtime.events.elapsed(), usage))

    async def _sample_every_period(self) -> None:
        while True:
            self.sample()
            await self._runtime.clock.sleep(self.period_s)

    def _on_event(self, event: dict[str, Any]) -> None:
        kind = event["kind"]
        if kind in DECISION_KINDS:
            self._decisions.append(event)
            if kind in MARK_KINDS:
                self._marks.append((event["t"], kind, event.get("agent_id")))
        elif kind == "runtime_stop":
            self._stopped = True
            self._unsubscribe()
            if self._task is not None:
                self._task.cancel()
                self._task = None

    # -- what the page reads ----------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The JSON `/live/state` returns (see the module docstring)."""
        snap = observe(self._runtime)
        while self._marks and self._marks[0][0] < snap.t_s - self.window_s:
            self._marks.popleft()
        return {
            "t": snap.t_s,
            "budget_bytes": snap.budget_bytes,
            "usage_bytes": snap.usage_bytes,
            "pressure": snap.pressure,
            "pressure_reason": snap.pressure_reason,
            "headroom_bytes": snap.headroom_bytes,
            "regions": {"yellow_from_bytes": snap.yellow_from_bytes,
                        "red_from_bytes": snap.red_from_bytes},
            "window_s": self.window_s,
            "period_s": self.period_s,
            "series": [[t, usage] for t, usage in self._series],
            "marks": [{"t": t, "kind": kind, "agent_id": agent} for t, kind, agent in self._marks],
            "sandboxes": [{"id": box.agent_id, "state": box.state,
                           "memory_bytes": box.memory_bytes, "restartable": box.restartable,
                           "reason": box.reason} for box in snap.sandboxes],
            "counts": snap.count_by_state(),
            "queue": [asdict(q) for q in snap.queued],
            "held": [asdict(h) for h in snap.held],
            "admission": {"admitted_bytes": snap.admitted_bytes,
                          "window_bytes": snap.window_bytes},
            "restartable_share": snap.restartable_share,
            "lifecycle_in_flight": snap.num_lifecycle_in_flight,
            "decisions": [describe(e) for e in reversed(self._decisions)],
        }

    def routes(self, prefix: str = "/live") -> list[Route]:
        async def page(request: Request) -> Response:
            del request
            self.start()
            return FileResponse(STATIC_DIR / "live.html", media_type="text/html")

        async def state(request: Request) -> Response:
            del request
            self.start()
            try:
                body = self.state()
            except (OSError, HostError) as exc:  # the domain went with a closed runtime
                return JSONResponse({"error": f"the runtime cannot be read: {exc}"},
                                    status_code=503)
            return JSONResponse(body, headers={"Cache-Control": "no-store"})

        async def static(request: Request) -> Response:
            name = request.path_params["name"]
            media_type = STATIC_FILES.get(name)
            if media_type is None:
                return Response("not found", status_code=404, media_type="text/plain")
            return FileResponse(STATIC_DIR / name, media_type=media_type)

        return [
            Route(prefix, page, methods=["GET"], name="live"),
            Route(f"{prefix}/state", state, methods=["GET"], name="live_state"),
            Route(f"{prefix}/static/{{name}}", static, methods=["GET"], name="live_static"),
        ]


def live_routes(runtime: Runtime) -> list[Route]:
    """`GET /live`, `GET /live/state` and the page's static files for `runtime`; the sampler
    starts at the first request and stops with the runtime. Use `LiveView` directly to tie
    it to an app's lifespan instead."""
    return LiveView(runtime).routes()
