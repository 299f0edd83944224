"""`tenon agents`: list, unblock and discard over a state directory (no controller)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from tenon.cli.main import app
from tenon.state.recovery import RecoveryStore
from tenon.state.statedir import locked
from tenon.state.workspace import WorkspaceStore

BLOCK_REASON = "generation 1 was lost with the controller while resident-only (redis-server)"


def make_state(state_dir: Path) -> None:
    """Three agents: one torn down, one blocked after its sandbox was lost, one resident."""
    store = RecoveryStore(state_dir / "recovery.sqlite")
    workspaces = WorkspaceStore(state_dir)
    for agent_id in ("agent-down", "agent-blocked", "agent-live"):
        workspaces.create(agent_id)
        (workspaces.path_for(agent_id) / "workspace" / "data.txt").write_text(agent_id)
        store.register(agent_id, "tenon-base:bookworm", "process")
        store.note_action_start(agent_id, f"{agent_id}-a0001")
        store.note_action_done(agent_id, boundary="restartable", reason="restartable")
    manifest = workspaces.capture("agent-down")
    store.commit_teardown("agent-down", 1, manifest.digest, "tenon-base:bookworm", "process",
                          manifest=manifest)
    store.mark_blocked("agent-blocked", BLOCK_REASON)
    store.note_action_start("agent-live", "agent-live-a0002")
    store.close()


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["agents", *args], env={"COLUMNS": "220"})
    return result.exit_code, result.stdout, result.stderr


def test_list_shows_state_generation_commit_and_blocked_reason(tmp_path: Path) -> None:
    make_state(tmp_path)
    code, out, _ = invoke("--state-dir", str(tmp_path))
    assert code == 0
    assert "controller not running" in out
    rows = {line.split("│")[1].strip(): line for line in out.splitlines()
            if line.count("│") > 3 and "agent-" in line}
    assert set(rows) == {"agent-down", "agent-blocked", "agent-live"}
    assert "torn down" in rows["agent-down"]
    assert "1/1" in rows["agent-down"]
    store = RecoveryStore(tmp_path / "recovery.sqlite")
    digest = store.get("agent-down").manifest_digest  # type: ignore[union-attr]
    store.close()
    assert digest is not None
    assert digest[:12] in rows["agent-down"]
    assert "blocked" in rows["agent-blocked"]
    assert "agent-live-a0002" in out  # the action in flight
    assert BLOCK_REASON in rows["agent-blocked"]


def test_unblock_commits_the_workspace_as_on_disk_and_the_agent_can_be_rebuilt(
    tmp_path: Path,
) -> None:
    make_state(tmp_path)
    code, out, _ = invoke("unblock", "agent-blocked", "--state-dir", str(tmp_path))
    assert code == 0, out
    assert "unblocked" in out
    store = RecoveryStore(tmp_path / "recovery.sqlite")
    record = store.get("agent-blocked")
    store.close()
    assert record is not None
    assert record.state == "torn_down"
    assert record.reason is None
    # the committed manifest is the workspace as it is now: a rebuild would verify
    WorkspaceStore(tmp_path).verify("agent-blocked", record.manifest_digest or "")


def test_unblock_refuses_an_agent_that_is_not_blocked(tmp_path: Path) -> None:
    make_state(tmp_path)
    code, _, err = invoke("unblock", "agent-down", "--state-dir", str(tmp_path))
    assert code == 1
    assert err.strip() == "error: agent agent-down is not blocked (it is torn_down)"


def test_discard_deletes_record_and_workspace(tmp_path: Path) -> None:
    make_state(tmp_path)
    code, out, _ = invoke("discard", "agent-live", "--state-dir", str(tmp_path))
    assert code == 0, out
    store = RecoveryStore(tmp_path / "recovery.sqlite")
    assert store.get("agent-live") is None
    assert store.get("agent-down") is not None  # only that one
    store.close()
    assert not (tmp_path / "workspaces" / "agent-live").exists()
    assert (tmp_path / "workspaces" / "agent-down").exists()


def test_unknown_agent_is_one_line_and_exit_1(tmp_path: Path) -> None:
    make_state(tmp_path)
    for command in ("unblock", "discard"):
        code, _, err = invoke(command, "agent-nope", "--state-dir", str(tmp_path))
        assert code == 1
        assert len(err.strip().splitlines()) == 1
        assert "unknown agent 'agent-nope'" in err


def test_unblock_and_discard_refuse_while_a_controller_holds_the_state_dir(
    tmp_path: Path,
) -> None:
    make_state(tmp_path)
    with locked(tmp_path):
        code, out, err = invoke("discard", "agent-live", "--state-dir", str(tmp_path))
        assert code == 1
        assert "in use by another controller" in err
        code, out, _ = invoke("--state-dir", str(tmp_path))  # listing still works
        assert code == 0
        assert "controller running" in out
    assert (tmp_path / "workspaces" / "agent-live").exists()
