"""Where each workflow's time went in a bench run, read back from a policy's event log.

A workflow's latency is its own length (its model waits and recorded action durations at
the run's speed: what it takes alone on an idle host) plus what the policy and the host
added to it:

- `slot`: waiting for a live-workflow slot before its last attempt started;
- `failed`: everything before its last attempt (the failed attempts and their slot waits);
- `admission`: its actions queued for admission (ready to admitted);
- `start`: admitted to running (rebuilding a torn-down sandbox, a start held by the gate);
- `frozen`: its running actions frozen by the execution gate;
- `other`: the rest, i.e. actions running slower than recorded (CPU contention, exec
  overhead) and timer slack. It is what is left, so the parts add up to the latency.

Only the last attempt's actions are split; an earlier attempt counts whole as `failed`.
Event logs written before workflows named their instance cannot be split (None).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PARTS = ("slot", "failed", "admission", "start", "frozen", "other")


@dataclass(frozen=True, slots=True)
class WorkflowDelay:
    """One workflow's latency split into its own length and what was added to it (s)."""

    workflow: str
    completed: bool
    end: float
    """When it finished (event time); the last to finish sets the makespan."""
    latency: float
    own: float
    slot: float
    failed: float
    admission: float
    start: float
    frozen: float
    other: float


@dataclass
class _Action:
    ready: float
    admit: float | None = None
    start: float | None = None
    done: float | None = None
    frozen: float = 0.0
    denied_at: float | None = None


@dataclass
class _Attempt:
    agent_id: str
    created: float
    slot: float
    actions: dict[str, _Action]


def workflow_delays(events: Iterable[Mapping[str, Any]]) -> list[WorkflowDelay] | None:
    """The split of every finished workflow in one policy's events, in finishing order;
    None if the log does not name workflows (written before `workflow_start` carried it)."""
    attempts: dict[str, list[_Attempt]] = defaultdict(list)
    by_agent: dict[str, _Attempt] = {}
    out: list[WorkflowDelay] = []
    for event in events:
        kind, t = event.get("kind"), float(event.get("t", 0.0))
        agent = by_agent.get(event.get("agent_id", ""))
        if kind == "workflow_start":
            name = event.get("workflow")
            if name is None:
                return None
            slot = float(event.get("waited_s", 0.0))
            attempt = _Attempt(event["agent_id"], t - slot, slot, {})
            attempts[name].append(attempt)
            by_agent[attempt.agent_id] = attempt
        elif kind == "action_ready" and agent is not None:
            agent.actions[event["action_id"]] = _Action(t)
        elif agent is not None and event.get("action_id") in agent.actions:
            _note(agent.actions[event["action_id"]], kind, t, event)
        elif kind == "workflow_done" and event.get("own_s") is not None:
            tries = attempts.get(event["workflow"])
            if tries:
                out.append(_split(event, tries, t))
    return out


def _note(action: _Action, kind: object, t: float, event: Mapping[str, Any]) -> None:
    if kind == "admit":
        action.admit = t
    elif kind == "action_start":
        action.start = t
    elif kind == "action_done":
        action.done = t
        if action.denied_at is not None:
            action.frozen += t - action.denied_at
            action.denied_at = None
    elif kind == "gate" and action.start is not None and action.done is None:
        if not event.get("allowed") and action.denied_at is None:
            action.denied_at = t
        elif event.get("allowed") and action.denied_at is not None:
            action.frozen += t - action.denied_at
            action.denied_at = None


def _split(done: Mapping[str, Any], tries: Sequence[_Attempt], end: float) -> WorkflowDelay:
    last = tries[-1]
    latency = float(done["latency_s"])
    own = float(done["own_s"])
    failed = last.created - tries[0].created
    admission = start = frozen = 0.0
    for action in last.actions.values():
        admitted = action.ready if action.admit is None else action.admit  # no admission step
        admission += admitted - action.ready
        if action.start is not None:
            start += action.start - admitted
        frozen += action.frozen
    parts = {"slot": last.slot, "failed": failed, "admission": admission, "start": start,
             "frozen": frozen}
    other = latency - own - sum(parts.values())
    return WorkflowDelay(str(done["workflow"]), bool(done.get("completed")), end, latency,
                         own, other=other, **parts)


def delays_markdown(delays: Mapping[str, Sequence[WorkflowDelay] | None]) -> str:
    """Two tables: the mean split over completed workflows per policy, and the split of the
    workflow each policy finished last (the one that sets its makespan)."""
    columns = ["latency", "own", *PARTS]
    head = "| policy | " + " | ".join(columns) + " |"
    rule = "|---" * (len(columns) + 1) + "|"
    means = ["Where the time went, mean seconds per completed workflow: latency = own (its "
             "length alone on an idle host) + slot (wait for a workflow slot) + failed "
             "(earlier attempts) + admission (queued) + start (rebuild, start held) + frozen "
             "(by the gate) + other (running slower than recorded).", "", head, rule]
    lasts = ["The workflow each policy finished last (seconds):", "", head, rule]
    skipped = []
    for name, rows in delays.items():
        if rows is None:
            skipped.append(name)
            continue
        done = [r for r in rows if r.completed]
        if done:
            row = {c: statistics.fmean(getattr(r, c) for r in done) for c in columns}
            means.append(f"| {name} ({len(done)}) | " +
                         " | ".join(f"{row[c]:.1f}" for c in columns) + " |")
        if rows:
            final = max(rows, key=lambda r: r.end)
            lost = "" if final.completed else ", not completed"
            lasts.append(f"| {name} ({final.workflow}{lost}) | " +
                         " | ".join(f"{getattr(final, c):.1f}" for c in columns) + " |")
    text = "\n".join(means) + "\n\n" + "\n".join(lasts) + "\n"
    if skipped:
        text += ("\nNot split (event logs written before workflows were named in them): "
                 + ", ".join(skipped) + "\n")
    return text
