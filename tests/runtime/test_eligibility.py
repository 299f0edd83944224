"""The fail-closed restart-safe check."""

from __future__ import annotations

from pathlib import Path

import pytest

from tenon.runtime.eligibility import check_restartable
from tenon.sandbox.base import ProcessInfo, SandboxSpec
from tenon.sandbox.fake import FakeBackend, FakeSandbox


def make_sandbox(
    *,
    processes: list[ProcessInfo] | None = None,
    changed: list[str] | None = None,
    fail_on: tuple[str, ...] = (),
) -> FakeSandbox:
    backend = FakeBackend(fail_on=fail_on)
    sandbox = FakeSandbox(SandboxSpec("s1", "img", Path("/nonexistent")), backend)
    sandbox.leftover_processes = processes or []
    sandbox.leftovers = changed
    return sandbox


def test_clean_sandbox_is_restartable() -> None:
    result = check_restartable(make_sandbox(changed=[]), agent_has_logical_state=True)
    assert result.restartable
    assert not result.resident_only


def test_leftover_background_process_is_resident_only() -> None:
    proc = ProcessInfo(host_pid=4242, ppid=1, command="python -m http.server")
    result = check_restartable(make_sandbox(processes=[proc], changed=[]), True)
    assert result.resident_only
    assert "4242" in result.reason
    assert "http.server" in result.reason


def test_many_leftovers_are_elided() -> None:
    procs = [ProcessInfo(host_pid=i, ppid=1, command=f"sleep {i}") for i in range(1, 9)]
    result = check_restartable(make_sandbox(processes=procs, changed=[]), True)
    assert "8 process(es)" in result.reason
    assert "and 3 more" in result.reason


def test_leftover_state_is_resident_only() -> None:
    result = check_restartable(make_sandbox(changed=["/etc/hosts", "/usr/lib/x.so"]), True)
    assert result.resident_only
    assert "/etc/hosts" in result.reason


def test_unknown_leftover_state_is_resident_only() -> None:
    result = check_restartable(make_sandbox(changed=None), True)
    assert result.resident_only
    assert "cannot be ruled out" in result.reason


@pytest.mark.parametrize("point", ["processes", "leftover_state"])
def test_error_while_checking_is_resident_only(point: str) -> None:
    result = check_restartable(make_sandbox(changed=[], fail_on=(point,)), True)
    assert result.resident_only
    assert "check failed" in result.reason
    assert point in result.reason


def test_missing_logical_state_is_resident_only() -> None:
    result = check_restartable(make_sandbox(changed=[]), agent_has_logical_state=False)
    assert result.resident_only
    assert "logical state" in result.reason


def test_not_a_sandbox_is_resident_only() -> None:
    result = check_restartable(object(), True)  # type: ignore[arg-type]
    assert result.resident_only
