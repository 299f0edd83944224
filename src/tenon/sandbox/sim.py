"""A simulated host: a memory-limited domain and sandboxes that run load profiles in clock time.

Serves scenario tests, the simulator and demos with the same runtime code the real backends
get. Nothing touches the OS; time is the injected clock (a `FakeClock` makes a whole burst
run instantly and identically).

A simulated sandbox understands one command language, the sim twin of the replay's load
program (`replay.loadprog`):

    tenon-sim-load AVG_BYTES PEAK_BYTES DURATION_S RESIDENT_AFTER_BYTES [EXIT_CODE]

The action's anonymous memory ramps to the peak over 10% of its duration, holds it for 10%,
then stays at the level that makes the time-average AVG; at the end it frees that memory and
the sandbox keeps RESIDENT_AFTER bytes (its "tmpfs files") until it is destroyed. Any other
command raises `UnknownSimCommand` rather than inventing a result.

The physics, which is what the controller is tested against:
- an action progresses only while its sandbox is thawed, at its CPU-quota speed, and at a
  tenth of that while its usage is above its memory.high mark (the kernel throttles there);
- CPU time is the progress made, so a frozen sandbox gains none (the gate sees that);
- whenever the domain's usage exceeds its budget, the kernel's choice is mimicked: the
  running action with the largest usage is OOM-killed (exit -9, its memory freed, the
  sandbox's oom_kill count raised); its sandbox survives.
"""

from __future__ import annotations

import logging
import os
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

from tenon.clock import Clock
from tenon.errors import ConfigError, SandboxDied, SandboxError, SandboxFrozen
from tenon.host.types import CgroupVersion, GateResult, MemoryReading, PressureReading
from tenon.sandbox.base import BackendCapacity, ExecIO, ExecResult, ProcessInfo, SandboxSpec
from tenon.sandbox.fake import FakeControl

logger = logging.getLogger(__name__)

SIM_LOAD = "tenon-sim-load"
STEP_S = 0.05  # simulation granularity of a running action
THROTTLED_SPEED = 0.1  # progress factor above memory.high


class UnknownSimCommand(SandboxError):
    """A simulated sandbox was asked to run a command outside its language."""


@dataclass(frozen=True)
class SimLoad:
    avg_bytes: int
    peak_bytes: int
    duration_s: float
    resident_after_bytes: int
    exit_code: int = 0


def sim_load_command(avg_bytes: int, peak_bytes: int, duration_s: float,
                     resident_after_bytes: int, exit_code: int = 0) -> str:
    """The sim command for one action's profile (the twin of `replay.loadprog.load_command`)."""
    load = SimLoad(int(avg_bytes), int(peak_bytes), float(duration_s), int(resident_after_bytes),
                   exit_code)
    _check(load)
    return f"{SIM_LOAD} {load.avg_bytes} {load.peak_bytes} {load.duration_s:.3f} " \
           f"{load.resident_after_bytes} {exit_code}"


def _check(load: SimLoad) -> SimLoad:
    if min(load.avg_bytes, load.peak_bytes, load.resident_after_bytes) < 0 or load.duration_s < 0:
        raise ConfigError(f"sim load: sizes and duration must not be negative: {load}")
    if load.peak_bytes < load.avg_bytes:
        raise ConfigError(f"sim load: peak {load.peak_bytes} < avg {load.avg_bytes}")
    return load


def parse_sim_command(command: str) -> SimLoad:
    words = shlex.split(command)
    if not words or words[0] != SIM_LOAD or len(words) not in (5, 6):
        raise UnknownSimCommand(
            f"simulated sandboxes run only `{SIM_LOAD} AVG PEAK DURATION RESIDENT [EXIT]`, "
            f"got {command[:120]!r}"
        )
    try:
        nums = [int(words[1]), int(words[2]), float(words[3]), int(words[4])]
        code = int(words[5]) if len(words) == 6 else 0
    except ValueError as exc:
        raise UnknownSimCommand(f"bad number in sim command {command!r}: {exc}") from None
    return _check(SimLoad(int(nums[0]), int(nums[1]), nums[2], int(nums[3]), code))


def anon_level(load: SimLoad, existing_bytes: int, progress_s: float) -> int:
    """Anonymous bytes at `progress_s`: the load program's ramp / hold / level shape."""
    peak = max(load.peak_bytes - existing_bytes, 0)
    avg = max(min(load.avg_bytes - existing_bytes, peak), 0)
    d = load.duration_s
    if peak <= 0 or d <= 0:
        return peak if progress_s < d else 0
    ramp, hold = 0.1 * d, 0.1 * d
    level = (avg * d - peak * (ramp / 2 + hold)) / (d - ramp - hold)
    if level < 0:
        level = 0.0
        hold = max(0.0, avg * d / peak - ramp / 2)
    if progress_s < ramp:
        return int(peak * progress_s / ramp)
    if progress_s < ramp + hold:
        return peak
    return int(min(peak, level))


