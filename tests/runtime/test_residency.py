"""Teardown, rematerialize and restart recovery on the fake backend."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tenon.clock import FakeClock
from tenon.errors import RecoveryError
from tenon.runtime.residency import REMATERIALIZE_STEPS, TEARDOWN_STEPS, ResidencyManager
from tenon.sandbox.base import ProcessInfo
from tenon.sandbox.fake import FakeBackend, FakeSandbox
from tenon.state.recovery import RecoveryStore
from tenon.state.workspace import PERSISTENT_DIRS, WorkspaceStore


@dataclass
class StepFaults:
    """A fault hook: fail `step` the next `times` times (None: forever)."""

    step: str | None = None
    times: int | None = None
    seen: list[str] = field(default_factory=list)

    def __call__(self, step: str, agent_id: str) -> None:
        self.seen.append(step)
        if step != self.step or self.times == 0:
            return
        if self.times is not None:
            self.times -= 1
        raise OSError(f"injected failure at {step} for {agent_id}")


@dataclass
class Runtime:
    state_dir: Path
    backend: FakeBackend
    workspaces: WorkspaceStore
    recovery: RecoveryStore
    manager: ResidencyManager
    faults: StepFaults


def build_tree(sandbox: FakeSandbox, command: str) -> str:
    """An action that writes a varied tree into the workspace."""
    root = sandbox.spec.workspace
    (root / "src" / "deep" / "er").mkdir(parents=True, exist_ok=True)
    (root / "src" / "deep" / "er" / "notes.md").write_text("# notes\n\u00e9\n")
    (root / "blob.bin").write_bytes(os.urandom(200_000) + b"\x00\xff")
    (root / "empty_dir").mkdir(exist_ok=True)
    (root / "tool.sh").write_text("#!/bin/sh\n")
    (root / "tool.sh").chmod(0o750)
    (root / "ro.txt").write_text("read only")
    (root / "ro.txt").chmod(0o444)
    if not (root / "latest").is_symlink():
        os.symlink("src/deep/er/notes.md", root / "latest")
    return f"built for {command}"


def snapshot(root: Path) -> dict[str, tuple]:
    """Every path's type, mode and bytes / link target."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            st = full.lstat()
            if full.is_symlink():
                out[rel] = ("link", os.readlink(full))
            elif full.is_dir():
                out[rel] = ("dir", st.st_mode)
            else:
                out[rel] = ("file", st.st_mode, full.read_bytes())
    return out


def make_runtime(
    state_dir: Path,
    *,
    backend: FakeBackend | None = None,
    faults: StepFaults | None = None,
) -> Runtime:
    backend = backend or FakeBackend(script=build_tree)
    faults = faults or StepFaults()
    workspaces = WorkspaceStore(state_dir)
    recovery = RecoveryStore(state_dir / "recovery.db")
    manager = ResidencyManager(
        backend, workspaces, recovery, FakeClock(), faults=faults, destroy_retry_s=0.0
    )
    return Runtime(state_dir, backend, workspaces, recovery, manager, faults)


async def started(rt: Runtime, agent_id: str = "agent-1") -> FakeSandbox:
    sandbox = await rt.manager.start(agent_id, "tenon-base:bookworm", {"max_pids": 64})
    await rt.manager.exec(agent_id, "build", timeout_s=5)
    return sandbox  # type: ignore[return-value]


async def test_workspace_survives_teardown_and_rebuild_byte_for_byte(tmp_path: Path) -> None:
    rt = make_runtime(tmp_path)
    old = await started(rt)
    before = snapshot(rt.workspaces.path_for("agent-1"))
    assert len(before) == 9 + len(PERSISTENT_DIRS)  # what the fake writes, and the empty dirs

    result = await rt.manager.teardown("agent-1")
    assert result.outcome == "torn_down", result.reason
    assert old.destroyed
    assert rt.recovery.get("agent-1").state == "torn_down"
    assert rt.faults.seen == ["validate", "capture", "commit", "destroy"]

    new = await rt.manager.rematerialize("agent-1")
    assert new is not old
    assert new.spec.workspace == old.spec.workspace
    assert new.spec.max_pids == 64
    assert snapshot(new.spec.workspace) == before
    record = rt.recovery.get("agent-1")
    assert (record.state, record.generation) == ("resident", 2)
    assert (await rt.manager.exec("agent-1", "again", timeout_s=5)).output == "built for again"


async def test_exec_after_teardown_rematerializes_transparently(tmp_path: Path) -> None:
    rt = make_runtime(tmp_path)
    await started(rt)
    await rt.manager.teardown("agent-1")
    assert rt.manager.sandbox_for("agent-1") is None
    assert (await rt.manager.exec("agent-1", "x", timeout_s=5)).output == "built for x"
    assert rt.recovery.get("agent-1").generation == 2
    assert len(rt.backend.live()) == 1


