"""The `tenon` command line."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from pydantic import ValidationError
from rich.markdown import Markdown
from rich.table import Table

from tenon.cli.agents import agents_app
from tenon.cli.bench import actuators_cmd, faults_cmd
from tenon.cli.cluster import cluster_app
from tenon.cli.console import make_console
from tenon.cli.errors import fail, require_writable_dir, require_writable_file, write_text
from tenon.cli.images import image_app
from tenon.cli.predict import predict_app
from tenon.cli.serve import serve_cmd
from tenon.errors import ConfigError, TenonError
from tenon.units import MIB, format_bytes, parse_size

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
bench_app = typer.Typer(help="The replay bench (with --trace) and micro-benchmarks.")
app.add_typer(image_app, name="image")
app.add_typer(bench_app, name="bench")
import_app = typer.Typer(no_args_is_help=True, help="Build traces from real agent logs.")
app.add_typer(import_app, name="import")
app.add_typer(predict_app, name="predict")
app.add_typer(agents_app, name="agents")
app.add_typer(cluster_app, name="cluster")
bench_app.command("faults")(faults_cmd)
bench_app.command("actuators")(actuators_cmd)
app.command("serve")(serve_cmd)

console = make_console()
DEFAULT_STATE_DIR = Path("/var/lib/tenon")
DEFAULT_IMAGE = "tenon-base:bookworm"

StateDir = Annotated[Path, typer.Option(help="Tenon's state directory.")]
Image = Annotated[str, typer.Option(help="Base image name.")]
JsonOut = Annotated[Path | None, typer.Option("--json", help="Write results here.")]
# Sampling longer than a day measures nothing a minute would not.
MAX_SAMPLING_S = 86_400.0
# Every sandbox holds at least one process, and 64-bit Linux never has more than
# PID_MAX_LIMIT (2**22) of them: a larger count is a typo, not a host.
MAX_SANDBOXES = 2**22


def _check_sandboxes(count: int, *, what: str) -> None:
    if count > MAX_SANDBOXES:
        raise ConfigError(f"{what}: {count} is more sandboxes than a Linux host has process "
                          f"ids ({MAX_SANDBOXES})")


# Exit status of `tenon doctor` when a check fails (2 stays for bad input).
EXIT_CHECK_FAILED = 1
# The demo's action writes this much into each agent's tmpfs scratch (charged to the
# sandbox); a budget below it cannot hold even one agent.
DEMO_BURST_MIB = 64


def _fail(exc: Exception) -> NoReturn:
    fail(exc)


@app.callback()
def _main(verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False) -> None:
    """Tenon: serve many LLM agents' sandboxes under one memory budget."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING)


@app.command()
def doctor(state_dir: StateDir = DEFAULT_STATE_DIR, image: Image = DEFAULT_IMAGE,
           image_dir: Annotated[Path | None, typer.Option(
               help="The image store (default: $TENON_IMAGE_DIR, else "
                    "/var/lib/tenon/images).")] = None) -> None:
    """Print what this host supports and what is missing, with the command that fixes it."""
    from tenon.cli.doctor import run_checks

    table = Table("check", "status", "detail", "fix")
    checks = run_checks(state_dir, image, image_dir)
    for check in checks:
        status = "[green]ok[/green]" if check.ok else "[red]missing[/red]"
        table.add_row(check.name, status, check.detail, check.fix)
    console.print(table)
    failed = [c.name for c in checks if not c.ok]
    if failed:
        console.print(f"[yellow]{len(failed)} of {len(checks)} checks failed "
                      f"({', '.join(failed)}); see the fix column[/yellow]")
        raise typer.Exit(EXIT_CHECK_FAILED)


