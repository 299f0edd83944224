"""The replay bench end to end on the simulated host: schedule, retries, JSON, report, errors."""

from __future__ import annotations

import asyncio
import gzip
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tenon.cli.main import app
from tenon.errors import ConfigError, TraceError
from tenon.replay.bench import BenchConfig, run_bench
from tenon.replay.delays import PARTS, workflow_delays
from tenon.replay.report import draw, table_markdown
from tenon.replay.schedule import (
    copies_of,
    make_schedule,
    makespan_bound_s,
    memory_bound_s,
    oversubscription,
)
from tenon.replay.trace import Action, Memory, Step, Trace, Workflow, make_header, write_trace
from tenon.runtime.events import read_events

MIB = 1 << 20
GIB = 1 << 30
POLICY_KEYS = {"makespan_s", "p50_latency_s", "peak_memory_bytes", "oom_events", "timeouts",
               "attempts", "failed_attempts", "completed", "restartable_share", "vs_bound",
               "safe", "teardowns", "rebuilds", "lifecycle_s", "cpu", "cpu_vs_floor"}


def make_workflow(wid: str, *, peak_mib: int = 300, steps: int = 3, submit_s: float = 0.0,
                  action_class: str = "test_runner") -> Workflow:
    memory = Memory(avg_bytes=peak_mib * MIB * 2 // 3, peak_bytes=peak_mib * MIB,
                    resident_after_bytes=16 * MIB)
    action = Action(command="pytest -x", tool="Bash", action_class=action_class,
                    duration_s=2.0, memory=memory)
    return Workflow(id=wid, submit_s=submit_s, base_image="tenon-base:bookworm", family="demo",
                    steps=[Step(model_wait_s=1.0, action=action)] * steps)


def write(tmp_path: Path, workflows: list[Workflow]) -> Path:
    return write_trace(Trace(header=make_header("test"), workflows=workflows),
                       tmp_path / "trace.jsonl")


def config(tmp_path: Path, trace: Path, **overrides) -> BenchConfig:
    fields = {"trace": trace, "budget_bytes": GIB, "policies": ["tenon", "eager"],
              "backend": "sim", "qps": 4.0, "window_s": 3.0, "out_dir": tmp_path / "run"}
    return BenchConfig.model_validate({**fields, **overrides})


def test_schedule_bursts_cycle_the_trace_and_speed_divides_time() -> None:
    workflows = [make_workflow("a", submit_s=10.0), make_workflow("b", submit_s=20.0, steps=5)]
    burst = make_schedule(workflows, qps=2.0, window_s=2.5, speed=4.0)
    assert [s.instance for s in burst] == ["a#0", "b#0", "a#1", "b#1", "a#2"]
    assert [s.submit_s for s in burst] == [0.0, 0.5, 1.0, 1.5, 2.0]
    # a takes 3 x (1 s wait + 2 s action) / 4 = 2.25 s, b 3.75 s: b#1 ends last, not a#2
    assert makespan_bound_s(burst, 4.0) == pytest.approx(1.5 + 3.75)
    at_trace_times = make_schedule(workflows, qps=None, speed=4.0)
    assert [s.submit_s for s in at_trace_times] == [2.5, 5.0]
    assert oversubscription(burst, GIB) == pytest.approx(5 * 300 / 1024)
    with pytest.raises(ConfigError, match="speed"):
        make_schedule(workflows, qps=1.0, speed=0.0)


