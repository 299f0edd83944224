"""The sandbox contract every backend implements."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from tenon.host.types import CgroupVersion, GateResult, MemoryReading, PressureReading
from tenon.sandbox.netpolicy import NetworkPolicy

# Subdirectory of an agent's persistent root -> where the sandbox sees it. HOME is
# /home/user, as in E2B sandboxes. Each is captured, fsynced and digested at teardown.
PERSISTENT_MOUNTS: dict[str, str] = {"workspace": "/workspace", "home": "/home/user",
                                     "tmp": "/tmp"}
HOME_DIR = PERSISTENT_MOUNTS["home"]
# A writable root (the process backend's overlay): what an agent writes outside the
# directories above lands in `OVERLAY_UPPER_DIR` of its persistent root (overlay whiteouts
# and opaque directories included), captured like them; `OVERLAY_WORK_DIR` beside it is
# the overlay's scratch space, never captured.
OVERLAY_UPPER_DIR = "upper"
OVERLAY_WORK_DIR = "work"
# Every subdirectory of a persistent root that holds the agent's state (what capture
# records), and those that must not be captured.
PERSISTENT_SUBDIRS: tuple[str, ...] = (*PERSISTENT_MOUNTS, OVERLAY_UPPER_DIR)
UNCAPTURED_SUBDIRS: frozenset[str] = frozenset({OVERLAY_WORK_DIR})
# The runtime's fixed state directory; backends unpack base images there by default.
DEFAULT_STATE_DIR = Path("/var/lib/tenon")


@dataclass(frozen=True)
class SandboxSpec:
    """What to materialize: a base image plus a workspace, inside the domain."""

    sandbox_id: str  # stable, filesystem-safe; names the cgroup / container
    image: str  # base image name, e.g. "tenon-base:bookworm"
    # The agent's persistent root on the host: its subdirectories (`PERSISTENT_MOUNTS`) are
    # bound read-write at /workspace, HOME and /tmp.
    workspace: Path
    # What the sandbox may reach (`netpolicy`): nothing unless asked. Also given as True or
    # False (internet access on or off) or a mapping of the policy's fields (records).
    network: NetworkPolicy = NetworkPolicy()
    max_pids: int = 512
    # Size cap of each tmpfs (/dev/shm and the disposable paths), charged to the sandbox.
    tmp_size_bytes: int = 1024 * 1024 * 1024
    # Absolute paths mounted as a fresh tmpfs at every materialization: whatever an action
    # leaves there is dropped at teardown. Only declared explicitly, never by default.
    disposable: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "network", NetworkPolicy.from_value(self.network))
        mounts = set(PERSISTENT_MOUNTS.values())
        for path in self.disposable:
            if not path.startswith("/") or path == "/" or ".." in path.split("/"):
                raise ValueError(f"disposable path {path!r} must be absolute, below /, no '..'")
            if any(path == m or path.startswith(m + "/") or m.startswith(path + "/")
                   for m in mounts):
                raise ValueError(f"disposable path {path!r} overlaps a persistent directory")


@dataclass(frozen=True)
class ExecResult:
    """A finished action: exit code, bounded output, how long it took."""

    exit_code: int  # negative: killed by that signal number
    output: str  # stdout and stderr interleaved, truncated to max_output_bytes
    truncated: bool
    duration_s: float
    timed_out: bool = False


class ExecControl(Protocol):
    """A command started with an `ExecIO`, as its caller steers it while it runs."""

    async def write_stdin(self, data: bytes) -> None:
        """Feed the command's stdin (SandboxError when it was not opened or is closed)."""
        ...

    async def close_stdin(self) -> None:
        """Close the command's stdin (it reads end of file); idempotent."""
        ...

    async def signal(self, signum: int) -> None:
        """Send `signum` to the command's whole process tree (SIGKILL ends it)."""
        ...


@dataclass
class ExecIO:
    """An interactive command's streams and settings (what the E2B API offers a client).

    With an `ExecIO`, `Sandbox.exec` keeps stdout and stderr apart and hands each chunk to
    its callback as it arrives (the `ExecResult` still carries both, interleaved and
    bounded), opens a stdin pipe when `stdin` is set, runs in `cwd` (default /workspace)
    as `user` with `env` added to the sandbox's, and calls `on_start` once the command
    runs, with the control to write its stdin and signal it.
    """

    on_stdout: Callable[[bytes], None] | None = None
    on_stderr: Callable[[bytes], None] | None = None
    stdin: bool = False
    cwd: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    on_start: Callable[[ExecControl], None] | None = None
    user: str | None = None
    """Who the command runs as: a user of the sandbox's /etc/passwd ("root": uid 0 with
    Docker's default capabilities, inside the sandbox only); None: the unprivileged default
    user (uid 1000, HOME /home/user)."""
    on_outcome: Callable[[str, int], None] | None = None
    """Called by the runtime (never a backend) once an action's outcome and exit code are
    known, before its boundary's bookkeeping (the restart-safe check, the records): a
    client may have its answer while Tenon finishes the boundary."""


@dataclass(frozen=True)
class ProcessInfo:
    """A live process inside a sandbox, as seen from the host."""

    host_pid: int
    ppid: int
    command: str


