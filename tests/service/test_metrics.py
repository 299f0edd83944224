"""`/metrics` scraped by a real Prometheus while real sandboxes run, torn down and rebuilt.

The runtime runs on the process backend; the metrics route is served by uvicorn on the
test's event loop (the collector reads the controller's state there); Debian's
`prometheus` scrapes it every second and the assertions are PromQL through its HTTP API.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import socket
import subprocess
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from prometheus_client import CollectorRegistry, generate_latest
from starlette.applications import Starlette

from tenon.policy.config import PolicyConfig
from tenon.predict.static import FixedPredictor
from tenon.runtime.open import open_runtime
from tenon.runtime.results import Outcome
from tenon.sandbox import launcher
from tenon.service.metrics import EventMetrics, metrics_registry, metrics_route

STATE_DIR = Path("/var/lib/tenon")
MIB = 1024 * 1024
BUDGET = 512 * MIB
PROMETHEUS = "/usr/bin/prometheus"
WAIT_S = 60.0  # how long Prometheus may take to see a value (scrapes every second)


def _need_real_sandboxes_and_prometheus() -> None:
    if os.geteuid() != 0:
        pytest.skip("real sandboxes need root")
    if problems := launcher.check():
        pytest.skip(problems[0])
    if not (STATE_DIR / "images").exists():
        pytest.skip("base image missing: run `tenon image build`")
    if not Path(PROMETHEUS).exists():  # in CI (CI=true) this skip is a failure (conftest)
        pytest.skip("prometheus is missing (apt-get install prometheus)")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.asynccontextmanager
async def _served(app: Starlette) -> AsyncIterator[str]:
    """`app` on uvicorn on this event loop, at 127.0.0.1 on a free port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            assert not task.done(), task.exception()
            await asyncio.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()


@contextlib.contextmanager
def _prometheus(target: str, tmp_path: Path) -> Iterator[str]:
    """A Prometheus scraping `target` (host:port) every second; its API URL. Killed by pid."""
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        "scrape_configs:\n  - job_name: tenon\n    metrics_path: /metrics\n"
        f"    static_configs:\n      - targets: ['{target}']\n")
    api = f"127.0.0.1:{_free_port()}"
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address={api}"],
        stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        yield f"http://{api}"
    finally:
        proc.kill()  # by its pid: nothing else of its name is touched
        proc.wait(timeout=30)
        log.close()


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


async def _query(api: str, promql: str) -> float | None:
    """The single value of an instant query, None when it has no sample (yet)."""
    url = f"{api}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    try:
        body = await asyncio.to_thread(_get, url)
    except OSError:  # not listening yet
        return None
    result = body["data"]["result"]
    if not result:
        return None
    assert len(result) == 1, result
    return float(result[0]["value"][1])


