"""Replays a schedule of workflows through one runtime, retrying failed attempts.

Each submitted workflow becomes a logical agent that runs its steps in order: a model wait,
then the action, reproduced by the load program (its recorded memory profile, duration
divided by the speed) or literally. An attempt fails on an OOM kill, a lost sandbox or a
timeout; the workflow is then started again from scratch (a fresh agent), up to
`max_retries` more times, so a failure's cost shows in the makespan and latency.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tenon.errors import RecoveryError, SandboxError, TenonError
from tenon.replay.loadprog import load_command
from tenon.replay.schedule import Submission, own_length_s
from tenon.replay.trace import Action
from tenon.runtime.controller import Runtime
from tenon.runtime.results import Outcome
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


def action_command(action: Action, *, speed: float, sim: bool) -> str:
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


async def replay(
    runtime: Runtime,
    submissions: Sequence[Submission],
    *,
    speed: float,
    max_retries: int = 5,
    on_done: Callable[[WorkflowRecord], None] | None = None,
) -> list[WorkflowRecord]:
    """Run every submission (concurrently, each at its submit time); one record each."""
    clock = runtime.clock
    sim = runtime.backend.name == "sim"
    start = clock.now()
    records = [WorkflowRecord(s.instance, s.submit_s) for s in submissions]

    async def one(sub: Submission, record: WorkflowRecord) -> None:
        await clock.sleep(sub.submit_s)
        workflow = sub.workflow
        try:
            while record.attempts <= max_retries and not record.completed:
                record.attempts += 1
                try:
                    outcome = await _attempt(runtime, sub, speed=speed, sim=sim)
                except (SandboxError, RecoveryError) as exc:
                    # a sandbox that would not start or was lost: a failed attempt, retried
                    logger.warning("workflow %s attempt %d: %s", sub.instance,
                                   record.attempts, exc)
                    record.errors.append(str(exc))
                    outcome = Outcome.SANDBOX_DIED
                if outcome is None:
                    record.completed = True
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


async def _attempt(runtime: Runtime, sub: Submission, *, speed: float,
                   sim: bool) -> Outcome | None:
    """One attempt of the whole workflow; None when it completed, else what failed it."""
    workflow = sub.workflow
    agent = await runtime.create_agent(image=workflow.base_image, family=workflow.family,
                                       task_prompt=workflow.task_prompt,
                                       profile_peak_bytes=workflow.profiled_peak_bytes,
                                       workflow=sub.instance, task=workflow.task)
    try:
        for step in workflow.steps:
            await runtime.clock.sleep(step.model_wait_s / speed)
            action = step.action
            result = await agent.run(action_command(action, speed=speed, sim=sim),
                                     timeout=action_timeout_s(action, speed),
                                     action_class=action.action_class,
                                     issued_command=action.command)
            if result.outcome.fails_attempt or result.outcome is Outcome.TIMEOUT:
                return result.outcome
        return None
    finally:
        await agent.close()
