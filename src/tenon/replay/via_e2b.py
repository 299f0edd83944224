"""Replays a schedule through the front door: each workflow is an E2B sandbox driven with the
official SDK's async client against the E2B-compatible server wrapped around the runtime.

The same schedule, steps, retries and records as `driver.replay`: a workflow attempt is one
sandbox (created with the workflow's `tenon.*` metadata, so the predictor and the
peak-reserving baselines see what `Agent.run` would hand them), each step the model wait
then one `commands.run` of the load program, its environment naming the command it stands
for and its action class; the sandbox is killed at the end of the attempt. A command's end
event says how it ended (`service.sessions._ended_of_action`): an OOM kill, a lost sandbox
or a timeout fails the attempt as in-process; a plain non-zero exit does not.

The server's added latency per command is the client's time for `commands.run` minus the
runtime's own time for that action (`action_ready` to `action_done`), the k-th command of a
sandbox matched with the k-th action of the agent of the same id. It also holds the
runtime's after-action work (the restart-safe check, up to the `residency` event), which an
in-process caller waits for as well; `api_overhead_net_*` leaves that out. Each command's
client time is also in the event log (`api_command`). Every SDK exception other than a
command's own non-zero exit counts as an API error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tenon.errors import ConfigError
from tenon.replay.driver import WorkflowRecord, action_command, action_timeout_s
from tenon.replay.schedule import Submission, own_length_s
from tenon.runtime.controller import Runtime
from tenon.runtime.results import Outcome

logger = logging.getLogger(__name__)

VIA_CHOICES = ("inproc", "e2b", "both")
SANDBOX_TIMEOUT_S = 86_400  # outlives any attempt; each is killed when it ends
REQUEST_TIMEOUT_S = 300.0  # control-plane calls and opening a command's stream, under load
# what the server's end event says (service.sessions._ended_of_action, commands.ended_from)
TIMED_OUT_ERROR = "command timed out"
OOM_ERROR_PREFIX = "OOM kill"
LOST_STATUS = "error"


def check_via(via: str, backend: str) -> None:
    """Refuse a `--via` this bench does not offer, or e2b on the simulator."""
    if via not in VIA_CHOICES:
        raise ConfigError(f"--via: expected one of {', '.join(VIA_CHOICES)}, got {via!r}")
    if via != "inproc" and backend == "sim":
        raise ConfigError(f"--via {via}: the simulator is not offered through the E2B API; "
                          "use --backend process or docker")


def single_image(submissions: Sequence[Submission]) -> str:
    """The one base image every workflow runs on (the server offers one template)."""
    images = sorted({s.workflow.base_image for s in submissions})
    if len(images) != 1:
        raise ConfigError(f"--via e2b replays workflows of one base image; the schedule has "
                          f"{len(images)}: {', '.join(images)}")
    return images[0]


@dataclass
class _ActionTimes:
    ready_t: float
    done_t: float | None = None
    checked_t: float | None = None  # the `residency` event: after-action work done


class ActionTimes:
    """Each agent's actions in order, timed by the runtime's own events."""

    def __init__(self) -> None:
        self.by_agent: dict[str, list[_ActionTimes]] = {}
        self._by_action: dict[str, _ActionTimes] = {}

    def observe(self, event: dict[str, Any]) -> None:
        kind = event["kind"]
        if kind == "action_ready":
            times = _ActionTimes(float(event["t"]))
            self.by_agent.setdefault(event["agent_id"], []).append(times)
            self._by_action[event["action_id"]] = times
        elif kind == "action_done":
            known = self._by_action.pop(event["action_id"], None)
            if known is not None:
                known.done_t = float(event["t"])
        elif kind == "residency":
            actions = self.by_agent.get(event["agent_id"], [])
            if actions and actions[-1].done_t is not None and actions[-1].checked_t is None:
                actions[-1].checked_t = float(event["t"])


@dataclass
class ApiStats:
    """Per command: (sandbox id, its number in the sandbox, client seconds); API errors."""

    commands: list[tuple[str, int, float]] = field(default_factory=list)
    num_errors: int = 0
    errors: list[str] = field(default_factory=list)

    def error(self, what: str, exc: BaseException) -> None:
        self.num_errors += 1
        if len(self.errors) < 20:  # the summary keeps a sample, the count is complete
            self.errors.append(f"{what}: {type(exc).__name__}: {str(exc)[:200]}")


def overhead_summary(stats: ApiStats, times: ActionTimes) -> dict[str, Any]:
    """p50/p99 in ms of the client's time per command minus the runtime's ready -> done
    (and minus ready -> after-action check: `net`), and the API error count."""
    gross: list[float] = []
    net: list[float] = []
    for sandbox_id, number, client_s in stats.commands:
        actions = times.by_agent.get(sandbox_id, [])
        if number > len(actions):
            continue
        action = actions[number - 1]
        if action.done_t is None:
            continue
        gross.append(client_s - (action.done_t - action.ready_t))
        if action.checked_t is not None:
            net.append(client_s - (action.checked_t - action.ready_t))
    return {
        "api_commands": len(stats.commands),
        "api_commands_matched": len(gross),
        "api_overhead_p50_ms": _ms(percentile(gross, 50)),
        "api_overhead_p99_ms": _ms(percentile(gross, 99)),
        "api_overhead_net_p50_ms": _ms(percentile(net, 50)),
        "api_overhead_net_p99_ms": _ms(percentile(net, 99)),
        "api_errors": stats.num_errors,
        "api_error_samples": stats.errors,
    }


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank q-th percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 3)


class LoopLag:
    """How late the event loop runs a task that sleeps `period_s`, sampled for as long as
    the block runs: a saturated loop delays every reply the server sends as much."""

    def __init__(self, period_s: float = 0.05) -> None:
        self.period_s = period_s
        self.lags_s: list[float] = []

    async def _probe(self) -> None:
        while True:
            began = time.monotonic()
            await asyncio.sleep(self.period_s)
            self.lags_s.append(max(time.monotonic() - began - self.period_s, 0.0))

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[LoopLag]:
        task = asyncio.ensure_future(self._probe())
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def summary(self) -> dict[str, float | None]:
        return {"loop_lag_p50_ms": _ms(percentile(self.lags_s, 50)),
                "loop_lag_p99_ms": _ms(percentile(self.lags_s, 99))}


@dataclass(frozen=True)
class _Endpoint:
    url: str
    api_key: str

    def opts(self) -> dict[str, Any]:
        return {"api_url": self.url, "sandbox_url": self.url, "api_key": self.api_key,
                "request_timeout": REQUEST_TIMEOUT_S}


@contextlib.asynccontextmanager
async def front_door(runtime: Runtime, image: str, image_dir: Path,
                     backend: str) -> Any:
    """The E2B-compatible server over `runtime` on this loop (a fresh sessions store, a
    fresh key, loopback, any free port); yields the endpoint."""
    from tenon.service.server import image_root_for, serving

    key = f"e2b_{secrets.token_hex(16)}"
    with tempfile.TemporaryDirectory(prefix="tenon-via-e2b-") as store:
        async with serving(runtime, Path(store), api_keys=[key], host="127.0.0.1", port=0,
                           image=image, image_root=image_root_for(backend, image_dir)
                           ) as url:
            yield _Endpoint(url, key)


async def replay_via_e2b(
    runtime: Runtime,
    submissions: Sequence[Submission],
    *,
    speed: float,
    image_dir: Path,
    max_retries: int = 5,
    on_done: Callable[[WorkflowRecord], None] | None = None,
) -> tuple[list[WorkflowRecord], dict[str, Any]]:
    """Run every submission through the E2B API (concurrently, each at its submit time);
    one record each, and the API's overhead figures (`overhead_summary`)."""
    image = single_image(submissions)
    times = ActionTimes()
    unsubscribe = runtime.events.subscribe(times.observe)
    stats = ApiStats()
    try:
        async with front_door(runtime, image, image_dir, runtime.backend.name) as endpoint:
            records = await _replay(runtime, endpoint, submissions, speed=speed,
                                    max_retries=max_retries, on_done=on_done, stats=stats)
    finally:
        unsubscribe()
    return records, overhead_summary(stats, times)


