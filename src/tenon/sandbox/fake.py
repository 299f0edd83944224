"""A fake sandbox backend: no OS resources, scripted results, injectable faults.

Serves tests, the simulator and demos. An exec is answered from a script: either one
callable used for every command, or a queue of steps consumed one per command (a step
is an `ExecResult` or a callable). A callable receives the sandbox and the command and
may really touch `sandbox.spec.workspace`, so workspace round trips are meaningful. When
a queue runs out, exec raises `FakeScriptExhausted` instead of inventing a result.

With an `ExecIO`, exec calls `on_start` once with a `FakeControl`; when stdin is asked for,
it waits until the caller closes stdin (or signals the command, which then ends with
-signum and consumes no step) and runs the step with what was written in
`sandbox.last_stdin`; the step's output then goes to `on_stdout` in one chunk.

Faults are named by operation ("materialize", "exec", "processes", "leftover_state",
"destroy"). `fail_on` takes either names (fail every time) or a mapping from name to a
count (fail that many times, then succeed), so retry paths can be driven exactly.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from tenon.errors import SandboxDied, SandboxError, SandboxFrozen
from tenon.host.types import GateResult, MemoryReading
from tenon.sandbox.base import BackendCapacity, ExecIO, ExecResult, ProcessInfo, SandboxSpec

logger = logging.getLogger(__name__)

FAULT_POINTS = frozenset({"materialize", "exec", "processes", "leftover_state", "destroy"})

# What a scripted step may return: a full result, an output string (exit 0), an exit
# code (no output), or None (exit 0, no output).
StepReturn = ExecResult | str | int | None
ExecStep = Callable[["FakeSandbox", str], StepReturn]
Script = ExecStep | Iterable[ExecResult | ExecStep]


class FakeScriptExhausted(SandboxError):
    """A fake sandbox was asked to exec a command its script has no step for."""


class InjectedFault(SandboxError):
    """A failure injected on purpose through `fail_on`."""


class Faults:
    """Which operations fail, and how many more times (None: forever)."""

    def __init__(self, fail_on: Iterable[str] | Mapping[str, int] = ()) -> None:
        self._remaining: dict[str, int | None] = {}
        if isinstance(fail_on, Mapping):
            for name, count in fail_on.items():
                self.set(name, count)
        else:
            for name in fail_on:
                self.set(name, None)

    def set(self, name: str, count: int | None = None) -> None:
        """Make `name` fail `count` more times (None: until cleared)."""
        if name not in FAULT_POINTS:
            raise ValueError(f"unknown fault point {name!r}; known: {sorted(FAULT_POINTS)}")
        if count is not None and count < 0:
            raise ValueError(f"fault count for {name!r} must be >= 0, got {count}")
        self._remaining[name] = count

    def clear(self, name: str | None = None) -> None:
        """Stop failing `name` (or everything)."""
        if name is None:
            self._remaining.clear()
        else:
            self._remaining.pop(name, None)

    def hit(self, name: str, where: str) -> None:
        """Raise InjectedFault if `name` is armed; consume one count."""
        if name not in self._remaining:
            return
        count = self._remaining[name]
        if count is not None:
            if count <= 0:
                del self._remaining[name]
                return
            self._remaining[name] = count - 1
        logger.debug("injecting fault at %s (%s)", name, where)
        raise InjectedFault(f"injected fault at {name} ({where})")


def _normalize(value: StepReturn, max_output_bytes: int) -> ExecResult:
    if isinstance(value, ExecResult):
        return value
    if value is None:
        return ExecResult(exit_code=0, output="", truncated=False, duration_s=0.0)
    if isinstance(value, bool):  # bool is an int; refuse the ambiguity
        raise TypeError("a fake exec step returned a bool; return an exit code or output")
    if isinstance(value, int):
        return ExecResult(exit_code=value, output="", truncated=False, duration_s=0.0)
    data = value.encode()
    truncated = len(data) > max_output_bytes
    output = data[:max_output_bytes].decode(errors="replace") if truncated else value
    return ExecResult(exit_code=0, output=output, truncated=truncated, duration_s=0.0)


# Signals whose default action leaves a process running.
_HARMLESS_SIGNALS = frozenset({signal.SIGCHLD, signal.SIGCONT, signal.SIGURG, signal.SIGWINCH})


class FakeControl:
    """`ExecControl` of a fake or simulated command: records stdin and signals.

    `ended` is set once stdin is closed or a signal that would end a process arrived
    (`signalled` is then that signal); after `finish`, writes raise SandboxError.
    """

    def __init__(self, stdin: bool) -> None:
        self._stdin_open = stdin
        self.stdin = bytearray()
        self.signals: list[int] = []
        self.signalled: int | None = None
        self.ended = asyncio.Event()

    async def write_stdin(self, data: bytes) -> None:
        if not self._stdin_open:
            raise SandboxError("the command's stdin is not open")
        self.stdin += data

    async def close_stdin(self) -> None:
        self._stdin_open = False
        self.ended.set()

    async def signal(self, signum: int) -> None:
        self.signals.append(signum)
        if signum not in _HARMLESS_SIGNALS and self.signalled is None:
            self.signalled = signum
            self.ended.set()

    def finish(self) -> None:
        self._stdin_open = False


class FakeMeter:
    """A fake sandbox's cgroup (`SandboxMeter`): its readings are the attributes a test sets,
    and the gate's freeze and thaw flip `frozen`, which the fake sandbox's exec honours."""

    def __init__(self) -> None:
        self.usage_bytes = 0
        self.peak_bytes = 0
        self.cpu_usage_s = 0.0
        self.num_oom_kills = 0
        self.frozen = False
        self.held_total_s = 0.0  # what `held_s` reports; a test advances it
        self.cpu_fraction: float | None = None
        self.memory_high_bytes: int | None = None
        self._seen_oom_kills = 0

    def reading(self) -> MemoryReading:
        return MemoryReading(self.usage_bytes, max(self.peak_bytes, self.usage_bytes), None,
                             self.cpu_usage_s, self.num_oom_kills)

    def sample(self) -> tuple[int, float]:
        return self.usage_bytes, self.cpu_usage_s

    def new_oom_kills(self) -> int:
        fresh, self._seen_oom_kills = self.num_oom_kills - self._seen_oom_kills, self.num_oom_kills
        return fresh

    def reset_peak(self) -> bool:
        self.peak_bytes = self.usage_bytes
        return True

    def is_frozen(self) -> bool:
        return self.frozen

    def freeze(self, timeout_s: float = 5.0) -> GateResult:
        changed, self.frozen = not self.frozen, True
        return GateResult(True, changed, 0.0)

    def thaw(self, timeout_s: float = 5.0) -> GateResult:
        changed, self.frozen = self.frozen, False
        return GateResult(False, changed, 0.0)

    def held_s(self) -> float:
        return self.held_total_s

    def set_cpu_quota(self, fraction: float | None) -> None:
        if fraction is not None and not fraction > 0:
            raise ValueError(f"cpu quota must be a positive fraction of a CPU, got {fraction}")
        self.cpu_fraction = fraction

    def set_memory_high(self, high_bytes: int | None) -> None:
        if high_bytes is not None and high_bytes < 0:
            raise ValueError(f"memory.high must not be negative, got {high_bytes}")
        self.memory_high_bytes = high_bytes


class FakeSandbox:
    """A live fake sandbox. Leftover processes and outside writes are plain attributes;
    `frozen` is its meter's (`cgroup`) freezer state."""

    def __init__(
        self, spec: SandboxSpec, backend: FakeBackend, script: Script | None = None
    ) -> None:
        self._spec = spec
        self._backend = backend
        self._callable: ExecStep | None = None
        self._queue: deque[ExecResult | ExecStep] = deque()
        self.set_script(script)
        self.leftover_processes: list[ProcessInfo] = []
        self.leftovers: list[str] | None = []
        self._meter = FakeMeter()
        self.destroyed = False
        self.commands: list[str] = []
        self.last_stdin = b""  # what the latest command with stdin was fed

    @property
    def spec(self) -> SandboxSpec:
        return self._spec

    @property
    def cgroup_name(self) -> str:
        return f"fake-{self._spec.sandbox_id}"

    @property
    def cgroup(self) -> FakeMeter:
        return self._meter

    @property
    def frozen(self) -> bool:
        return self._meter.frozen

    @frozen.setter
    def frozen(self, frozen: bool) -> None:
        self._meter.frozen = frozen

    def set_script(self, script: Script | None) -> None:
        """Replace the script: one callable for all commands, or a queue of steps."""
        self._queue.clear()
        self._callable = None
        if script is None:
            return
        if callable(script):
            self._callable = script
        else:
            self._queue.extend(script)

    def push(self, *steps: ExecResult | ExecStep) -> None:
        """Append steps to the queue."""
        self._queue.extend(steps)

    async def exec(
        self, command: str, *, timeout_s: float, max_output_bytes: int = 65536,
        io: ExecIO | None = None,
    ) -> ExecResult:
        if self.destroyed:
            raise SandboxDied(f"fake sandbox {self._spec.sandbox_id} was destroyed")
        if self.frozen:
            raise SandboxFrozen(f"fake sandbox {self._spec.sandbox_id} is frozen")
        self._backend.faults.hit("exec", self._spec.sandbox_id)
        self.commands.append(command)
        if io is None:
            return self._run_step(command, max_output_bytes)
        control = FakeControl(io.stdin)
        try:
            if io.on_start is not None:
                io.on_start(control)
            if io.stdin:
                try:
                    await asyncio.wait_for(control.ended.wait(), timeout_s)
                except TimeoutError:
                    return ExecResult(-9, "", False, timeout_s, timed_out=True)
                self.last_stdin = bytes(control.stdin)
            if control.signalled is not None:
                return ExecResult(-control.signalled, "", False, 0.0)
            result = self._run_step(command, max_output_bytes)
        finally:
            control.finish()
        if result.output and io.on_stdout is not None:
            io.on_stdout(result.output.encode())
        return result

    def _run_step(self, command: str, max_output_bytes: int) -> ExecResult:
        if self._callable is not None:
            step: ExecResult | ExecStep = self._callable
        elif self._queue:
            step = self._queue.popleft()
        else:
            raise FakeScriptExhausted(
                f"fake sandbox {self._spec.sandbox_id} has no scripted step for "
                f"command {command!r} (ran {len(self.commands) - 1} before)"
            )
        value = step if isinstance(step, ExecResult) else step(self, command)
        return _normalize(value, max_output_bytes)

    def processes(self) -> list[ProcessInfo]:
        self._backend.faults.hit("processes", self._spec.sandbox_id)
        return list(self.leftover_processes)

    def leftover_state(self) -> list[str] | None:
        self._backend.faults.hit("leftover_state", self._spec.sandbox_id)
        return None if self.leftovers is None else list(self.leftovers)

    async def destroy(self) -> None:
        if self.destroyed:
            return
        self._backend.faults.hit("destroy", self._spec.sandbox_id)
        self.destroyed = True
        self.leftover_processes = []
        logger.debug("fake sandbox %s destroyed", self._spec.sandbox_id)


