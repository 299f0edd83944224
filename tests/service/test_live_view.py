"""The live view in a real headless Chromium while real sandboxes run, tear down, rebuild.

The runtime runs on the process backend with a few agents running the load program; the
live routes are served by uvicorn on the test's event loop (with the view's lifespan, so
the sampler runs from the start); Chromium loads `/live`, runs its script (virtual time:
a few polls of `/live/state`) and the test reads the rendered DOM.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import urllib.request
from collections.abc import AsyncIterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette

from tenon.policy.config import PolicyConfig
from tenon.predict.static import FixedPredictor
from tenon.replay.loadprog import SCRATCH_DIR, load_command
from tenon.runtime.controller import Agent
from tenon.runtime.open import open_runtime
from tenon.sandbox import launcher
from tenon.service.live import DECISION_KINDS, SAMPLER_TASK_NAME, LiveView, describe
from tenon.service.observe import RESIDENCY_STATES

STATE_DIR = Path("/var/lib/tenon")
MIB = 1024 * 1024
BUDGET = 768 * MIB
AVG, PEAK, RESIDENT = 24 * MIB, 48 * MIB, 8 * MIB
AGENTS = ("agent-a", "agent-b", "agent-c")
CHROMIUM_TIMEOUT_S = 120.0


def _chromium() -> str | None:
    return shutil.which("chromium-headless-shell") or shutil.which("chromium")


def _need_real_sandboxes_and_chromium() -> str:
    if os.geteuid() != 0:
        pytest.skip("real sandboxes need root")
    if problems := launcher.check():
        pytest.skip(problems[0])
    if not (STATE_DIR / "images").exists():
        pytest.skip("base image missing: run `tenon image build`")
    chromium = _chromium()
    if chromium is None:  # in CI (CI=true) this skip is a failure (conftest)
        pytest.skip("chromium is missing (apt-get install chromium-headless-shell)")
    return chromium


@contextlib.asynccontextmanager
async def _served(app: Starlette) -> AsyncIterator[str]:
    """`app` (with its lifespan) on uvicorn on this event loop, at 127.0.0.1:free port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
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


async def _chromium_run(chromium: str, profile: Path, *args: str) -> str:
    """Run headless Chromium to its end; its stdout. Killed (its process group, which it
    leads) if it outlives the timeout."""
    proc = await asyncio.create_subprocess_exec(
        chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
        "--disable-background-networking", "--disable-dev-shm-usage", "--hide-scrollbars",
        f"--user-data-dir={profile}", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), CHROMIUM_TIMEOUT_S)
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    return out.decode()


class _Dom(HTMLParser):
    """Every element's tag and attributes, with the ids of the elements around it."""

    VOID = frozenset({"meta", "link", "br", "img", "input", "hr", "source", "wbr"})

    def __init__(self) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str], tuple[str, ...]]] = []
        self._stack: list[tuple[str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = {k: v or "" for k, v in attrs}
        around = tuple(i for _, i in self._stack if i)
        self.elements.append((tag, attributes, around))
        if tag not in self.VOID:
            self._stack.append((tag, attributes.get("id")))

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, {k: v or "" for k, v in attrs},
                              tuple(i for _, i in self._stack if i)))

    def handle_endtag(self, tag: str) -> None:
        while self._stack:
            if self._stack.pop()[0] == tag:
                break

    def by_id(self, element_id: str) -> dict[str, str]:
        found = [a for _, a, _ in self.elements if a.get("id") == element_id]
        assert len(found) == 1, f"#{element_id}: {len(found)} elements"
        return found[0]

    def inside(self, element_id: str, tag: str) -> list[dict[str, str]]:
        return [a for t, a, around in self.elements if t == tag and element_id in around]


async def _workload(agent: Agent, stop: asyncio.Event) -> int:
    """Actions with model waits between them until told to stop; how many ran."""
    num = 0
    while not stop.is_set() and num < 40:
        result = await agent.run(load_command(AVG, PEAK, 0.8, RESIDENT), timeout=120)
        assert not result.outcome.fails_attempt, result
        num += 1
        await asyncio.sleep(0.4)  # the model wait that lets residency tear it down
    return num


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


