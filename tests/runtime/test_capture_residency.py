"""Teardown and rebuild around incremental capture, on the fake backend."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tenon.clock import FakeClock
from tenon.errors import RecoveryError
from tenon.runtime.residency import ResidencyManager
from tenon.sandbox.base import ProcessInfo
from tenon.sandbox.fake import FakeBackend, FakeSandbox
from tenon.state.capture import CaptureLimits
from tenon.state.recovery import RecoveryStore
from tenon.state.workspace import WorkspaceStore


def write_files(sandbox: FakeSandbox, command: str) -> str:
    for i in range(5):
        (sandbox.spec.workspace / f"f{i}.txt").write_text(f"{command} {i}\n")
    return "ok"


def make_manager(tmp_path: Path, limits: CaptureLimits | None = None
                 ) -> tuple[ResidencyManager, FakeBackend, WorkspaceStore, RecoveryStore]:
    backend = FakeBackend(script=write_files)
    workspaces = WorkspaceStore(tmp_path, capture_limits=limits)
    recovery = RecoveryStore(tmp_path / "recovery.db")
    manager = ResidencyManager(backend, workspaces, recovery, FakeClock(), destroy_retry_s=0.0)
    return manager, backend, workspaces, recovery


async def test_a_tampered_root_blocks_the_rebuild_before_any_sandbox_exists(tmp_path: Path
                                                                            ) -> None:
    manager, backend, workspaces, recovery = make_manager(tmp_path)
    await manager.start("a1", "img")
    await manager.exec("a1", "write", timeout_s=5)
    assert (await manager.teardown("a1")).outcome == "torn_down"
    victim = workspaces.path_for("a1") / "f2.txt"
    st = victim.stat()
    victim.write_text("WRITE 2\n")
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    before = len(backend.sandboxes)
    with pytest.raises(RecoveryError, match="failed at verify"):
        await manager.rematerialize("a1")
    assert len(backend.sandboxes) == before  # nothing was materialized on it
    record = recovery.get("a1")
    assert record is not None
    assert record.state == "blocked"


async def test_capture_limits_keep_the_boundary_resident_only_with_the_bound(tmp_path: Path
                                                                            ) -> None:
    manager, backend, _, recovery = make_manager(tmp_path, CaptureLimits(max_files=4))
    sandbox = await manager.start("a1", "img")
    await manager.exec("a1", "write", timeout_s=5)
    result = await manager.teardown("a1")
    assert (result.outcome, result.step) == ("kept_resident", "capture")
    assert result.reason.startswith("resident_only:")
    assert "max_files=4" in result.reason
    assert not sandbox.destroyed
    record = recovery.get("a1")
    assert record is not None
    assert record.state == "resident"


async def test_teardown_reuses_a_check_nothing_ran_after(tmp_path: Path) -> None:
    manager, _, _, _ = make_manager(tmp_path)
    sandbox = await manager.start("a1", "img")
    await manager.exec("a1", "write", timeout_s=5)
    token = manager.check_token("a1")
    # a process the check would see: a stale token makes the teardown check again
    sandbox.leftover_processes = [ProcessInfo(host_pid=9, ppid=1, command="sleep")]
    await manager.exec("a1", "again", timeout_s=5)
    stale = await manager.teardown("a1", checked=token)
    assert (stale.outcome, stale.step) == ("kept_resident", "validate")
    # the same token taken after the last action: the check it stands for is not repeated
    sandbox.leftover_processes = []
    fresh = manager.check_token("a1")
    sandbox.leftover_processes = [ProcessInfo(host_pid=9, ppid=1, command="sleep")]
    assert (await manager.teardown("a1", checked=fresh)).outcome == "torn_down"
