"""Replays a schedule of workflows through one runtime, retrying failed attempts.

Each submitted workflow becomes a logical agent that runs its steps in order: a model wait,
then the action, reproduced by the load program (its recorded memory profile, duration
divided by the speed) or literally. An attempt fails on an OOM kill, a lost sandbox or a
timeout; the workflow is then started again from scratch (a fresh agent), up to
`max_retries` more times, so a failure's cost shows in the makespan and latency.

Resuming after a controller restart (`journal`): every workflow that completes is
appended, fsynced, to the journal, and a replay given an existing journal skips those and
continues the others. The controller holds each agent's logical state, so a workflow whose
agent was recovered (`Runtime.recovered`) resumes at its next step, running an interrupted
action again; a blocked agent is discarded and its workflow starts a fresh attempt.
Workflows without a recovered agent start from their first step. Submit times count from
the first run's start (wall clock), so a resumed replay keeps the schedule.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tenon.clock import Clock
from tenon.errors import RecoveryError, SandboxError, TenonError
from tenon.replay.loadprog import load_command
from tenon.replay.schedule import Submission, own_length_s
from tenon.replay.trace import Action
from tenon.runtime.results import ActionResult, Outcome
from tenon.sandbox.sim import sim_load_command

logger = logging.getLogger(__name__)

MIN_ACTION_TIMEOUT_S = 30.0
TIMEOUT_FACTOR = 20.0  # an action may take this many times its (sped-up) recorded duration


@dataclass
class WorkflowRecord:
    instance: str
    submit_s: float
    end_s: float = 0.0
    attempts: int = 0
    failed_attempts: int = 0
    oom_events: int = 0
    timeouts: int = 0
    completed: bool = False
    errors: list[str] = field(default_factory=list)

    @property
    def latency_s(self) -> float:
        return self.end_s - self.submit_s


class _Backend(Protocol):
    @property
    def simulated(self) -> bool: ...


class _Events(Protocol):
    def emit(self, kind: str, **fields: Any) -> dict[str, Any]: ...


class ReplayAgent(Protocol):
    """What the replay needs of an agent: `Agent`, or a cluster's `ClusterAgent`."""

    @property
    def id(self) -> str: ...

    @property
    def workflow(self) -> str | None: ...

    @property
    def failed(self) -> bool: ...

    @property
    def num_actions_done(self) -> int: ...

    interrupted: Any

    async def run(self, command: str, *, timeout: float,  # noqa: ASYNC109
                  action_class: str | None = None,
                  issued_command: str | None = None) -> ActionResult: ...

    async def close(self) -> None: ...


class AgentHost(Protocol):
    """What the replay needs of a runtime: `Runtime`, or a cluster's `Dispatcher`."""

    @property
    def clock(self) -> Clock: ...

    @property
    def backend(self) -> _Backend: ...

    @property
    def events(self) -> _Events: ...

    @property
    def recovered(self) -> Mapping[str, ReplayAgent]: ...

    async def create_agent(self, *, image: str, family: str | None = ...,
                           task_prompt: str | None = ..., profile_peak_bytes: int | None = ...,
                           workflow: str | None = ..., task: str | None = ...
                           ) -> ReplayAgent: ...


# A change to one step's command before it runs: (submission, step number from 1, command).
CommandDecorator = Callable[[Submission, int, str], str]


def action_command(action: Action, *, speed: float, sim: bool) -> str:
    """The command that reproduces `action`: for a simulated backend (`sim`) always its
    profile in the simulator's language, else the command itself or the load program."""
    memory = action.memory
    duration_s = action.duration_s / speed
    if sim:
        return sim_load_command(memory.avg_bytes, memory.peak_bytes, duration_s,
                                memory.resident_after_bytes)
    if action.reproduce.mode == "literal":
        return action.command
    return load_command(memory.avg_bytes, memory.peak_bytes, duration_s,
                        memory.resident_after_bytes)


