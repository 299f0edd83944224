"""The runtime's hooks for a service on top of it: interactive commands, commands alongside
an action, workspace edits, teardown and rebuild on request, restarts that keep agents, and
the per-agent residency view. Simulated backend and clock, except where marked."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from tenon.clock import FakeClock, run_simulated
from tenon.errors import NotBusy, RecoveryError, UnknownAgent
from tenon.policy.config import PolicyConfig
from tenon.predict.static import FixedPredictor
from tenon.runtime.controller import Runtime
from tenon.runtime.residency import run_inline
from tenon.runtime.results import Outcome
from tenon.sandbox import launcher
from tenon.sandbox.base import BackendCapacity, ExecControl, ExecIO, ProcessInfo
from tenon.sandbox.sim import SimBackend, SimDomain, SimSandbox, sim_load_command
from tenon.state.recovery import RecoveryStore

MIB = 1024 * 1024
GIB = 1024 * MIB
LEFTOVER = ProcessInfo(4242, 1, "python3 -m http.server")

Body = Callable[[Runtime, SimBackend, FakeClock], Awaitable[Any]]


def load(duration_s: float, peak_mib: int = 20) -> str:
    return sim_load_command(10 * MIB, peak_mib * MIB, duration_s, 0)


def make_runtime(state_dir: Path, clock: FakeClock, *, keep_agents: bool = False,
                 policy: str = "tenon", config: PolicyConfig | None = None,
                 max_admitted_actions: int | None = None) -> tuple[Runtime, SimBackend]:
    domain = SimDomain(GIB)
    backend = SimBackend(domain, clock)
    if max_admitted_actions is not None:
        capacity = BackendCapacity(max_admitted_actions=max_admitted_actions)
        backend.capacity = lambda: capacity  # type: ignore[method-assign]
    runtime = Runtime(domain=domain, backend=backend, state_dir=state_dir, clock=clock,
                      blocking=run_inline, keep_events=True, policy=policy, config=config,
                      keep_agents=keep_agents, predictor=FixedPredictor(10 * MIB, 20 * MIB))
    return runtime, backend


def simulate(tmp_path: Path, body: Body, **kwargs: Any) -> Any:
    clock = FakeClock()

    async def main() -> Any:
        runtime, backend = make_runtime(tmp_path / "state", clock, **kwargs)
        async with runtime:
            return await body(runtime, backend, clock)

    return asyncio.run(run_simulated(main(), clock))


def sandbox_of(rt: Runtime, agent_id: str) -> SimSandbox:
    sandbox = rt.residency.sandbox_for(agent_id)
    assert isinstance(sandbox, SimSandbox)
    return sandbox


def kinds(rt: Runtime, kind: str, agent_id: str) -> list[dict[str, Any]]:
    return [e for e in rt.events.of_kind(kind) if e.get("agent_id") == agent_id]


# -- interactive commands as actions ---------------------------------------------------


def test_an_interactive_action_gets_its_control_and_is_still_admitted(tmp_path: Path) -> None:
    async def body(rt: Runtime, backend: SimBackend, clock: FakeClock) -> Any:
        agent = await rt.create_agent(image="sim")
        controls: list[ExecControl] = []

        def started(control: ExecControl) -> None:
            controls.append(control)
            asyncio.ensure_future(control.signal(signal.SIGTERM))

        result = await agent.run(load(30.0), timeout=60, io=ExecIO(on_start=started))
        return result, controls, kinds(rt, "admit", agent.id)

    result, controls, admits = simulate(tmp_path, body)
    assert len(controls) == 1
    assert result.exit_code == -signal.SIGTERM  # the signal reached the command
    assert result.duration_s < 1.0
    assert [a["action_id"] for a in admits] == [result.action_id]


# -- commands alongside the action in flight --------------------------------------------


def test_alongside_runs_next_to_the_action_without_an_admission(tmp_path: Path) -> None:
    async def body(rt: Runtime, backend: SimBackend, clock: FakeClock) -> Any:
        agent = await rt.create_agent(image="sim")
        with pytest.raises(NotBusy):  # nothing in flight before the first action
            await agent.run_alongside(load(1.0), timeout=10)
        main = asyncio.ensure_future(agent.run(load(5.0), timeout=60))
        await asyncio.sleep(0)  # the action is ready, not yet started: alongside waits
        side = await agent.run_alongside(load(1.0), timeout=10)
        side_done_at = clock.now()
        assert not main.done()
        result = await main
        with pytest.raises(NotBusy):
            await agent.run_alongside(load(1.0), timeout=10)
        return side, side_done_at, result, clock.now(), len(rt.events.of_kind("admit")), \
            sandbox_of(rt, agent.id).commands

    side, side_done_at, result, end, num_admits, commands = simulate(tmp_path, body)
    assert side.exit_code == 0
    assert "sim load done" in side.output
    assert side_done_at < end
    assert result.outcome is Outcome.OK
    assert num_admits == 1
    assert len(commands) == 2  # both ran in the one sandbox


def test_a_command_outliving_its_action_pins_the_sandbox_and_the_boundary(
        tmp_path: Path) -> None:
    async def body(rt: Runtime, backend: SimBackend, clock: FakeClock) -> Any:
        agent = await rt.create_agent(image="sim")
        main = asyncio.ensure_future(agent.run(load(1.0), timeout=60))
        side = asyncio.ensure_future(agent.run_alongside(load(6.0), timeout=60))
        await main
        seen: dict[str, Any] = {"during": rt.residency_of(agent.id),
                "teardown_during": await rt.teardown_now(agent.id),
                "residency_event": kinds(rt, "residency", agent.id)[-1]}
        teardown = await rt.residency.teardown(agent.id)  # the protocol itself refuses too
        seen["refused"] = (teardown.outcome, teardown.step)
        await side
        seen["after"] = rt.residency_of(agent.id)
        seen["teardown_after"] = await rt.teardown_now(agent.id)
        seen["live"] = len(backend.live())
        return seen

    seen = simulate(tmp_path, body)
    assert seen["during"] == "busy"
    assert seen["teardown_during"].startswith("busy")
    assert seen["residency_event"]["restartable"] is False
    assert "alongside" in seen["residency_event"]["eligibility"]
    assert seen["refused"] == ("kept_resident", "held")
    assert seen["after"] == "resident_only"
    assert seen["teardown_after"].startswith("resident_only")
    assert seen["live"] == 1


# -- workspace edits -----------------------------------------------------------------------


def test_an_edit_before_the_first_action_is_what_the_sandbox_starts_with(
        tmp_path: Path) -> None:
    async def body(rt: Runtime, backend: SimBackend, clock: FakeClock) -> Any:
        agent = await rt.create_agent(image="sim")
        async with rt.edit_workspace(agent.id) as root:
            (root / "workspace" / "in.txt").write_text("given")
        record = rt._recovery.get(agent.id)
        state_before = rt.residency_of(agent.id)
        await agent.run(load(0.5), timeout=60)
        workspace = sandbox_of(rt, agent.id).spec.workspace
        return (record, state_before, (workspace / "workspace" / "in.txt").read_text(),
                rt._recovery.get(agent.id), kinds(rt, "materialize", agent.id))

    record, state_before, text, after, materialized = simulate(tmp_path, body)
    assert record is not None
    assert record.generation == 0
    assert record.state == "torn_down"
    assert state_before == "new"
    assert text == "given"
    assert after is not None
    assert after.generation == 1
    assert after.state == "resident"
    assert len(materialized) == 1


def test_an_edit_while_torn_down_is_what_the_rebuild_verifies_and_sees(tmp_path: Path) -> None:
    async def body(rt: Runtime, backend: SimBackend, clock: FakeClock) -> Any:
        agent = await rt.create_agent(image="sim")
        await agent.run(load(0.5), timeout=60)
        assert await rt.teardown_now(agent.id) is None
        assert rt.residency_of(agent.id) == "torn_down"
        digest = rt._recovery.get(agent.id).manifest_digest  # type: ignore[union-attr]
        async with rt.edit_workspace(agent.id) as root:
            (root / "home" / ".bashrc").write_text("export X=1\n")
        edited = rt._recovery.get(agent.id)
        await agent.run(load(0.5), timeout=60)  # rebuilds and verifies
        workspace = sandbox_of(rt, agent.id).spec.workspace
        return digest, edited, (workspace / "home" / ".bashrc").read_text(), \
            rt.residency_of(agent.id)

    digest, edited, text, residency = simulate(tmp_path, body)
    assert edited.state == "torn_down"
    assert edited.manifest_digest != digest
    assert edited.generation == 1
    assert text == "export X=1\n"
    assert residency == "resident"


def test_an_edit_holds_off_a_rebuild_and_a_teardown(tmp_path: Path) -> None:
    async def body(rt: Runtime, backend: SimBackend, clock: FakeClock) -> Any:
        agent = await rt.create_agent(image="sim")
        await agent.run(load(0.5), timeout=60)
        release = asyncio.Event()
        editing = asyncio.Event()

        async def edit() -> None:
            async with rt.edit_workspace(agent.id) as root:
                editing.set()
                await release.wait()
                (root / "workspace" / "late.txt").write_text("late")

        editor = asyncio.ensure_future(edit())
        await editing.wait()
        held = await rt.teardown_now(agent.id)  # resident and idle, but edited: stays
        release.set()
        await editor
        assert await rt.teardown_now(agent.id) is None  # the edit did not spoil the boundary

        release.clear()
        editing.clear()
        editor = asyncio.ensure_future(edit())
        await editing.wait()
        warm = asyncio.ensure_future(rt.prewarm(agent.id))
        await clock.sleep(2.0)
        waited = not warm.done() and rt.residency_of(agent.id) == "torn_down"
        release.set()
        await editor
        await warm
        workspace = sandbox_of(rt, agent.id).spec.workspace
        return held, waited, (workspace / "workspace" / "late.txt").read_text()

    held, waited, text = simulate(tmp_path, body)
    assert held is not None
    assert "edit" in held
    assert waited
    assert text == "late"


def test_a_first_action_during_an_edit_materializes_from_the_edited_root(
        tmp_path: Path) -> None:
    async def body(rt: Runtime, backend: SimBackend, clock: FakeClock) -> Any:
        agent = await rt.create_agent(image="sim")
        release = asyncio.Event()

        async def edit() -> None:
            async with rt.edit_workspace(agent.id) as root:
                await release.wait()
                (root / "workspace" / "in.txt").write_text("given")

        editor = asyncio.ensure_future(edit())
        await asyncio.sleep(0)
        first = asyncio.ensure_future(agent.run(load(0.5), timeout=60))
        await clock.sleep(1.0)
        waited = not first.done() and backend.live() == []
        release.set()
        await editor
        result = await first
        workspace = sandbox_of(rt, agent.id).spec.workspace
        return (waited, result, (workspace / "workspace" / "in.txt").read_text(),
                rt._recovery.get(agent.id))

    waited, result, text, record = simulate(tmp_path, body)
    assert waited
    assert result.outcome is Outcome.OK
    assert text == "given"
    assert record.generation == 1
    assert record.state == "resident"


def test_closing_a_never_run_agent_removes_the_root_its_edit_made(tmp_path: Path) -> None:
    async def body(rt: Runtime, backend: SimBackend, clock: FakeClock) -> Any:
        agent = await rt.create_agent(image="sim")
        async with rt.edit_workspace(agent.id) as root:
            (root / "tmp" / "x").write_text("x")
        await agent.close()
        return root.exists(), rt._recovery.get(agent.id)

    exists, record = simulate(tmp_path, body)
    assert not exists
    assert record is None


# -- teardown and rebuild on request, and the residency view --------------------------------


def test_teardown_now_and_prewarm_follow_the_agents_state(tmp_path: Path) -> None:
    async def body(rt: Runtime, backend: SimBackend, clock: FakeClock) -> Any:
        agent = await rt.create_agent(image="sim")
        out: dict[str, Any] = {"new": rt.residency_of(agent.id),
                               "teardown_new": await rt.teardown_now(agent.id)}
        await rt.prewarm(agent.id)  # nothing to rebuild: no sandbox yet
        out["live_after_prewarm_new"] = len(backend.live())
        main = asyncio.ensure_future(agent.run(load(3.0), timeout=60))
        await clock.sleep(1.0)
        out["running"] = rt.residency_of(agent.id)
        out["teardown_busy"] = await rt.teardown_now(agent.id)
        await main
        out["idle"] = rt.residency_of(agent.id)
        out["teardown"] = await rt.teardown_now(agent.id)
        out["teardown_again"] = await rt.teardown_now(agent.id)
        out["torn_down"] = rt.residency_of(agent.id)
        out["live_torn_down"] = len(backend.live())
        await rt.prewarm(agent.id)
        out["prewarmed"] = rt.residency_of(agent.id)
        await rt.prewarm(agent.id)  # resident: a no-op
        out["rebuilds"] = len(kinds(rt, "rebuild", agent.id))
        out["live"] = len(backend.live())
        with pytest.raises(UnknownAgent):
            rt.residency_of("nobody")
        return out

    out = simulate(tmp_path, body)
    assert out["new"] == "new"
    assert out["teardown_new"] is None
    assert out["live_after_prewarm_new"] == 0
    assert out["running"] == "busy"
    assert out["teardown_busy"].startswith("busy")
    assert out["idle"] == "resident"
    assert out["teardown"] is None
    assert out["teardown_again"] is None
    assert out["torn_down"] == "torn_down"
    assert out["live_torn_down"] == 0
    assert out["prewarmed"] == "resident"
    assert out["rebuilds"] == 1
    assert out["live"] == 1


def test_an_action_the_gate_holds_shows_frozen(tmp_path: Path) -> None:
    async def body(rt: Runtime, backend: SimBackend, clock: FakeClock) -> Any:
        # both predicted small, both grow to 600 MiB in a 1 GiB domain: the gate holds one
        agents = [await rt.create_agent(image="sim") for _ in range(2)]
        runs = [asyncio.ensure_future(a.run(load(6.0, peak_mib=600), timeout=60))
                for a in agents]
        seen: list[set[str]] = [set(), set()]
        while not all(run.done() for run in runs):
            await clock.sleep(0.1)
            for i, agent in enumerate(agents):
                seen[i].add(rt.residency_of(agent.id))
        return seen, [run.result().outcome for run in runs]

    seen, outcomes = simulate(tmp_path, body)
    assert outcomes == [Outcome.OK, Outcome.OK]
    assert "frozen" in seen[0] | seen[1]
    assert all("busy" in states for states in seen)


def test_a_resident_only_boundary_is_the_reason_teardown_now_gives(tmp_path: Path) -> None:
    async def body(rt: Runtime, backend: SimBackend, clock: FakeClock) -> Any:
        agent = await rt.create_agent(image="sim")
        await agent.run(load(0.5), timeout=60)
        sandbox_of(rt, agent.id).leftover_processes = [LEFTOVER]
        await agent.run(load(0.5), timeout=60)
        return rt.residency_of(agent.id), await rt.teardown_now(agent.id), len(backend.live())

    residency, reason, live = simulate(tmp_path, body)
    assert residency == "resident_only"
    assert reason is not None
    assert reason.startswith("resident_only")
    assert "4242" in reason
    assert live == 1


def test_a_failed_rebuild_shows_blocked_and_prewarm_raises(tmp_path: Path) -> None:
    async def body(rt: Runtime, backend: SimBackend, clock: FakeClock) -> Any:
        agent = await rt.create_agent(image="sim")
        await agent.run(load(0.5), timeout=60)
        assert await rt.teardown_now(agent.id) is None
        # a write that bypasses edit_workspace: the committed digest no longer matches
        (rt.workspaces.path_for(agent.id) / "workspace" / "stray").write_text("x")
        with pytest.raises(RecoveryError):
            await rt.prewarm(agent.id)
        return rt.residency_of(agent.id)

    assert simulate(tmp_path, body) == "blocked"


def test_an_oom_killed_attempt_shows_failed(tmp_path: Path) -> None:
    async def body(rt: Runtime, backend: SimBackend, clock: FakeClock) -> Any:
        agents = [await rt.create_agent(image="sim") for _ in range(2)]
        results = await asyncio.gather(*(a.run(load(3.0, peak_mib=700), timeout=60)
                                         for a in agents))
        failed = [a for a, r in zip(agents, results, strict=True)
                  if r.outcome is Outcome.OOM_KILLED]
        assert failed
        return rt.residency_of(failed[0].id), await rt.teardown_now(failed[0].id)

    residency, reason = simulate(tmp_path, body, policy="eager")
    assert residency == "failed"
    assert reason is not None
    assert reason.startswith("failed")


# -- a restart that keeps agents ----------------------------------------------------------


def test_a_restart_keeping_agents_restores_each_as_a_crash_would(tmp_path: Path) -> None:
    clock = FakeClock()
    state_dir = tmp_path / "state"

    async def main() -> Any:
        first, backend = make_runtime(state_dir, clock, keep_agents=True)
        async with first:
            await first.create_agent(image="sim", agent_id="fresh", workflow="wf-f")
            idle = await first.create_agent(image="sim", agent_id="idle")
            pinned = await first.create_agent(image="sim", agent_id="pinned")
            for agent in (idle, pinned):
                await agent.run(load(0.5), timeout=60)
            root = first.residency.sandbox_for("idle").spec.workspace  # type: ignore[union-attr]
            (root / "workspace" / "kept.txt").write_text("kept")
            sandbox_of(first, "pinned").leftover_processes = [LEFTOVER]
            await pinned.run(load(0.5), timeout=60)
            assert first.residency_of("pinned") == "resident_only"
            running = await first.create_agent(image="sim", agent_id="running")
            await running.run(load(0.5), timeout=60)
            cut = asyncio.ensure_future(running.run(load(30.0), timeout=60))
            await clock.sleep(1.0)
        assert (await cut).outcome is Outcome.SANDBOX_DIED
        assert backend.live() == []

        second, _ = make_runtime(state_dir, clock)
        async with second:
            recovered = {a.id: a for a in second.recover()}
            seen = {i: second.residency_of(i) for i in recovered}
            meta = second.agents["fresh"].workflow
            kept = await recovered["idle"].run(load(0.5), timeout=60)
            text = (second.residency.sandbox_for("idle").spec.workspace  # type: ignore[union-attr]
                    / "workspace" / "kept.txt").read_text()
            first_run = await recovered["fresh"].run(load(0.5), timeout=60)
            report = second.last_reconcile
            assert report is not None
            assert report.interrupted == {"running": "running-a0002"}
            assert report.recaptured == ("running",)
            reason = report.blocked.get("pinned")
        return seen, meta, kept, text, first_run, reason

    seen, meta, kept, text, first_run, reason = asyncio.run(run_simulated(main(), clock))
    assert seen == {"fresh": "new", "idle": "torn_down", "pinned": "blocked",
                    "running": "torn_down"}
    assert meta == "wf-f"
    assert kept.outcome is Outcome.OK
    assert text == "kept"
    assert first_run.outcome is Outcome.OK
    assert reason is not None
    assert "resident-only" in reason
    assert "4242" in reason


def test_keeping_agents_tears_down_one_whose_next_action_is_only_queued(
        tmp_path: Path) -> None:
    clock = FakeClock()

    async def main() -> Any:
        rt, _ = make_runtime(tmp_path / "state", clock, keep_agents=True,
                             max_admitted_actions=1)
        async with rt:
            queued = await rt.create_agent(image="sim", agent_id="queued")
            running = await rt.create_agent(image="sim", agent_id="running")
            await queued.run(load(0.5), timeout=60)
            long = asyncio.ensure_future(running.run(load(30.0), timeout=60))
            await clock.sleep(1.0)
            waiting = asyncio.ensure_future(queued.run(load(0.5), timeout=60))
            await clock.sleep(1.0)
            assert not waiting.done()  # behind the admission cap
        waiting.cancel()
        await asyncio.gather(long, waiting, return_exceptions=True)
        return {e["agent_id"]: e["how"] for e in rt.events.of_kind("agent_kept")}

    kept = asyncio.run(run_simulated(main(), clock))
    assert kept == {"queued": "torn_down", "running": "dropped"}
    store = RecoveryStore(tmp_path / "state" / "recovery.sqlite")
    try:
        states = {r.agent_id: (r.state, r.in_flight) for r in store.all()}
    finally:
        store.close()
    assert states == {"queued": ("torn_down", None), "running": ("resident", "running-a0001")}


def test_a_default_close_still_ends_every_workflow(tmp_path: Path) -> None:
    clock = FakeClock()
    state_dir = tmp_path / "state"

    async def main() -> Any:
        first, _ = make_runtime(state_dir, clock)
        async with first:
            agent = await first.create_agent(image="sim")
            await agent.run(load(0.5), timeout=60)
        second, _ = make_runtime(state_dir, clock)
        async with second:
            return second.recover()

    assert asyncio.run(run_simulated(main(), clock)) == []


# -- on the process backend ---------------------------------------------------------------

STATE_DIR = Path("/var/lib/tenon")
IMAGE = "tenon-base:bookworm"


def _need_real_sandboxes() -> None:
    import os

    if os.geteuid() != 0:
        pytest.skip("real sandboxes need root")
    if problems := launcher.check():
        pytest.skip(problems[0])
    if not (STATE_DIR / "images").exists():
        pytest.skip("base image missing: run `tenon image build`")


@pytest.mark.sandbox
@pytest.mark.cgroups
@pytest.mark.disk
@pytest.mark.slow
async def test_hooks_on_real_sandboxes_and_a_restart_that_keeps_them(tmp_path: Path) -> None:
    from tenon.host import diskfs
    from tenon.runtime.open import open_runtime

    _need_real_sandboxes()
    run_dir = tmp_path / "run"
    opened: dict[str, Any] = {"budget_bytes": 1024 * MIB, "state_dir": STATE_DIR,
                              "run_dir": run_dir,
                              "predictor": FixedPredictor(16 * MIB, 32 * MIB)}
    async with open_runtime(keep_agents=True, **opened) as rt:
        agent = await rt.create_agent(image=IMAGE, agent_id="svc-a")
        main = asyncio.ensure_future(agent.run("sleep 1.5; cat /workspace/side.txt",
                                               timeout=30))
        await asyncio.sleep(0)  # the action is in flight (it may not have started yet)
        side = await agent.run_alongside("echo side > /workspace/side.txt; echo hi",
                                         timeout=30)
        assert side.exit_code == 0
        assert side.output == "hi\n"
        done = await main
        assert done.output == "side\n"

        main = asyncio.ensure_future(agent.run("sleep 1", timeout=30))
        await asyncio.sleep(0)
        outliving = asyncio.ensure_future(agent.run_alongside("sleep 3", timeout=30))
        await main
        assert rt.residency_of(agent.id) == "busy"
        assert (await outliving).exit_code == 0
        assert rt.residency_of(agent.id) == "resident_only"  # the real check saw the sleep
        reason = await rt.teardown_now(agent.id)
        assert reason is not None
        assert reason.startswith("resident_only")

        assert (await agent.run("true", timeout=30)).exit_code == 0
        assert await rt.teardown_now(agent.id) is None
        async with rt.edit_workspace(agent.id) as root:
            assert diskfs.mounted_at(root) is not None
            (root / "workspace" / "edited.txt").write_text("edited")
        await rt.prewarm(agent.id)
        assert rt.residency_of(agent.id) == "resident"
        seen = await agent.run("cat /workspace/edited.txt", timeout=30)
        assert seen.output == "edited"
        assert await rt.teardown_now(agent.id) is None
        fresh = await rt.create_agent(image=IMAGE, agent_id="svc-new")
        async with rt.edit_workspace(fresh.id) as root:
            (root / "home" / "given.txt").write_text("given")

    async with open_runtime(**opened) as rt:
        assert sorted(rt.recovered) == ["svc-a", "svc-new"]
        assert rt.residency_of("svc-a") == "torn_down"
        assert rt.residency_of("svc-new") == "new"
        again = await rt.recovered["svc-a"].run("cat /workspace/edited.txt", timeout=30)
        assert again.output == "edited"
        given = await rt.recovered["svc-new"].run("cat ~/given.txt", timeout=30)
        assert given.output == "given"
    assert diskfs.mounts_under(run_dir / "workspaces") == []
    assert not any((run_dir / "workspaces").glob("svc-*"))