async def _replay(runtime: Runtime, endpoint: _Endpoint, submissions: Sequence[Submission],
                  *, speed: float, max_retries: int,
                  on_done: Callable[[WorkflowRecord], None] | None,
                  stats: ApiStats) -> list[WorkflowRecord]:
    clock = runtime.clock
    start = clock.now()
    records = [WorkflowRecord(s.instance, s.submit_s) for s in submissions]

    async def one(sub: Submission, record: WorkflowRecord) -> None:
        await clock.sleep(max(sub.submit_s - (clock.now() - start), 0.0))
        try:
            while record.attempts <= max_retries and not record.completed:
                record.attempts += 1
                outcome = await _attempt(runtime, endpoint, sub, speed=speed, stats=stats,
                                         record=record)
                if outcome is None:
                    record.completed = True
                    break
                record.failed_attempts += 1
                record.oom_events += outcome is Outcome.OOM_KILLED
                record.timeouts += outcome is Outcome.TIMEOUT
                runtime.events.emit("attempt_failed", workflow=sub.instance,
                                    attempt=record.attempts, outcome=outcome.value)
        finally:
            record.end_s = clock.now() - start
            runtime.events.emit("workflow_done", workflow=sub.instance,
                                completed=record.completed, attempts=record.attempts,
                                latency_s=round(record.latency_s, 4),
                                own_s=round(own_length_s(sub.workflow, speed), 4))
            if on_done is not None:
                on_done(record)

    await asyncio.gather(*(one(s, r) for s, r in zip(submissions, records, strict=True)))
    return records