def test_bench_runs_every_policy_with_retries_and_writes_the_exact_keys(tmp_path: Path) -> None:
    trace = write(tmp_path, [make_workflow(f"w{i}") for i in range(4)])
    summary = asyncio.run(run_bench(config(tmp_path, trace)))
    assert summary["workflows"] == 12
    assert summary["oversubscription"] == pytest.approx(12 * 300 / 1024, abs=0.01)
    assert set(summary["policies"]) == {"tenon", "eager"}
    for figures in summary["policies"].values():
        assert set(figures) == POLICY_KEYS
    tenon, eager = summary["policies"]["tenon"], summary["policies"]["eager"]
    assert tenon["completed"] == 12
    assert tenon["oom_events"] == 0
    assert tenon["attempts"] == 12
    assert eager["oom_events"] > 0
    # every attempt either completed its workflow or failed and was retried (or gave up)
    assert eager["attempts"] == eager["completed"] + eager["failed_attempts"]
    assert eager["attempts"] > 12
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["policies"] == summary["policies"]
    assert on_disk["meta"]["complete"]
    assert (tmp_path / "run" / "tenon" / "events.jsonl").stat().st_size > 0
    for name, figures in summary["policies"].items():  # the share the event log records
        judged = [e["restartable"] for e in read_events(tmp_path / "run" / name / "events.jsonl")
                  if e["kind"] == "residency"]
        share = sum(judged) / len(judged) if judged else None
        assert figures["restartable_share"] == pytest.approx(share, abs=1e-4)
    assert summary["policies"]["tenon"]["restartable_share"] == 1.0  # the sim leaves nothing
    for name, figures in summary["policies"].items():  # the counts the event log records
        events = list(read_events(tmp_path / "run" / name / "events.jsonl"))
        assert figures["teardowns"] == sum(
            e["kind"] == "teardown" and e["outcome"] != "kept_resident" for e in events)
        assert figures["rebuilds"] == sum(e["kind"] == "rebuild" for e in events)
        assert figures["cpu"]["controller_s"] > 0.0  # the simulator's host costs nothing else
        assert figures["cpu_vs_floor"] is None  # no floor in this run
    written = draw(tmp_path / "run")
    assert [p.name for p in written] == ["table.md", "delays.md", "timeline.png", "bars.png"]
    assert all(p.stat().st_size > 0 for p in written)
    splits = {name: workflow_delays(read_events(tmp_path / "run" / name / "events.jsonl"))
              for name in summary["policies"]}
    for name, rows in splits.items():
        assert rows is not None
        assert len(rows) == 12
        assert max(r.end for r in rows) == pytest.approx(summary["policies"][name]["makespan_s"],
                                                         abs=0.5)
        for r in rows:
            assert r.own == pytest.approx(3 * 3.0)  # three steps of 1 s wait + 2 s action
            assert r.own + sum(getattr(r, p) for p in PARTS) == pytest.approx(r.latency)
    # eager admits nothing and its retries are its only delay beyond running; Tenon's kept
    # the budget by queueing admissions or holding starts (the 12 peaks do not fit at once)
    assert all(r.admission == 0.0 for r in splits["eager"] or [])
    assert sum(r.failed for r in splits["eager"] or []) > 0
    assert sum(r.admission + r.start + r.frozen for r in splits["tenon"] or []) > 1.0
    assert "| tenon (12) |" in (tmp_path / "run" / "delays.md").read_text()
    table = (tmp_path / "run" / "table.md").read_text()
    assert "| tenon | 12/12 |" in table
    # no policy beats the bound; 12 three-step workflows, the last submitted at 2.75 s
    assert summary["makespan_bound_s"] == pytest.approx(2.75 + 3 * 3.0)
    assert all(p["makespan_s"] >= summary["makespan_bound_s"]
               for p in summary["policies"].values())
    assert f"No policy can finish before {summary['bound_s']:.1f} s" in table
    assert f"longest workflow {summary['makespan_bound_s']:.1f} s" in table


def test_budget_smaller_than_the_largest_action_is_refused_by_name(tmp_path: Path) -> None:
    trace = write(tmp_path, [make_workflow("small", peak_mib=100),
                             make_workflow("huge", peak_mib=2048)])
    with pytest.raises(ConfigError, match="workflow huge step 0 peaks"):
        asyncio.run(run_bench(config(tmp_path, trace)))
    assert not (tmp_path / "run" / "tenon").exists()  # refused before anything ran
    # a burst of the small one alone never runs the huge action: the budget is enough
    summary = asyncio.run(run_bench(config(tmp_path, trace, qps=None, copies=2, of="small",
                                           policies=["tenon"])))
    assert summary["policies"]["tenon"]["completed"] == 2


