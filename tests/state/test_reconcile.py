"""Reconcile on start (plain directories, no cgroups) and the state directory's lock."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tenon.errors import ConfigError
from tenon.state.reconcile import Restore, reconcile, restore_decision
from tenon.state.recovery import RecoveryRecord, RecoveryStore
from tenon.state.statedir import (
    StateDirBusy,
    domain_name,
    holder_pid,
    is_locked,
    locked,
)
from tenon.state.workspace import WorkspaceStore


def make_record(**fields: object) -> RecoveryRecord:
    base: dict[str, object] = {"agent_id": "a1", "generation": 2, "manifest_digest": "d" * 64,
                               "base_image": "img", "backend": "process"}
    return RecoveryRecord(**(base | fields))  # type: ignore[arg-type]


@pytest.mark.parametrize(("fields", "action", "words"), [
    ({"state": "torn_down"}, Restore.KEEP, "committed"),
    ({"state": "blocked", "reason": "verify failed"}, Restore.KEEP, "committed"),
    ({"state": "resident"}, Restore.RECAPTURE, "before its first boundary"),
    ({"state": "resident", "last_boundary": "restartable"}, Restore.RECAPTURE, "restartable"),
    ({"state": "resident", "last_boundary": "resident_only",
      "last_boundary_reason": "1 process(es) left in the sandbox: pid 9 (redis-server)"},
     Restore.BLOCK, "redis-server"),
    ({"state": "resident", "last_boundary": "unchecked"}, Restore.BLOCK, "never checked"),
])
def test_restore_decision(fields: dict[str, object], action: Restore, words: str) -> None:
    decision = restore_decision(make_record(**fields))
    assert decision.action is action
    assert words in decision.reason


def test_reconcile_keeps_workspaces_with_records_and_removes_the_rest(tmp_path: Path) -> None:
    store = RecoveryStore(tmp_path / "recovery.sqlite")
    workspaces = WorkspaceStore(tmp_path)
    for agent_id in ("kept", "orphan"):
        workspaces.create(agent_id)
        (workspaces.path_for(agent_id) / "workspace" / "f.txt").write_text(agent_id)
    store.register("kept", "img", "process")
    store.note_action_start("kept", "kept-a0001", agent_meta={"workflow": "w"})
    removed_sandboxes = ["cgroup:kept-g1-abc"]

    report = reconcile(store, workspaces, remove_leftovers=lambda: removed_sandboxes)

    assert report.removed_sandboxes == ("cgroup:kept-g1-abc",)
    assert report.removed_workspaces == ("orphan",)
    assert not workspaces.path_for("orphan").exists()
    assert (workspaces.path_for("kept") / "workspace" / "f.txt").read_text() == "kept"
    assert report.recaptured == ("kept",)  # lost before its first boundary ended
    assert report.interrupted == {"kept": "kept-a0001"}
    record = store.get("kept")
    assert record is not None
    assert record.state == "torn_down"
    assert record.in_flight is None
    assert record.interrupted == "kept-a0001"
    assert record.agent_meta == {"workflow": "w"}
    store.close()


def test_a_record_that_cannot_be_recaptured_blocks_with_the_reason(tmp_path: Path) -> None:
    store = RecoveryStore(tmp_path / "recovery.sqlite")
    store.register("gone", "img", "process")  # its workspace never made it to disk
    report = reconcile(store, WorkspaceStore(tmp_path))
    assert "could not be committed" in report.blocked["gone"]
    record = store.get("gone")
    assert record is not None
    assert record.state == "blocked"
    store.close()


def test_a_second_controller_on_the_same_state_dir_is_refused(tmp_path: Path) -> None:
    with locked(tmp_path):
        assert is_locked(tmp_path)
        with pytest.raises(StateDirBusy, match="in use by another controller"), \
                locked(tmp_path):
            pass
    assert not is_locked(tmp_path)
    with locked(tmp_path):  # released: the next controller gets it
        pass


def test_the_lock_names_the_holding_process_and_dies_with_it(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from pathlib import Path; from tenon.state.statedir import locked\n"
         "with locked(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(60)",
         str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StateDirBusy, match=f"pid {holder.pid}"), locked(tmp_path):
            pass
        assert holder_pid(tmp_path) == holder.pid
    finally:
        holder.kill()
        holder.wait()
        assert holder.stdout is not None
        holder.stdout.close()
    deadline = time.monotonic() + 10
    while is_locked(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not is_locked(tmp_path)  # SIGKILL released it: no stale lock to clear by hand


def test_the_domain_name_is_fixed_on_first_use(tmp_path: Path) -> None:
    name = domain_name(tmp_path)
    assert name.startswith("tenon-")
    assert domain_name(tmp_path) == name
    assert domain_name(tmp_path, name) == name
    with pytest.raises(ConfigError, match="belongs to workload domain"):
        domain_name(tmp_path, "tenon-other")
    assert domain_name(tmp_path / "fresh", "tenon-chosen") == "tenon-chosen"


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_reconcile_hands_a_dead_sandboxs_root_back_to_root(tmp_path: Path) -> None:
    """The uid a dead sandbox ran as goes back to the pool: its next holder must not enter
    the root. What is inside keeps its owner (a rebuild under the same uid chowns one dir)."""
    store = RecoveryStore(tmp_path / "recovery.sqlite")
    workspaces = WorkspaceStore(tmp_path)
    workspaces.create("a1")
    root = workspaces.path_for("a1")
    (root / "workspace" / "f.txt").write_text("x")
    stale_uid = 1_700_000_007
    for path in (root, root / "workspace", root / "workspace" / "f.txt"):
        os.lchown(path, stale_uid, stale_uid)
    root.chmod(0o755)
    store.register("a1", "img", "process")

    reconcile(store, workspaces)

    st = root.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, 0, 0o700)
    assert (root / "workspace" / "f.txt").stat().st_uid == stale_uid