async def _until(api: str, promql: str, check: Callable[[float], bool]) -> float:
    """Poll `promql` until its value passes `check`; fails naming the last value seen."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    value = None
    while loop.time() < deadline:
        value = await _query(api, promql)
        if value is not None and check(value):
            return value
        await asyncio.sleep(0.5)
    pytest.fail(f"{promql} = {value}: never passed its check")


@pytest.mark.sandbox
@pytest.mark.cgroups
@pytest.mark.slow
async def test_prometheus_scrapes_domain_sandboxes_and_lifecycle(tmp_path: Path) -> None:
    _need_real_sandboxes_and_prometheus()
    # teardown and rebuild cost nothing: every idle boundary after a model wait tears down
    config = PolicyConfig(teardown_cost_s=0.0, rebuild_cost_s=0.0)
    async with open_runtime(budget_bytes=BUDGET, state_dir=STATE_DIR, run_dir=tmp_path / "run",
                            policy="tenon", config=config, workspace_limits=None,
                            predictor=FixedPredictor(8 * MIB, 16 * MIB)) as rt:
        domain = rt.domain.name
        app = Starlette(routes=[metrics_route(rt)])
        registry = metrics_registry(rt)  # a second one, read after the runtime closed
        async with _served(app) as url:
            with _prometheus(url.removeprefix("http://"), tmp_path) as api:
                cycler = await rt.create_agent(agent_id="cycler")
                failing = await rt.create_agent(agent_id="failing")
                outcomes = []
                for _ in range(3):
                    outcomes.append((await cycler.run("echo hi", timeout=60)).outcome)
                    await asyncio.sleep(0.3)  # the model wait the teardown amortizes
                outcomes.append((await failing.run("echo hi", timeout=60)).outcome)
                outcomes.append((await failing.run("exit 3", timeout=60)).outcome)
                assert outcomes == [Outcome.OK] * 4 + [Outcome.ERROR]

                assert await _until(api, "tenon_domain_memory_limit_bytes",
                                    lambda v: v == BUDGET) == BUDGET
                await _until(api, "tenon_domain_memory_usage_bytes", lambda v: 0 < v <= BUDGET)
                await _until(api, "sum(tenon_sandboxes)", lambda v: v == 2)
                await _until(api, 'sum(tenon_sandboxes{state=~"resident|resident_only|busy|'
                                  'torn_down|frozen"})', lambda v: v == 2)
                await _until(api, 'tenon_teardowns_total{outcome="torn_down"}',
                             lambda v: v >= 1)
                await _until(api, "tenon_teardown_duration_seconds_count", lambda v: v >= 1)
                await _until(api, "sum(tenon_rebuilds_total)", lambda v: v >= 1)
                await _until(api, "tenon_rebuild_duration_seconds_count", lambda v: v >= 1)
                await _until(api, 'tenon_actions_total{outcome="ok"}', lambda v: v == 4)
                await _until(api, 'tenon_actions_total{outcome="error"}', lambda v: v == 1)
                await _until(api, 'tenon_actions_total{outcome="oom_killed"}', lambda v: v == 0)
                await _until(api, "tenon_materializations_total", lambda v: v == 2)
                await _until(api, "tenon_admission_wait_seconds_count", lambda v: v == 5)
                await _until(api, "tenon_admission_queue_depth", lambda v: v == 0)
                await _until(api, "tenon_oom_kills_total", lambda v: v == 0)
                await _until(api, "sum(tenon_pressure_state)", lambda v: v == 1)
                await _until(api, 'tenon_pressure_state{state="green"}', lambda v: v == 1)
                await _until(api, "tenon_restartable_boundary_ratio", lambda v: v == 1.0)
                await _until(api, "tenon_boundaries_checked_total", lambda v: v == 5)
                red = await _until(api, 'tenon_domain_pressure_region_start_bytes'
                                        '{region="red"}', lambda v: 0 < v < BUDGET)
                await _until(api, 'tenon_domain_pressure_region_start_bytes{region="yellow"}',
                             lambda v: 0 < v < red)
                up = await _query(api, 'up{job="tenon"}')
                assert up == 1
                await cycler.close()
                await failing.close()
    assert not glob.glob(f"/sys/fs/cgroup/*/{domain}")  # nothing left behind
    # a scrape after the runtime closed (its domain is gone): the event-fed series only
    text = generate_latest(registry).decode()
    assert "tenon_domain_memory_usage_bytes" not in text
    assert 'tenon_actions_total{outcome="ok"} 4.0' in text


def test_event_metrics_count_what_the_events_say() -> None:
    """The event-fed series, from a scripted event stream (no runtime needed)."""
    registry = CollectorRegistry()
    metrics = EventMetrics(registry)
    for event in [
        {"t": 1.0, "kind": "action_ready", "action_id": "a1"},
        {"t": 3.5, "kind": "admit", "action_id": "a1"},
        {"t": 4.0, "kind": "action_done", "action_id": "a1", "outcome": "oom_killed"},
        {"t": 4.0, "kind": "oom_kill", "action_id": "a1", "num_kills": 2},
        {"t": 5.0, "kind": "teardown", "outcome": "kept_resident", "duration_s": 0.2},
        {"t": 6.0, "kind": "rebuild", "predictive": True, "duration_s": 1.5},
        {"t": 6.5, "kind": "gate", "allowed": False},
        {"t": 7.0, "kind": "action_ready", "action_id": "a2"},
        {"t": 7.5, "kind": "action_start", "action_id": "a2"},  # no admission: no wait
    ]:
        metrics.on_event(event)
    text = generate_latest(registry).decode()
    assert 'tenon_actions_total{outcome="oom_killed"} 1.0' in text
    assert 'tenon_actions_total{outcome="ok"} 0.0' in text
    assert "tenon_oom_kills_total 2.0" in text
    assert 'tenon_teardowns_total{outcome="kept_resident"} 1.0' in text
    assert 'tenon_rebuilds_total{trigger="predictive"} 1.0' in text
    assert 'tenon_rebuild_duration_seconds_bucket{le="2.5"} 1.0' in text
    assert 'tenon_rebuild_duration_seconds_bucket{le="1.0"} 0.0' in text
    assert "tenon_admission_wait_seconds_count 1.0" in text
    assert "tenon_admission_wait_seconds_sum 2.5" in text
    assert 'tenon_gate_decisions_total{decision="freeze"} 1.0' in text


def test_subscribers_see_every_event_and_a_failing_one_stops_nothing() -> None:
    from tenon.clock import FakeClock
    from tenon.runtime.events import EventLog

    log = EventLog(None, FakeClock().now)
    seen: list[str] = []

    def broken(event: dict[str, Any]) -> None:
        raise RuntimeError(f"observer bug on {event['kind']}")

    log.subscribe(broken)
    unsubscribe = log.subscribe(lambda event: seen.append(event["kind"]))
    log.emit("admit", action_id="a1")
    unsubscribe()
    log.emit("teardown", agent_id="x")
    assert seen == ["admit"]
    assert [e["kind"] for e in log.events or []] == ["admit", "teardown"]
