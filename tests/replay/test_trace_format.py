"""The trace format: round trip, and malformed lines named by file, line and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tenon.errors import TraceError
from tenon.replay.trace import (
    Action,
    Memory,
    Step,
    Trace,
    Workflow,
    check_trace,
    load_trace,
    make_header,
    profiled_peak_bytes,
    write_trace,
)

MIB = 1 << 20


def make_step(*, wait_s=1.0, avg_mib=10, peak_mib=20, resident_mib=0, command="pytest -x"):
    memory = Memory(
        avg_bytes=avg_mib * MIB, peak_bytes=peak_mib * MIB, resident_after_bytes=resident_mib * MIB
    )
    action = Action(
        command=command, tool="Bash", action_class="test_runner", duration_s=2.5, memory=memory
    )
    return Step(model_wait_s=wait_s, action=action)


def make_workflow(workflow_id="w1", *, peaks_mib=(20, 300, 40), task_prompt=None):
    return Workflow(
        id=workflow_id,
        submit_s=0.0,
        base_image="tenon-base:bookworm",
        family="dask",
        task_prompt=task_prompt,
        metadata={"start_epoch": 1.5},
        steps=[make_step(avg_mib=p // 2, peak_mib=p) for p in peaks_mib],
    )


def make_trace(num_workflows=2):
    return Trace(
        header=make_header("test"),
        workflows=[make_workflow(f"w{i}", task_prompt="fix") for i in range(num_workflows)],
    )


def write_lines(path: Path, records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def good_records():
    trace = make_trace()
    return [trace.header.model_dump(), *(w.model_dump() for w in trace.workflows)]


def test_round_trip(tmp_path):
    trace = make_trace(3)
    path = write_trace(trace, tmp_path / "sub" / "trace.jsonl")
    loaded = load_trace(path)
    assert loaded == trace
    assert loaded.num_actions == 9
    assert json.loads(path.read_text().splitlines()[0])["format"] == "tenon-trace"


def test_profiled_peak_is_max_action_peak():
    workflow = make_workflow(peaks_mib=(20, 300, 40))
    assert profiled_peak_bytes(workflow) == workflow.profiled_peak_bytes == 300 * MIB


def test_task_is_the_recorded_task_else_the_workflow_id():
    workflow = make_workflow("dask__dask-2205/attempt_1")
    assert workflow.task == "dask__dask-2205/attempt_1"
    attempt = workflow.model_copy(update={"metadata": {"task": "dask__dask-2205"}})
    assert attempt.task == "dask__dask-2205"


def test_peak_below_avg_names_line_and_field(tmp_path):
    records = good_records()
    records[2]["steps"][1]["action"]["memory"]["peak_bytes"] = 1
    path = write_lines(tmp_path / "trace.jsonl", records)
    with pytest.raises(TraceError) as caught:
        load_trace(path)
    assert str(caught.value) == f"{path}:3: steps.1.action.memory.peak_bytes: must be >= avg_bytes"


def test_bad_json(tmp_path):
    records = good_records()
    records.insert(2, '{"id": "broken",')
    path = write_lines(tmp_path / "trace.jsonl", records)
    with pytest.raises(TraceError, match=r"trace\.jsonl:3: invalid JSON"):
        load_trace(path)


def test_missing_field(tmp_path):
    records = good_records()
    del records[1]["steps"][0]["action"]["duration_s"]
    path = write_lines(tmp_path / "trace.jsonl", records)
    with pytest.raises(
        TraceError, match=r":2: steps\.0\.action\.duration_s: required field missing"
    ):
        load_trace(path)


def test_unknown_field(tmp_path):
    records = good_records()
    records[2]["steps"][0]["action"]["memory"]["rss"] = 5
    path = write_lines(tmp_path / "trace.jsonl", records)
    with pytest.raises(TraceError, match=r":3: steps\.0\.action\.memory\.rss: unknown field"):
        load_trace(path)


def test_negative_and_bad_mode(tmp_path):
    records = good_records()
    records[1]["steps"][2]["model_wait_s"] = -1
    records[2]["steps"][0]["action"]["reproduce"]["mode"] = "magic"
    path = write_lines(tmp_path / "trace.jsonl", records)
    errors = check_trace(path)
    assert len(errors) == 2
    assert errors[0].startswith(f"{path}:2: steps.2.model_wait_s: Input should be greater")
    assert errors[1].startswith(f"{path}:3: steps.0.action.reproduce.mode:")


@pytest.mark.parametrize(
    ("submit_s", "message"),
    [
        (float("inf"), "Input should be a finite number"),  # json writes it as Infinity
        (float("nan"), "Input should be a finite number"),
        (1e300, "Input should be less than or equal to 604800"),
        (7 * 86_400 + 1, "Input should be less than or equal to 604800"),
        (-1.0, "Input should be greater than or equal to 0"),
    ],
)
def test_submit_time_must_be_finite_and_within_a_week(tmp_path, submit_s, message):
    records = good_records()
    records[2]["submit_s"] = submit_s
    path = write_lines(tmp_path / "trace.jsonl", records)
    with pytest.raises(TraceError) as caught:
        load_trace(path)
    assert str(caught.value) == f"{path}:3: submit_s: {message}"


def test_submit_time_of_a_week_is_valid(tmp_path):
    records = good_records()
    records[2]["submit_s"] = 7 * 86_400.0
    assert load_trace(write_lines(tmp_path / "trace.jsonl", records)).workflows[1].submit_s == (
        7 * 86_400.0
    )


def test_wrong_version(tmp_path):
    records = good_records()
    records[0]["version"] = 2
    path = write_lines(tmp_path / "trace.jsonl", records)
    with pytest.raises(TraceError, match=r":1: version: unsupported trace version 2"):
        load_trace(path)


def test_not_a_trace(tmp_path):
    path = write_lines(tmp_path / "trace.jsonl", [{"hello": 1}])
    with pytest.raises(TraceError, match=r":1: format: expected 'tenon-trace'"):
        load_trace(path)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(TraceError, match="empty file"):
        load_trace(tmp_path / "empty.jsonl")


def test_collect_errors_and_duplicates(tmp_path):
    records = good_records()
    records.append(records[1])
    records.append("[1, 2]")
    path = write_lines(tmp_path / "trace.jsonl", records)
    with pytest.raises(TraceError) as caught:
        load_trace(path, collect_errors=True)
    errors = caught.value.errors
    assert len(errors) == 2
    assert ":4: id: duplicate workflow id 'w0' (first on line 2)" in errors[0]
    assert ":5: workflow: expected a JSON object" in errors[1]


def test_blank_lines_are_not_data(tmp_path):
    path = write_lines(tmp_path / "trace.jsonl", [*good_records(), ""])
    assert len(load_trace(path).workflows) == 2
