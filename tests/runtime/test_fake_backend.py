"""The fake backend's script and fault behaviour."""

from __future__ import annotations

from pathlib import Path

import pytest

from tenon.errors import SandboxDied, SandboxError
from tenon.sandbox.base import ExecResult, SandboxSpec
from tenon.sandbox.fake import FakeBackend, FakeSandbox, FakeScriptExhausted, InjectedFault


def make_spec(workspace: Path, sandbox_id: str = "s1") -> SandboxSpec:
    return SandboxSpec(sandbox_id=sandbox_id, image="img", workspace=workspace)


async def test_queue_script_runs_out_with_a_clear_error(tmp_path: Path) -> None:
    ok = ExecResult(exit_code=0, output="ok", truncated=False, duration_s=0.1)
    backend = FakeBackend(script=[ok, lambda sb, cmd: f"ran {cmd}"])
    sandbox = await backend.materialize(make_spec(tmp_path))
    assert await sandbox.exec("a", timeout_s=1) == ok
    assert (await sandbox.exec("b", timeout_s=1)).output == "ran b"
    with pytest.raises(FakeScriptExhausted, match="'c'"):
        await sandbox.exec("c", timeout_s=1)


async def test_callable_script_touches_the_workspace(tmp_path: Path) -> None:
    def step(sandbox: FakeSandbox, command: str) -> int:
        (sandbox.spec.workspace / "out.txt").write_text(command)
        return 3

    sandbox = await FakeBackend(script=step).materialize(make_spec(tmp_path))
    result = await sandbox.exec("hello", timeout_s=1)
    assert result.exit_code == 3
    assert (tmp_path / "out.txt").read_text() == "hello"


async def test_output_is_truncated_to_the_limit(tmp_path: Path) -> None:
    sandbox = await FakeBackend(script=lambda sb, cmd: "x" * 100).materialize(make_spec(tmp_path))
    result = await sandbox.exec("c", timeout_s=1, max_output_bytes=10)
    assert result.truncated
    assert result.output == "x" * 10


async def test_counted_faults_fail_then_succeed(tmp_path: Path) -> None:
    backend = FakeBackend(fail_on={"materialize": 1, "destroy": 2})
    with pytest.raises(InjectedFault, match="materialize"):
        await backend.materialize(make_spec(tmp_path))
    sandbox = await backend.materialize(make_spec(tmp_path))
    for _ in range(2):
        with pytest.raises(SandboxError):
            await sandbox.destroy()
    await sandbox.destroy()
    await sandbox.destroy()  # idempotent
    assert backend.live() == []
    with pytest.raises(SandboxDied):
        await sandbox.exec("x", timeout_s=1)


async def test_missing_workspace_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SandboxError, match="not a directory"):
        await FakeBackend().materialize(make_spec(tmp_path / "missing"))


def test_unknown_fault_point_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown fault point"):
        FakeBackend(fail_on={"explode"})
