"""`/metrics`: the runtime in Prometheus' text format, one private registry per app.

Names follow cAdvisor (`container_memory_usage_bytes`, `container_spec_memory_limit_bytes`,
`container_oom_events_total`) and kubernetes-sigs/agent-sandbox (`agent_sandboxes` by
state, lifecycle counters with a latency histogram beside them), prefixed `tenon_`, units
in the name, durations in seconds:

  gauges, read at scrape time (`RuntimeCollector`)
    tenon_domain_memory_usage_bytes, tenon_domain_memory_limit_bytes,
    tenon_domain_memory_max_usage_bytes, tenon_domain_memory_headroom_bytes,
    tenon_domain_pressure_region_start_bytes{region}, tenon_pressure_state{state},
    tenon_sandboxes{state}, tenon_sandbox_memory_usage_bytes{sandbox},
    tenon_admission_queue_depth, tenon_admission_admitted_bytes,
    tenon_admission_window_bytes, tenon_gate_held_actions{kind},
    tenon_lifecycle_operations_in_flight, tenon_restartable_boundary_ratio
  counters read at scrape time
    tenon_domain_oom_events_total, tenon_boundaries_checked_total,
    tenon_boundaries_restartable_total
  fed from the event log (`EventMetrics`, through `EventLog.subscribe`)
    tenon_actions_total{outcome}, tenon_oom_kills_total,
    tenon_teardowns_total{outcome}, tenon_teardown_duration_seconds,
    tenon_rebuilds_total{trigger}, tenon_rebuild_duration_seconds,
    tenon_materializations_total, tenon_admission_wait_seconds,
    tenon_gate_decisions_total{decision}

Event-fed series count from the app's creation (Prometheus treats a restart as a counter
reset). Every callback runs on the runtime's event loop (prometheus-client's ASGI app
collects inline), so the controller's state is read between awaits, never torn.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, make_asgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tenon.errors import HostError
from tenon.runtime.results import Outcome
from tenon.service.observe import PRESSURE_STATES, observe

if TYPE_CHECKING:
    from tenon.runtime.controller import Runtime

logger = logging.getLogger(__name__)

ASGIApp = Callable[..., Any]

LIFECYCLE_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ADMISSION_WAIT_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                            120.0, 300.0)
TEARDOWN_OUTCOMES = ("torn_down", "kept_resident", "destroy_pending")
MAX_TRACKED_READY = 100_000
"""Ready actions remembered for their admission wait; past this the oldest are dropped
(an action cancelled while queued is never admitted and would otherwise stay)."""


class RuntimeCollector(Collector):
    """The gauges of one runtime, read from `observe(runtime)` at every scrape."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime

    def collect(self) -> Iterable[Metric]:
        try:
            snap = observe(self._runtime)
        except (OSError, HostError) as exc:  # the domain's cgroup went with a closed runtime
            logger.warning("metrics: the runtime cannot be read: %r", exc)
            return
        yield _gauge("tenon_domain_memory_usage_bytes",
                     "Memory the workload domain's cgroup uses (all sandboxes).",
                     snap.usage_bytes)
        if snap.budget_bytes is not None:
            yield _gauge("tenon_domain_memory_limit_bytes",
                         "The workload domain's memory budget (its cgroup limit).",
                         snap.budget_bytes)
        yield _gauge("tenon_domain_memory_max_usage_bytes",
                     "The domain cgroup's peak usage as the kernel records it.",
                     snap.peak_bytes)
        yield _gauge("tenon_domain_memory_headroom_bytes",
                     "Usable headroom: the budget less usage and the safety margin.",
                     snap.headroom_bytes)
        lines = GaugeMetricFamily(
            "tenon_domain_pressure_region_start_bytes",
            "Domain usage at which pressure turns yellow or red by headroom alone.",
            labels=["region"])
        for region, start in (("yellow", snap.yellow_from_bytes), ("red", snap.red_from_bytes)):
            if start is not None:
                lines.add_metric([region], start)
        yield lines
        pressure = GaugeMetricFamily("tenon_pressure_state",
                                     "1 for the domain's current pressure state, else 0.",
                                     labels=["state"])
        for state in PRESSURE_STATES:
            pressure.add_metric([state], 1.0 if state == snap.pressure else 0.0)
        yield pressure
        yield _counter("tenon_domain_oom_events_total",
                       "OOM kills the kernel counted in the domain's cgroup.",
                       snap.num_oom_kills)
        boxes = GaugeMetricFamily("tenon_sandboxes",
                                  "Sandboxes (logical agents) by residency state.",
                                  labels=["state"])
        for state, count in snap.count_by_state().items():
            boxes.add_metric([state], count)
        yield boxes
        memory = GaugeMetricFamily("tenon_sandbox_memory_usage_bytes",
                                   "Memory each resident sandbox's cgroup uses.",
                                   labels=["sandbox"])
        for box in snap.sandboxes:
            if box.memory_bytes is not None:
                memory.add_metric([box.agent_id], box.memory_bytes)
        yield memory
        yield _gauge("tenon_admission_queue_depth",
                     "Actions ready and waiting for admission.", len(snap.queued))
        if snap.admitted_bytes is not None and snap.window_bytes is not None:
            yield _gauge("tenon_admission_admitted_bytes",
                         "Charges of the admitted actions (the water level).",
                         snap.admitted_bytes)
            yield _gauge("tenon_admission_window_bytes",
                         "The logical window admission fills.", snap.window_bytes)
        held = GaugeMetricFamily("tenon_gate_held_actions",
                                 "Actions the gate holds: before their start or frozen.",
                                 labels=["kind"])
        for kind in ("start", "frozen"):
            held.add_metric([kind], sum(h.kind == kind for h in snap.held))
        yield held
        yield _gauge("tenon_lifecycle_operations_in_flight",
                     "Teardowns and rebuilds running now.", snap.num_lifecycle_in_flight)
        if snap.restartable_share is not None:
            yield _gauge("tenon_restartable_boundary_ratio",
                         "Share of action boundaries the restart-safe check passed.",
                         snap.restartable_share)
        yield _counter("tenon_boundaries_checked_total",
                       "Action boundaries the restart-safe check judged.", snap.num_boundaries)
        yield _counter("tenon_boundaries_restartable_total",
                       "Action boundaries judged restartable.",
                       snap.num_restartable_boundaries)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


