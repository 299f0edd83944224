"""Where a workflow's time went: the split of its latency read back from an event log."""

from __future__ import annotations

import pytest

from tenon.replay.delays import PARTS, delays_markdown, workflow_delays


def ev(t: float, kind: str, **fields: object) -> dict[str, object]:
    return {"t": t, "kind": kind, **fields}


def test_a_retried_workflow_is_split_into_its_parts() -> None:
    events = [
        # attempt 1: waits 1 s for a slot, then fails
        ev(1.0, "workflow_start", agent_id="a1", workflow="w#0", waited_s=1.0),
        ev(1.5, "action_ready", action_id="a1-1", agent_id="a1"),
        ev(4.0, "workflow_end", agent_id="a1", failed="OOM kill"),
        # attempt 2 starts at once
        ev(4.0, "workflow_start", agent_id="a2", workflow="w#0", waited_s=0.5),
        ev(5.0, "action_ready", action_id="a2-1", agent_id="a2"),
        ev(5.0, "gate", action_id="a2-1", agent_id="a2", allowed=False),  # a held start
        ev(7.0, "admit", action_id="a2-1", agent_id="a2"),
        ev(8.0, "action_start", action_id="a2-1", agent_id="a2"),
        ev(9.0, "gate", action_id="a2-1", agent_id="a2", allowed=False),
        ev(9.5, "gate", action_id="a2-1", agent_id="a2", allowed=False),  # still held
        ev(11.0, "gate", action_id="a2-1", agent_id="a2", allowed=True),
        ev(12.0, "gate", action_id="a2-1", agent_id="a2", allowed=False),
        ev(12.5, "action_done", action_id="a2-1", agent_id="a2"),  # ends frozen
        ev(13.0, "action_ready", action_id="a2-2", agent_id="a2"),  # no admission step
        ev(13.25, "action_start", action_id="a2-2", agent_id="a2"),
        ev(14.0, "action_done", action_id="a2-2", agent_id="a2"),
        ev(14.0, "workflow_done", workflow="w#0", completed=True, attempts=2,
           latency_s=14.0, own_s=5.0),
    ]
    [split] = workflow_delays(events) or []
    assert split.workflow == "w#0"
    assert split.completed
    assert split.end == 14.0
    assert split.slot == pytest.approx(0.5)  # the last attempt's
    assert split.failed == pytest.approx(3.5)  # from attempt 1's creation to attempt 2's
    assert split.admission == pytest.approx(2.0)
    assert split.start == pytest.approx(1.0 + 0.25)
    assert split.frozen == pytest.approx(2.0 + 0.5)  # the hold before start is not counted
    parts = sum(getattr(split, p) for p in PARTS)
    assert split.own + parts == pytest.approx(split.latency)
    assert split.other == pytest.approx(14.0 - 5.0 - 0.5 - 3.5 - 2.0 - 1.25 - 2.5)


def test_the_table_gives_means_and_the_last_workflow_and_names_unsplit_logs() -> None:
    def run(name: str, latency: float, end: float, *, completed: bool = True
            ) -> list[dict[str, object]]:
        return [ev(0.0, "workflow_start", agent_id=name, workflow=name, waited_s=0.0),
                ev(end, "workflow_done", workflow=name, completed=completed, attempts=1,
                   latency_s=latency, own_s=2.0)]

    rows = workflow_delays(run("fast", 4.0, 4.0) + run("slow", 10.0, 12.0))
    assert rows is not None
    assert [r.workflow for r in rows] == ["fast", "slow"]
    old_log = [ev(0.0, "workflow_start", agent_id="a", waited_s=0.0)]
    assert workflow_delays(old_log) is None
    text = delays_markdown({"tenon": rows, "eager": None})
    assert "| tenon (2) | 7.0 | 2.0 | 0.0 | 0.0 | 0.0 | 0.0 | 0.0 | 5.0 |" in text
    assert "| tenon (slow) | 10.0 | 2.0 |" in text
    lost = workflow_delays(run("done", 4.0, 4.0) + run("gave-up", 30.0, 30.0, completed=False))
    lost_text = delays_markdown({"eager": lost})
    assert "| eager (1) | 4.0 |" in lost_text  # the means are over completed workflows
    assert "| eager (gave-up, not completed) | 30.0 |" in lost_text
    assert "Not split" in text
    assert "eager" in text