@bench_app.callback(invoke_without_command=True)
def bench_replay_cmd(
    ctx: typer.Context,
    trace: Annotated[Path | None, typer.Option(help="Trace to replay (tenon-trace JSONL).")] = None,
    budget: Annotated[str, typer.Option(help="Memory budget of the workload domain.")] = "3GiB",
    policies: Annotated[str, typer.Option(help="Comma-separated policies, run in turn "
                        "(unconstrained: eager with no memory limit, the floor).")] = (
        "tenon,eager,static-4,reservation,agentcgroup"),
    backend: Annotated[str, typer.Option(help="process, docker or sim")] = "process",
    speed: Annotated[float, typer.Option(help="Divide model waits and durations by K.")] = 1.0,
    qps: Annotated[str | None, typer.Option(help="Burst rate (a list sweeps it); "
                                                  "default: trace times.")] = None,
    window: Annotated[str, typer.Option(help="Burst length at --qps.")] = "10s",
    workflows: Annotated[int | None, typer.Option(help="Number of workflows to submit.")] = None,
    copies: Annotated[int | None, typer.Option(help="A synchronized burst: K copies of the "
                      "workflow --of, submitted together.")] = None,
    of: Annotated[str | None, typer.Option(help="The workflow --copies repeats (its id in "
                  "the trace).")] = None,
    retries: Annotated[int, typer.Option(help="Re-runs of a failed attempt.")] = 5,
    setting: Annotated[list[str] | None, typer.Option(
        "--set", help="Policy parameter key=value (repeatable).")] = None,
    sweep: Annotated[str | None, typer.Option(help="param=v1,v2,... (qps, red_fraction, "
                     "yellow_fraction, admission_window_bytes, lifecycle_limit)")] = None,
    predictor: Annotated[str, typer.Option(help="Tenon's memory predictor: online (per-class "
                         "figures raised by what each workflow and family measured), static, "
                         "history or forest (cross-fitted: a workflow is predicted by a "
                         "model that never saw it), online-forest (the forest, raised "
                         "online), or oracle (each action's recorded figures: an "
                         "ablation, not deployable)")] = "online",
    out: Annotated[Path | None, typer.Option(help="Run directory.")] = None,
    json_path: JsonOut = None,
    state_dir: StateDir = DEFAULT_STATE_DIR,
    via: Annotated[str, typer.Option(help="inproc (Agent.run), e2b (each workflow an E2B "
                   "sandbox driven with the official SDK through the E2B-compatible server "
                   "on loopback; adds the API's overhead per command to the summary) or "
                   "both (each policy in-process, then as <policy>@e2b)")] = "inproc",
    gate_actuator: Annotated[str, typer.Option(help="How the execution gate holds a sandbox: "
                             "auto (the sched_ext scheduler where the host offers it, else "
                             "the cgroup freezer), scx or freezer")] = "auto",
) -> None:
    """Replay a trace under a budget with every policy, side by side."""
    if ctx.invoked_subcommand is not None:
        return
    if trace is None:
        console.print(ctx.get_help())
        raise typer.Exit(2)
    from tenon.cli.bench import parse_seconds, parse_settings, run_cli_bench
    from tenon.replay.bench import check_via

    try:
        check_via(via, backend)
        out_dir = out or Path("bench/runs") / time.strftime("%Y%m%d-%H%M%S")
        base = {
            "trace": trace, "budget_bytes": parse_size(budget, what="--budget"),
            "policies": [p.strip() for p in policies.split(",") if p.strip()],
            "backend": backend, "speed": speed,
            "window_s": parse_seconds(window, what="--window"), "num_workflows": workflows,
            "copies": copies, "of": of,
            "max_retries": retries, "policy_config": parse_settings(setting or []),
            "predictor": predictor,
            "state_dir": state_dir, "out_dir": out_dir, "via": via,
            "gate_actuator": gate_actuator,
        }
        run_cli_bench(console=console, base=base, sweep=sweep, qps=qps, json_path=json_path)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/yellow]: sandboxes and cgroups removed; partial "
                      f"results in {out_dir}/summary.json")
        raise typer.Exit(130) from None
    except (TenonError, ValidationError) as exc:
        _fail(exc)


@app.command()
def report(run_dir: Annotated[Path, typer.Argument(help="A bench run directory.")]) -> None:
    """Redraw a bench run's table and plots from its summary and event logs."""
    from tenon.replay.report import draw, load_summary, table_markdown

    try:
        written = draw(run_dir)
        console.print(Markdown(table_markdown(load_summary(run_dir))))
        if (run_dir / "delays.md").exists():
            console.print(Markdown((run_dir / "delays.md").read_text()))
    except (TenonError, ValueError, OSError) as exc:
        _fail(exc)
    console.print("wrote " + ", ".join(str(p) for p in written))