async def test_tampered_workspace_blocks_and_retry_after_restore_succeeds(
    tmp_path: Path,
) -> None:
    rt = make_runtime(tmp_path)
    await started(rt)
    await rt.manager.teardown("agent-1")
    notes = rt.workspaces.path_for("agent-1") / "src" / "deep" / "er" / "notes.md"
    original = notes.read_bytes()
    notes.write_bytes(b"tampered")

    with pytest.raises(RecoveryError, match="notes.md"):
        await rt.manager.rematerialize("agent-1")
    record = rt.recovery.get("agent-1")
    assert record.state == "blocked"
    assert "notes.md" in record.reason
    assert record.generation == 1  # the committed generation, untouched
    assert rt.backend.live() == []  # the partial sandbox was destroyed
    assert rt.manager.sandbox_for("agent-1") is None
    with pytest.raises(RecoveryError):
        await rt.manager.exec("agent-1", "x", timeout_s=5)

    notes.write_bytes(original)
    sandbox = await rt.manager.rematerialize("agent-1")
    record = rt.recovery.get("agent-1")
    assert (record.state, record.generation, record.reason) == ("resident", 2, None)
    assert rt.backend.live() == [sandbox]


def assert_live_or_committed(rt: Runtime, old: FakeSandbox, agent_id: str = "agent-1") -> str:
    """The core invariant: a usable live sandbox, or a committed record. Never neither."""
    record = rt.recovery.get(agent_id)
    live = not old.destroyed and rt.manager.sandbox_for(agent_id) is old
    committed = (
        record is not None and record.state == "torn_down" and record.manifest_digest is not None
    )
    assert live or committed
    if live:
        assert record.state == "resident"
        return "live"
    assert rt.manager.sandbox_for(agent_id) is None
    assert old.destroyed or old in rt.manager.pending_destroys(agent_id)
    return "committed"


@pytest.mark.parametrize("step", TEARDOWN_STEPS)
async def test_persistent_failure_at_each_teardown_step_never_loses_the_agent(
    tmp_path: Path, step: str
) -> None:
    rt = make_runtime(tmp_path, faults=StepFaults(step=step))
    old = await started(rt)
    result = await rt.manager.teardown("agent-1")

    state = assert_live_or_committed(rt, old)
    assert not rt.manager.is_dispatch_blocked("agent-1")
    if step == "destroy":
        assert (state, result.outcome) == ("committed", "destroy_pending")
        assert result.record is not None
        rt.faults.step = None
        assert await rt.manager.reap() == 0
        assert old.destroyed
    else:
        assert (state, result.outcome, result.step) == ("live", "kept_resident", step)
        assert "injected failure" in result.reason
        # still usable, and a later teardown works once the fault is gone
        assert (await rt.manager.exec("agent-1", "x", timeout_s=5)).exit_code == 0
        rt.faults.step = None
        assert (await rt.manager.teardown("agent-1")).outcome == "torn_down"
    assert (await rt.manager.exec("agent-1", "y", timeout_s=5)).output == "built for y"


@pytest.mark.parametrize("step", TEARDOWN_STEPS)
async def test_transient_failure_at_each_teardown_step(tmp_path: Path, step: str) -> None:
    rt = make_runtime(tmp_path, faults=StepFaults(step=step, times=1))
    old = await started(rt)
    result = await rt.manager.teardown("agent-1")
    state = assert_live_or_committed(rt, old)
    if step == "destroy":  # retried within the same teardown
        assert (state, result.outcome, old.destroyed) == ("committed", "torn_down", True)
    else:
        assert (state, result.outcome) == ("live", "kept_resident")


async def test_backend_destroy_failure_keeps_committed_record(tmp_path: Path) -> None:
    rt = make_runtime(tmp_path)
    old = await started(rt)
    rt.backend.faults.set("destroy")
    result = await rt.manager.teardown("agent-1")
    assert result.outcome == "destroy_pending"
    assert assert_live_or_committed(rt, old) == "committed"
    # the next rematerialize refuses to run beside an undead predecessor
    with pytest.raises(RecoveryError, match="not yet destroyed"):
        await rt.manager.rematerialize("agent-1")
    assert rt.recovery.get("agent-1").state == "blocked"
    rt.backend.faults.clear()
    await rt.manager.rematerialize("agent-1")
    assert old.destroyed
    assert len(rt.backend.live()) == 1


@pytest.mark.parametrize("step", REMATERIALIZE_STEPS)
async def test_failure_at_each_rematerialize_step_blocks_then_retries(
    tmp_path: Path, step: str
) -> None:
    rt = make_runtime(tmp_path)
    await started(rt)
    await rt.manager.teardown("agent-1")
    rt.faults.step = step
    with pytest.raises(RecoveryError, match=step):
        await rt.manager.rematerialize("agent-1")
    assert rt.recovery.get("agent-1").state == "blocked"
    assert rt.backend.live() == []
    rt.faults.step = None
    await rt.manager.rematerialize("agent-1")
    assert rt.recovery.get("agent-1").generation == 2


