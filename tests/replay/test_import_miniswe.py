"""mini-swe-agent import: timings from message timestamps, memory from a named profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tenon.errors import TraceError
from tenon.replay.importers.miniswe import import_mini_swe_agent, load_memory_profile
from tenon.replay.trace import Memory

# Real trajectories (see tests/data/traces/README.md).
EXCERPT = Path(__file__).resolve().parents[1] / "data" / "traces" / "mini-swe-agent"
MB = 1_000_000


def assistant(command, *, created, received):
    return {
        "role": "assistant",
        "content": "thinking",
        "extra": {
            "actions": [{"command": command}],
            "response": {"created": created},
            "timestamp": received,
        },
    }


def tool(finished):
    return {"role": "tool", "content": "out", "extra": {"returncode": 0, "timestamp": finished}}


def make_trajectory(path: Path) -> Path:
    document = {
        "trajectory_format": "mini-swe-agent-1.1",
        "instance_id": "org__proj-7",
        "info": {"config": {"environment": {"image": "docker.io/x:latest"}}},
        "messages": [
            {"role": "system", "content": "You are a helpful assistant"},
            {
                "role": "user",
                "content": "<pr_description>\nConsider the following PR "
                "description:\nFix bug X\n</pr_description>\nmore",
            },
            assistant("python -m pytest", created=1000, received=1003.5),
            tool(1010.0),
            assistant("cat a.py", created=1010, received=1012.0),
            tool(1012.25),
            {"role": "exit", "content": ""},
        ],
    }
    path.write_text(json.dumps(document))
    return path


def make_profile(path: Path) -> Path:
    path.write_text(
        json.dumps(
            {
                "test_runner": {
                    "avg_bytes": 300 * MB,
                    "peak_bytes": 900 * MB,
                    "resident_after_bytes": 0,
                },
                "default": {
                    "avg_bytes": 5 * MB,
                    "peak_bytes": 10 * MB,
                    "resident_after_bytes": 1 * MB,
                },
            }
        )
    )
    return path


def test_with_profile_file(tmp_path):
    make_trajectory(tmp_path / "org__proj-7.traj.json")
    trace = import_mini_swe_agent(tmp_path, make_profile(tmp_path / "profile.json"))
    (workflow,) = trace.workflows
    assert (workflow.id, workflow.family, workflow.task_prompt) == (
        "org__proj-7",
        "proj",
        "Fix bug X",
    )
    assert workflow.metadata["original_image"] == "docker.io/x:latest"
    first, second = workflow.steps
    assert (first.model_wait_s, first.action.duration_s) == (3.5, 6.5)
    assert (second.model_wait_s, second.action.duration_s) == (2.0, 0.25)
    assert first.action.action_class == "test_runner"
    assert first.action.memory.peak_bytes == 900 * MB
    assert second.action.action_class == "file_read"
    assert second.action.memory.resident_after_bytes == 1 * MB


def test_with_callable(tmp_path):
    make_trajectory(tmp_path / "t.traj.json")
    seen = []

    def predictor(action_class, command, step_index):
        seen.append((action_class, command, step_index))
        return Memory(avg_bytes=1, peak_bytes=2, resident_after_bytes=0)

    import_mini_swe_agent(tmp_path, predictor)
    assert seen == [("test_runner", "python -m pytest", 0), ("file_read", "cat a.py", 1)]


def test_without_profile_is_a_clear_error(tmp_path):
    make_trajectory(tmp_path / "t.traj.json")
    with pytest.raises(TraceError, match="a memory profile is required"):
        import_mini_swe_agent(tmp_path, None)


def test_bad_profile(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(
        json.dumps({"tests": {"avg_bytes": 1, "peak_bytes": 2, "resident_after_bytes": 0}})
    )
    with pytest.raises(TraceError, match="tests: unknown action class"):
        load_memory_profile(path)
    path.write_text(
        json.dumps({"default": {"avg_bytes": 5, "peak_bytes": 2, "resident_after_bytes": 0}})
    )
    with pytest.raises(TraceError, match="default.peak_bytes: must be >= avg_bytes"):
        load_memory_profile(path)


def test_profile_without_class_or_default(tmp_path):
    make_trajectory(tmp_path / "t.traj.json")
    profile = {"test_runner": Memory(avg_bytes=1, peak_bytes=2, resident_after_bytes=0)}
    with pytest.raises(TraceError, match="no entry for action class 'file_read'"):
        import_mini_swe_agent(tmp_path, profile)


def test_real_trajectories(tmp_path):
    trace = import_mini_swe_agent(EXCERPT, make_profile(tmp_path / "profile.json"))
    astropy, django = trace.workflows
    assert (astropy.id, django.id) == ("astropy__astropy-12907", "django__django-11099")
    assert (astropy.family, django.family) == ("astropy", "django")
    assert (len(astropy.steps), len(django.steps)) == (36, 42)
    assert astropy.task_prompt is not None
    assert astropy.task_prompt.startswith(
        "Modeling's `separability_matrix` does not compute separability correctly for nested "
        "CompoundModels"
    )
    assert django.metadata == {
        "source": "mini-swe-agent",
        "original_image": "docker.io/swebench/sweb.eval.x86_64.django_1776_django-11099:latest",
        "exit_status": "Submitted",
    }
    # Read by hand from the messages: the first wait runs from the request's `created` second
    # (1775802348) to the response (1775802351.874); the command finished at 1775802351.990.
    first = astropy.steps[0]
    assert (first.model_wait_s, first.action.duration_s) == (3.874, 0.116)
    assert first.action.command.startswith('find . -type f -name "*.py" | grep -i separable')
    assert first.action.memory.peak_bytes == 10 * MB  # not a test run: the default entry
    run_tests = astropy.steps[7]
    assert run_tests.action.command.startswith("cd /testbed && python3 -m pytest astropy/")
    assert (run_tests.model_wait_s, run_tests.action.duration_s) == (3.52, 0.205)
    assert run_tests.action.action_class == "test_runner"
    assert run_tests.action.memory.peak_bytes == 900 * MB
    assert astropy.steps[12].model_wait_s == 49.331
    # The submit command is the last message before exit: no result, so no duration.
    for workflow in trace.workflows:
        last = workflow.steps[-1]
        assert last.action.command.startswith("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")
        assert last.action.duration_s == 0
    assert (astropy.steps[-1].model_wait_s, django.steps[-1].model_wait_s) == (3.927, 3.804)
