"""What an action returns, and the per-action memory figures the execution loop gathers."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tenon.errors import TenonError


class Outcome(enum.Enum):
    """How an action ended. Only OOM_KILLED and SANDBOX_DIED fail the workflow attempt.

    INTERRUPTED does not fail it either: the agent was restored from its record and the
    caller decides whether to run the interrupted action again (its effects on the
    persistent root, if any, are kept as they were on disk)."""

    OK = "ok"  # exit code 0
    ERROR = "error"  # the command exited non-zero (the agent sees it; nothing failed)
    TIMEOUT = "timeout"  # ran past its timeout; its process tree was killed
    OOM_KILLED = "oom_killed"  # the kernel's OOM killer hit the sandbox during the action
    SANDBOX_DIED = "sandbox_died"  # the sandbox itself was lost
    INTERRUPTED = "interrupted"  # the controller stopped mid-action; reported after restart

    @property
    def fails_attempt(self) -> bool:
        return self in (Outcome.OOM_KILLED, Outcome.SANDBOX_DIED)


class WorkflowFailed(TenonError, RuntimeError):
    """The agent's workflow attempt already failed (OOM kill or lost sandbox); start anew."""


class AgentClosed(TenonError, RuntimeError):
    """The agent was closed; it runs no more actions."""


@dataclass(frozen=True)
class ActionResult:
    """One action's output, exit code and resource figures."""

    action_id: str
    agent_id: str
    outcome: Outcome
    exit_code: int
    output: str
    truncated: bool
    duration_s: float
    """From the start of execution to its end (time held by the gate included)."""
    queued_s: float
    """From ready to start: admission, rebuild and workflow waits."""
    avg_memory_bytes: int
    peak_memory_bytes: int
    predicted_avg_bytes: int
    predicted_peak_bytes: int
    charge_bytes: int
    action_class: str
    workspace_full: str | None = None
    """Set when the agent's persistent root was at its byte or inode limit after the action:
    why its writes failed (ENOSPC inside the sandbox), for the agent to be told."""

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK


class ActionStats:
    """Time-weighted average and peak of a sandbox's usage over one action."""

    def __init__(self, started_at: float, usage_bytes: int, cgroup_peak_bytes: int) -> None:
        self._last_t = started_at
        self._last_usage = usage_bytes
        self._area = 0.0
        self._span = 0.0
        self.start_bytes = usage_bytes
        self.peak_bytes = usage_bytes
        self._start_cgroup_peak = cgroup_peak_bytes

    def add(self, now: float, usage_bytes: int) -> None:
        dt = now - self._last_t
        if dt > 0:
            # trapezoid between samples: a ramp between two ticks counts at its mean
            self._area += dt * (self._last_usage + usage_bytes) / 2
            self._span += dt
        self._last_t, self._last_usage = now, usage_bytes
        self.peak_bytes = max(self.peak_bytes, usage_bytes)

    def finish(self, now: float, usage_bytes: int, cgroup_peak_bytes: int) -> tuple[int, int]:
        """(avg, peak). A cgroup high-water mark that rose during the action is its true peak
        (samples can miss a spike between ticks)."""
        self.add(now, usage_bytes)
        peak = self.peak_bytes
        if cgroup_peak_bytes > self._start_cgroup_peak:
            peak = max(peak, cgroup_peak_bytes)
        avg = int(self._area / self._span) if self._span > 0 else self.peak_bytes
        return min(avg, peak), peak
