"""Reconcile on start: what a dead controller left, against its recovery records.

A controller can die anywhere (SIGKILL, OOM, power). Its process sandboxes die with it
(bwrap `--die-with-parent`); Docker containers, sandbox cgroups, workspace mounts and
workspaces stay. On start, before any agent runs:

1. every sandbox of the domain is removed (`remove_leftovers`: cgroups killed and removed,
   containers labelled with the domain removed): none of them belongs to this controller,
   and a record, not a live sandbox, is what an agent is restored from;
2. workspaces without a record are removed (nothing was committed for them), the others
   are kept (and their mounts set up again, when the workspace store manages mounts);
3. each record is restored by `restore_decision` (pure): a committed record (torn down or
   blocked) stays as it is; a record still *resident* lost its sandbox with the
   controller, and is rebuilt from its persistent root as it is on disk (a fresh manifest
   is captured and committed, then it is like any torn-down agent) only if its last
   boundary was restartable, since then everything a later action could see was in the
   persistent root; otherwise the live state it kept (a server, /dev/shm, IPC) is gone
   and the agent blocks with a reason naming what was lost;
4. an action that was in flight is recorded as interrupted, for the caller to see.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tenon.errors import RecoveryError, WorkspaceError
from tenon.sandbox.ownership import hide_persistent_root
from tenon.state.recovery import RecoveryRecord, RecoveryStore
from tenon.state.workspace import WorkspaceStore

logger = logging.getLogger(__name__)

LeftoverRemover = Callable[[], list[str]]  # removes every sandbox of the domain; their names


class Restore(enum.Enum):
    KEEP = "keep"  # committed (torn down or blocked): restored as recorded
    RECAPTURE = "recapture"  # lost while resident at a restartable boundary: commit the disk
    BLOCK = "block"  # lost while resident with state outside the persistent root


@dataclass(frozen=True)
class RestoreDecision:
    action: Restore
    reason: str


def restore_decision(record: RecoveryRecord) -> RestoreDecision:
    """How to restore one record after a controller crash (pure)."""
    if record.state != "resident":
        return RestoreDecision(Restore.KEEP, f"committed record ({record.state})")
    lost = f"generation {record.generation} was lost with the controller"
    if record.last_boundary is None:
        # No action had ended: the sandbox held only what materialization put there, and
        # an action in flight wrote, if anything, to the persistent root.
        return RestoreDecision(Restore.RECAPTURE, f"{lost} before its first boundary")
    if record.last_boundary == "restartable":
        return RestoreDecision(Restore.RECAPTURE, f"{lost} after a restartable boundary")
    if record.last_boundary == "resident_only":
        return RestoreDecision(
            Restore.BLOCK,
            f"{lost} while resident-only, and what it held outside the persistent root "
            f"is gone ({record.last_boundary_reason or 'no reason recorded'})",
        )
    return RestoreDecision(
        Restore.BLOCK,
        f"{lost} and its last boundary was never checked for restart safety",
    )


@dataclass(frozen=True)
class ReconcileReport:
    """What reconciling found and did; logged and emitted as the `reconcile` event."""

    removed_sandboxes: tuple[str, ...] = ()
    removed_workspaces: tuple[str, ...] = ()
    restored: tuple[str, ...] = ()  # committed records, rebuilt at their next action
    recaptured: tuple[str, ...] = ()  # lost while resident, committed from disk
    blocked: dict[str, str] = field(default_factory=dict)  # agent id -> reason
    interrupted: dict[str, str] = field(default_factory=dict)  # agent id -> action id

    def as_event(self) -> dict[str, Any]:
        return {
            "removed_sandboxes": list(self.removed_sandboxes),
            "removed_workspaces": list(self.removed_workspaces),
            "restored": list(self.restored),
            "recaptured": list(self.recaptured),
            "blocked": dict(self.blocked),
            "interrupted": dict(self.interrupted),
        }


def reconcile(
    store: RecoveryStore,
    workspaces: WorkspaceStore,
    *,
    remove_leftovers: LeftoverRemover | None = None,
) -> ReconcileReport:
    """Bring the host and the records into agreement (see the module docstring)."""
    removed = remove_leftovers() if remove_leftovers is not None else []
    records = store.all()
    removed_workspaces = _reconcile_workspaces(workspaces, {r.agent_id for r in records})
    restored: list[str] = []
    recaptured: list[str] = []
    blocked: dict[str, str] = {}
    interrupted: dict[str, str] = {}
    for record in records:
        agent_id = record.agent_id
        if record.in_flight is not None or record.interrupted is not None:
            action_id = store.mark_interrupted(agent_id)
            if action_id is not None:
                interrupted[agent_id] = action_id
        decision = restore_decision(record)
        if decision.action is Restore.RECAPTURE:
            try:
                manifest = workspaces.capture(agent_id)
                store.commit_teardown(
                    agent_id, record.generation, manifest.digest, record.base_image,
                    record.backend, record.backend_config, manifest=manifest,
                )
            except (WorkspaceError, RecoveryError) as exc:
                decision = RestoreDecision(
                    Restore.BLOCK, f"{decision.reason}, but its persistent root could not "
                    f"be committed: {exc}")
            else:
                recaptured.append(agent_id)
                logger.info("agent %s: %s; committed its persistent root as on disk "
                            "(digest %s)", agent_id, decision.reason, manifest.digest[:12])
        if decision.action is Restore.BLOCK:
            store.mark_blocked(agent_id, decision.reason)
            blocked[agent_id] = decision.reason
        elif record.state == "blocked":
            blocked[agent_id] = record.reason or "blocked"
        elif decision.action is Restore.KEEP:
            restored.append(agent_id)
    report = ReconcileReport(tuple(removed), tuple(removed_workspaces), tuple(restored),
                             tuple(recaptured), blocked, interrupted)
    logger.info("reconciled: %d leftover sandbox(es) removed, %d orphan workspace(s) "
                "removed, %d restored, %d recaptured, %d blocked, %d interrupted",
                len(removed), len(removed_workspaces), len(restored), len(recaptured),
                len(blocked), len(interrupted))
    return report


def _reconcile_workspaces(workspaces: WorkspaceStore, keep: set[str]) -> list[str]:
    """Remove workspaces without a record, mount the kept ones again, and hand each kept
    root back to root: the uid its dead sandbox ran as returns to the pool, and its next
    holder must not enter the root. The ids removed."""
    removed = list(workspaces.reconcile(keep).removed)
    for agent_id in sorted(keep):
        root = workspaces.path_for(agent_id)
        if root.is_dir():
            hide_persistent_root(root)
    return removed