def _metadata(sub: Submission) -> dict[str, str]:
    from tenon.service.sessions import FAMILY_KEY, PROFILE_PEAK_KEY, TASK_KEY, WORKFLOW_KEY

    workflow = sub.workflow
    return {WORKFLOW_KEY: sub.instance, TASK_KEY: workflow.task, FAMILY_KEY: workflow.family,
            PROFILE_PEAK_KEY: str(workflow.profiled_peak_bytes)}


async def _attempt(runtime: Runtime, endpoint: _Endpoint, sub: Submission, *, speed: float,
                   stats: ApiStats, record: WorkflowRecord) -> Outcome | None:
    """One attempt of the whole workflow in a fresh sandbox; None when it completed, else
    what failed it (a sandbox the API would not create or lost: SANDBOX_DIED)."""
    from e2b import AsyncSandbox

    from tenon.service.sessions import ACTION_CLASS_ENV, ACTION_ENV

    try:
        sandbox = await AsyncSandbox.create(timeout=SANDBOX_TIMEOUT_S, metadata=_metadata(sub),
                                            **endpoint.opts())
    except Exception as exc:  # noqa: BLE001 - every API failure is counted and retried
        stats.error("create", exc)
        record.errors.append(f"create: {exc}")
        return Outcome.SANDBOX_DIED
    try:
        for number, step in enumerate(sub.workflow.steps, 1):
            await runtime.clock.sleep(step.model_wait_s / speed)
            action = step.action
            command = action_command(action, speed=speed, sim=False)
            envs = {ACTION_ENV: action.command, ACTION_CLASS_ENV: action.action_class}
            timeout_s = action_timeout_s(action, speed)
            began = time.monotonic()
            outcome = await _run(sandbox, command, envs, timeout_s, stats, record)
            client_s = time.monotonic() - began
            stats.commands.append((sandbox.sandbox_id, number, client_s))
            runtime.events.emit("api_command", agent_id=sandbox.sandbox_id, number=number,
                                client_s=round(client_s, 5))
            if outcome is not None and (outcome.fails_attempt or outcome is Outcome.TIMEOUT):
                return outcome
        return None
    finally:
        try:
            await sandbox.kill()
        except Exception as exc:  # noqa: BLE001 - counted; the attempt's outcome stands
            stats.error("kill", exc)


async def _run(sandbox: Any, command: str, envs: dict[str, str], timeout_s: float,
               stats: ApiStats, record: WorkflowRecord) -> Outcome | None:
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
        stats.error("command", exc)
        record.errors.append(f"command: {exc}")
        return Outcome.SANDBOX_DIED
    return None


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
