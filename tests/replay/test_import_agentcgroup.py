"""AgentCgroup import: exact figures on a hand-made run, sensible ones on the shared data."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tenon.errors import TraceError
from tenon.replay.importers.agentcgroup import family_of, import_agentcgroup, parse_mem_usage
from tenon.replay.trace import load_trace, write_trace

SHARED = Path("/work/shared/traces/agentcgroup/all_images_haiku")
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


def quantile(values, fraction):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


@pytest.mark.skipif(not SHARED.is_dir(), reason="shared AgentCgroup data not present")
def test_shared_data(tmp_path):
    trace = import_agentcgroup(SHARED)
    # 55 task directories, 10 of which lack tool_calls.json
    assert len(trace.workflows) >= 40
    assert trace.header.metadata["num_skipped"] == 10
    steps = [step for workflow in trace.workflows for step in workflow.steps]
    assert len(steps) > 1000
    assert 1.0 <= quantile([s.model_wait_s for s in steps], 0.5) <= 3.5
    peaks = [w.profiled_peak_bytes for w in trace.workflows]
    assert 1.2e9 < max(peaks) < 2.5e9
    heaviest = max(steps, key=lambda s: s.action.memory.peak_bytes).action
    assert heaviest.action_class == "test_runner"
    assert all(100e6 < w.metadata["agent_baseline_bytes"] < 250e6 for w in trace.workflows)
    path = write_trace(trace, tmp_path / "agentcgroup.jsonl")
    assert path.stat().st_size < 1_000_000
    assert load_trace(path) == trace