class EventMetrics:
    """Counters and histograms fed by the runtime's events (`on_event`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.actions = Counter("tenon_actions_total", "Commands (actions) run, by outcome.",
                               ["outcome"], registry=registry)
        for outcome in Outcome:
            self.actions.labels(outcome.value)
        self.oom_kills = Counter("tenon_oom_kills_total",
                                 "OOM kills during actions (each fails its attempt).",
                                 registry=registry)
        self.teardowns = Counter("tenon_teardowns_total",
                                 "Teardowns of idle sandboxes, by outcome.", ["outcome"],
                                 registry=registry)
        for outcome_name in TEARDOWN_OUTCOMES:
            self.teardowns.labels(outcome_name)
        self.teardown_s = Histogram("tenon_teardown_duration_seconds",
                                    "Time to capture and destroy an idle sandbox.",
                                    buckets=LIFECYCLE_BUCKETS_S, registry=registry)
        self.rebuilds = Counter("tenon_rebuilds_total",
                                "Rebuilds of torn-down sandboxes, by trigger.", ["trigger"],
                                registry=registry)
        for trigger in ("on_demand", "predictive"):
            self.rebuilds.labels(trigger)
        self.rebuild_s = Histogram("tenon_rebuild_duration_seconds",
                                   "Time to rematerialize a sandbox from its record.",
                                   buckets=LIFECYCLE_BUCKETS_S, registry=registry)
        self.materializations = Counter("tenon_materializations_total",
                                        "First sandboxes made for new agents.",
                                        registry=registry)
        self.admission_wait_s = Histogram("tenon_admission_wait_seconds",
                                          "Time from an action being ready to its admission.",
                                          buckets=ADMISSION_WAIT_BUCKETS_S, registry=registry)
        self.gate = Counter("tenon_gate_decisions_total",
                            "The gate's freezes and thaws (and holds before a start).",
                            ["decision"], registry=registry)
        for decision in ("freeze", "thaw", "hold_start"):
            self.gate.labels(decision)
        self._ready_t: OrderedDict[str, float] = OrderedDict()

    def on_event(self, event: dict[str, Any]) -> None:
        kind = event["kind"]
        if kind == "action_ready":
            self._ready_t[event["action_id"]] = event["t"]
            if len(self._ready_t) > MAX_TRACKED_READY:
                self._ready_t.popitem(last=False)
        elif kind == "admit":
            ready = self._ready_t.pop(event["action_id"], None)
            if ready is not None:
                self.admission_wait_s.observe(max(event["t"] - ready, 0.0))
        elif kind in ("action_start", "action_done"):
            self._ready_t.pop(event["action_id"], None)  # no admission: nothing to observe
            if kind == "action_done":
                self.actions.labels(event["outcome"]).inc()
        elif kind == "oom_kill":
            self.oom_kills.inc(max(int(event.get("num_kills") or 1), 1))
        elif kind == "teardown":
            self.teardowns.labels(event["outcome"]).inc()
            self.teardown_s.observe(event["duration_s"])
        elif kind == "rebuild":
            self.rebuilds.labels("predictive" if event.get("predictive") else "on_demand").inc()
            self.rebuild_s.observe(event["duration_s"])
        elif kind == "materialize":
            self.materializations.inc()
        elif kind == "gate":
            self.gate.labels("thaw" if event["allowed"] else "freeze").inc()
        elif kind == "start_held":
            self.gate.labels("hold_start").inc()


def metrics_registry(runtime: Runtime) -> CollectorRegistry:
    """A fresh registry with the runtime's gauges and its event-fed series (subscribed to
    its event log for the runtime's lifetime)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RuntimeCollector(runtime))
    runtime.events.subscribe(EventMetrics(registry).on_event)
    return registry


def metrics_app(runtime: Runtime) -> ASGIApp:
    """An ASGI app serving the runtime's metrics at any path (for `Mount`). Its registry is
    its own: two apps (or two runtimes in one process) never share a series."""
    app: ASGIApp = make_asgi_app(metrics_registry(runtime))
    return app


def metrics_route(runtime: Runtime, path: str = "/metrics") -> Route:
    """`GET /metrics` as a Starlette route, with its own registry (as `metrics_app`). The
    format follows the scraper's Accept header (OpenMetrics for Prometheus)."""
    registry = metrics_registry(runtime)

    async def endpoint(request: Request) -> Response:
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encoder(registry), headers={"Content-Type": content_type})

    return Route(path, endpoint, methods=["GET"], name="metrics")
