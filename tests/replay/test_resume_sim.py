"""The replay's journal: completed workflows are recorded durably and skipped on resume."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from tenon.clock import FakeClock, run_simulated
from tenon.predict.static import FixedPredictor
from tenon.replay.driver import WorkflowRecord, replay
from tenon.replay.schedule import make_schedule
from tenon.replay.trace import Action, Memory, Step, Workflow
from tenon.runtime.controller import Runtime
from tenon.runtime.residency import run_inline
from tenon.sandbox.sim import SimBackend, SimDomain

MIB = 1 << 20
GIB = 1 << 30


def make_workflow(wid: str, *, steps: int = 3) -> Workflow:
    memory = Memory(avg_bytes=100 * MIB, peak_bytes=150 * MIB, resident_after_bytes=8 * MIB)
    action = Action(command="make test", tool="Bash", action_class="compiler", duration_s=2.0,
                    memory=memory)
    return Workflow(id=wid, submit_s=0.0, base_image="sim", family="demo",
                    steps=[Step(model_wait_s=1.0, action=action)] * steps)


def run_replay(state_dir: Path, journal: Path, workflows: list[Workflow]
               ) -> tuple[list[WorkflowRecord], list[str]]:
    """One controller replaying `workflows`; the records and the event kinds it logged."""
    clock = FakeClock()
    domain = SimDomain(GIB)
    submissions = make_schedule(workflows, qps=None)

    async def main() -> tuple[list[WorkflowRecord], list[str]]:
        rt = Runtime(domain=domain, backend=SimBackend(domain, clock), state_dir=state_dir,
                     clock=clock, blocking=run_inline, keep_events=True,
                     predictor=FixedPredictor(100 * MIB, 150 * MIB))
        async with rt:
            rt.recover()
            records = await replay(rt, submissions, speed=1.0, journal=journal)
            return records, [e["kind"] for e in rt.events.events or []]

    return asyncio.run(run_simulated(main(), clock))


def test_completed_workflows_are_journaled_and_skipped_when_resuming(tmp_path: Path) -> None:
    journal = tmp_path / "journal.jsonl"
    workflows = [make_workflow("w1"), make_workflow("w2", steps=2)]
    records, kinds = run_replay(tmp_path / "state", journal, workflows)
    assert all(r.completed for r in records)
    assert kinds.count("workflow_start") == 2
    entries = [json.loads(line) for line in journal.read_text().splitlines()]
    assert entries[0]["kind"] == "start"
    assert sorted(e["workflow"] for e in entries[1:]) == sorted(r.instance for r in records)

    again, kinds = run_replay(tmp_path / "state", journal, workflows)
    assert [r.completed for r in again] == [True, True]
    assert "workflow_start" not in kinds  # nothing was run a second time
    assert "action_start" not in kinds


def test_a_journal_torn_mid_write_keeps_what_was_complete(tmp_path: Path) -> None:
    journal = tmp_path / "journal.jsonl"
    workflows = [make_workflow("w1", steps=1), make_workflow("w2", steps=1)]
    records, _ = run_replay(tmp_path / "state", journal, workflows)
    lines = journal.read_text().splitlines()
    second = json.loads(lines[2])["workflow"]
    journal.write_text("\n".join(lines[:2]) + "\n" + lines[2][:10])  # the last write torn
    again, kinds = run_replay(tmp_path / "state", journal, workflows)
    assert all(r.completed for r in again)
    assert kinds.count("workflow_start") == 1  # only the workflow whose entry was torn
    assert second in {r.instance for r in records}
