"""The oracle predictor: each action's recorded figures, by workflow instance and step."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tenon.errors import ConfigError
from tenon.predict.base import ActionContext, MeasuredAction
from tenon.predict.oracle import OraclePredictor
from tenon.replay.bench import BenchConfig, run_bench
from tenon.replay.predictors import oracle_predictor
from tenon.replay.trace import Action, Memory, Step, Trace, Workflow, make_header, write_trace

MIB = 1 << 20
GIB = 1 << 30


def stepped_workflow(wid: str, peaks_mib: list[int]) -> Workflow:
    """One action per peak, each its own figures (avg half the peak)."""
    steps = [Step(model_wait_s=0.5, action=Action(
        command="python3 -m pytest", tool="Bash", action_class="test_runner", duration_s=1.0,
        memory=Memory(avg_bytes=peak * MIB // 2, peak_bytes=peak * MIB,
                      resident_after_bytes=8 * MIB)))
        for peak in peaks_mib]
    return Workflow(id=wid, submit_s=0.0, base_image="tenon-base:bookworm", family="demo",
                    steps=steps)


def context(workflow_id: str, step: int) -> ActionContext:
    return ActionContext(workflow_id, "python3 -m pytest", "test_runner", step)


def test_predicts_each_actions_recorded_figures_and_flags_heavy_ones() -> None:
    oracle = oracle_predictor({"a#0": stepped_workflow("a", [40, 1500, 90])},
                              heavy_peak_bytes=1024 * MIB)
    first, heavy, last = (oracle.predict(context("a#0", i)) for i in range(3))
    assert (first.avg_bytes, first.peak_bytes, first.heavy_risk) == (20 * MIB, 40 * MIB, False)
    assert (heavy.peak_bytes, heavy.heavy_risk) == (1500 * MIB, True)
    assert (last.avg_bytes, last.peak_bytes) == (45 * MIB, 90 * MIB)


def test_an_action_it_was_not_given_fails_by_name() -> None:
    oracle = OraclePredictor({"a#0": [MeasuredAction("test_runner", 20 * MIB, 40 * MIB, 1.0)]})
    with pytest.raises(ConfigError, match="no recorded workflow 'b#0'"):
        oracle.predict(context("b#0", 0))
    with pytest.raises(ConfigError, match="has 1 steps, asked for step 1"):
        oracle.predict(context("a#0", 1))


def test_bench_hands_tenon_every_actions_recorded_peak(tmp_path: Path) -> None:
    """Each copy of each workflow is predicted its own steps' figures, in order."""
    peaks = {"a": [40, 700, 90], "b": [300, 60, 500, 120]}
    trace = write_trace(Trace(header=make_header("test"),
                              workflows=[stepped_workflow(w, p) for w, p in peaks.items()]),
                        tmp_path / "trace.jsonl")
    config = BenchConfig.model_validate({
        "trace": trace, "budget_bytes": GIB, "policies": ["tenon"], "backend": "sim",
        "qps": 4.0, "window_s": 1.0, "predictor": "oracle", "out_dir": tmp_path / "run"})
    summary = asyncio.run(run_bench(config))
    assert summary["policies"]["tenon"]["completed"] == 4
    events = [json.loads(line) for line in
              (tmp_path / "run" / "tenon" / "events.jsonl").read_text().splitlines()]
    workflow_of = {e["agent_id"]: e["workflow"] for e in events if e["kind"] == "workflow_start"}
    predicted: dict[str, list[int]] = {}
    for e in events:
        if e["kind"] == "action_ready":
            predicted.setdefault(e["agent_id"], []).append(e["predicted_peak_bytes"])
    assert sorted(workflow_of.values()) == ["a#0", "a#1", "b#0", "b#1"]
    for agent, instance in workflow_of.items():
        assert predicted[agent] == [p * MIB for p in peaks[instance.split("#")[0]]]
