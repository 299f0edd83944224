"""The client side of a replay through the E2B API, in its own process (as an E2B client
runs apart from the server): `python -m tenon.service.replay_client SPEC`.

SPEC (JSON) names the server (`url`, `api_key`), the replay (`speed`, `max_retries`), the
`start` of the replay on the host's monotonic clock (which the server's runtime clock also
reads, so both count from the same instant) and the `submissions`. Each workflow attempt is
one sandbox (created with the workflow's `tenon.*` metadata), each step the model wait then
one `commands.run` of the load program, its environment naming the command it stands for
and its action class; the sandbox is killed at the end of the attempt. A command's end event
says how it ended (`service.sessions._ended_of_action`): an OOM kill, a lost sandbox or a
timeout fails the attempt, as in-process; a plain non-zero exit does not.

What happens is written to stdout as JSON lines, flushed one by one: `command` (sandbox id,
its number in the sandbox, the client's seconds for `commands.run`), `api_error` (any SDK
exception other than a command's own non-zero exit), `attempt_failed` and `record` (a
workflow's `WorkflowRecord` once it is done), and at the end `client_lag` (how late the
client's own event loop ran: a saturated client delays what it observes).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tenon.replay.driver import WorkflowRecord, action_command, action_timeout_s
from tenon.replay.loop_lag import LoopLag
from tenon.replay.schedule import Submission
from tenon.replay.trace import Workflow
from tenon.runtime.results import Outcome
from tenon.service.sessions import (
    ACTION_CLASS_ENV,
    ACTION_ENV,
    FAMILY_KEY,
    PROFILE_PEAK_KEY,
    PROMPT_KEY,
    TASK_KEY,
    WORKFLOW_KEY,
)

SANDBOX_TIMEOUT_S = 86_400  # outlives any attempt; each is killed when it ends
REQUEST_TIMEOUT_S = 300.0  # control-plane calls and opening a command's stream, under load
# what the server's end event says (service.sessions._ended_of_action, commands.ended_from)
TIMED_OUT_ERROR = "command timed out"
OOM_ERROR_PREFIX = "OOM kill"


@dataclass(frozen=True)
class ClientSpec:
    url: str
    api_key: str
    speed: float
    max_retries: int
    start: float  # time.monotonic() at the replay's start
    submissions: list[Submission]

    def to_json(self) -> str:
        return json.dumps({
            "url": self.url, "api_key": self.api_key, "speed": self.speed,
            "max_retries": self.max_retries, "start": self.start,
            "submissions": [{"instance": s.instance, "submit_s": s.submit_s,
                             "workflow": s.workflow.model_dump(mode="json")}
                            for s in self.submissions]})

    @classmethod
    def from_json(cls, text: str) -> ClientSpec:
        raw = json.loads(text)
        subs = [Submission(s["instance"], Workflow.model_validate(s["workflow"]),
                           float(s["submit_s"])) for s in raw["submissions"]]
        return cls(raw["url"], raw["api_key"], float(raw["speed"]), int(raw["max_retries"]),
                   float(raw["start"]), subs)

    def opts(self) -> dict[str, Any]:
        return {"api_url": self.url, "sandbox_url": self.url, "api_key": self.api_key,
                "request_timeout": REQUEST_TIMEOUT_S}


def _say(kind: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"kind": kind, **fields}) + "\n")
    sys.stdout.flush()


def outcome_of_exit(exit_code: int, error: str | None) -> Outcome:
    """A non-zero end event as the runtime's outcome: the server's error names an OOM kill,
    a timeout or a lost sandbox; anything else is the command's own failure."""
    if error is not None:
        if error.startswith(OOM_ERROR_PREFIX):
            return Outcome.OOM_KILLED
        if error == TIMED_OUT_ERROR:
            return Outcome.TIMEOUT
        return Outcome.SANDBOX_DIED
    return Outcome.ERROR


def metadata_of(sub: Submission) -> dict[str, str]:
    workflow = sub.workflow
    meta = {WORKFLOW_KEY: sub.instance, TASK_KEY: workflow.task, FAMILY_KEY: workflow.family,
            PROFILE_PEAK_KEY: str(workflow.profiled_peak_bytes)}
    if workflow.task_prompt:
        meta[PROMPT_KEY] = workflow.task_prompt
    return meta


