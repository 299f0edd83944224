"""AgentCgroup import: exact figures on a hand-made run and on an excerpt of the real data."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tenon.errors import TraceError
from tenon.replay.importers.agentcgroup import family_of, import_agentcgroup, parse_mem_usage
from tenon.replay.trace import load_trace, write_trace

# Real runs (see tests/data/traces/README.md): three tasks with tool calls, one without.
EXCERPT = Path(__file__).resolve().parents[1] / "data" / "traces" / "agentcgroup"
T0 = 1_770_000_000.0
MB = 1_000_000


def iso(offset_s: float) -> str:
    moment = datetime.fromtimestamp(T0 + offset_s, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def make_run(root: Path, task: str, *, samples_mb, calls, with_calls=True) -> Path:
    attempt = root / task / "attempt_1"
    attempt.mkdir(parents=True)
    samples = [
        {
            "timestamp": "local",
            "epoch": T0 + t,
            "mem_usage": usage,
            "mem_percent": "0%",
            "cpu_percent": "0%",
        }
        for t, usage in samples_mb
    ]
    (attempt / "resources.json").write_text(json.dumps({"samples": samples, "summary": {}}))
    if with_calls:
        records = [
            {
                "timestamp": iso(start),
                "tool": tool,
                "id": f"t{i}",
                "input": tool_input,
                "end_timestamp": iso(end),
                "result_preview": "",
            }
            for i, (tool, tool_input, start, end) in enumerate(calls)
        ]
        (attempt / "tool_calls.json").write_text(json.dumps(records))
    return attempt


SAMPLES = [
    (0, "10MB / 134.5GB"),
    (1, "200MB / 134.5GB"),
    (2, "200MB / 134.5GB"),
    (3, "500MB / 134.5GB"),
    (4, "300MB / 134.5GB"),
    (5, "260MB / 134.5GB"),
    (6, "250MB / 134.5GB"),
    (7, "200MB / 134.5GB"),
    (8, "200000kB / 134.5GB"),
    (9, "0B / 0B"),
]
CALLS = [
    ("Bash", {"command": "python -m pytest -x"}, 2.5, 4.5),
    ("Read", {"file_path": "/testbed/a.py"}, 6.5, 6.6),
    ("Bash", {"command": "ls"}, 7.5, 7.5),
]


def test_synthetic_run_exact_figures(tmp_path, caplog):
    make_run(tmp_path, "org__my-repo-12", samples_mb=SAMPLES, calls=CALLS)
    make_run(tmp_path, "org__other-1", samples_mb=SAMPLES, calls=[], with_calls=False)
    with caplog.at_level(logging.WARNING):
        trace = import_agentcgroup(tmp_path)
    assert "missing tool_calls.json" in caplog.text
    assert trace.header.metadata["num_skipped"] == 1
    (workflow,) = trace.workflows
    assert workflow.id == "org__my-repo-12/attempt_1"
    assert workflow.family == "my-repo"
    assert workflow.submit_s == 0
    assert workflow.metadata["start_epoch"] == T0
    # idle samples within [2.5, 7.5]: 260, 250, 200 MB -> the agent baseline is 200 MB
    assert workflow.metadata["agent_baseline_bytes"] == 200 * MB
    first, second, third = (step.action for step in workflow.steps)
    # curve 350 @2.5, 500 @3, 300 @4, 280 @4.5: area 212.5 + 400 + 145 = 757.5 MB*s over 2 s
    assert first.action_class == "test_runner"
    assert first.duration_s == 2.0
    assert first.memory.avg_bytes == pytest.approx(178.75 * MB, abs=2)
    assert first.memory.peak_bytes == 300 * MB
    assert first.memory.resident_after_bytes == 50 * MB  # lowest in the gap: 250 MB @6
    # no sample inside [6.5, 6.6]: interpolated 225 and 220 MB
    assert second.command == "Read /testbed/a.py"
    assert second.action_class == "file_read"
    assert second.memory.avg_bytes == pytest.approx(22.5 * MB, abs=2)
    assert second.memory.peak_bytes == pytest.approx(25 * MB, abs=2)
    assert second.memory.resident_after_bytes == 0
    assert (third.duration_s, third.memory.peak_bytes, third.memory.avg_bytes) == (0, 0, 0)
    waits = [step.model_wait_s for step in workflow.steps]
    assert waits == pytest.approx([2.5, 2.0, 0.9])


def test_overlapping_calls_wait_zero(tmp_path):
    calls = [("Read", {"file_path": "a"}, 2.0, 3.0), ("Read", {"file_path": "b"}, 2.5, 3.5)]
    make_run(tmp_path, "o__r-1", samples_mb=SAMPLES, calls=calls)
    (workflow,) = import_agentcgroup(tmp_path).workflows
    assert [step.model_wait_s for step in workflow.steps] == [2.0, 0.0]


def test_malformed_file_names_it(tmp_path):
    attempt = make_run(tmp_path, "o__r-1", samples_mb=SAMPLES, calls=CALLS)
    (attempt / "resources.json").write_text('{"samples": [{"epoch": 1, "mem_usage": "lots"}]}')
    with pytest.raises(TraceError, match=r"resources\.json: samples\[0\]\.mem_usage"):
        import_agentcgroup(tmp_path)


def test_nothing_importable(tmp_path):
    make_run(tmp_path, "o__r-1", samples_mb=SAMPLES, calls=[], with_calls=False)
    with pytest.raises(TraceError, match="no importable"):
        import_agentcgroup(tmp_path)


def test_helpers():
    assert parse_mem_usage("185.3MB / 134.5GB") == 185_300_000
    assert parse_mem_usage("2.195kB / 1GB") == 2195
    assert family_of("dask__dask-5510") == "dask"
    assert family_of("NVIDIA__nv-ingest-71") == "nv-ingest"


def test_real_excerpt(tmp_path):
    trace = import_agentcgroup(EXCERPT)
    assert trace.header.metadata["num_skipped"] == 1
    assert trace.header.metadata["skipped"] == "all_images_haiku/Textualize__textual-2987/attempt_1"
    by_task = {workflow.metadata["task"]: workflow for workflow in trace.workflows}
    assert list(by_task) == ["dask__dask-5510", "encode__httpx-2701", "tobymao__sqlglot-4014"]
    assert [len(w.steps) for w in by_task.values()] == [3, 15, 33]
    assert [sum(s.action.tool == "Bash" for s in w.steps) for w in by_task.values()] == [0, 5, 11]
    assert [w.family for w in by_task.values()] == ["dask", "httpx", "sqlglot"]

    # Read by hand from dask__dask-5510: first sample at epoch 1770428578.074, calls at
    # 01:43:04.625-.651, 06.756-.791, 08.527-.833 UTC; idle samples in between read 187.2,
    # 187.9, 157.5, 158.5 MB.
    dask = by_task["dask__dask-5510"]
    assert [s.action.tool for s in dask.steps] == ["TodoWrite", "Grep", "Read"]
    assert [s.model_wait_s for s in dask.steps] == pytest.approx([6.551, 2.105, 1.736])
    assert [s.action.duration_s for s in dask.steps] == pytest.approx([0.026, 0.035, 0.306])
    assert dask.metadata["agent_baseline_bytes"] == 157_500_000
    assert dask.metadata["num_samples"] == 20
    assert dask.steps[2].action.command == "Read /testbed/dask/array/routines.py"

    # httpx: the highest sample, 229.1 MB, falls inside a pytest run; the baseline is 158.9 MB.
    httpx = by_task["encode__httpx-2701"]
    assert httpx.metadata["agent_baseline_bytes"] == 158_900_000
    assert httpx.profiled_peak_bytes == 229_100_000 - 158_900_000
    assert [s.action.action_class for s in httpx.steps].count("test_runner") == 4

    # sqlglot: the full test suite, five runs of about 29.5 s; the fourth peaks at 2.076 GB.
    sqlglot = by_task["tobymao__sqlglot-4014"]
    assert sqlglot.metadata["agent_baseline_bytes"] == 158_800_000
    heaviest = max(sqlglot.steps, key=lambda s: s.action.memory.peak_bytes).action
    assert (heaviest.command, heaviest.action_class) == ("python3 -m pytest", "test_runner")
    assert heaviest.duration_s == pytest.approx(29.471)
    assert heaviest.memory.peak_bytes == 2_076_000_000 - 158_800_000
    assert max(w.profiled_peak_bytes for w in trace.workflows) == heaviest.memory.peak_bytes

    path = write_trace(trace, tmp_path / "agentcgroup.jsonl")
    assert load_trace(path) == trace