def test_malformed_trace_and_unknown_policy_fail_before_running(tmp_path: Path) -> None:
    trace = write(tmp_path, [make_workflow("w")])
    lines = trace.read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(lines[0] + "\n" + lines[1].replace('"duration_s":2.0', '"duration_s":-1') + "\n")
    with pytest.raises(TraceError, match=r"bad.jsonl:2: steps.0.action.duration_s"):
        asyncio.run(run_bench(config(tmp_path, bad)))
    with pytest.raises(ConfigError, match="unknown policy"):
        asyncio.run(run_bench(config(tmp_path, trace, policies=["tenon", "fifo"])))


def test_interrupted_bench_keeps_the_finished_policies(tmp_path: Path) -> None:
    trace = write(tmp_path, [make_workflow(f"w{i}", steps=40) for i in range(3)])
    cfg = config(tmp_path, trace, policies=["eager", "tenon"], qps=1.0, window_s=3.0)

    async def main() -> None:
        started: list[str] = []

        def on_start(name: str, total: int) -> None:
            started.append(name)
            if name == "tenon":  # eager has finished; interrupt the second policy
                asyncio.get_running_loop().call_soon(task.cancel)

        task = asyncio.ensure_future(run_bench(cfg, on_policy_start=on_start))
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert list(summary["policies"]) == ["eager"]
    assert summary["meta"]["interrupted_during"] == "tenon"
    assert not summary["meta"]["complete"]


def test_cli_bench_and_report(tmp_path: Path) -> None:
    trace = write(tmp_path, [make_workflow(f"w{i}") for i in range(2)])
    out = tmp_path / "cli-run"
    result = CliRunner().invoke(app, [
        "bench", "--trace", str(trace), "--budget", "1GiB", "--backend", "sim",
        "--policies", "tenon,static-2", "--qps", "2", "--window", "2s", "--speed", "2",
        "--out", str(out), "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "r.json").read_text())
    assert {"budget_bytes", "oversubscription", "workflows", "policies"} <= set(data)
    assert set(data["policies"]) == {"tenon", "static-2"}
    (out / "bars.png").unlink()
    assert "Where the time went" in result.output
    again = CliRunner().invoke(app, ["report", str(out)])
    assert again.exit_code == 0, again.output
    assert (out / "bars.png").exists()
    assert "Where the time went" in again.output
    # recorded results keep their event logs gzipped: the report reads those too
    log = out / "tenon" / "events.jsonl"
    log.with_suffix(".jsonl.gz").write_bytes(gzip.compress(log.read_bytes()))
    log.unlink()
    (out / "delays.md").unlink()
    gzipped = CliRunner().invoke(app, ["report", str(out)])
    assert gzipped.exit_code == 0, gzipped.output
    assert "| tenon (4) |" in (out / "delays.md").read_text()
    bad = CliRunner().invoke(app, ["bench", "--trace", str(trace), "--backend", "sim",
                                   "--set", "horizon_secs=2"])
    assert bad.exit_code == 2
    assert "horizon_secs" in bad.output


def test_cli_sweep_writes_one_point_per_value(tmp_path: Path) -> None:
    trace = write(tmp_path, [make_workflow("w", steps=1)])
    result = CliRunner().invoke(app, [
        "bench", "--trace", str(trace), "--budget", "1GiB", "--backend", "sim",
        "--policies", "tenon", "--qps", "1", "--window", "2s",
        "--sweep", "lifecycle_limit=1,3", "--out", str(tmp_path / "sw"),
        "--json", str(tmp_path / "sw.json")])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "sw.json").read_text())
    assert data["sweep"] == "lifecycle_limit"
    assert [p["value"] for p in data["points"]] == [1, 3]
    assert (tmp_path / "sw" / "lifecycle_limit-3" / "summary.json").exists()