class SimDomain:
    """The simulated workload domain: a budget over its sandboxes' usage; OOM kills beyond."""

    def __init__(self, budget_bytes: int | None, *, name: str = "tenon-sim",
                 version: CgroupVersion = CgroupVersion.V2) -> None:
        self.name = name
        self.budget_bytes = budget_bytes
        self._version = version
        self.cgroups: dict[str, SimCgroup] = {}
        self.num_oom_kills = 0
        self.peak_bytes = 0

    @property
    def version(self) -> CgroupVersion:
        return self._version

    def set_budget(self, budget_bytes: int | None) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise ConfigError(f"budget must not be negative, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.enforce()

    def usage_bytes(self) -> int:
        return sum(c.usage_bytes for c in self.cgroups.values())

    def pressure(self) -> PressureReading | None:
        return None  # the simulated host models no stalls: usage is its only signal

    def reading(self) -> MemoryReading:
        usage = self.usage_bytes()
        self.peak_bytes = max(self.peak_bytes, usage)
        cpu_s = sum(c.cpu_usage_s for c in self.cgroups.values())
        return MemoryReading(usage, self.peak_bytes, self.budget_bytes, cpu_s, self.num_oom_kills)

    def enforce(self) -> None:
        """OOM-kill the largest running action while the domain is over its budget."""
        usage = self.usage_bytes()
        self.peak_bytes = max(self.peak_bytes, usage)
        while self.budget_bytes is not None and usage > self.budget_bytes:
            running = [c for c in self.cgroups.values() if c.anon_bytes > 0 and c.running]
            if not running:
                return  # only resident files: the kernel would reclaim or refuse writes
            victim = max(running, key=lambda c: (c.usage_bytes, c.sandbox_id))
            logger.info("sim: OOM kill in %s (domain %d > %d)", victim.sandbox_id, usage,
                        self.budget_bytes)
            victim.oom_kill()
            self.num_oom_kills += 1
            usage = self.usage_bytes()


class SimCgroup:
    """A simulated sandbox cgroup; implements `SandboxMeter`."""

    def __init__(self, sandbox_id: str, domain: SimDomain) -> None:
        self.sandbox_id = sandbox_id
        self.domain = domain
        self.resident_bytes = 0
        self.anon_bytes = 0
        self.cpu_usage_s = 0.0
        self.peak_bytes = 0
        self.frozen = False
        self.cpu_fraction: float | None = None
        self.memory_high_bytes: int | None = None
        self.running = False
        self.oom_killed = False  # the running action was killed; read by the action
        self.held_total_s = 0.0  # clock time the running actions spent frozen
        self._oom_kills = 0
        self._seen_oom_kills = 0

    @property
    def usage_bytes(self) -> int:
        return self.resident_bytes + self.anon_bytes

    def reading(self) -> MemoryReading:
        return MemoryReading(self.usage_bytes, self.peak_bytes, None, self.cpu_usage_s,
                             self._oom_kills)

    def sample(self) -> tuple[int, float]:
        return self.usage_bytes, self.cpu_usage_s

    def reset_peak(self) -> bool:
        self.peak_bytes = self.usage_bytes
        return True

    def new_oom_kills(self) -> int:
        fresh, self._seen_oom_kills = self._oom_kills - self._seen_oom_kills, self._oom_kills
        return fresh

    def is_frozen(self) -> bool:
        return self.frozen

    def _set_frozen(self, frozen: bool) -> GateResult:
        start = time.perf_counter()
        changed = self.frozen != frozen
        self.frozen = frozen
        return GateResult(frozen, changed, time.perf_counter() - start)

    def freeze(self, timeout_s: float = 5.0) -> GateResult:
        return self._set_frozen(True)

    def thaw(self, timeout_s: float = 5.0) -> GateResult:
        return self._set_frozen(False)

    def held_s(self) -> float:
        return self.held_total_s

    def set_cpu_quota(self, fraction: float | None) -> None:
        if fraction is not None and not fraction > 0:
            raise ConfigError(f"cpu quota must be a positive fraction of a CPU, got {fraction}")
        self.cpu_fraction = fraction

    def set_memory_high(self, high_bytes: int | None) -> None:
        if high_bytes is not None and high_bytes < 0:
            raise ConfigError(f"memory.high must not be negative, got {high_bytes}")
        self.memory_high_bytes = high_bytes

    def speed(self) -> float:
        if self.frozen:
            return 0.0
        speed = 1.0 if self.cpu_fraction is None else min(self.cpu_fraction, 1.0)
        if self.memory_high_bytes is not None and self.usage_bytes > self.memory_high_bytes:
            speed *= THROTTLED_SPEED
        return speed

    def set_anon(self, anon_bytes: int) -> None:
        self.anon_bytes = anon_bytes
        self.peak_bytes = max(self.peak_bytes, self.usage_bytes)
        self.domain.enforce()

    def oom_kill(self) -> None:
        self.anon_bytes = 0
        self.oom_killed = True
        self._oom_kills += 1


class SimSandbox:
    """A simulated live sandbox."""

    def __init__(self, spec: SandboxSpec, cgroup: SimCgroup, clock: Clock) -> None:
        self._spec = spec
        self.cgroup = cgroup
        self._clock = clock
        self.destroyed = False
        self.leftover_processes: list[ProcessInfo] = []
        self.leftovers: list[str] | None = []
        self.commands: list[str] = []

    @property
    def spec(self) -> SandboxSpec:
        return self._spec

    @property
    def cgroup_name(self) -> str:
        return self._spec.sandbox_id

    async def exec(self, command: str, *, timeout_s: float,
                   max_output_bytes: int = 65536, io: ExecIO | None = None) -> ExecResult:
        """Run a load command. With `io`, streams are ignored (the output is only in the
        result) but `on_start` gets a control whose ending signal kills the action (exit
        -signum) at the next simulation step."""
        if self.destroyed:
            raise SandboxDied(f"sim sandbox {self._spec.sandbox_id} was destroyed")
        if self.cgroup.frozen:
            raise SandboxFrozen(f"sim sandbox {self._spec.sandbox_id} is frozen")
        load = parse_sim_command(command)
        self.commands.append(command)
        control = FakeControl(io is not None and io.stdin)
        if io is not None and io.on_start is not None:
            io.on_start(control)
        cg = self.cgroup
        start = last = self._clock.now()
        existing = cg.resident_bytes
        progress = 0.0
        cg.running, cg.oom_killed = True, False
        try:
            cg.set_anon(anon_level(load, existing, 0.0))
            held_at_start = cg.held_total_s
            while progress < load.duration_s and not cg.oom_killed:
                if control.signalled is not None:
                    cg.anon_bytes = 0
                    return ExecResult(-control.signalled, "", False, self._clock.now() - start)
                running_s = self._clock.now() - start - (cg.held_total_s - held_at_start)
                if running_s >= timeout_s:  # held time does not count toward the timeout
                    cg.anon_bytes = 0
                    return ExecResult(-9, "", False, self._clock.now() - start, timed_out=True)
                await self._clock.sleep(STEP_S)
                if self.destroyed:
                    raise SandboxDied(f"sim sandbox {self._spec.sandbox_id} died mid-action")
                now = self._clock.now()
                if cg.frozen:
                    cg.held_total_s += now - last
                step = (now - last) * cg.speed()
                last = now
                progress = min(progress + step, load.duration_s)
                cg.cpu_usage_s += step
                if not cg.oom_killed:
                    cg.set_anon(anon_level(load, existing, progress))
        finally:
            cg.running = False
            control.finish()
        elapsed = self._clock.now() - start
        if cg.oom_killed:
            return ExecResult(-9, "Killed\n", False, elapsed)
        cg.anon_bytes = 0
        cg.resident_bytes = load.resident_after_bytes
        cg.set_anon(0)
        out = f"sim load done: peak {load.peak_bytes} resident {load.resident_after_bytes}\n"
        return ExecResult(load.exit_code, out[:max_output_bytes], False, elapsed)

    def processes(self) -> list[ProcessInfo]:
        return list(self.leftover_processes)

    def leftover_state(self) -> list[str] | None:
        return None if self.leftovers is None else list(self.leftovers)

    async def destroy(self) -> None:
        if self.destroyed:
            return
        self.destroyed = True
        self.cgroup.resident_bytes = self.cgroup.anon_bytes = 0
        self.cgroup.domain.cgroups.pop(self.cgroup.sandbox_id, None)


class SimBackend:
    """Materializes simulated sandboxes in a `SimDomain`, taking `materialize_s` of clock time."""

    name = "sim"
    simulated = True

    def __init__(self, domain: SimDomain, clock: Clock, *, materialize_s: float = 0.02,
                 base_bytes: int = 0) -> None:
        self.domain = domain
        self.clock = clock
        self.materialize_s = materialize_s
        self.base_bytes = base_bytes  # what an idle sandbox's init costs
        self.sandboxes: list[SimSandbox] = []

    def capacity(self) -> BackendCapacity:
        """No limit beyond memory: simulated actions cost no CPU of the host."""
        return BackendCapacity()

    def remove_leftovers(self, sandbox_prefix: str = "") -> list[str]:
        return []

    def release_domain(self) -> None:
        pass

    def image_root(self, image: str) -> Path | None:
        return None

    def check(self) -> list[str]:
        return []

    async def materialize(self, spec: SandboxSpec) -> SimSandbox:
        if spec.sandbox_id in self.domain.cgroups:
            raise SandboxError(f"sim sandbox {spec.sandbox_id} already exists")
        if not os.path.isdir(spec.workspace):  # noqa: ASYNC240 - one stat, and deterministic
            raise SandboxError(f"workspace {spec.workspace} is not a directory")
        await self.clock.sleep(self.materialize_s)
        cgroup = SimCgroup(spec.sandbox_id, self.domain)
        cgroup.resident_bytes = self.base_bytes
        self.domain.cgroups[spec.sandbox_id] = cgroup
        sandbox = SimSandbox(spec, cgroup, self.clock)
        self.sandboxes.append(sandbox)
        return sandbox

    def live(self) -> list[SimSandbox]:
        return [s for s in self.sandboxes if not s.destroyed]
