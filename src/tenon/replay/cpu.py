"""Where a replay's CPU went: the whole host, the sandboxes, the controller, the rest.

The rest is the host's busy time that is neither the sandboxes' (the workload domain's
cgroup) nor the controller process's: sandbox setup and removal done by other processes
(bubblewrap, mounts, the Docker daemon), the kernel's work outside the sandboxes, and
anything else the host ran meanwhile.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tenon.host.cpustat import host_busy_seconds


def controller_seconds() -> float:
    """This process's own user and system CPU time (all of its threads)."""
    times = os.times()
    return times.user + times.system


@dataclass(frozen=True, slots=True)
class CpuMark:
    host_s: float
    controller_s: float

    @classmethod
    def now(cls) -> CpuMark:
        return cls(host_busy_seconds(), controller_seconds())


def cpu_spent(before: CpuMark, after: CpuMark, sandboxes_s: float) -> dict[str, float]:
    """CPU-seconds between two marks: `host_s` in all, split into `sandboxes_s` (given:
    the workload domain's own counter), `controller_s` and `other_s`."""
    host = after.host_s - before.host_s
    controller = after.controller_s - before.controller_s
    return {"host_s": round(host, 2), "sandboxes_s": round(sandboxes_s, 2),
            "controller_s": round(controller, 2),
            "other_s": round(max(host - sandboxes_s - controller, 0.0), 2)}