async def test_leftover_background_process_keeps_resident(tmp_path: Path) -> None:
    rt = make_runtime(tmp_path)
    old = await started(rt)
    old.leftover_processes = [ProcessInfo(host_pid=777, ppid=1, command="npm run dev")]
    result = await rt.manager.teardown("agent-1")
    assert (result.outcome, result.step) == ("kept_resident", "validate")
    assert "npm run dev" in result.reason
    assert rt.faults.seen[-1] == "validate"  # nothing captured, committed or destroyed
    assert rt.recovery.get("agent-1").state == "resident"
    assert not old.destroyed


@pytest.mark.parametrize("changed", [["/etc/passwd"], None])
async def test_leftover_state_keeps_resident(tmp_path: Path, changed: list[str] | None) -> None:
    rt = make_runtime(tmp_path)
    old = await started(rt)
    old.leftovers = changed
    result = await rt.manager.teardown("agent-1")
    assert result.outcome == "kept_resident"
    assert not old.destroyed


async def test_checking_error_keeps_resident(tmp_path: Path) -> None:
    rt = make_runtime(tmp_path)
    old = await started(rt)
    rt.backend.faults.set("processes")
    result = await rt.manager.teardown("agent-1")
    assert result.outcome == "kept_resident"
    assert "check failed" in result.reason
    assert not old.destroyed


async def test_agent_without_logical_state_keeps_resident(tmp_path: Path) -> None:
    rt = make_runtime(tmp_path)
    await started(rt)
    result = await rt.manager.teardown("agent-1", agent_has_logical_state=False)
    assert result.outcome == "kept_resident"


async def test_teardown_during_an_action_keeps_resident(tmp_path: Path) -> None:
    rt = make_runtime(tmp_path)
    old = await started(rt)
    outcomes = []

    def tear_down_mid_action(sandbox: FakeSandbox, command: str) -> None:
        # Drive teardown by hand while exec holds dispatch: it must refuse, not wait.
        coro = rt.manager.teardown("agent-1")
        try:
            coro.send(None)
        except StopIteration as stop:
            outcomes.append(stop.value)
        else:
            coro.close()
            outcomes.append("teardown waited")

    old.set_script(tear_down_mid_action)
    await rt.manager.exec("agent-1", "x", timeout_s=5)
    assert [(r.outcome, r.step) for r in outcomes] == [("kept_resident", "block")]
    assert not old.destroyed
    assert rt.recovery.get("agent-1").state == "resident"


async def test_controller_restart_recovers_every_agent(tmp_path: Path) -> None:
    rt = make_runtime(tmp_path)
    for agent_id in ("a1", "a2", "a3", "a4"):
        await started(rt, agent_id)
    await rt.manager.teardown("a1")
    await rt.manager.teardown("a2")
    await rt.manager.exec("a2", "rebuild", timeout_s=5)
    await rt.manager.teardown("a2")  # a2 is now at generation 2, torn down
    await rt.manager.teardown("a3")
    await rt.manager.rematerialize("a3")  # a3 resident at generation 2, then lost
    # a4 was never torn down: resident at generation 1 with no manifest
    before = {a: snapshot(rt.workspaces.path_for(a)) for a in ("a1", "a2", "a3")}
    rt.recovery.close()

    rt2 = make_runtime(tmp_path)  # new stores and backend on the same state dir
    records = {r.agent_id: r for r in rt2.manager.recover_all()}
    assert {a: (r.state, r.generation) for a, r in records.items()} == {
        "a1": ("torn_down", 1),
        "a2": ("torn_down", 2),
        "a3": ("resident", 2),
        "a4": ("resident", 1),
    }
    for agent_id, gen in (("a1", 2), ("a2", 3), ("a3", 3)):
        sandbox = await rt2.manager.rematerialize(agent_id)
        assert snapshot(sandbox.spec.workspace) == before[agent_id]
        assert rt2.recovery.get(agent_id).generation == gen
    with pytest.raises(RecoveryError, match="no workspace manifest"):
        await rt2.manager.rematerialize("a4")
    assert rt2.recovery.get("a4").state == "blocked"


async def test_rematerialize_refuses_a_different_backend(tmp_path: Path) -> None:
    rt = make_runtime(tmp_path)
    await started(rt)
    await rt.manager.teardown("agent-1")
    rt.recovery.close()
    other = FakeBackend(script=build_tree)
    other.name = "docker"
    rt2 = make_runtime(tmp_path, backend=other)
    with pytest.raises(RecoveryError, match="backend"):
        await rt2.manager.rematerialize("agent-1")
    assert other.live() == []


async def test_unsafe_agent_id_is_refused_before_anything_happens(tmp_path: Path) -> None:
    from tenon.errors import WorkspaceError

    rt = make_runtime(tmp_path)
    with pytest.raises(WorkspaceError, match=r"\.\./x"):
        await rt.manager.start("../x", "img")
    assert rt.backend.sandboxes == []


async def test_finish_destroys_and_forgets(tmp_path: Path) -> None:
    rt = make_runtime(tmp_path)
    old = await started(rt)
    await rt.manager.finish("agent-1")
    assert old.destroyed
    assert rt.recovery.get("agent-1") is None
    assert not rt.workspaces.exists("agent-1")
