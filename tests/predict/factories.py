"""Factories with keyword defaults for predictor tests: actions, episodes, trace workflows."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tenon.predict.base import MeasuredAction
from tenon.predict.episodes import Episode
from tenon.replay.trace import Action, Memory, Step, Trace, Workflow, make_header, write_trace

MIB = 1 << 20
GIB = 1 << 30

# (command, tool, action class, peak MiB): one light-weight agent loop around a test run
LOOP: tuple[tuple[str, str, str, int], ...] = (
    ("Read /testbed/setup.py", "Read", "file_read", 20),
    ("Grep def parse", "Grep", "search", 25),
    ("Edit /testbed/src/parse.py", "Edit", "file_edit", 22),
    ("pip install -e .", "Bash", "package_install", 150),
    ("python -m pytest tests", "Bash", "test_runner", 200),
    ("Read /testbed/src/parse.py", "Read", "file_read", 30),
)


def make_action(
    command: str = "pytest -x",
    *,
    action_class: str = "test_runner",
    peak_mib: float = 100,
    avg_mib: float | None = None,
    duration_s: float = 1.0,
) -> MeasuredAction:
    avg = peak_mib * 2 / 3 if avg_mib is None else avg_mib
    return MeasuredAction(action_class, int(avg * MIB), int(peak_mib * MIB), duration_s, command)


def make_episode(
    workflow_id: str = "w1",
    *,
    family: str | None = "demo",
    task_prompt: str | None = None,
    actions: Sequence[MeasuredAction] | None = None,
) -> Episode:
    if actions is None:
        actions = [make_action(c, action_class=k, peak_mib=p) for c, _, k, p in LOOP]
    return Episode(workflow_id, family, task_prompt, tuple(actions))


def make_workflow(
    workflow_id: str = "w1",
    *,
    family: str = "demo",
    test_peak_mib: int = 200,
    loops: int = 2,
) -> Workflow:
    """`loops` repetitions of LOOP; the test run peaks at `test_peak_mib`."""
    steps = []
    for _ in range(loops):
        for command, tool, klass, peak_mib in LOOP:
            peak = test_peak_mib if klass == "test_runner" else peak_mib
            memory = Memory(
                avg_bytes=peak * MIB * 2 // 3, peak_bytes=peak * MIB, resident_after_bytes=0
            )
            action = Action(
                command=command, tool=tool, action_class=klass, duration_s=1.0, memory=memory
            )
            steps.append(Step(model_wait_s=1.0, action=action))
    return Workflow(
        id=workflow_id, submit_s=0.0, base_image="tenon-base:bookworm", family=family, steps=steps
    )


def big_family_trace(*, num_big: int = 4, num_small: int = 8) -> Trace:
    """Workflows identical but for the family: `bigrepo`'s test runs need 2 GiB, others 200 MiB.

    A per-class figure cannot tell them apart; a predictor that looks at the family can.
    """
    workflows = [
        make_workflow(f"big-{i}", family="bigrepo", test_peak_mib=2048) for i in range(num_big)
    ]
    workflows += [
        make_workflow(f"small-{i}", family=f"lib{i % 4}", test_peak_mib=200)
        for i in range(num_small)
    ]
    return Trace(header=make_header("test"), workflows=workflows)


def write(tmp_path: Path, trace: Trace, name: str = "trace.jsonl") -> Path:
    return write_trace(trace, tmp_path / name)
