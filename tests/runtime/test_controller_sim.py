"""The runtime's contract, on the simulated host: outcomes, charges, residency, baselines."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from tenon.clock import FakeClock, run_simulated
from tenon.errors import ConfigError
from tenon.host.types import CgroupVersion
from tenon.policy.config import PAPER_RESERVES, PolicyConfig
from tenon.predict.base import Prediction
from tenon.predict.static import FixedPredictor
from tenon.runtime.controller import Runtime
from tenon.runtime.events import read_events
from tenon.runtime.residency import run_inline
from tenon.runtime.results import Outcome, WorkflowFailed
from tenon.runtime.simulate import SimAction, SimWorkflow, simulate
from tenon.sandbox.base import BackendCapacity, ProcessInfo
from tenon.sandbox.sim import SimBackend, SimDomain, sim_load_command

MIB = 1024 * 1024
GIB = 1024 * MIB


def load(avg_mib: int, peak_mib: int, duration_s: float, resident_mib: int = 0) -> str:
    return sim_load_command(avg_mib * MIB, peak_mib * MIB, duration_s, resident_mib * MIB)


def run_with_runtime(
    tmp_path: Path,
    body: Callable[[Runtime, SimDomain, SimBackend, FakeClock], Awaitable[Any]],
    *,
    budget_bytes: int = GIB,
    policy: str = "tenon",
    config: PolicyConfig | None = None,
    version: CgroupVersion = CgroupVersion.V2,
    predictor: Any = None,
    event_log: Path | None = None,
) -> Any:
    clock = FakeClock()
    domain = SimDomain(budget_bytes, version=version)
    backend = SimBackend(domain, clock)
    # the scenarios' sizes are laid out against the paper's reserves
    config = config or PolicyConfig(**PAPER_RESERVES)

    async def main() -> Any:
        runtime = Runtime(domain=domain, backend=backend, state_dir=tmp_path / "state",
                          policy=policy, config=config, clock=clock, keep_events=True,
                          predictor=predictor or FixedPredictor(100 * MIB, 200 * MIB),
                          blocking=run_inline, event_log=event_log)
        async with runtime:
            return await body(runtime, domain, backend, clock)

    return asyncio.run(run_simulated(main(), clock))


def test_action_reports_output_exit_code_and_memory_figures(tmp_path: Path) -> None:
    async def body(rt, domain, backend, clock):
        agent = await rt.create_agent(image="sim")
        return await agent.run(load(100, 300, 4.0, 20), timeout=60)

    result = run_with_runtime(tmp_path, body)
    assert result.outcome is Outcome.OK
    assert result.exit_code == 0
    assert "sim load done" in result.output
    assert result.duration_s == pytest.approx(4.0, abs=0.2)
    assert result.peak_memory_bytes == 300 * MIB
    # time-average of the profile (avg 100 MiB), from 100 ms samples
    assert 70 * MIB < result.avg_memory_bytes < 130 * MIB
    assert result.predicted_peak_bytes == 200 * MIB


def test_oom_kill_fails_the_attempt_and_is_reported(tmp_path: Path) -> None:
    async def body(rt, domain, backend, clock):
        a, b = await rt.create_agent(image="sim"), await rt.create_agent(image="sim")
        results = await asyncio.gather(a.run(load(600, 700, 3.0), timeout=60),
                                       b.run(load(500, 600, 3.0), timeout=60))
        victim = a if results[0].outcome is Outcome.OOM_KILLED else b
        with pytest.raises(WorkflowFailed):
            await victim.run(load(10, 10, 1.0), timeout=60)
        return results, victim.failed, rt.events.of_kind("oom_kill")

    (first, second), failed, oom_events = run_with_runtime(tmp_path, body, policy="eager")
    outcomes = {first.outcome, second.outcome}
    assert Outcome.OOM_KILLED in outcomes
    assert Outcome.OK in outcomes
    assert failed
    assert len(oom_events) == 1


def test_timeout_is_reported_distinctly_and_the_agent_goes_on(tmp_path: Path) -> None:
    async def body(rt, domain, backend, clock):
        agent = await rt.create_agent(image="sim")
        slow = await agent.run(load(50, 50, 30.0), timeout=2.0)
        after = await agent.run(load(50, 50, 1.0), timeout=10.0)
        return slow, after

    slow, after = run_with_runtime(tmp_path, body)
    assert slow.outcome is Outcome.TIMEOUT
    assert not slow.outcome.fails_attempt
    assert slow.duration_s == pytest.approx(2.0, abs=0.2)
    assert after.outcome is Outcome.OK


def test_every_admitted_charge_is_released_exactly_once_even_on_failures() -> None:
    # tenon-no-gate lets this burst hit OOM kills; charges must still all come back
    action = SimAction(250 * MIB, 450 * MIB, 2.0, 0)
    workflows = [SimWorkflow([action] * 2) for _ in range(8)]
    report = simulate(workflows, budget_bytes=GIB, policy="tenon-no-gate",
                      predictor=FixedPredictor(100 * MIB, 150 * MIB))
    assert report.num_oom_kills > 0
    admits = [e["action_id"] for e in report.of_kind("admit")]
    releases = [e["action_id"] for e in report.of_kind("release")]
    assert sorted(admits) == sorted(releases)
    assert len(set(admits)) == len(admits)
    assert report.runtime.admission is not None
    assert report.runtime.admission.admitted_total_bytes == 0
    assert not report.runtime.admission.charges


def test_idle_sandbox_is_torn_down_under_pressure_and_rebuilt_for_the_next_action(
    tmp_path: Path,
) -> None:
    async def body(rt, domain, backend, clock):
        agent = await rt.create_agent(image="sim")
        # leaves 700 MiB resident on a 1 GiB budget: yellow or red once idle
        await agent.run(load(700, 700, 1.0, 700), timeout=60)
        await clock.sleep(3.0)
        usage_while_idle = domain.usage_bytes()
        second = await agent.run(load(10, 20, 1.0), timeout=60)
        return usage_while_idle, second, rt.residency.sandbox_for(agent.id)

    usage_idle, second, sandbox = run_with_runtime(tmp_path, body)
    assert usage_idle < 100 * MIB  # the idle sandbox's memory went back to the domain
    assert second.outcome is Outcome.OK
    assert "-g2-" in sandbox.spec.sandbox_id  # rebuilt: a second generation


def test_resident_only_sandbox_is_never_torn_down(tmp_path: Path) -> None:
    async def body(rt, domain, backend, clock):
        agent = await rt.create_agent(image="sim")
        await agent.run(load(10, 20, 0.5), timeout=60)
        sandbox = rt.residency.sandbox_for(agent.id)
        sandbox.leftover_processes = [ProcessInfo(4242, 1, "postgres -D /workspace/db")]
        await agent.run(load(700, 700, 1.0, 700), timeout=60)
        await clock.sleep(5.0)  # red the whole time: reclaim would pick it if it could
        still = rt.residency.sandbox_for(agent.id)
        return sandbox, still, sandbox.destroyed, rt.events.of_kind("residency")

    before, after, destroyed, decisions = run_with_runtime(tmp_path, body)
    assert after is before
    assert not destroyed
    assert decisions[-1]["restartable"] is False
    assert "process" in decisions[-1]["eligibility"]


def test_static_n_never_runs_more_than_n_workflows() -> None:
    action = SimAction(50 * MIB, 60 * MIB, 1.0, 0, model_wait_s=0.5)
    report = simulate([SimWorkflow([action] * 3) for _ in range(9)], budget_bytes=4 * GIB,
                      policy="static-3")
    assert all(r.completed for r in report.runs)
    live = 0
    max_live = 0
    for e in report.events:
        if e["kind"] == "workflow_start":
            live += 1
        elif e["kind"] == "workflow_end":
            live -= 1
        max_live = max(max_live, live)
    assert max_live == 3


def test_reservation_admits_by_profiled_peaks_and_needs_them(tmp_path: Path) -> None:
    small = SimWorkflow([SimAction(100 * MIB, 400 * MIB, 2.0, 0)])
    report = simulate([small] * 6, budget_bytes=GIB, policy="reservation")
    assert report.num_oom_kills == 0
    starts = sorted(e["t"] for e in report.of_kind("workflow_start"))
    assert starts[:2] == [0.0, 0.0]
    assert starts[2] > 0.0

    async def body(rt, domain, backend, clock):
        with pytest.raises(ConfigError, match="profiled peak"):
            await rt.create_agent(image="sim")

    run_with_runtime(tmp_path, body, policy="reservation")


def test_agentcgroup_marks_low_sandboxes_v2_and_throttles_them_v1(tmp_path: Path) -> None:
    async def body(rt, domain, backend, clock):
        low = await rt.create_agent(image="sim", profile_peak_bytes=100 * MIB)
        high = await rt.create_agent(image="sim", profile_peak_bytes=900 * MIB)
        await asyncio.gather(low.run(load(450, 500, 2.0), timeout=600),
                             high.run(load(100, 200, 1.0), timeout=600))
        cgroups = {s.spec.sandbox_id.split("-g")[0]: s.cgroup for s in backend.sandboxes}
        return cgroups[low.id], cgroups[high.id], rt.events.of_kind("throttle")

    low_v2, high_v2, _ = run_with_runtime(tmp_path / "v2", body, policy="agentcgroup",
                                          budget_bytes=2 * GIB)
    assert low_v2.memory_high_bytes == 400 * MIB
    assert high_v2.memory_high_bytes is None
    low_v1, _, throttles = run_with_runtime(tmp_path / "v1", body, policy="agentcgroup",
                                            budget_bytes=2 * GIB, version=CgroupVersion.V1)
    assert low_v1.memory_high_bytes is None
    assert [e["throttled"] for e in throttles][:1] == [True]  # over 400 MiB: throttled
    assert low_v1.cpu_fraction is None  # released when the action ended


def test_event_log_is_json_lines_with_time_and_kind(tmp_path: Path) -> None:
    log = tmp_path / "run" / "events.jsonl"

    async def body(rt, domain, backend, clock):
        agent = await rt.create_agent(image="sim")
        await agent.run(load(10, 20, 1.0), timeout=60)
        await agent.close()

    run_with_runtime(tmp_path, body, event_log=log)
    events = read_events(log)
    kinds = [e["kind"] for e in events]
    for kind in ("runtime_start", "action_ready", "admit", "action_start", "action_done",
                 "release", "residency", "workflow_end", "runtime_stop"):
        assert kind in kinds
    assert all(isinstance(e["t"], float | int) for e in events)
    log.write_text(log.read_text() + '{"t": 9, "kind": "torn')  # a crash mid-write
    assert len(read_events(log)) == len(events)
    lines = log.read_text().splitlines()
    log.write_text("\n".join([lines[0], "not json", *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match=":2:"):
        read_events(log)
    assert json.loads(lines[0])["kind"] == "runtime_start"


def test_controller_restart_recovers_torn_down_agents_from_their_records(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    domain = SimDomain(GIB)
    backend = SimBackend(domain, clock)

    def make() -> Runtime:
        return Runtime(domain=domain, backend=backend, state_dir=tmp_path, clock=clock,
                       blocking=run_inline, keep_events=True,
                       config=PolicyConfig(**PAPER_RESERVES))

    async def main() -> tuple[str, str]:
        first = make()
        await first.start()
        agent = await first.create_agent(image="sim")
        await agent.run(load(700, 700, 1.0, 700), timeout=60)  # torn down once idle
        await clock.sleep(2.0)
        assert first.residency.sandbox_for(agent.id) is None
        # the controller dies: no close(), its loop simply stops
        assert first._loop_task is not None
        first._loop_task.cancel()
        second = make()
        await second.start()
        (recovered,) = second.recover()
        result = await recovered.run(load(10, 20, 1.0), timeout=60)
        sandbox = second.residency.sandbox_for(recovered.id)
        await second.close()
        return result.outcome.value, sandbox.spec.sandbox_id

    outcome, sandbox_id = asyncio.run(run_simulated(main(), clock))
    assert outcome == "ok"
    assert "-g2-" in sandbox_id


def test_under_pressure_a_new_action_waits_before_it_starts_not_frozen_mid_growth(
    tmp_path: Path,
) -> None:
    async def body(rt, domain, backend, clock):
        big = await rt.create_agent(image="sim")
        other = await rt.create_agent(image="sim")
        first = asyncio.ensure_future(big.run(load(600, 650, 6.0), timeout=60))
        await clock.sleep(1.0)  # the domain is yellow now: 650 MiB of 1 GiB in use
        second = await other.run(load(300, 350, 1.0), timeout=60)
        return await first, second, rt.events.of_kind("start_held")

    first, second, held = run_with_runtime(
        tmp_path, body, predictor=FixedPredictor(300 * MIB, 700 * MIB))
    assert first.outcome is Outcome.OK
    assert second.outcome is Outcome.OK
    assert [e["action_id"] for e in held] == [second.action_id]
    assert second.queued_s > 1.0  # it waited for the big one, holding no memory meanwhile
    assert second.duration_s == pytest.approx(1.0, abs=0.2)  # and then ran unfrozen


def test_green_launches_only_the_starts_that_fit_above_the_yellow_line(tmp_path: Path) -> None:
    """A burst of ready actions in a green domain starts a few at a time, held before their
    start (holding nothing), not all at once to be frozen half-allocated in the yellow
    region they push the domain into."""
    async def body(rt, domain, backend, clock):
        agents = [await rt.create_agent(image="sim") for _ in range(5)]
        results = await asyncio.gather(*(a.run(load(150, 200, 2.0), timeout=60)
                                         for a in agents))
        return results, rt.events.of_kind("start_held"), rt.events.of_kind("sample")

    results, held, samples = run_with_runtime(tmp_path, body)
    assert [r.outcome for r in results] == [Outcome.OK] * 5
    assert len(held) >= 3  # 266 MiB demand each (peak + slack); ~500 MiB above the line
    launched = [e["running"] - e["pending"] for e in samples]
    assert max(launched) <= 3  # never all five at once


def test_a_held_grower_past_overdue_keeps_its_room_from_new_admissions(tmp_path: Path) -> None:
    """An action that outgrew its prediction and is held must not starve behind a stream of
    light actions that admission keeps handing the room it needs."""
    async def body(rt, domain, backend, clock):
        big = await rt.create_agent(image="sim")
        light = [await rt.create_agent(image="sim") for _ in range(6)]

        async def stream(agent):
            for _ in range(60):
                await agent.run(load(60, 80, 0.5), timeout=60)
            return clock.now()

        streams = [asyncio.ensure_future(stream(a)) for a in light]
        await clock.sleep(0.5)
        result = await big.run(load(450, 600, 2.0), timeout=120)  # predicted 200 MiB peak
        big_done = clock.now()
        return result, big_done, min(await asyncio.gather(*streams))

    result, big_done, first_stream_done = run_with_runtime(
        tmp_path, body, predictor=FixedPredictor(50 * MIB, 100 * MIB))
    assert result.outcome is Outcome.OK
    assert big_done < first_stream_done  # it ran while the light work was still flowing


def test_the_predictor_sees_the_callers_workflow_name_and_the_history(tmp_path: Path) -> None:
    seen: list[tuple[str, int]] = []

    class Recording:
        name = "recording"

        def observe(self, context, measured):
            pass

        def observe_running(self, context, peak_bytes):
            pass

        def predict(self, context):
            seen.append((context.workflow_id, len(context.history)))
            return FixedPredictor(10 * MIB, 20 * MIB).predict(context)

    async def body(rt, domain, backend, clock):
        named = await rt.create_agent(image="sim", workflow="repo__task-1#2")
        plain = await rt.create_agent(image="sim")
        for _ in range(2):
            await named.run(load(5, 10, 0.2), timeout=60)
        await plain.run(load(5, 10, 0.2), timeout=60)
        return plain.id

    plain_id = run_with_runtime(tmp_path, body, predictor=Recording())
    assert seen == [("repo__task-1#2", 0), ("repo__task-1#2", 1), (plain_id, 0)]


def test_the_predictor_sees_the_issued_command_not_its_stand_in(tmp_path: Path) -> None:
    """A replay runs a load program in place of the agent's command; its arguments are
    the figures being predicted, so the predictor must never see them."""
    seen: list[tuple[str, tuple[str, ...], str | None]] = []

    class Recording:
        name = "recording"

        def observe(self, context, measured):
            pass

        def observe_running(self, context, peak_bytes):
            pass

        def predict(self, context):
            seen.append((context.command, tuple(m.command for m in context.history),
                         context.task))
            return FixedPredictor(10 * MIB, 20 * MIB).predict(context)

    async def body(rt, domain, backend, clock):
        agent = await rt.create_agent(image="sim", task="repo__task-1")
        first = await agent.run(load(5, 10, 0.2), timeout=60, issued_command="pytest -x")
        await agent.run(load(5, 10, 0.2), timeout=60, issued_command="git diff")
        return first

    first = run_with_runtime(tmp_path, body, predictor=Recording())
    assert seen == [("pytest -x", (), "repo__task-1"), ("git diff", ("pytest -x",), "repo__task-1")]
    assert first.action_class == "test_runner"  # classified from the issued command
    assert first.outcome is Outcome.OK  # and the stand-in is what ran


def test_work_queued_behind_a_full_window_does_not_tear_down_idle_sandboxes(
    tmp_path: Path,
) -> None:
    """Admission's logical window is full of charges (predicted peaks) while the host has
    room: a teardown would free memory no queued action may take, and cost a rebuild."""
    async def body(rt, domain, backend, clock):
        idle = await rt.create_agent(image="sim")
        await idle.run(load(100, 100, 0.5, 100), timeout=60)  # 100 MiB stays resident
        busy = [await rt.create_agent(image="sim") for _ in range(8)]
        # the first five fill the 1 GiB window with 200 MiB charges and use 10 MiB each;
        # the other three queue behind the window
        await asyncio.gather(*(a.run(load(10, 10, 4.0), timeout=60) for a in busy))
        return rt.events.of_kind("teardown"), rt.events.of_kind("admit")

    # without the gate no start is held (held starts may reclaim under any pressure)
    teardowns, admits = run_with_runtime(tmp_path, body, policy="tenon-no-gate",
                                         predictor=FixedPredictor(200 * MIB, 200 * MIB))
    assert any(e["pressure"] == "yellow" for e in admits)  # the window made it yellow
    assert len(admits) == 9
    assert teardowns == []


def test_a_sandbox_whose_next_action_waits_for_admission_is_reclaimed(tmp_path: Path) -> None:
    """An agent whose next action queues behind a full window holds its sandbox's memory
    while it waits: under pressure that sandbox is torn down, and rebuilt once admitted."""
    async def body(rt, domain, backend, clock):
        runner = await rt.create_agent(image="sim")
        running = asyncio.ensure_future(runner.run(load(400, 400, 10.0), timeout=60))
        await clock.sleep(0.5)
        queued = await rt.create_agent(image="sim")
        await queued.run(load(200, 200, 0.5, 200), timeout=60)  # 200 MiB stays resident
        # at once, no model wait: yellow (H = 1024 - 600 - 256 = 168 MiB), and this
        # 500 MiB action fits the window but not the host: it queues for the runner
        second = await queued.run(load(500, 500, 1.0), timeout=60)
        await running
        return second, list(rt.events.events), queued.id, rt.residency.sandbox_for(queued.id)

    second, log, agent_id, sandbox = run_with_runtime(tmp_path, body, predictor=_ByPeak())
    assert second.outcome is Outcome.OK
    assert second.queued_s > 5.0  # it did wait for the runner
    admitted_at = next(e["t"] for e in log if e["kind"] == "admit"
                       and e["action_id"] == f"{agent_id}-a0002")
    torn = [e for e in log if e["kind"] == "teardown" and e["agent_id"] == agent_id]
    assert torn
    assert torn[0]["t"] < admitted_at  # torn down while its action was queued
    assert "-g2-" in sandbox.spec.sandbox_id


def test_an_action_queued_for_room_that_idle_sandboxes_hold_gets_it_under_green(
    tmp_path: Path,
) -> None:
    """Green, an idle sandbox holding 300 MiB, and a 500 MiB action whose charge fits the
    window but not H (468 MiB): it stayed queued for as long as the idle one stayed idle
    (forever); past overdue the idle sandbox is reclaimed for it."""
    async def body(rt, domain, backend, clock):
        idle = await rt.create_agent(image="sim")
        await idle.run(load(300, 300, 0.5, 300), timeout=60)
        runner = await rt.create_agent(image="sim")
        result = await runner.run(load(500, 500, 1.0), timeout=60)
        return result, rt.events.of_kind("teardown")

    result, teardowns = run_with_runtime(tmp_path, body, predictor=_ByPeak())
    assert result.outcome is Outcome.OK
    assert 3.0 <= result.queued_s < 6.0  # overdue, then a teardown's time
    assert [t["agent_id"] for t in teardowns] == ["agent-00001"]
    assert "stuck" in teardowns[0]["why"]


def test_an_action_stuck_on_idle_memory_gets_it_even_while_a_small_action_runs(
    tmp_path: Path,
) -> None:
    """As above, but a long action holding 20 MiB runs meanwhile: its end cannot free the
    room, so waiting for it (30 s) is no answer; past overdue the idle sandbox goes."""
    async def body(rt, domain, backend, clock):
        idle = await rt.create_agent(image="sim")
        await idle.run(load(300, 300, 0.5, 300), timeout=60)
        long = await rt.create_agent(image="sim")
        running = asyncio.ensure_future(long.run(load(20, 20, 30.0), timeout=60))
        await clock.sleep(1.0)
        runner = await rt.create_agent(image="sim")
        result = await runner.run(load(500, 500, 1.0), timeout=60)
        await running
        return result, rt.events.of_kind("teardown")

    result, teardowns = run_with_runtime(tmp_path, body, predictor=_ByPeak())
    assert result.outcome is Outcome.OK
    assert 3.0 <= result.queued_s < 10.0  # overdue, then a teardown: not the runner's 29 s
    assert [t["agent_id"] for t in teardowns] == ["agent-00001"]
    assert "stuck" in teardowns[0]["why"]


class _LearnsHeavy:
    """Exact figures from the command, until an action above 1 GiB was observed: from then
    on every light action is expected to peak at 1.5 GiB (a peer's test run was heavy)."""

    name = "learns-heavy"

    def __init__(self) -> None:
        self.heavy_seen = False

    def predict(self, context: Any) -> Prediction:
        avg, peak = (int(x) for x in context.command.split()[1:3])
        if self.heavy_seen and peak < GIB:
            return Prediction(avg, 1536 * MIB, heavy_risk=True)
        return Prediction(avg, peak)

    def observe(self, context: Any, measured: Any) -> None:
        self.heavy_seen = self.heavy_seen or measured.peak_bytes > GIB

    def observe_running(self, context: Any, peak_bytes: int) -> None:
        pass


def test_a_queued_action_is_predicted_again_after_a_heavy_run_is_observed(
    tmp_path: Path,
) -> None:
    """Predicted light when it became ready, queued behind a full window while a peer's
    heavy run completes: it is admitted as heavy (charged its new peak), not as predicted
    a while ago."""
    async def body(rt, domain, backend, clock):
        heavy, filler, queued = [await rt.create_agent(image="sim") for _ in range(3)]
        runs = [asyncio.ensure_future(heavy.run(load(1200, 1200, 2.0), timeout=60)),
                asyncio.ensure_future(filler.run(load(700, 700, 10.0), timeout=60))]
        await clock.sleep(0.5)
        # 1,900 MiB of the 2 GiB window is charged: 200 MiB more does not fit
        result = await queued.run(load(200, 200, 1.0), timeout=60)
        await asyncio.gather(*runs)
        admit = next(e for e in rt.events.of_kind("admit")
                     if e["action_id"] == result.action_id)
        return result, admit, rt.events.of_kind("repredict")

    result, admit, repredicted = run_with_runtime(tmp_path, body, budget_bytes=2 * GIB,
                                                  predictor=_LearnsHeavy())
    assert result.outcome is Outcome.OK
    assert [e["action_id"] for e in repredicted] == [result.action_id]
    assert admit["heavy"]
    assert admit["charge_bytes"] >= 1536 * MIB
    assert result.queued_s > 8.0  # it waited for the filler, not just for the heavy run


class _ByPeak:
    """Predicts a simulated load exactly: its average and peak, read off the command."""

    name = "by-peak"

    def observe(self, context: Any, measured: Any) -> None:
        pass

    def observe_running(self, context: Any, peak_bytes: int) -> None:
        pass

    def predict(self, context: Any) -> Prediction:
        avg, peak = (int(x) for x in context.command.split()[1:3])
        return Prediction(avg, peak)


def test_a_start_held_for_room_in_a_green_domain_gets_idle_memory_reclaimed(
    tmp_path: Path,
) -> None:
    """Green promises no room above the yellow line: an admitted start that needs more than
    the domain can give gets idle sandboxes torn down for it once it is overdue, instead
    of waiting for the domain to drain (its charge meanwhile blocks admission)."""
    async def body(rt, domain, backend, clock):
        idle = [await rt.create_agent(image="sim") for _ in range(3)]
        for agent in idle:  # 900 MiB left resident by idle, restartable sandboxes
            await agent.run(load(300, 300, 0.5, 300), timeout=60)
        runner = await rt.create_agent(image="sim")
        running = asyncio.ensure_future(runner.run(load(10, 10, 10.0), timeout=60))
        await clock.sleep(0.5)
        big = await rt.create_agent(image="sim")
        result = await big.run(load(250, 800, 1.0), timeout=60)
        await running
        return result, rt.events.of_kind("start_held"), rt.events.of_kind("teardown")

    # 2 GiB: H is 882 MiB with the idle ones, short of the big start's 1,016 MiB demand
    result, held, teardowns = run_with_runtime(
        tmp_path, body, budget_bytes=2 * GIB, predictor=_ByPeak())
    assert result.outcome is Outcome.OK
    assert held  # it did not fit above the yellow line at first
    assert any("held or stuck work" in t["why"] for t in teardowns)
    assert result.queued_s < 6.0  # after the 3 s overdue, not after the runner's 10 s


def test_an_action_past_its_peak_gives_its_charge_back_to_admission(tmp_path: Path) -> None:
    """A test run that spikes and then idles for most of its duration: once it has passed
    its peak its charge shrinks, and a queued action runs beside it instead of after it."""
    async def body(rt, domain, backend, clock):
        filler, heavy, light = [await rt.create_agent(image="sim") for _ in range(3)]
        filling = asyncio.ensure_future(filler.run(load(500, 500, 8.0), timeout=60))
        await clock.sleep(0.1)
        first = asyncio.ensure_future(heavy.run(load(100, 800, 10.0), timeout=60))
        await clock.sleep(0.1)
        second = await light.run(load(500, 500, 0.5), timeout=60)
        light_done = clock.now()
        await filling
        return await first, second, light_done, rt.events.of_kind("peak_passed")

    # a 1.2 GiB window: filler 500 MiB + heavy ~385 MiB (water level) leave no room for
    # the light one's 500 MiB until the heavy one falls back to its 100 MiB average
    config = PolicyConfig(**PAPER_RESERVES, admission_window_bytes=1229 * MIB)
    heavy, light, light_done, passed = run_with_runtime(
        tmp_path, body, budget_bytes=4 * GIB, predictor=_ByPeak(), config=config)
    assert heavy.outcome is Outcome.OK
    assert light.outcome is Outcome.OK
    assert [e["action_id"] for e in passed] == [heavy.action_id]
    assert passed[0]["charge_bytes"] == 100 * MIB  # what it holds, at least its average
    assert light_done < 6.0  # beside the heavy one, not after the 8 s filler


def test_cancelling_a_running_action_and_its_waiter_together_returns_every_charge(
        tmp_path: Path) -> None:
    """Shutdown cancels every task at once: the running action's release admits a waiter
    whose own cancellation has not been handled yet. That used to raise InvalidStateError
    (a result set on a cancelled future) in the middle of the shutdown."""
    config = PolicyConfig(admission_window_bytes=150 * MIB)  # room for one 100 MiB charge

    async def body(rt, domain, backend, clock):
        a, b = await rt.create_agent(image="sim"), await rt.create_agent(image="sim")
        running = asyncio.ensure_future(a.run(load(100, 150, 30.0), timeout=60))
        await clock.sleep(1.0)
        waiting = asyncio.ensure_future(b.run(load(100, 150, 30.0), timeout=60))
        await clock.sleep(1.0)
        assert rt.admission is not None
        assert len(rt.admission.queued) == 1
        running.cancel()
        waiting.cancel()
        outcomes = await asyncio.gather(running, waiting, return_exceptions=True)
        return outcomes, rt.admission.admitted_total_bytes, dict(rt.admission.charges)

    outcomes, admitted_total, charges = run_with_runtime(tmp_path, body, config=config)
    assert all(isinstance(o, asyncio.CancelledError) for o in outcomes), outcomes
    assert admitted_total == 0
    assert not charges


def test_an_exec_that_finds_its_sandbox_frozen_waits_for_the_thaw(tmp_path: Path) -> None:
    """A tick can freeze a launched sandbox before its exec begins; the action must wait for
    the gate, not fail its workflow's attempt (8 attempts lost so in one real 8x replay)."""
    async def body(rt, domain, backend, clock):
        agent = await rt.create_agent(image="sim")
        original = rt.residency.exec
        refused: list[float] = []

        async def thaw_later(cgroups):
            await clock.sleep(1.5)
            for cgroup in cgroups:
                cgroup.frozen = False

        async def freeze_first(agent_id, command, **kwargs):
            if not refused:
                cgroups = list(domain.cgroups.values())
                for cgroup in cgroups:
                    cgroup.frozen = True
                asyncio.get_running_loop().create_task(thaw_later(cgroups))
            try:
                return await original(agent_id, command, **kwargs)
            except Exception:
                refused.append(clock.now())
                raise

        rt.residency.exec = freeze_first
        started = clock.now()
        result = await agent.run(load(50, 80, 2.0), timeout=60)
        return result, refused, clock.now() - started

    result, refused, elapsed = run_with_runtime(tmp_path, body)
    assert result.outcome is Outcome.OK
    assert len(refused) >= 2  # it retried while frozen, not once and done
    assert elapsed >= 1.5 + 2.0 - 0.2  # ran only after the thaw


def test_the_older_workflow_is_admitted_first(tmp_path: Path) -> None:
    """Rank is the workflow's start time: with one slot at a time, an older workflow's
    action goes before a younger one's, whatever peers of the younger one's task ran."""
    async def body(rt, domain, backend, clock):
        lead = await rt.create_agent(image="sim", task="T")
        for _ in range(3):
            await lead.run(load(10, 10, 2.0), timeout=60)
        for _ in range(2):
            short = await rt.create_agent(image="sim")
            await short.run(load(10, 10, 0.5), timeout=60)
            await short.close()
        # five 200 MiB charges fill the 1 GiB window; they end one by one
        blockers = [await rt.create_agent(image="sim") for _ in range(5)]
        blocking = [asyncio.ensure_future(b.run(load(10, 10, 3.0 + i), timeout=60))
                    for i, b in enumerate(blockers)]
        await clock.sleep(0.5)
        old = await rt.create_agent(image="sim")
        old_run = asyncio.ensure_future(old.run(load(10, 10, 5.0), timeout=60))
        await clock.sleep(0.5)
        young = await rt.create_agent(image="sim", task="T")
        young_run = asyncio.ensure_future(young.run(load(10, 10, 5.0), timeout=60))
        await asyncio.gather(*blocking, old_run, young_run)
        admitted = {e["agent_id"]: e["t"] for e in rt.events.of_kind("admit")}
        return admitted[old.id], admitted[young.id]

    old_at, young_at = run_with_runtime(
        tmp_path, body, predictor=FixedPredictor(200 * MIB, 200 * MIB),
    )
    assert old_at < young_at
    assert abs(young_at - old_at) > 0.5  # one slot at a time: a blocker's end apart


@pytest.mark.parametrize(("hint", "expected_s"), [(2, 2.0), (None, 1.0)])
def test_the_auto_action_cap_comes_from_the_backend(
    tmp_path: Path, hint: int | None, expected_s: float,
) -> None:
    """Admission takes its action cap from the backend's capacity (the Docker backend has
    one, 4 per core); a backend without one leaves memory alone to limit admission. Four
    1 s actions: two rounds under a cap of 2, one without."""
    clock = FakeClock()
    domain = SimDomain(GIB)
    backend = SimBackend(domain, clock)
    if hint is not None:
        backend.capacity = lambda: BackendCapacity(max_admitted_actions=hint)  # type: ignore[method-assign]

    async def main() -> tuple[Any, float]:
        runtime = Runtime(domain=domain, backend=backend, state_dir=tmp_path / "state",
                          clock=clock, predictor=FixedPredictor(10 * MIB, 10 * MIB),
                          blocking=run_inline)
        async with runtime:
            agents = [await runtime.create_agent(image="sim") for _ in range(4)]
            start = clock.now()
            await asyncio.gather(*(a.run(load(10, 10, 1.0), timeout=60) for a in agents))
            return runtime.capacity.max_admitted_actions, clock.now() - start

    cap, took = asyncio.run(run_simulated(main(), clock))
    assert cap == hint
    assert took == pytest.approx(expected_s, abs=0.5)


def test_a_peer_hears_of_a_heavy_run_before_it_ends(tmp_path: Path) -> None:
    """One attempt's test run crosses 1 GiB 1 s into its 10 s; another attempt's test step
    that becomes ready meanwhile is predicted heavy at once, not after the run ends."""
    from tenon.predict.online import OnlinePredictor

    async def body(rt, domain, backend, clock):
        first = await rt.create_agent(image="sim", task="T")
        second = await rt.create_agent(image="sim", task="T")
        running = asyncio.ensure_future(
            first.run(load(200, 1500, 10.0), timeout=60, action_class="test_runner"))
        await clock.sleep(3.0)
        await second.run(load(20, 20, 0.5), timeout=60, action_class="test_runner")
        await running
        return [e for e in rt.events.of_kind("action_ready") if e["agent_id"] == second.id]

    predictor = OnlinePredictor(FixedPredictor(20 * MIB, 40 * MIB), heavy_peak_bytes=GIB)
    (ready,) = run_with_runtime(tmp_path, body, budget_bytes=4 * GIB, predictor=predictor)
    assert ready["heavy"] is True
    assert ready["predicted_peak_bytes"] >= 1400 * MIB


class _TestsLookHeavy(_ByPeak):
    """Exact for every action but test runs, which it expects at 1.5 GiB (a peer's test run
    needed that once): the replay's false heavies, whose same command peaked at 30 MiB."""

    def predict(self, context: Any) -> Prediction:
        if context.action_class == "test_runner":
            return Prediction(100 * MIB, 1536 * MIB)
        return super().predict(context)


def _idle_then_test(test_load: str) -> Callable[..., Awaitable[Any]]:
    async def body(rt, domain, backend, clock):
        idle = [await rt.create_agent(image="sim") for _ in range(3)]
        for agent in idle:  # 900 MiB left resident by idle, restartable sandboxes
            await agent.run(load(300, 300, 0.5, 300), timeout=60)
        tester = await rt.create_agent(image="sim")
        result = await tester.run(test_load, timeout=60, action_class="test_runner")
        return (result, rt.events.of_kind("start_held"), rt.events.of_kind("teardown"),
                domain.reading().num_oom_kills)
    return body


def test_a_heavy_prediction_that_stays_small_starts_without_emptying_the_domain(
    tmp_path: Path,
) -> None:
    """A start predicted heavy is not held until its whole predicted peak (1.9 GiB with
    slack) fits: it starts on bootstrap demand and the gate meters its measured growth, so
    no idle sandbox is torn down for a run that needs 30 MiB."""
    result, held, teardowns, _ = run_with_runtime(
        tmp_path, _idle_then_test(load(20, 30, 1.0)), budget_bytes=3 * GIB,
        predictor=_TestsLookHeavy(), config=PolicyConfig(**PAPER_RESERVES, reclaim_min_idle_s=0.0))
    assert result.outcome is Outcome.OK
    assert not held
    assert not teardowns
    assert result.queued_s + result.duration_s < 1.5


def test_a_heavy_start_that_does_grow_gets_room_from_idle_sandboxes_without_oom(
    tmp_path: Path,
) -> None:
    """Started on bootstrap demand, a real 1.4 GiB test run in a 2 GiB domain with 900 MiB
    idle: the gate holds its growth while idle sandboxes are torn down, and nothing is
    OOM-killed."""
    result, _, teardowns, oom_kills = run_with_runtime(
        tmp_path, _idle_then_test(load(1000, 1400, 4.0)), budget_bytes=2 * GIB,
        predictor=_TestsLookHeavy())
    assert result.outcome is Outcome.OK
    assert oom_kills == 0
    assert teardowns  # the room came from idle sandboxes
    assert result.peak_memory_bytes >= 1400 * MIB


def test_two_copies_of_a_mispredicted_large_run_take_turns_instead_of_deadlocking(
    tmp_path: Path,
) -> None:
    """Two copies of a test run predicted at 100 MiB that each need 1.3 GiB, in a 2 GiB
    domain: they cannot both have their peak. The one that outgrew its prediction second
    waits frozen near its predicted size while the first has the domain, then finishes;
    neither is OOM-killed. (Thawed together whenever the domain looked green, each used to
    end up holding part of what the other needed, and the probe let go was killed.)"""
    async def body(rt, domain, backend, clock):
        first, second = [await rt.create_agent(image="sim") for _ in range(2)]
        a = asyncio.ensure_future(first.run(load(900, 1300, 6.0), timeout=120,
                                            action_class="test_runner"))
        await clock.sleep(0.3)
        b = asyncio.ensure_future(second.run(load(900, 1300, 6.0), timeout=120,
                                             action_class="test_runner"))
        results = await asyncio.gather(a, b)
        return results, rt.events.of_kind("gate"), domain.reading().num_oom_kills

    results, gates, oom_kills = run_with_runtime(
        tmp_path, body, budget_bytes=2 * GIB, predictor=FixedPredictor(50 * MIB, 100 * MIB))
    assert [r.outcome for r in results] == [Outcome.OK, Outcome.OK]
    assert oom_kills == 0
    assert any("outgrew its prediction after" in g["reason"] for g in gates)


def test_tenon_keeps_at_most_the_backends_live_workflows(tmp_path: Path) -> None:
    """With `max_live_workflows` 2, a third workflow starts only when one of the first two
    ends; the backend's hint stands in for "auto"."""
    async def body(rt, domain, backend, clock):
        async def workflow() -> tuple[float, float]:
            agent = await rt.create_agent(image="sim")
            started = clock.now()
            await agent.run(load(10, 10, 2.0), timeout=60)
            await agent.close()
            return started, clock.now()

        spans = await asyncio.gather(*(workflow() for _ in range(3)))
        return spans, rt.capacity.max_live_workflows, rt.events.of_kind("workflow_start")

    class _Backend(SimBackend):
        def capacity(self) -> BackendCapacity:
            return BackendCapacity(max_live_workflows=2)

    clock = FakeClock()
    domain = SimDomain(GIB)
    backend = _Backend(domain, clock)

    async def main() -> Any:
        runtime = Runtime(domain=domain, backend=backend, state_dir=tmp_path / "state",
                          clock=clock, keep_events=True, blocking=run_inline,
                          predictor=FixedPredictor(10 * MIB, 20 * MIB))
        async with runtime:
            return await body(runtime, domain, backend, clock)

    spans, cap, starts = asyncio.run(run_simulated(main(), clock))
    assert cap == 2
    first_end = min(end for _, end in spans)
    assert sorted(s for s, _ in spans)[2] >= first_end  # the third waited for a place
    assert max(e["waited_s"] for e in starts) > 1.5


def test_restartable_share_counts_every_judged_boundary(tmp_path: Path) -> None:
    """Two of three boundaries restartable: the share is 2/3 in the residency events, in the
    runtime's tally and in the runtime_stop event (the figure the bench summary reports)."""

    async def body(rt, domain, backend, clock):
        agent = await rt.create_agent(image="sim")
        await agent.run(load(10, 20, 1.0, 0), timeout=60)
        (sandbox,) = backend.live()
        sandbox.leftovers = ["/dev/shm/seg"]  # state a later action could read
        await agent.run(load(10, 20, 1.0, 0), timeout=60)
        sandbox.leftovers = []
        await agent.run(load(10, 20, 1.0, 0), timeout=60)
        return [e["restartable"] for e in rt.events.of_kind("residency")], rt.boundary.tally

    log = tmp_path / "events.jsonl"
    judged, tally = run_with_runtime(tmp_path, body, event_log=log)
    assert judged == [True, False, True]
    assert (tally.num_checked, tally.num_restartable) == (3, 2)
    assert tally.share == pytest.approx(2 / 3)
    stop = [json.loads(line) for line in log.read_text().splitlines()][-1]
    assert stop["kind"] == "runtime_stop"
    assert (stop["boundaries"], stop["restartable_boundaries"]) == (3, 2)
    assert stop["restartable_share"] == pytest.approx(0.6667)


def test_the_workflow_tenon_has_delayed_most_goes_first(tmp_path: Path) -> None:
    """Admission ranks an action by when it would have been ready had Tenon never made its
    workflow wait. B's first action waited 9 s behind C's, so B's second goes ahead of A's,
    though A's was ready first and both workflows started together; by start time alone A
    would go first, and a long workflow would collect one wait per action."""
    config = PolicyConfig(admission_window_bytes=150 * MIB)  # room for one 100 MiB charge

    async def body(rt, domain, backend, clock):
        a, b, c, d = [await rt.create_agent(image="sim") for _ in range(4)]

        async def at(t: float, agent: Any, *durations: float) -> None:
            await clock.sleep(t - clock.now())
            for duration in durations:
                result = await agent.run(load(100, 100, duration), timeout=60)
                assert result.outcome is Outcome.OK

        await asyncio.gather(at(0.0, c, 10.0), at(1.0, b, 2.0, 2.0), at(10.5, d, 2.0),
                             at(11.0, a, 2.0))
        ids = {agent.id: name for name, agent in zip("abcd", (a, b, c, d), strict=True)}
        return ([(ids[e["agent_id"]], e["t"]) for e in rt.events.of_kind("admit")],
                {(ids[e["agent_id"]], e["t"]): e["rank_at"]
                 for e in rt.events.of_kind("action_ready")})

    admits, ranks = run_with_runtime(tmp_path, body, config=config)
    assert [name for name, _ in admits] == ["c", "b", "d", "b", "a"]
    # B's second action: ready at 12 s, after a 9 s wait for its first
    (ready_t, rank), = [(t, r) for (name, t), r in ranks.items() if name == "b" and t > 5]
    assert rank == pytest.approx(ready_t - 9.0, abs=0.2)
    (a_rank,) = [r for (name, _), r in ranks.items() if name == "a"]
    assert a_rank == pytest.approx(11.0, abs=0.2)  # never delayed before