def action_timeout_s(action: Action, speed: float) -> float:
    return max(MIN_ACTION_TIMEOUT_S, TIMEOUT_FACTOR * action.duration_s / speed)


def with_workspace_write(command: str, path: str, num_bytes: int) -> str:
    """`command`, then `num_bytes` random bytes written to `path` (in the persistent root);
    the exit code stays the command's."""
    return (f"{command}; rc=$?; head -c {int(num_bytes)} /dev/urandom > {path}; "
            f"exit $rc")


async def _check_steps_kept(agent: ReplayAgent, num_steps: int) -> Outcome | None:
    """None when the workspace holds every step's file, else a failed attempt (logged)."""
    result = await agent.run(f"test $(ls /workspace/step-*.bin | wc -l) -eq {num_steps}",
                             timeout=MIN_ACTION_TIMEOUT_S, action_class="check")
    if result.outcome is Outcome.OK:
        return None
    logger.error("agent %s: its workspace lost step files (%s, exit %d)", agent.id,
                 result.outcome.value, result.exit_code)
    return result.outcome


class Journal:
    """Completed workflows, one JSON line each, fsynced: what a resumed replay skips."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.started_wall_s = time.time()
        self.completed: dict[str, dict[str, Any]] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:  # a torn last line: that write never returned
                    continue
                if entry.get("kind") == "start":
                    self.started_wall_s = float(entry["wall_s"])
                elif entry.get("kind") == "completed":
                    self.completed[entry["workflow"]] = entry
        else:
            self._append({"kind": "start", "wall_s": self.started_wall_s})

    def elapsed_s(self) -> float:
        return time.time() - self.started_wall_s

    def complete(self, record: WorkflowRecord) -> None:
        entry = {"kind": "completed", "workflow": record.instance,
                 "attempts": record.attempts, "end_s": round(self.elapsed_s(), 3)}
        self._append(entry)
        self.completed[record.instance] = entry

    def _append(self, entry: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as fh:
            fh.write(json.dumps(entry) + "\n")
            fh.flush()
            os.fsync(fh.fileno())


async def replay(
    runtime: AgentHost,
    submissions: Sequence[Submission],
    *,
    speed: float,
    max_retries: int = 5,
    on_done: Callable[[WorkflowRecord], None] | None = None,
    journal: Path | None = None,
    workspace_write_bytes: int = 0,
    decorate: CommandDecorator | None = None,
    check_workspace: bool = False,
) -> list[WorkflowRecord]:
    """Run every submission (concurrently, each at its submit time); one record each.

    With `journal`, the replay is resumable (see the module docstring); with
    `workspace_write_bytes`, each action also writes that many bytes into the agent's
    workspace (`/workspace/step-<n>.bin`), so restarts have committed bytes to keep; with
    `check_workspace` too, each workflow ends by checking that every step's file is there
    (one more action; a missing file fails the attempt). `decorate` changes each step's
    command before it runs.
    """
    clock = runtime.clock
    sim = runtime.backend.simulated
    start = clock.now()
    records = [WorkflowRecord(s.instance, s.submit_s) for s in submissions]
    done = Journal(journal) if journal is not None else None
    offset_s = done.elapsed_s() if done is not None else 0.0
    resumable = await _claim_recovered(runtime, submissions, done)

    async def one(sub: Submission, record: WorkflowRecord) -> None:
        if done is not None and sub.instance in done.completed:
            record.completed = True
            record.attempts = int(done.completed[sub.instance].get("attempts", 1))
            return
        await clock.sleep(max(sub.submit_s - offset_s, 0.0))
        workflow = sub.workflow
        resumed = resumable.pop(sub.instance, None)
        try:
            while record.attempts <= max_retries and not record.completed:
                record.attempts += 1
                agent, resumed = resumed, None
                try:
                    outcome = await _attempt(runtime, sub, speed=speed, sim=sim, agent=agent,
                                             write_bytes=workspace_write_bytes,
                                             decorate=decorate, check=check_workspace)
                except (SandboxError, RecoveryError) as exc:
                    # a sandbox that would not start or was lost: a failed attempt, retried
                    logger.warning("workflow %s attempt %d: %s", sub.instance,
                                   record.attempts, exc)
                    record.errors.append(str(exc))
                    outcome = Outcome.SANDBOX_DIED
                if outcome is None:
                    record.completed = True
                    if done is not None:
                        done.complete(record)
                    break
                record.failed_attempts += 1
                record.oom_events += outcome is Outcome.OOM_KILLED
                record.timeouts += outcome is Outcome.TIMEOUT
                runtime.events.emit("attempt_failed", workflow=sub.instance,
                                    attempt=record.attempts, outcome=outcome.value)
        except TenonError as exc:  # a broken sandbox or record: counted, never silent
            logger.warning("workflow %s (%s): %s", sub.instance, workflow.id, exc)
            record.errors.append(str(exc))
        finally:
            record.end_s = clock.now() - start
            runtime.events.emit("workflow_done", workflow=sub.instance,
                                completed=record.completed, attempts=record.attempts,
                                latency_s=round(record.latency_s, 4),
                                own_s=round(own_length_s(workflow, speed), 4))
            if on_done is not None:
                on_done(record)

    await asyncio.gather(*(one(s, r) for s, r in zip(submissions, records, strict=True)))
    return records


async def _claim_recovered(runtime: AgentHost, submissions: Sequence[Submission],
                           done: Journal | None) -> dict[str, ReplayAgent]:
    """Recovered agents that can carry on their workflow, by workflow instance; the rest
    (blocked, of a completed workflow, of no workflow in this replay) are discarded."""
    pending = {s.instance for s in submissions
               if done is None or s.instance not in done.completed}
    claimed: dict[str, ReplayAgent] = {}
    for agent in runtime.recovered.values():
        name = agent.workflow
        if name in pending and name not in claimed and not agent.failed:
            claimed[name] = agent
            if agent.interrupted is not None:
                logger.info("workflow %s: action %s was interrupted; running it again",
                            name, agent.interrupted.action_id)
            continue
        logger.info("discarding recovered agent %s (workflow %s%s)", agent.id, name,
                    ", blocked" if agent.failed else "")
        await agent.close()
    return claimed


async def _attempt(runtime: AgentHost, sub: Submission, *, speed: float, sim: bool,
                   agent: ReplayAgent | None = None, write_bytes: int = 0,
                   decorate: CommandDecorator | None = None,
                   check: bool = False) -> Outcome | None:
    """One attempt of the whole workflow; None when it completed, else what failed it.
    A recovered `agent` carries on from its next step (no model wait before it: the model
    answered before the crash)."""
    workflow = sub.workflow
    first = 0
    if agent is None:
        agent = await runtime.create_agent(image=workflow.base_image, family=workflow.family,
                                           task_prompt=workflow.task_prompt,
                                           profile_peak_bytes=workflow.profiled_peak_bytes,
                                           workflow=sub.instance, task=workflow.task)
    else:
        first = agent.num_actions_done
    try:
        for number, step in enumerate(workflow.steps[first:], first + 1):
            if number > first + 1 or first == 0:
                await runtime.clock.sleep(step.model_wait_s / speed)
            action = step.action
            command = action_command(action, speed=speed, sim=sim)
            if write_bytes > 0:
                command = with_workspace_write(command, f"/workspace/step-{number:04d}.bin",
                                               write_bytes)
            if decorate is not None:
                command = decorate(sub, number, command)
            result = await agent.run(command,
                                     timeout=action_timeout_s(action, speed),
                                     action_class=action.action_class,
                                     issued_command=action.command)
            if result.outcome.fails_attempt or result.outcome is Outcome.TIMEOUT:
                return result.outcome
        if check and write_bytes > 0 and not sim:
            return await _check_steps_kept(agent, len(workflow.steps))
        return None
    finally:
        await agent.close()
