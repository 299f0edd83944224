"""The differential harness itself, on the fake backend: what it calls a divergence, what it
excuses, and which boundaries it flags. The fake's sandbox keeps a 'memory' that dies with
it (state a backend forgot to declare) next to files in the persistent workspace."""

from __future__ import annotations

from pathlib import Path

import pytest

from tenon.clock import FakeClock
from tenon.replay.differential import (
    Boundary,
    Comparison,
    RunResult,
    StepResult,
    compare,
    differential,
    summarize,
)
from tenon.replay.differential_script import Script, Step
from tenon.runtime.residency import ResidencyManager
from tenon.sandbox.fake import FakeBackend, FakeSandbox
from tenon.state.recovery import RecoveryStore
from tenon.state.workspace import WorkspaceStore

MEMORY: dict[str, str] = {}  # sandbox id -> what `remember` stored: lost with the sandbox


def fake_shell(sandbox: FakeSandbox, command: str) -> str | int:
    """remember X / recall: in-sandbox memory; save X / load: the persistent workspace;
    declare: mark a leftover so the check keeps the sandbox; fail: exit 3."""
    verb, _, arg = command.partition(" ")
    notes = sandbox.spec.workspace / "workspace" / "notes"
    if verb == "remember":
        MEMORY[sandbox.spec.sandbox_id] = arg
    elif verb == "recall":
        return MEMORY.get(sandbox.spec.sandbox_id, "nothing")
    elif verb == "save":
        notes.write_text(arg)
    elif verb == "load":
        return notes.read_text() if notes.exists() else "no notes"
    elif verb == "declare":
        sandbox.leftovers = [arg]
    elif verb == "undeclare":
        sandbox.leftovers = []
    elif verb == "fail":
        return 3
    return "ok"


@pytest.fixture
def manager(tmp_path: Path):
    recovery = RecoveryStore(tmp_path / "recovery.db")
    yield ResidencyManager(FakeBackend(script=fake_shell), WorkspaceStore(tmp_path), recovery,
                           FakeClock(), destroy_retry_s=0.0)
    recovery.close()


def make_script(*steps: Step, name: str = "s") -> Script:
    return Script(name, steps)


async def test_persistent_state_gives_identical_runs_and_full_share(manager):
    script = make_script(Step("save draft"), Step("load"), Step("fail", expect_exit=3))
    resident, torn_down, comparison = await differential(manager, script)
    assert [s.output for s in resident.steps] == ["ok", "draft", ""]
    assert comparison.ok, comparison.first_failure()
    assert comparison.divergences == ()
    assert comparison.restartable_share == 1.0
    assert resident.restartable_share is None
    assert [s.boundary.outcome for s in torn_down.steps] == ["torn_down"] * 3


async def test_state_lost_at_a_teardown_is_a_divergence_it_names(manager):
    script = make_script(Step("remember secret"), Step("save x"), Step("recall"))
    _, _, comparison = await differential(manager, script)
    assert not comparison.ok
    (divergence,) = comparison.divergences
    assert (divergence.index, divergence.field) == (2, "output")
    assert (divergence.resident, divergence.torn_down) == ("secret", "nothing")
    assert not divergence.excused
    assert comparison.first_failure() == (
        "s: step 2 (recall): output differs: resident run 'secret', torn-down run 'nothing'")


async def test_declared_state_keeps_the_sandbox_and_nothing_diverges(manager):
    script = make_script(
        Step("remember secret"),
        Step("declare /dev/shm/secret", resident_because="/dev/shm"),
        Step("recall", resident_because="/dev/shm"),
        Step("undeclare"), Step("load"))
    _, torn_down, comparison = await differential(manager, script)
    # The first boundary lost the memory before it was declared: recall still differs.
    assert [d.index for d in comparison.divergences] == [2]
    assert [s.boundary.outcome for s in torn_down.steps] == [
        "torn_down", "kept_resident", "kept_resident", "torn_down", "torn_down"]
    assert comparison.restartable_share == pytest.approx(3 / 5)
    assert comparison.num_resident_by_design == 2


async def test_boundaries_not_as_designed_are_problems(manager):
    script = make_script(
        Step("declare /dev/shm/x"),  # should have been restartable
        Step("undeclare", resident_because="process"),  # should have been kept
        Step("declare /dev/shm/y", resident_because="SysV"),  # kept, for another reason
        Step("fail"))  # exits 3, the step expects 0
    _, _, comparison = await differential(manager, script)
    assert comparison.divergences == ()
    assert not comparison.ok
    problems = comparison.problems
    assert len(problems) == 6, problems
    assert problems[0].startswith("boundary after step 0 (declare /dev/shm/x): should be "
                                  "restartable, was kept_resident")
    assert "should be resident-only (process), was torn_down" in problems[1]
    assert "does not name 'SysV'" in problems[2]
    assert problems[3].startswith("step 3 (fail) in the resident run: exit code 3, expected 0")
    assert problems[4].startswith("step 3 (fail) in the torn-down run: exit code 3")
    assert problems[5].startswith("boundary after step 3 (fail): should be restartable")


def run_of(*results: tuple[str, str | None]) -> RunResult:
    """A run B from (output, teardown outcome) pairs."""
    return RunResult("s", True, tuple(
        StepResult(0, output, False, Boundary(outcome, "why") if outcome else None)
        for output, outcome in results))


def test_a_divergence_is_excused_only_before_the_first_teardown():
    script = make_script(Step("a"), Step("b"), Step("c"))
    resident = RunResult("s", False, tuple(StepResult(0, "same", False) for _ in range(3)))
    torn_down = run_of(("other", "kept_resident"), ("other", "torn_down"),
                       ("other", "kept_resident"))
    comparison = compare(script, resident, torn_down)
    assert [(d.index, d.excused) for d in comparison.divergences] == [
        (0, True), (1, True), (2, False)]
    assert comparison.first_failure() is not None
    assert comparison.first_failure().startswith("s: step 2 (c)")


def test_a_run_that_misses_steps_is_refused():
    script = make_script(Step("a"), Step("b"))
    resident = RunResult("s", False, (StepResult(0, "", False),))
    with pytest.raises(ValueError, match="do not cover every step"):
        compare(script, resident, run_of(("", "torn_down"), ("", "torn_down")))


def test_a_script_needs_steps():
    with pytest.raises(ValueError, match="has no steps"):
        Script("empty", ())


def make_comparison(*, num_boundaries: int, num_torn_down: int, num_by_design: int,
                    problems: tuple[str, ...] = ()) -> Comparison:
    return Comparison("s", (), problems, num_boundaries, num_torn_down, num_by_design)


def test_summary_adds_up_the_shares_over_scripts():
    summary = summarize("process", [
        make_comparison(num_boundaries=5, num_torn_down=2, num_by_design=3),
        make_comparison(num_boundaries=3, num_torn_down=2, num_by_design=0,
                        problems=("boundary after step 1 (x): should be restartable",))])
    assert (summary["num_boundaries"], summary["num_torn_down"]) == (8, 4)
    assert summary["restartable_share"] == 0.5
    assert summary["restartable_share_of_designed_restartable"] == 0.8
    assert not summary["ok"]
    assert [s["ok"] for s in summary["scripts"]] == [True, False]
    assert summary["scripts"][1]["first_failure"] == (
        "s: boundary after step 1 (x): should be restartable")
