"""A controller that dies mid-run, restarted on the same state directory (simulated backend).

The dead controller is simulated the way a SIGKILL leaves things: its loop stops, nothing
is closed, and its sandboxes are gone (a fresh backend and domain for the second one).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tenon.clock import FakeClock, run_simulated
from tenon.predict.static import FixedPredictor
from tenon.runtime.controller import Agent, Runtime
from tenon.runtime.residency import run_inline
from tenon.runtime.results import Outcome, WorkflowFailed
from tenon.sandbox.base import ProcessInfo
from tenon.sandbox.sim import SimBackend, SimDomain, sim_load_command
from tenon.state.recovery import RecoveryStore

MIB = 1024 * 1024
GIB = 1024 * MIB


def load(avg_mib: int, peak_mib: int, duration_s: float) -> str:
    return sim_load_command(avg_mib * MIB, peak_mib * MIB, duration_s, 0)


def make_runtime(state_dir: Path, clock: FakeClock) -> Runtime:
    domain = SimDomain(GIB)
    return Runtime(domain=domain, backend=SimBackend(domain, clock), state_dir=state_dir,
                   clock=clock, blocking=run_inline, keep_events=True,
                   predictor=FixedPredictor(100 * MIB, 200 * MIB))


async def crash(runtime: Runtime, *in_flight: asyncio.Task[Any]) -> None:
    """Stop the controller as SIGKILL would: no close(), no record written after this."""
    assert runtime._loop_task is not None
    runtime._loop_task.cancel()
    for task in in_flight:
        task.cancel()
    await asyncio.gather(runtime._loop_task, *in_flight, return_exceptions=True)


def crash_mid_action(tmp_path: Path, *, leftover: ProcessInfo | None = None,
                     workspace_file: bytes = b"") -> dict[str, Any]:
    """One action ends (its boundary as set up), the second is cut short by a crash; then a
    second controller recovers and runs the interrupted action again."""
    clock = FakeClock()

    async def main() -> dict[str, Any]:
        first = make_runtime(tmp_path, clock)
        await first.start()
        agent = await first.create_agent(image="sim", workflow="wf-1", task="t")
        sandbox = first.residency.sandbox_for(agent.id)
        await agent.run(load(10, 20, 0.5), timeout=60)
        sandbox = first.residency.sandbox_for(agent.id)
        assert sandbox is not None
        if workspace_file:
            (sandbox.spec.workspace / "workspace" / "notes.txt").write_bytes(workspace_file)
        if leftover is not None:  # the process appears after the first boundary was checked
            sandbox.leftover_processes = [leftover]
            await agent.run(load(10, 20, 0.5), timeout=60)
        cut = asyncio.ensure_future(agent.run(load(10, 20, 30.0), timeout=60))
        await clock.sleep(1.0)  # the action runs
        await crash(first, cut)

        second = make_runtime(tmp_path, clock)
        await second.start()
        (recovered,) = second.recover()
        out: dict[str, Any] = {
            "agent": recovered, "report": second.last_reconcile,
            "record": second._recovery.get(recovered.id),
            "events": list(second.events.events or []),
        }
        if recovered.failed:
            with pytest.raises(WorkflowFailed, match="blocked"):
                await recovered.run(load(10, 20, 0.5), timeout=60)
        else:
            out["rerun"] = await recovered.run(load(10, 20, 0.5), timeout=60)
            out["sandbox"] = second.residency.sandbox_for(recovered.id)
            out["done"] = recovered.num_actions_done
        await second.close()
        return out

    return asyncio.run(run_simulated(main(), clock))


def test_an_action_in_flight_at_the_crash_comes_back_interrupted_and_reruns(
    tmp_path: Path,
) -> None:
    out = crash_mid_action(tmp_path, workspace_file=b"written before the crash\n")
    agent: Agent = out["agent"]
    assert agent.workflow == "wf-1"  # the caller's name for it survives the restart
    assert agent.interrupted is not None
    assert agent.interrupted.outcome is Outcome.INTERRUPTED
    assert agent.interrupted.action_id == f"{agent.id}-a0002"
    kinds = {e["kind"]: e for e in out["events"]}
    assert kinds["action_interrupted"]["action_id"] == f"{agent.id}-a0002"
    assert out["report"].interrupted == {agent.id: f"{agent.id}-a0002"}
    # restartable at its last boundary: recommitted from disk, then rebuilt from that record
    assert out["report"].recaptured == (agent.id,)
    record = out["record"]
    assert record.state == "torn_down"
    assert any(e.path == "workspace/notes.txt" for e in record.manifest.entries)
    assert record.num_actions == 1
    assert record.last_boundary == "restartable"
    # the rerun carries on the numbering: it is the interrupted action, run again
    assert out["rerun"].action_id == f"{agent.id}-a0002"
    assert out["rerun"].outcome is Outcome.OK
    assert "-g2-" in out["sandbox"].spec.sandbox_id
    assert out["done"] == 2


def test_a_resident_only_sandbox_lost_with_the_controller_blocks_naming_what_was_lost(
    tmp_path: Path,
) -> None:
    out = crash_mid_action(tmp_path, leftover=ProcessInfo(4242, 1, "postgres -D /workspace/db"))
    agent: Agent = out["agent"]
    reason = out["report"].blocked[agent.id]
    assert "resident-only" in reason
    assert "postgres" in reason
    assert out["record"].state == "blocked"
    assert out["record"].reason == reason
    assert agent.failed
    assert agent.interrupted is not None  # reported even though the agent cannot go on


def test_close_keeps_a_blocked_agents_record_for_the_operator(tmp_path: Path) -> None:
    crash_mid_action(tmp_path, leftover=ProcessInfo(7, 1, "redis-server"))
    store = RecoveryStore(tmp_path / "recovery.sqlite")
    try:
        (record,) = store.all()
    finally:
        store.close()
    assert record.state == "blocked"
    assert (tmp_path / "workspaces" / record.agent_id).is_dir()


def test_a_new_agent_never_takes_the_id_of_a_recovered_one(tmp_path: Path) -> None:
    clock = FakeClock()

    async def main() -> tuple[str, str]:
        first = make_runtime(tmp_path, clock)
        await first.start()
        old = await first.create_agent(image="sim")
        await old.run(load(10, 20, 0.5), timeout=60)
        await crash(first)
        second = make_runtime(tmp_path, clock)
        await second.start()
        second.recover()
        new = await second.create_agent(image="sim")
        await second.close()
        return old.id, new.id

    old_id, new_id = asyncio.run(run_simulated(main(), clock))
    assert old_id == "agent-00001"
    assert new_id == "agent-00002"
