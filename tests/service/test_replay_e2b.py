"""The replay through the front door (`tenon bench --via e2b`): the same workflows and actions
as in-process, the API's overhead in the summary, and `--via` refused when it cannot run."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tenon.cli.main import app
from tenon.errors import ConfigError
from tenon.replay.bench import BenchConfig, run_bench
from tenon.replay.loop_lag import percentile
from tenon.replay.trace import (
    Action,
    Memory,
    Reproduce,
    Step,
    Trace,
    Workflow,
    make_header,
    write_trace,
)
from tenon.runtime.results import Outcome
from tenon.sandbox import launcher
from tenon.service.replay_client import outcome_of_exit
from tenon.service.replay_e2b import ActionTimes, ApiStats, overhead_summary, replay_via_e2b

MIB = 1 << 20
WIDE = {"COLUMNS": "400"}  # rich never wraps the one error line


def make_action(*, action_class: str = "test_runner", peak_mib: int = 24,
                command: str | None = None) -> Action:
    literal = command is not None
    return Action(command=command or f"pytest -k {action_class}", tool="Bash",
                  action_class=action_class, duration_s=0.4,  # type: ignore[arg-type]
                  memory=Memory(avg_bytes=peak_mib * MIB // 2, peak_bytes=peak_mib * MIB,
                                resident_after_bytes=4 * MIB),
                  reproduce=Reproduce(mode="literal" if literal else "load"))


def write_tiny_trace(path: Path) -> Path:
    """Two workflows: load-program steps of several classes, and a literal command that
    exits non-zero (a failed command, not a failed attempt)."""
    first = Workflow(id="w1", submit_s=0.0, base_image="tenon-base:bookworm", family="demo",
                     steps=[Step(model_wait_s=0.2, action=make_action(action_class=c))
                            for c in ("file_read", "test_runner", "compiler", "file_read")])
    second = Workflow(id="w2", submit_s=0.5, base_image="tenon-base:bookworm",
                      family="other", metadata={"task": "t2"},
                      steps=[Step(model_wait_s=0.2, action=make_action(action_class="vcs")),
                             Step(model_wait_s=0.2, action=make_action(
                                 action_class="other", command="exit 3")),
                             Step(model_wait_s=0.2, action=make_action(peak_mib=40))])
    return write_trace(Trace(header=make_header("test"), workflows=[first, second]), path)


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _actions_by_workflow(events: list[dict[str, Any]]) -> dict[str, list[tuple[str, str]]]:
    """Per workflow instance: (action class, outcome) of each action, in order."""
    workflow_of = {e["agent_id"]: e["workflow"] for e in events
                   if e["kind"] == "workflow_start"}
    classes = {e["action_id"]: e["action_class"] for e in events if e["kind"] == "action_ready"}
    out: dict[str, list[tuple[str, str]]] = {}
    for e in events:
        if e["kind"] == "action_done":
            out.setdefault(workflow_of[e["agent_id"]], []).append(
                (classes[e["action_id"]], e["outcome"]))
    return out


def _need_real_sandboxes() -> None:
    if os.geteuid() != 0:
        pytest.skip("real sandboxes need root")
    if problems := launcher.check():
        pytest.skip(problems[0])
    if not Path("/var/lib/tenon/images").exists():
        pytest.skip("base image missing: run `tenon image build`")


@pytest.mark.sandbox
@pytest.mark.cgroups
@pytest.mark.slow
async def test_replay_via_e2b_runs_every_action_as_in_process(tmp_path: Path) -> None:
    _need_real_sandboxes()
    trace = write_tiny_trace(tmp_path / "tiny.jsonl")
    out = tmp_path / "run"
    config = BenchConfig(trace=trace, budget_bytes=1 << 30, policies=["tenon"],
                         backend="process", speed=4.0, out_dir=out, via="both")
    summary = await run_bench(config, e2b_driver=replay_via_e2b)

    assert list(summary["policies"]) == ["tenon", "tenon@e2b"]
    inproc, e2b = summary["policies"]["tenon"], summary["policies"]["tenon@e2b"]
    for result in (inproc, e2b):
        assert result["completed"] == 2
        assert result["failed_attempts"] == 0
    # the same actions, classes (TENON_ACTION_CLASS reached the predictor) and outcomes
    # (the literal `exit 3` is a failed command in both, not a failed attempt)
    expected = {"w1#0": [("file_read", "ok"), ("test_runner", "ok"), ("compiler", "ok"),
                         ("file_read", "ok")],
                "w2#0": [("vcs", "ok"), ("other", "error"), ("test_runner", "ok")]}
    assert _actions_by_workflow(_events(out / "tenon" / "events.jsonl")) == expected
    e2b_events = _events(out / "tenon@e2b" / "events.jsonl")
    assert _actions_by_workflow(e2b_events) == expected
    # the sandbox metadata reached create_agent: family and profiled peak per workflow
    starts = {e["workflow"]: e for e in e2b_events if e["kind"] == "workflow_start"}
    assert {w: e["family"] for w, e in starts.items()} == {"w1#0": "demo", "w2#0": "other"}
    assert starts["w2#0"]["profile_peak_bytes"] == 40 * MIB
    # every command was timed and matched with its action
    assert e2b["api_commands"] == e2b["api_commands_matched"] == 7
    assert e2b["api_errors"] == 0
    for key in ("api_overhead_p50_ms", "api_overhead_p99_ms", "api_overhead_net_p50_ms",
                "api_overhead_net_p99_ms", "client_loop_lag_p50_ms", "client_loop_lag_p99_ms"):
        assert isinstance(e2b[key], float)
    assert e2b["api_overhead_p50_ms"] <= e2b["api_overhead_p99_ms"]
    assert "api_overhead_p50_ms" not in inproc
    for result in (inproc, e2b):  # how busy the loop was, for comparing the two
        assert isinstance(result["loop_lag_p50_ms"], float)
        assert result["loop_lag_p50_ms"] <= result["loop_lag_p99_ms"]
    assert summary["meta"]["via"] == "both"


@pytest.mark.parametrize(("args", "message"), [
    (["--via", "grpc"], "error: --via: expected one of inproc, e2b, both, got 'grpc'"),
    (["--via", "e2b", "--backend", "sim"],
     "error: --via e2b: the simulator is not offered through the E2B API; use --backend "
     "process or docker"),
])
def test_bad_via_is_one_line_error(tmp_path: Path, args: list[str], message: str) -> None:
    trace = write_tiny_trace(tmp_path / "tiny.jsonl")
    result = CliRunner().invoke(app, ["bench", "--trace", str(trace), "--out",
                                      str(tmp_path / "run"), *args], env=WIDE)
    assert result.exit_code == 2
    assert result.output.strip() == message
    assert not (tmp_path / "run").exists()


async def test_via_e2b_without_an_e2b_driver_is_refused_before_anything_runs(
        tmp_path: Path) -> None:
    """The bench (replay) cannot reach the service on its own: the driver is handed in."""
    trace = write_tiny_trace(tmp_path / "tiny.jsonl")
    config = BenchConfig(trace=trace, budget_bytes=1 << 30, policies=["tenon"],
                         backend="process", out_dir=tmp_path / "run", via="e2b")
    with pytest.raises(ConfigError, match="--via e2b: no E2B driver was given"):
        await run_bench(config)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("exit_code", "error", "outcome"), [
    (3, None, Outcome.ERROR),
    (-1, None, Outcome.ERROR),  # a signal the command got, no error from the server
    (-1, "OOM kill: the sandbox ran out of memory", Outcome.OOM_KILLED),
    (-1, "command timed out", Outcome.TIMEOUT),
    (-1, "sandbox died: bwrap exited", Outcome.SANDBOX_DIED),
])
def test_end_event_maps_to_the_in_process_outcome(exit_code: int, error: str | None,
                                                  outcome: Outcome) -> None:
    assert outcome_of_exit(exit_code, error) is outcome


def test_overhead_matches_commands_to_actions_by_sandbox_and_order() -> None:
    times = ActionTimes()
    events = [
        {"t": 1.0, "kind": "action_ready", "agent_id": "s1", "action_id": "s1-a0001"},
        {"t": 1.0, "kind": "action_ready", "agent_id": "s2", "action_id": "s2-a0001"},
        {"t": 1.5, "kind": "action_done", "agent_id": "s1", "action_id": "s1-a0001"},
        {"t": 1.502, "kind": "residency", "agent_id": "s1"},
        {"t": 3.0, "kind": "action_done", "agent_id": "s2", "action_id": "s2-a0001"},
        {"t": 4.0, "kind": "action_ready", "agent_id": "s1", "action_id": "s1-a0002"},
        {"t": 6.0, "kind": "action_done", "agent_id": "s1", "action_id": "s1-a0002"},
        {"t": 6.001, "kind": "residency", "agent_id": "s1"},
        {"t": 7.0, "kind": "action_ready", "agent_id": "s2", "action_id": "s2-a0002"},
    ]
    for event in events:
        times.observe(event)
    stats = ApiStats(commands=[("s1", 1, 0.504), ("s1", 2, 2.003), ("s2", 1, 2.010),
                               ("s2", 2, 0.1),  # its action never ended: not matched
                               ("s3", 1, 0.2)])  # no action of that sandbox
    stats.error("kill: RuntimeError: gone")
    summary = overhead_summary(stats, times)
    assert summary["api_commands"] == 5
    assert summary["api_commands_matched"] == 3
    assert summary["api_overhead_p50_ms"] == pytest.approx(4.0)  # of 4, 3 and 10 ms
    assert summary["api_overhead_p99_ms"] == pytest.approx(10.0)
    assert summary["api_overhead_net_p50_ms"] == pytest.approx(2.0)  # of 2 and 2 ms
    assert summary["api_errors"] == 1
    assert summary["api_error_samples"] == ["kill: RuntimeError: gone"]


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert percentile([5.0], 99) == 5.0
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile(list(reversed(values)), 100) == 100.0