@pytest.mark.sandbox
@pytest.mark.cgroups
@pytest.mark.slow
async def test_live_view_in_chromium_shows_budget_sandboxes_and_decisions(
    tmp_path: Path,
) -> None:
    chromium = _need_real_sandboxes_and_chromium()
    config = PolicyConfig(teardown_cost_s=0.0, rebuild_cost_s=0.0)
    async with open_runtime(budget_bytes=BUDGET, state_dir=STATE_DIR, run_dir=tmp_path / "run",
                            policy="tenon", config=config, workspace_limits=None,
                            keep_events=True, predictor=FixedPredictor(AVG, PEAK),
                            backend_config={"disposable": [SCRATCH_DIR]}) as rt:
        domain = rt.domain.name
        view = LiveView(rt, period_s=0.5)
        app = Starlette(routes=view.routes(), lifespan=view.lifespan)
        async with _served(app) as url:
            agents = [await rt.create_agent(agent_id=name) for name in AGENTS]
            stop = asyncio.Event()
            runs = [asyncio.create_task(_workload(agent, stop)) for agent in agents]
            try:
                while not rt.events.of_kind("teardown"):  # the workload tears down
                    assert not any(r.done() for r in runs), [r.result() for r in runs if r.done()]
                    await asyncio.sleep(0.2)
                dom_text = await _chromium_run(chromium, tmp_path / "profile",
                                               "--virtual-time-budget=4000", "--dump-dom",
                                               f"{url}/live")
                shot = tmp_path / "live-view.png"
                await _chromium_run(chromium, tmp_path / "profile",
                                    "--virtual-time-budget=4000", "--window-size=1280,1100",
                                    f"--screenshot={shot}", f"{url}/live")
                state = await asyncio.to_thread(_get_json, f"{url}/live/state")
            finally:
                stop.set()
                num_actions = await asyncio.gather(*runs)
                for agent in agents:
                    await agent.close()
        print(f"live view screenshot: {shot}")

        dom = _Dom()
        dom.feed(dom_text)
        assert dom.by_id("budget")["data-bytes"] == str(BUDGET)
        assert dom.by_id("region-red")["data-to-bytes"] == str(BUDGET)
        assert dom.by_id("budget-line")["data-bytes"] == str(BUDGET)
        assert int(dom.by_id("memory-line")["data-num-points"]) >= 2
        assert int(dom.by_id("decision-marks")["data-count"]) >= 1  # the teardown seen
        assert dom.by_id("pressure")["data-state"] in ("green", "yellow", "red")
        rows = dom.inside("sandboxes", "tr")
        rows = [r for r in rows if "data-sandbox-id" in r]
        assert sorted(r["data-sandbox-id"] for r in rows) == list(AGENTS)
        assert all(r["data-state"] in RESIDENCY_STATES for r in rows), rows
        decisions = dom.inside("decisions", "li")
        assert decisions, "no decision listed"
        assert all(d["data-kind"] in DECISION_KINDS for d in decisions)
        assert {"admit", "materialize"} <= {d["data-kind"] for d in decisions} | {
            d["kind"] for d in state["decisions"]}
        assert shot.stat().st_size > 10_000  # a rendered page, not a blank one

        # the state the page polled: a sampled series, every agent, decisions newest first
        times = [t for t, _ in state["series"]]
        assert len(times) >= 2
        assert times == sorted(times)
        assert all(0 <= usage <= BUDGET for _, usage in state["series"])
        assert max(usage for _, usage in state["series"]) > 0
        assert sorted(s["id"] for s in state["sandboxes"]) == list(AGENTS)
        assert sum(state["counts"].values()) == len(AGENTS)
        decision_times = [d["t"] for d in state["decisions"]]
        assert decision_times == sorted(decision_times, reverse=True)
        assert len(state["decisions"]) <= 50
        assert min(num_actions) >= 1
    assert not glob.glob(f"/sys/fs/cgroup/*/{domain}")  # nothing left behind


