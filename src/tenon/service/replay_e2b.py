"""Replays a schedule through the front door: each workflow is an E2B sandbox driven with the
official SDK's async client against the E2B-compatible server wrapped around the runtime.

The server runs on this event loop over the open runtime; the clients run in a child
process (`service.replay_client`), apart from the server as real E2B clients are, with the same
schedule, steps, retries and records as `driver.replay`. The child reports each command,
API error, failed attempt and finished workflow as a JSON line; they become this runtime's
events (`api_command`, `attempt_failed`, `workflow_done`) and the replay's records.

The server's added latency per command is the client's time for `commands.run` minus the
runtime's own time for that action (`action_ready` to `action_done`), the k-th command of a
sandbox matched with the k-th action of the agent of the same id. It also holds the
runtime's after-action work (the restart-safe check, up to the `residency` event), which an
in-process caller waits for as well; `api_overhead_net_*` leaves that out. Every SDK
exception other than a command's own non-zero exit counts as an API error.

`replay_via_e2b` is the bench's E2B driver (`replay.bench.WorkflowDriver`): the CLI hands it
to `run_bench` for `--via e2b|both`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tenon.errors import ConfigError, TenonError
from tenon.replay.driver import WorkflowRecord
from tenon.replay.loop_lag import percentile, rounded_ms
from tenon.replay.schedule import Submission, own_length_s
from tenon.runtime.controller import Runtime
from tenon.service.server import serving

STDERR_TAIL_BYTES = 2000  # of a client process that failed, in the error


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
    """Per command: (sandbox id, its number in the sandbox, client seconds); API errors;
    the client's loop lag (`client_loop_lag_p50_ms`, `_p99_ms`)."""

    commands: list[tuple[str, int, float]] = field(default_factory=list)
    num_errors: int = 0
    errors: list[str] = field(default_factory=list)
    client_lag: dict[str, Any] = field(default_factory=dict)  # the client's loop lag

    def error(self, message: str) -> None:
        self.num_errors += 1
        if len(self.errors) < 20:  # the summary keeps a sample, the count is complete
            self.errors.append(message)


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
        "api_overhead_p50_ms": rounded_ms(percentile(gross, 50)),
        "api_overhead_p99_ms": rounded_ms(percentile(gross, 99)),
        "api_overhead_net_p50_ms": rounded_ms(percentile(net, 50)),
        "api_overhead_net_p99_ms": rounded_ms(percentile(net, 99)),
        **stats.client_lag,
        "api_errors": stats.num_errors,
        "api_error_samples": stats.errors,
    }


@contextlib.asynccontextmanager
async def front_door(runtime: Runtime, image: str, image_dir: Path
                     ) -> AsyncIterator[tuple[str, str]]:
    """The E2B-compatible server over `runtime` on this loop (a fresh sessions store, a
    fresh key, loopback, any free port); yields its URL and key."""
    key = f"e2b_{secrets.token_hex(16)}"
    with tempfile.TemporaryDirectory(prefix="tenon-via-e2b-") as store:
        async with serving(runtime, Path(store), api_keys=[key], host="127.0.0.1", port=0,
                           image=image,
                           image_root=runtime.backend.image_root
                           ) as url:
            yield url, key


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
    one record each, in the order given, and the API's overhead figures
    (`overhead_summary`). TenonError when the client process fails."""
    from tenon.service.replay_client import ClientSpec

    image = single_image(submissions)
    times = ActionTimes()
    stats = ApiStats()
    unsubscribe = runtime.events.subscribe(times.observe)
    records: dict[str, WorkflowRecord] = {}
    try:
        async with front_door(runtime, image, image_dir) as (url, key):
            spec = ClientSpec(url, key, speed, max_retries, runtime.clock.now(),
                              list(submissions))
            with tempfile.NamedTemporaryFile("w", prefix="tenon-e2b-client-",
                                             suffix=".json") as spec_file:
                spec_file.write(spec.to_json())
                spec_file.flush()
                await _run_clients(runtime, Path(spec_file.name), stats, records,
                                   on_done, {s.instance: s for s in submissions}, speed)
    finally:
        unsubscribe()
    missing = [s.instance for s in submissions if s.instance not in records]
    if missing:
        raise TenonError(f"the E2B client process reported no result for {len(missing)} "
                         f"workflows (first {missing[0]})")
    return [records[s.instance] for s in submissions], overhead_summary(stats, times)


async def _run_clients(runtime: Runtime, spec_path: Path, stats: ApiStats,
                       records: dict[str, WorkflowRecord],
                       on_done: Callable[[WorkflowRecord], None] | None,
                       by_instance: dict[str, Submission], speed: float) -> None:
    """Run the client process to its end, turning its lines into events and records; it
    is killed (by its pid) when this is cancelled."""
    # a native crash in the client says where: Python's stacks, glibc's message on stderr
    env = {**os.environ, "PYTHONFAULTHANDLER": "1", "LIBC_FATAL_STDERR_": "1"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tenon.service.replay_client", str(spec_path),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        limit=1 << 20, env=env)
    assert proc.stdout is not None
    assert proc.stderr is not None
    stderr = asyncio.ensure_future(proc.stderr.read())
    try:
        async for line in proc.stdout:
            _take(runtime, json.loads(line), stats, records, on_done, by_instance, speed)
        await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        errors = (await stderr).decode(errors="replace")
    if proc.returncode != 0:
        raise TenonError(f"the E2B client process exited with {proc.returncode}: "
                         f"{errors[-STDERR_TAIL_BYTES:].strip()}")


def _take(runtime: Runtime, line: dict[str, Any], stats: ApiStats,
          records: dict[str, WorkflowRecord],
          on_done: Callable[[WorkflowRecord], None] | None,
          by_instance: dict[str, Submission], speed: float) -> None:
    kind = line.pop("kind")
    if kind == "command":
        stats.commands.append((line["sandbox_id"], int(line["number"]),
                               float(line["client_s"])))
        runtime.events.emit("api_command", agent_id=line["sandbox_id"],
                            number=line["number"], client_s=round(line["client_s"], 5))
    elif kind == "api_error":
        stats.error(line["message"])
    elif kind == "client_lag":
        stats.client_lag = line
    elif kind == "attempt_failed":
        runtime.events.emit("attempt_failed", **line)
    elif kind == "record":
        record = WorkflowRecord(**line)
        records[record.instance] = record
        runtime.events.emit("workflow_done", workflow=record.instance,
                            completed=record.completed, attempts=record.attempts,
                            latency_s=round(record.latency_s, 4),
                            own_s=round(own_length_s(by_instance[record.instance].workflow,
                                                     speed), 4))
        if on_done is not None:
            on_done(record)