class SandboxMeter(Protocol):
    """A sandbox's cgroup as the controller's loops use it: read, gate, throttle.

    `host.cgroup.SandboxCgroup` is the real one; `sandbox.sim.SimCgroup` the simulated one.
    """

    def reading(self) -> MemoryReading:
        """Usage, peak, limit, CPU time and OOM kills of the sandbox's cgroup."""
        ...

    def sample(self) -> tuple[int, float]:
        """(usage_bytes, cpu_usage_s), cheaply: the execution loop's per-period read."""
        ...

    def new_oom_kills(self) -> int:
        """OOM kills in this cgroup since the previous call."""
        ...

    def reset_peak(self) -> bool:
        """Restart the peak at the current usage; False where the cgroup cannot."""
        ...

    def is_frozen(self) -> bool:
        """Whether the freezer holds the sandbox now."""
        ...

    def freeze(self, timeout_s: float = ...) -> GateResult:
        """Hold the sandbox; HostError if it is not frozen within `timeout_s`."""
        ...

    def thaw(self, timeout_s: float = ...) -> GateResult:
        """Let the sandbox run again; HostError if it is not thawed within `timeout_s`."""
        ...

    def held_s(self) -> float:
        """Total seconds held frozen by the gate (excluded from action timeouts)."""
        ...

    def set_cpu_quota(self, fraction: float | None) -> None:
        """Cap the sandbox's CPU at `fraction` of one CPU; None lifts the cap."""
        ...

    def set_memory_high(self, high_bytes: int | None) -> None:
        """Throttle the sandbox above `high_bytes` (memory.high); None lifts the mark."""
        ...


class DomainMeter(Protocol):
    """The workload domain as the controller uses it (`host.domain.WorkloadDomain` is one)."""

    name: str
    """The domain's cgroup name (also the label of what its sandboxes leave behind)."""
    budget_bytes: int | None
    """The memory limit Tenon manages; None: unlimited."""

    @property
    def version(self) -> CgroupVersion:
        """The cgroup version whose memory controller the domain uses."""
        ...

    def reading(self) -> MemoryReading:
        """The domain's usage, peak and limit, all its sandboxes included."""
        ...

    def set_budget(self, budget_bytes: int | None) -> None:
        """Set the memory limit (None: unlimited)."""
        ...

    def pressure(self) -> PressureReading | None:
        """The domain's memory pressure (PSI); None where the host has none."""
        ...


@dataclass(frozen=True)
class BackendCapacity:
    """How much a backend serves well at once, beyond what memory allows; None: no limit of
    its own. The runtime takes these where its config says "auto"
    (`PolicyConfig.max_admitted_actions`, `PolicyConfig.max_live_workflows`)."""

    max_admitted_actions: int | None = None
    """Actions running at once before each one slows down (e.g. a daemon serving every exec)."""
    max_live_workflows: int | None = None
    """Workflows worth keeping live at once; more only queue for the admitted actions."""

    def __post_init__(self) -> None:
        for name in ("max_admitted_actions", "max_live_workflows"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1 or None, got {value}")


@runtime_checkable
class Sandbox(Protocol):
    """A live physical sandbox."""

    @property
    def spec(self) -> SandboxSpec:
        """What the sandbox was materialized from."""
        ...

    @property
    def cgroup_name(self) -> str:
        """The sandbox's cgroup, relative to the workload domain."""
        ...

    @property
    def cgroup(self) -> SandboxMeter:
        """The sandbox's cgroup as the controller reads, gates and throttles it. It holds
        every process of the sandbox, and stays the same object for the sandbox's life."""
        ...

    async def exec(
        self, command: str, *, timeout_s: float, max_output_bytes: int = 65536,
        io: ExecIO | None = None,
    ) -> ExecResult:
        """Run `command` under /bin/sh -c as a fresh process in /workspace (`io.cwd`).

        `timeout_s` bounds the action's running time: time the gate holds the sandbox
        frozen does not count. On timeout the action's whole process tree is killed and the
        result has timed_out=True. Never called while the gate holds the sandbox frozen.
        """
        ...

    def processes(self) -> list[ProcessInfo]:
        """Processes alive in the sandbox other than the backend's own init."""
        ...

    def leftover_state(self) -> list[str] | None:
        """State outside the persistent and disposable directories that a later action could
        observe (files written elsewhere, /dev/shm files, SysV and POSIX IPC objects,
        listening sockets), each named in one string; None when it cannot be known."""
        ...

    async def destroy(self) -> None:
        """Dematerialize: kill everything, release memory, remove the cgroup. Idempotent."""
        ...


class SandboxBackend(Protocol):
    """Materializes sandboxes of one kind."""

    @property
    def name(self) -> str:
        """The backend's type tag (`sandbox.config`), recorded with each agent so that a
        controller restarted on another backend refuses to rebuild its sandboxes."""
        ...

    @property
    def simulated(self) -> bool:
        """True when sandboxes run no programs: exec understands only the simulated load
        command (`sandbox.sim.sim_load_command`) and time is the injected clock's. False
        when exec takes a shell command (the replay's load program, or the agent's own)."""
        ...

    def capacity(self) -> BackendCapacity:
        """What this backend serves well at once, beyond memory (cheap; may read the host's
        CPU count)."""
        ...

    def check(self) -> list[str]:
        """Problems that prevent materializing (empty when ready), each with its fix."""
        ...

    async def materialize(self, spec: SandboxSpec) -> Sandbox:
        """Start a sandbox; return only when an exec would succeed."""
        ...

    def remove_leftovers(self, sandbox_prefix: str = "") -> list[str]:
        """Remove what sandboxes of this backend's domain (those whose id starts with
        `sandbox_prefix`) hold outside the domain's cgroups (a dead controller's
        containers), when none of them is a live controller's; what was removed, each named
        in one string. The domain's cgroups are the
        runtime's to remove (`WorkloadDomain.remove_children`)."""
        ...

    def image_root(self, image: str) -> Path | None:
        """The host directory holding `image`'s root filesystem when the host can read it
        directly (the service serves files outside the persistent mounts from it); None
        otherwise."""
        ...

    def release_domain(self) -> None:
        """After the workload domain is removed: remove what the backend made for it
        outside the domain itself. Idempotent."""
        ...
