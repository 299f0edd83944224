"""The commands of one E2B sandbox: each runs as a Tenon action (or alongside the action in
flight), its output fanned out to every client stream attached to it.

A command gets its pid (the sandbox-local number clients use) and emits its start event at
once, before admission lets it run: a client's handle exists while Tenon decides when the
action may start. Input written before the command runs is kept and delivered when it
starts; a signal before that cancels it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import shlex
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from tenon.sandbox.base import ExecControl, ExecIO

logger = logging.getLogger(__name__)

FIRST_PID = 1000  # below it the numbers of a real sandbox's system processes
NO_TIMEOUT_S = 7 * 24 * 3600.0  # a command with no deadline still has one for the runtime


@dataclass(frozen=True)
class CommandSpec:
    """What a client asked to run: `cmd` with `args`, `envs` added, in `cwd`, as `user`
    (None: the sandbox's default user)."""

    cmd: str
    args: tuple[str, ...] = ()
    envs: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    tag: str | None = None
    stdin: bool = False
    user: str | None = None

    def shell_line(self) -> str:
        """The command line the sandbox's /bin/sh runs (exec: no extra shell stays)."""
        return "exec " + shlex.join([self.cmd, *self.args])


@dataclass(frozen=True)
class Ended:
    """How a command ended, as envd reports it."""

    exit_code: int
    exited: bool  # False when a signal ended it
    status: str  # "exit status 1", "signal: killed"
    error: str | None = None


# an event on a command's stream: ("stdout"|"stderr", bytes) or ("end", Ended)
Event = tuple[str, bytes] | tuple[str, Ended]
Runner = Callable[["Command", ExecIO, float], Awaitable[Ended]]


class Command:
    """One running command and the client streams attached to it."""

    def __init__(self, pid: int, spec: CommandSpec) -> None:
        self.pid = pid
        self.spec = spec
        self.ended: Ended | None = None
        self._subscribers: set[asyncio.Queue[Event]] = set()
        self._control: ExecControl | None = None
        self._pending_input: list[bytes | None] = []  # None: close stdin
        self._drainer: asyncio.Task[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._done = asyncio.Event()

    # -- streams -------------------------------------------------------------------

    def subscribe(self) -> asyncio.Queue[Event]:
        queue: asyncio.Queue[Event] = asyncio.Queue()
        if self.ended is not None:
            queue.put_nowait(("end", self.ended))
        else:
            self._subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[Event]) -> None:
        self._subscribers.discard(queue)

    def _publish(self, event: Event) -> None:
        for queue in self._subscribers:
            queue.put_nowait(event)

    async def events(self, queue: asyncio.Queue[Event], keepalive_s: float
                     ) -> AsyncIterator[Event | None]:
        """The stream's events until the end event; None when `keepalive_s` passed in
        silence (the caller sends a keepalive)."""
        while True:
            try:
                event = await asyncio.wait_for(queue.get(), keepalive_s)
            except TimeoutError:
                yield None
                continue
            yield event
            if event[0] == "end":
                return

    # -- running -------------------------------------------------------------------

    def start(self, run: Runner, timeout_s: float) -> None:
        io = ExecIO(on_stdout=lambda data: self._publish(("stdout", data)),
                    on_stderr=lambda data: self._publish(("stderr", data)),
                    stdin=self.spec.stdin, cwd=self.spec.cwd, env=dict(self.spec.envs),
                    on_start=self._on_start, user=self.spec.user)
        self._task = asyncio.ensure_future(self._run(run, io, timeout_s))

    async def _run(self, run: Runner, io: ExecIO, timeout_s: float) -> None:
        try:
            ended = await run(self, io, timeout_s)
        except asyncio.CancelledError:
            ended = Ended(-1, False, "signal: killed", "killed before it started")
        except Exception as exc:  # noqa: BLE001 - every failure ends the stream with its reason
            ended = Ended(-1, False, "error", str(exc).splitlines()[0] if str(exc) else
                          type(exc).__name__)
        self.ended = ended
        self._publish(("end", ended))
        self._subscribers.clear()
        self._done.set()

    def _on_start(self, control: ExecControl) -> None:
        self._control = control
        self._drain_input()

    def _drain_input(self) -> None:
        """Deliver queued input in order, by one task at a time (a close never overtakes a
        write queued before it)."""
        if self._control is None or not self._pending_input:
            return
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.ensure_future(self._drain(self._control))

    async def _drain(self, control: ExecControl) -> None:
        while self._pending_input:
            item = self._pending_input.pop(0)
            try:
                if item is None:
                    await control.close_stdin()
                else:
                    await control.write_stdin(item)
            except Exception as exc:  # noqa: BLE001 - the command ended; its input is moot
                logger.debug("stdin of process %d: %s", self.pid, exc)
                self._pending_input.clear()

    async def write_stdin(self, data: bytes) -> None:
        if not self.spec.stdin:
            raise ValueError(f"process {self.pid} was started without stdin")
        self._pending_input.append(data)
        self._drain_input()

    async def close_stdin(self) -> None:
        self._pending_input.append(None)
        self._drain_input()

    async def signal(self, signum: int) -> None:
        if self._control is not None:
            await self._control.signal(signum)
        elif self._task is not None and signum in (signal.SIGKILL, signal.SIGTERM):
            self._task.cancel()

    async def wait(self) -> Ended:
        await self._done.wait()
        assert self.ended is not None
        return self.ended

    async def kill(self) -> None:
        """End the command whatever it is doing (the sandbox is going away)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task


class CommandTable:
    """The live commands of one sandbox, by pid and tag."""

    def __init__(self) -> None:
        self._pids = itertools.count(FIRST_PID)
        self.running: dict[int, Command] = {}

    def start(self, spec: CommandSpec, run: Runner, timeout_s: float) -> Command:
        command = Command(next(self._pids), spec)
        self.running[command.pid] = command
        command.start(run, timeout_s)
        asyncio.ensure_future(self._forget_when_done(command))
        return command

    async def _forget_when_done(self, command: Command) -> None:
        await command.wait()
        self.running.pop(command.pid, None)

    def find(self, *, pid: int | None = None, tag: str | None = None) -> Command | None:
        if pid is not None:
            return self.running.get(pid)
        return next((c for c in self.running.values() if tag is not None and c.spec.tag == tag),
                    None)

    @property
    def busy(self) -> bool:
        return bool(self.running)

    async def kill_all(self) -> None:
        await asyncio.gather(*(c.kill() for c in list(self.running.values())))


def ended_from(exit_code: int, *, timed_out: bool = False, error: str | None = None) -> Ended:
    """envd's end event for a process that exited with `exit_code` (negative: the signal
    that killed it)."""
    if timed_out:
        return Ended(-1, False, "signal: killed", error or "command timed out")
    if exit_code < 0:
        try:
            name = signal.Signals(-exit_code).name.removeprefix("SIG").lower()
        except ValueError:
            name = str(-exit_code)
        return Ended(-1, False, f"signal: {'killed' if name == 'kill' else name}", error)
    return Ended(exit_code, True, f"exit status {exit_code}", error)