def test_every_decision_kind_reads_as_a_decision_with_a_reason() -> None:
    samples: dict[str, dict[str, Any]] = {
        "admit": {"heavy": False, "reason": "fits the window"},
        "gate": {"allowed": False, "reason": "growth over the yellow line"},
        "start_held": {},
        "residency": {"decision": "tear_down", "reason": "green: wait", "eligibility": "ok"},
        "teardown": {"outcome": "torn_down", "reason": "committed", "why": "green"},
        "rebuild": {"predictive": True},
        "rebuild_wait": {"reason": "red: no rebuild started"},
        "materialize": {},
        "oom_kill": {"num_kills": 1, "sandbox_id": "s1"},
        "throttle": {"throttled": True, "reason": "low class over its mark"},
        "workspace_full": {"reason": "no space left"},
        "window": {"budget_bytes": 1},
    }
    assert set(samples) == DECISION_KINDS
    for kind, fields in samples.items():
        row = describe({"t": 1.5, "kind": kind, "agent_id": "a", **fields})
        assert (row["t"], row["kind"], row["agent_id"]) == (1.5, kind, "a")
        assert row["decision"], row
        assert row["reason"], row
    assert describe({"t": 0, "kind": "gate", "allowed": True, "reason": "r"})["decision"] == "thaw"


def test_live_routes_sample_from_the_first_request_until_the_runtime_stops(
    tmp_path: Path,
) -> None:
    """On the simulated host (its clock jumps): `live_routes` as the lead mounts them."""
    import httpx

    from tenon.clock import FakeClock, run_simulated
    from tenon.runtime.controller import Runtime
    from tenon.runtime.residency import run_inline
    from tenon.sandbox.sim import SimBackend, SimDomain, sim_load_command
    from tenon.service.live import live_routes

    clock = FakeClock()
    domain = SimDomain(BUDGET)
    backend = SimBackend(domain, clock)

    def samplers() -> int:
        return sum(t.get_name() == SAMPLER_TASK_NAME for t in asyncio.all_tasks())

    async def main() -> tuple[dict[str, Any], int, int]:
        runtime = Runtime(domain=domain, backend=backend, state_dir=tmp_path / "state",
                          clock=clock, keep_events=True, blocking=run_inline,
                          predictor=FixedPredictor(AVG, PEAK),
                          config=PolicyConfig(teardown_cost_s=0.0, rebuild_cost_s=0.0))
        app = Starlette(routes=live_routes(runtime))
        transport = httpx.ASGITransport(app=app)
        async with runtime, httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            page = await c.get("/live")
            assert page.status_code == 200
            assert 'id="memory-chart"' in page.text
            assert (await c.get("/live/static/live.js")).status_code == 200
            assert (await c.get("/live/static/live.css")).status_code == 200
            assert (await c.get("/live/static/secret.py")).status_code == 404
            agent = await runtime.create_agent(agent_id="sim-a")
            for _ in range(3):
                await agent.run(sim_load_command(AVG, PEAK, 5.0, RESIDENT), timeout=60)
                await clock.sleep(3.0)
            state = (await c.get("/live/state")).json()
            running = samplers()
        await asyncio.sleep(0)  # the cancelled sampler's last turn
        return state, running, samplers()

    state, running, after = asyncio.run(run_simulated(main(), clock))
    assert state["budget_bytes"] == BUDGET
    times = [t for t, _ in state["series"]]
    # sampled every second of runtime time from the page's request to the last state
    assert len(times) >= 20
    assert all(0.9 <= b - a <= 1.1 for a, b in zip(times, times[1:], strict=False)), times
    assert max(usage for _, usage in state["series"]) >= AVG // 2  # the load, sampled at 1 Hz
    assert [s["id"] for s in state["sandboxes"]] == ["sim-a"]
    kinds = {d["kind"] for d in state["decisions"]}
    assert {"admit", "materialize", "residency", "teardown", "rebuild"} <= kinds
    marks = state["marks"]
    assert {m["kind"] for m in marks} == {"teardown", "rebuild"}
    assert [m["t"] for m in marks] == sorted(m["t"] for m in marks)
    assert (running, after) == (1, 0)  # one sampler, ended with the runtime


def test_the_states_shown_are_the_states_the_runtime_reports() -> None:
    from typing import get_args, get_type_hints

    from tenon.runtime.controller import Runtime

    reported = get_args(get_type_hints(Runtime.residency_of)["return"])
    assert sorted(RESIDENCY_STATES) == sorted(reported)