@bench_app.command("lifecycle")
def bench_lifecycle_cmd(
    backend: Annotated[str, typer.Option(
        help="process or docker (with --files also none: the workspace's part alone)")
    ] = "process",
    runs: Annotated[int, typer.Option(help="Repetitions (median reported).")] = 10,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
    state_dir: StateDir = DEFAULT_STATE_DIR,
    image: Image = DEFAULT_IMAGE,
    files: Annotated[str | None, typer.Option(
        help="Tree sizes (e.g. 10,5000,50000): time workspace teardown and rebuild instead."
    )] = None,
    out: Annotated[Path | None, typer.Option(help="With --files: write JSON here.")] = None,
) -> None:
    """Materialize -> exec `true` -> dematerialize (docker: against bare `docker run`/`rm`);
    with --files, a workspace's teardown and rebuild per tree size."""
    if files is not None:
        from tenon.cli.bench import capture_lifecycle

        capture_lifecycle(files, runs, out, state_dir, backend)
        return
    from tenon.cli.bench import bench_backend
    from tenon.replay.lifecycle import bench_lifecycle

    try:
        if runs < 1:
            raise ConfigError(f"--runs: must be at least 1, got {runs}")
        if json_path is not None:
            require_writable_file(json_path, what="--json")
        require_writable_dir(state_dir, what="--state-dir")
        with bench_backend(backend, state_dir) as impl:
            result = asyncio.run(bench_lifecycle(impl, image=image, num_runs=runs))
        if backend == "docker":
            import docker

            from tenon.sandbox.docker import bare_docker_lifecycle

            bare = bare_docker_lifecycle(docker.from_env(), image, runs)
            result["bare_run_ms"] = round(bare["bare_run_ms"], 2)
            result["bare_rm_ms"] = round(bare["bare_rm_ms"], 2)
    except TenonError as exc:
        _fail(exc)
    if backend == "docker":
        ratio = result["materialize_ms"] / result["bare_run_ms"]
        console.print(f"materialize / bare docker run = {ratio:.3f} (target <= 1.25)")
    _write_json(result, json_path)


def _write_json(result: dict[str, object], json_path: Path | None) -> None:
    console.print_json(json.dumps(result))
    if json_path:
        try:
            write_text(json_path, json.dumps(result, indent=2) + "\n", what="--json")
        except TenonError as exc:
            _fail(exc)


@bench_app.command("gate")
def bench_gate_cmd(
    sandboxes: Annotated[int, typer.Option(help="Live sandboxes the gate decides for.")] = 1000,
    iterations: Annotated[int, typer.Option(help="Decisions timed.")] = 200,
    json_path: JsonOut = None,
) -> None:
    """Time one execution-gate decision for N sandboxes (wall and CPU percentiles, and the
    garbage collections that ran during timed decisions)."""
    from tenon.replay.gate_bench import bench_gate_detail

    try:
        _check_sandboxes(sandboxes, what="--sandboxes")
        if json_path is not None:
            require_writable_file(json_path, what="--json")
        result = bench_gate_detail(sandboxes, iterations)
    except ValueError as exc:
        _fail(exc)
    _write_json(dict(result), json_path)


@bench_app.command("sampling")
def bench_sampling_cmd(
    sandboxes: Annotated[int, typer.Option(help="Real sandboxes sampled.")] = 100,
    seconds: Annotated[float, typer.Option(help="How long to sample.")] = 10.0,
    backend: Annotated[str, typer.Option(help="process or docker")] = "process",
    json_path: JsonOut = None,
    state_dir: StateDir = DEFAULT_STATE_DIR,
    image: Image = DEFAULT_IMAGE,
) -> None:
    """CPU cost of the execution loop sampling N real sandboxes every 100 ms."""
    from tenon.replay.sampling_bench import bench_sampling

    try:
        if not math.isfinite(seconds) or seconds > MAX_SAMPLING_S:
            raise ConfigError(f"--seconds: must be a finite number of seconds up to "
                              f"{MAX_SAMPLING_S:.0f}, got {seconds}")
        _check_sandboxes(sandboxes, what="--sandboxes")
        if json_path is not None:
            require_writable_file(json_path, what="--json")
        require_writable_dir(state_dir, what="--state-dir")
        result = asyncio.run(bench_sampling(num_sandboxes=sandboxes, seconds=seconds,
                                            backend=backend, state_dir=state_dir, image=image))
    except (TenonError, ValueError) as exc:
        _fail(exc)
    _write_json(dict(result), json_path)


