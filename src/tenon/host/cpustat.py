"""CPU time the whole host has spent busy, from /proc/stat."""

from __future__ import annotations

import os
from pathlib import Path

from tenon.errors import HostError

PROC_STAT = Path("/proc/stat")
# user nice system idle iowait irq softirq steal: all but idle and iowait are busy (guest
# time is already inside user and nice)
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)


def host_busy_seconds(stat_path: Path = PROC_STAT) -> float:
    """CPU-seconds all of the host's CPUs have been busy since boot."""
    try:
        first = stat_path.read_text().split("\n", 1)[0]
    except OSError as exc:
        raise HostError(f"cannot read {stat_path}: {exc}") from exc
    fields = first.split()
    if len(fields) < 9 or fields[0] != "cpu":
        raise HostError(f"{stat_path}: first line is not the all-CPU total: {first!r}")
    try:
        ticks = sum(int(fields[1 + i]) for i in _BUSY_FIELDS)
    except ValueError as exc:
        raise HostError(f"{stat_path}: non-numeric CPU field in {first!r}") from exc
    return ticks / os.sysconf("SC_CLK_TCK")