def test_cli_import_agentcgroup_and_mini_swe_agent(tmp_path: Path) -> None:
    from tenon.replay.trace import load_trace

    # Real runs shipped with the tests (see tests/data/traces/README.md).
    traces = Path(__file__).resolve().parents[1] / "data" / "traces"
    out = tmp_path / "ac.jsonl"
    result = CliRunner().invoke(app, ["import", "agentcgroup", str(traces / "agentcgroup"),
                                      "-o", str(out)])
    assert result.exit_code == 0, result.output
    # three tasks with 3 + 15 + 33 tool calls; one task has no tool_calls.json
    summary = " ".join(result.output.split())  # the console wraps long lines
    assert summary.startswith("3 workflows, 51 actions -> ")
    assert summary.endswith("(skipped 1)")
    no_profile = CliRunner().invoke(app, ["import", "mini-swe-agent",
                                          str(traces / "mini-swe-agent"), "-o",
                                          str(tmp_path / "ms.jsonl")])
    assert no_profile.exit_code == 2
    assert "memory profile is required" in no_profile.output
    derived = CliRunner().invoke(app, ["import", "mini-swe-agent",
                                       str(traces / "mini-swe-agent"), "-o",
                                       str(tmp_path / "ms.jsonl"), "--profile-from", str(out)])
    assert derived.exit_code == 0, derived.output
    assert "2 workflows, 78 actions" in derived.output
    astropy, django = load_trace(tmp_path / "ms.jsonl").workflows
    assert (astropy.id, len(astropy.steps), django.id, len(django.steps)) == (
        "astropy__astropy-12907", 36, "django__django-11099", 42)
    # memory comes from the measured runs: a pytest run (step 7) is profiled far above a find
    run_tests, find = astropy.steps[7].action, astropy.steps[0].action
    assert run_tests.action_class == "test_runner"
    assert run_tests.memory.peak_bytes > 4 * find.memory.peak_bytes > 0


@pytest.mark.parametrize("predictor", ["static", "history", "forest", "online-forest"])
def test_bench_runs_tenon_with_each_predictor(tmp_path: Path, predictor: str) -> None:
    workflows = [make_workflow(f"w{i}", peak_mib=100 + 60 * i) for i in range(4)]
    trace = write(tmp_path, workflows)
    summary = asyncio.run(run_bench(config(tmp_path, trace, policies=["tenon"],
                                           predictor=predictor)))
    assert summary["meta"]["predictor"] == predictor
    assert summary["policies"]["tenon"]["completed"] == 12
    (start,) = [json.loads(line) for line in
                (tmp_path / "run" / "tenon" / "events.jsonl").read_text().splitlines()
                if '"runtime_start"' in line]
    assert start["predictor"] == predictor


def test_the_memory_bound_is_the_trace_area_over_the_budget() -> None:
    """One workflow of three 2 s actions averaging 200 MiB, 16 MiB left resident through
    each 1 s model wait that follows: 1,200 MiB-s of actions (plus 32 MiB-s idle)."""
    burst = make_schedule([make_workflow("a")], qps=None, speed=1.0)
    assert memory_bound_s(burst, 1.0, GIB) == pytest.approx(1200 / 1024)
    assert memory_bound_s(burst, 1.0, GIB, idle_resident=True) == pytest.approx(1232 / 1024)
    assert memory_bound_s(burst, 4.0, GIB) == pytest.approx(1200 / 1024 / 4)


def test_a_synchronized_burst_submits_copies_of_one_workflow_together(tmp_path: Path) -> None:
    workflows = [make_workflow("a"), make_workflow("b", steps=5)]
    burst = copies_of(workflows, "b", 3)
    assert [(s.instance, s.submit_s, s.workflow.id) for s in burst] == [
        ("b#0", 0.0, "b"), ("b#1", 0.0, "b"), ("b#2", 0.0, "b")]
    with pytest.raises(ConfigError, match="no workflow 'c'"):
        copies_of(workflows, "c", 3)
    trace = write(tmp_path, workflows)
    with pytest.raises(ConfigError, match="--copies and --of go together"):
        asyncio.run(run_bench(config(tmp_path, trace, copies=3)))