class FakeBackend:
    """Materializes FakeSandboxes; records every one it made.

    `script` is the default script each new sandbox gets (a queue is copied per
    sandbox). `problems` is what `check()` reports.
    """

    name = "fake"
    simulated = False  # exec hands any command to the script


    def __init__(
        self,
        *,
        script: Script | None = None,
        fail_on: Iterable[str] | Mapping[str, int] = (),
        problems: Iterable[str] = (),
        require_workspace: bool = True,
    ) -> None:
        self._script: Script | None = script if script is None or callable(script) else list(script)
        self.faults = Faults(fail_on)
        self.problems = list(problems)
        self.require_workspace = require_workspace
        self.sandboxes: list[FakeSandbox] = []

    def capacity(self) -> BackendCapacity:
        return BackendCapacity()

    def remove_leftovers(self, sandbox_prefix: str = "") -> list[str]:
        return []

    def release_domain(self) -> None:
        pass

    def image_root(self, image: str) -> Path | None:
        return None

    def check(self) -> list[str]:
        return list(self.problems)

    async def materialize(self, spec: SandboxSpec) -> FakeSandbox:
        self.faults.hit("materialize", spec.sandbox_id)
        if self.problems:
            raise SandboxError(f"fake backend not ready: {'; '.join(self.problems)}")
        if self.require_workspace and not await asyncio.to_thread(os.path.isdir, spec.workspace):
            raise SandboxError(f"workspace {spec.workspace} is not a directory")
        script = (
            self._script if self._script is None or callable(self._script) else (list(self._script))
        )
        sandbox = FakeSandbox(spec, self, script)
        self.sandboxes.append(sandbox)
        logger.debug("fake sandbox %s materialized", spec.sandbox_id)
        return sandbox

    def live(self) -> list[FakeSandbox]:
        """Sandboxes materialized and not yet destroyed."""
        return [s for s in self.sandboxes if not s.destroyed]
