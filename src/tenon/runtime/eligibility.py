"""The fail-closed restart-safe check made at an action boundary.

A boundary is restartable only when nothing but the persistent directories (/workspace,
HOME, /tmp) carries state across actions: no process is left in the sandbox besides the
backend's init, no other state a later action could observe remains (files written
elsewhere, /dev/shm files, SysV or POSIX IPC objects, listening sockets; or it cannot be
known), and the controller holds the agent's logical state. Any other answer, an unknown
answer, or an error while asking makes the boundary resident_only. The caller guarantees
no action is in flight.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tenon.sandbox.base import ProcessInfo, Sandbox

logger = logging.getLogger(__name__)

MAX_NAMED = 5  # how many processes or paths a reason names before eliding


@dataclass(frozen=True)
class Eligibility:
    """Whether the sandbox may be torn down at this boundary, and why (not)."""

    restartable: bool
    reason: str

    @property
    def resident_only(self) -> bool:
        return not self.restartable


def _resident_only(reason: str) -> Eligibility:
    return Eligibility(restartable=False, reason=reason)


def _name_some(items: list[str]) -> str:
    named = ", ".join(items[:MAX_NAMED])
    more = len(items) - MAX_NAMED
    return f"{named} and {more} more" if more > 0 else named


def _describe(proc: ProcessInfo) -> str:
    return f"pid {proc.host_pid} ({proc.command})"


def check_restartable(sandbox: Sandbox, agent_has_logical_state: bool) -> Eligibility:
    """Decide restartable vs resident_only; never raises (errors are resident_only)."""
    sandbox_id = "?"
    try:
        sandbox_id = sandbox.spec.sandbox_id
        if not agent_has_logical_state:
            return _resident_only("the controller does not hold the agent's logical state")
        procs = sandbox.processes()
        if procs is None:
            return _resident_only("the sandbox's process list is unknown")
        if procs:
            return _resident_only(
                f"{len(procs)} process(es) left in the sandbox: "
                f"{_name_some([_describe(p) for p in procs])}"
            )
        leftovers = sandbox.leftover_state()
        if leftovers is None:
            return _resident_only("state left outside the persistent directories "
                                  "cannot be ruled out")
        if leftovers:
            return _resident_only(
                f"{len(leftovers)} piece(s) of state left outside the persistent "
                f"directories: {_name_some([str(p) for p in leftovers])}"
            )
    except Exception as exc:  # fail closed: whatever went wrong, keep the sandbox
        logger.warning("restart-safe check of %s failed: %r", sandbox_id, exc)
        return _resident_only(f"the restart-safe check failed: {exc!r}")
    return Eligibility(restartable=True, reason="restartable: no leftover processes or state")