def test_every_policy_is_judged_against_the_bound_and_the_best_safe_baseline(
    tmp_path: Path,
) -> None:
    """Eight copies of a 300 MiB workflow in 1 GiB: the floor is the unconstrained run; a
    safe run completes everything with no OOM kill; the best safe baseline is the fastest
    safe static limit or reservation, never Tenon or eager."""
    trace = write(tmp_path, [make_workflow("w", peak_mib=300)])
    summary = asyncio.run(run_bench(config(
        tmp_path, trace, qps=None, copies=8, of="w",
        policies=["tenon", "eager", "static-1", "static-3", "reservation", "unconstrained"])))
    runs = summary["policies"]
    assert summary["workflows"] == 8
    assert runs["unconstrained"]["oom_events"] == 0
    assert runs["unconstrained"]["peak_memory_bytes"] > GIB  # no limit: all eight at once
    assert summary["floor_makespan_s"] == runs["unconstrained"]["makespan_s"]
    assert summary["bound_s"] == pytest.approx(max(
        summary["floor_makespan_s"], summary["memory_bound_s"], summary["makespan_bound_s"]),
        abs=1e-3)
    for name, figures in runs.items():
        assert figures["vs_bound"] == pytest.approx(figures["makespan_s"] / summary["bound_s"],
                                                    abs=1e-3)
        if name != "unconstrained":  # the floor alone is not held to the budget
            assert figures["vs_bound"] >= 1.0 - 1e-3
        assert figures["safe"] == (figures["completed"] == 8 and figures["oom_events"] == 0)
    assert runs["eager"]["safe"] is False  # eight 300 MiB peaks at once in 1 GiB
    safe_baselines = {name: runs[name]["makespan_s"] for name in
                      ("static-1", "static-3", "reservation") if runs[name]["safe"]}
    assert safe_baselines
    best = summary["best_safe_baseline"]
    assert best in safe_baselines
    assert safe_baselines[best] == min(safe_baselines.values())
    events = list(read_events(tmp_path / "run" / "tenon" / "events.jsonl"))
    assert runs["tenon"]["teardowns"] == sum(
        e["kind"] == "teardown" and e["outcome"] != "kept_resident" for e in events) > 0
    assert runs["tenon"]["rebuilds"] == sum(e["kind"] == "rebuild" for e in events) > 0
    table = table_markdown(summary)
    assert f"floor (unconstrained) {summary['floor_makespan_s']:.1f} s" in table
    assert "| policy | teardowns | rebuilds |" in table
    assert f"no OOM kill): {summary['best_safe_baseline']}." in table


def test_cli_copies_of_one_workflow_and_refuses_half_of_it(tmp_path: Path) -> None:
    trace = write(tmp_path, [make_workflow("a"), make_workflow("b")])
    result = CliRunner().invoke(app, [
        "bench", "--trace", str(trace), "--budget", "1GiB", "--backend", "sim",
        "--policies", "tenon,unconstrained", "--copies", "4", "--of", "b",
        "--out", str(tmp_path / "burst"), "--json", str(tmp_path / "burst.json")])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "burst.json").read_text())
    assert data["workflows"] == 4
    assert (data["meta"]["copies"], data["meta"]["of"]) == (4, "b")
    assert data["floor_makespan_s"] == data["policies"]["unconstrained"]["makespan_s"]
    half = CliRunner().invoke(app, ["bench", "--trace", str(trace), "--backend", "sim",
                                    "--copies", "4", "--out", str(tmp_path / "half")])
    assert half.exit_code != 0
    assert "--copies and --of go together" in half.output
