"""Readings and results the host layer returns (plain frozen values)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class CgroupVersion(enum.Enum):
    V1 = "v1"
    V2 = "v2"


@dataclass(frozen=True)
class MemoryReading:
    """One sample of a cgroup's memory and CPU (bytes and seconds)."""

    usage_bytes: int  # v1 usage_in_bytes (+ swap where accounted); v2 memory.current + swap.current
    peak_bytes: int  # v1 max_usage_in_bytes; v2 memory.peak (or usage when the kernel lacks it)
    limit_bytes: int | None  # None when unlimited
    cpu_usage_s: float  # cumulative CPU time of the cgroup
    num_oom_kills: int  # cumulative OOM kills inside this cgroup


@dataclass(frozen=True)
class PressureReading:
    """PSI 'some' and 'full' averages (percent) and totals (microseconds)."""

    some_avg10: float
    some_avg60: float
    full_avg10: float
    full_avg60: float
    some_total_us: int
    full_total_us: int


@dataclass(frozen=True)
class GateResult:
    """Outcome of a freeze/thaw request."""

    frozen: bool  # the state reached
    changed: bool  # False when the cgroup was already in that state (idempotent)
    elapsed_s: float  # time until the state was reached


@dataclass(frozen=True)
class OomEvent:
    """One OOM kill inside the domain, attributed to the sandbox cgroup it hit."""

    sandbox_id: str
    num_kills: int  # kills seen in this sandbox since the previous poll


@dataclass(frozen=True)
class HostProcess:
    """One process as /proc shows it from the host's pid namespace."""

    pid: int
    ppid: int
    sid: int  # session id
    pgid: int  # process group id
    command: str  # argv joined by spaces (comm in brackets for zombies and kernel threads)