@app.command()
def demo(
    backend: Annotated[str, typer.Option(help="process or docker")] = "process",
    budget: Annotated[str, typer.Option(help="Workload domain memory budget.")] = "512MiB",
    agents: Annotated[int, typer.Option(help="Logical agents.")] = 4,
    state_dir: StateDir = DEFAULT_STATE_DIR,
    image: Image = DEFAULT_IMAGE,
) -> None:
    """Agents under a budget: run actions, tear sandboxes down, rebuild them, verify workspaces."""
    from tenon.replay.demo import run_demo

    try:
        budget_bytes = parse_size(budget, what="--budget")
        if budget_bytes < DEMO_BURST_MIB * MIB:
            raise ConfigError(f"--budget: {format_bytes(budget_bytes)} cannot hold one agent's "
                              f"{DEMO_BURST_MIB} MiB action; give at least {DEMO_BURST_MIB}MiB")
        if agents < 1:
            raise ConfigError(f"--agents: must be at least 1, got {agents}")
        _check_sandboxes(agents, what="--agents")
        require_writable_dir(state_dir, what="--state-dir")
        asyncio.run(run_demo(backend=backend, budget_bytes=budget_bytes, num_agents=agents,
                             state_dir=state_dir, image=image, console=console,
                             burst_mib=DEMO_BURST_MIB))
    except TenonError as exc:
        _fail(exc)


TraceOut = Annotated[Path, typer.Option("--output", "-o", help="Trace file to write.")]
BaseImage = Annotated[str, typer.Option(help="Base image the workflows run on.")]


@import_app.command("agentcgroup")
def import_agentcgroup_cmd(
    directory: Annotated[Path, typer.Argument(help="Directory of <task>/attempt_*/ runs.")],
    output: TraceOut,
    base_image: BaseImage = DEFAULT_IMAGE,
) -> None:
    """Join AgentCgroup tool calls with their memory samples into a trace."""
    from tenon.replay.importers.agentcgroup import import_agentcgroup
    from tenon.replay.trace import write_trace

    try:
        require_writable_file(output, what="--output")
        trace = import_agentcgroup(directory, base_image=base_image)
        write_trace(trace, output)
    except TenonError as exc:
        _fail(exc)
    console.print(f"{len(trace.workflows)} workflows, {trace.num_actions} actions -> {output} "
                  f"(skipped {trace.header.metadata.get('num_skipped', 0)})")


@import_app.command("mini-swe-agent")
def import_miniswe_cmd(
    directory: Annotated[Path, typer.Argument(help="A *.traj.json file or a directory of them.")],
    output: TraceOut,
    profile: Annotated[Path | None, typer.Option(
        help="JSON memory profile: action class -> {avg_bytes, peak_bytes, "
             "resident_after_bytes}.")] = None,
    profile_from: Annotated[Path | None, typer.Option(
        help="Derive per-class memory from a trace with measured memory (static predictor).")
    ] = None,
    base_image: BaseImage = DEFAULT_IMAGE,
) -> None:
    """Turn mini-swe-agent trajectories into a trace (memory from a profile or predictor)."""
    from tenon.replay.importers.miniswe import import_mini_swe_agent
    from tenon.replay.trace import write_trace

    try:
        if profile is not None and profile_from is not None:
            raise ConfigError("give --profile or --profile-from, not both")
        require_writable_file(output, what="--output")
        source: object = profile
        if profile_from is not None:
            source = _memory_from_trace(profile_from)
        trace = import_mini_swe_agent(directory, source, base_image=base_image)  # type: ignore[arg-type]
        write_trace(trace, output)
    except TenonError as exc:
        _fail(exc)
    console.print(f"{len(trace.workflows)} workflows, {trace.num_actions} actions -> {output}")


def _memory_from_trace(path: Path):  # type: ignore[no-untyped-def]
    """A memory callable from the static predictor fitted on a measured trace."""
    from tenon.policy.config import PolicyConfig
    from tenon.predict.base import ActionContext
    from tenon.replay.bench import profiled_static_predictor
    from tenon.replay.trace import Memory, load_trace

    predictor = profiled_static_predictor(load_trace(path), PolicyConfig())

    def memory(action_class: str, command: str, step: int) -> Memory:
        p = predictor.predict(ActionContext("import", command, action_class, step))
        return Memory(avg_bytes=p.avg_bytes, peak_bytes=p.peak_bytes, resident_after_bytes=0)

    return memory


if __name__ == "__main__":
    app()