async def replay(spec: ClientSpec) -> None:
    """Every submission, concurrently, each at its submit time; a `record` line each."""

    async def one(sub: Submission) -> None:
        record = WorkflowRecord(sub.instance, sub.submit_s)
        await asyncio.sleep(max(sub.submit_s - (time.monotonic() - spec.start), 0.0))
        try:
            while record.attempts <= spec.max_retries and not record.completed:
                record.attempts += 1
                outcome = await _attempt(spec, sub, record)
                if outcome is None:
                    record.completed = True
                    break
                record.failed_attempts += 1
                record.oom_events += outcome is Outcome.OOM_KILLED
                record.timeouts += outcome is Outcome.TIMEOUT
                _say("attempt_failed", workflow=sub.instance, attempt=record.attempts,
                     outcome=outcome.value)
        finally:
            record.end_s = time.monotonic() - spec.start
            _say("record", **dataclasses.asdict(record))

    lag = LoopLag()
    async with lag.running():
        await asyncio.gather(*(one(s) for s in spec.submissions))
    _say("client_lag", **{f"client_{k}": v for k, v in lag.summary().items()})


async def _attempt(spec: ClientSpec, sub: Submission, record: WorkflowRecord
                   ) -> Outcome | None:
    """One attempt of the whole workflow in a fresh sandbox; None when it completed, else
    what failed it (a sandbox the API would not create or lost: SANDBOX_DIED)."""
    from e2b import AsyncSandbox

    try:
        sandbox = await AsyncSandbox.create(timeout=SANDBOX_TIMEOUT_S,
                                            metadata=metadata_of(sub), **spec.opts())
    except Exception as exc:  # noqa: BLE001 - every API failure is counted and retried
        _api_error("create", exc, record)
        return Outcome.SANDBOX_DIED
    try:
        for number, step in enumerate(sub.workflow.steps, 1):
            await asyncio.sleep(step.model_wait_s / spec.speed)
            action = step.action
            command = action_command(action, speed=spec.speed, sim=False)
            envs = {ACTION_ENV: action.command, ACTION_CLASS_ENV: action.action_class}
            began = time.monotonic()
            outcome = await _run(sandbox, command, envs, action_timeout_s(action, spec.speed),
                                 record)
            _say("command", sandbox_id=sandbox.sandbox_id, number=number,
                 client_s=time.monotonic() - began)
            if outcome is not None and (outcome.fails_attempt or outcome is Outcome.TIMEOUT):
                return outcome
        return None
    finally:
        try:
            await sandbox.kill()
        except Exception as exc:  # noqa: BLE001 - counted; the attempt's outcome stands
            _api_error("kill", exc, record)


async def _run(sandbox: Any, command: str, envs: dict[str, str], timeout_s: float,
               record: WorkflowRecord) -> Outcome | None:
    """One command; None when it exited 0, else its outcome as the in-process driver
    counts it."""
    from e2b import CommandExitException, TimeoutException

    try:
        await sandbox.commands.run(command, envs=envs, timeout=timeout_s,
                                   request_timeout=REQUEST_TIMEOUT_S)
    except CommandExitException as exc:
        return outcome_of_exit(exc.exit_code, exc.error)
    except TimeoutException as exc:
        # the server times the action out with the client's deadline, which the client
        # reaches first: the action timed out
        record.errors.append(f"command: {exc}")
        return Outcome.TIMEOUT
    except Exception as exc:  # noqa: BLE001 - an API failure mid-attempt loses the sandbox
        _api_error("command", exc, record)
        return Outcome.SANDBOX_DIED
    return None


def _api_error(what: str, exc: BaseException, record: WorkflowRecord) -> None:
    message = f"{what}: {type(exc).__name__}: {str(exc)[:200]}"
    record.errors.append(message)
    _say("api_error", message=message)


def main() -> None:
    spec = ClientSpec.from_json(Path(sys.argv[1]).read_text())
    asyncio.run(replay(spec))
    sys.stdout.flush()
    # Everything is reported: leave without the interpreter's finalization, in which the
    # SDK's native HTTP transport now and then aborts the process (SIGABRT, no Python
    # frame) after the replay has finished.
    os._exit(0)


if __name__ == "__main__":
    main()
