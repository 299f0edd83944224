"""`tenon bench` (the replay bench, with sweeps) and `tenon report`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markdown import Markdown
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tenon.cli.console import make_console
from tenon.cli.errors import (
    describe_validation,
    fail,
    parse_positive_float,
    require_writable_dir,
    require_writable_file,
    write_text,
)
from tenon.errors import ConfigError, TenonError
from tenon.policy.baselines import parse_policy
from tenon.policy.config import PolicyConfig
from tenon.replay.bench import BenchConfig, check_budget, run_bench, schedule_of
from tenon.replay.driver import WorkflowRecord
from tenon.replay.report import draw, table_markdown
from tenon.replay.schedule import makespan_bound_s
from tenon.replay.trace import MAX_SUBMIT_S, load_trace
from tenon.units import parse_size

if TYPE_CHECKING:
    from tenon.sandbox.base import SandboxBackend

SWEEPABLE = ("qps", "red_fraction", "yellow_fraction", "admission_window_bytes",
             "lifecycle_limit")
# Workflow instances one run submits (--workflows, or --qps times --window). Each instance is
# a sandbox and a row in every log; more than this is a typo, and the schedule alone would
# exhaust memory before the first one ran.
MAX_SUBMISSIONS = 100_000
# The option each BenchConfig field comes from, so a validation error names what to change.
BENCH_FLAGS = {
    "trace": "--trace", "budget_bytes": "--budget", "policies": "--policies",
    "backend": "--backend", "speed": "--speed", "qps": "--qps", "window_s": "--window",
    "num_workflows": "--workflows", "max_retries": "--retries", "predictor": "--predictor",
    "copies": "--copies", "of": "--of",
    "policy_config": "--set", "out_dir": "--out", "state_dir": "--state-dir",
    "gate_actuator": "--gate-actuator",
}


def parse_seconds(text: str, *, what: str) -> float:
    """A positive, finite number of seconds ("10s" or "10"), at most a week."""
    return parse_positive_float(text.strip().lower().removesuffix("s"), what=what,
                                example="10s", max_value=MAX_SUBMIT_S)


def parse_qps(text: str | None) -> list[float]:
    """`--qps`: one rate or a comma-separated list (a sweep); [] means trace times."""
    if text is None:
        return []
    values = [v for v in text.split(",") if v.strip()]
    if not values:
        raise ConfigError(f"--qps: expected a rate like 16 or a list like 8,16, got {text!r}")
    # A rate above the submission cap would submit more than MAX_SUBMISSIONS in one second.
    return [parse_positive_float(v, what="--qps", example="16", max_value=MAX_SUBMISSIONS)
            for v in values]


def parse_settings(settings: list[str]) -> dict[str, Any]:
    """`--set key=value` pairs into PolicyConfig overrides (validated by name and bounds)."""
    out: dict[str, Any] = {}
    for item in settings:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        out[key.strip()] = _coerce(key.strip(), value.strip(), what=f"--set {key.strip()}")
    _validate_policy_config(out)
    return out


def _validate_policy_config(settings: dict[str, Any]) -> None:
    try:
        PolicyConfig.model_validate(settings)
    except ValidationError as exc:
        raise ConfigError(describe_validation(exc, prefix="--set ")) from None


def _coerce(key: str, value: str, *, what: str) -> Any:
    if value.lower() == "none":
        return None
    if key.endswith("_bytes"):
        return parse_size(value, what=what)
    try:
        return int(value)
    except ValueError:
        pass
    try:
        number = float(value)
    except ValueError:
        return value
    if not math.isfinite(number):
        raise ConfigError(f"{what}: must be a finite number, got {value!r}")
    return number


def sweep_points(sweep: str | None, qps: str | None) -> tuple[str | None, list[Any]]:
    """The swept parameter and its values (qps given as a list sweeps qps)."""
    if sweep:
        key, sep, values = sweep.partition("=")
        key = key.strip()
        if not sep or key not in SWEEPABLE:
            raise ConfigError(f"--sweep expects one of {', '.join(SWEEPABLE)}=v1,v2,..., "
                              f"got {sweep!r}")
        if key == "qps":
            return key, parse_qps(values)
        return key, [_coerce(key, v, what=f"--sweep {key}") for v in values.split(",")
                     if v.strip()]
    rates = parse_qps(qps)
    if len(rates) > 1:
        return "qps", list(rates)
    return None, [None]


def bench_configs(base: dict[str, Any], sweep: str | None,
                  qps: str | None) -> tuple[str | None, list[tuple[Any, BenchConfig]]]:
    """The swept parameter and every point's validated config, before any of them runs."""
    speed = base.get("speed", 1.0)
    if isinstance(speed, float) and not math.isfinite(speed):
        raise ConfigError(f"--speed: must be a finite number, got {speed}")
    param, values = sweep_points(sweep, qps)
    rates = parse_qps(qps)
    if len(rates) > 1 and param != "qps":
        raise ConfigError("--qps: a list of rates is a sweep; give it or --sweep, not both")
    if sweep and param == "qps" and rates:
        raise ConfigError("--qps: the sweep sets the rate; give --qps or --sweep qps=..., not both")
    configs = []
    for value in values:
        fields = dict(base)
        fields["qps"] = rates[0] if len(rates) == 1 and param != "qps" else fields.get("qps")
        if param == "qps":
            fields["qps"] = value
        elif param is not None:
            fields["policy_config"] = {**fields["policy_config"], param: value}
            _validate_policy_config(fields["policy_config"])
        if param is not None:
            fields["out_dir"] = Path(fields["out_dir"]) / f"{param}-{value}"
        try:
            config = BenchConfig.model_validate(fields)
        except ValidationError as exc:
            raise ConfigError(describe_validation(exc, BENCH_FLAGS)) from None
        configs.append((value, config))
    return param, configs


def preflight(configs: list[tuple[Any, BenchConfig]]) -> None:
    """Refuse, before anything runs, what would fail or never finish part-way through a sweep:
    an unknown policy, a bad trace, a budget below the largest action, more than
    MAX_SUBMISSIONS workflows, a replay whose ideal length passes a week (where the simulator
    gives up), or a run directory that cannot be written.
    """
    for _, config in configs:
        for name in config.policies:
            try:
                parse_policy(name)
            except ConfigError as exc:
                raise ConfigError(f"--policies: {exc}") from None
    trace = load_trace(configs[0][1].trace)
    for _, config in configs:
        if config.qps is not None:
            count = config.num_workflows or max(round(config.qps * config.window_s), 1)
            if count > MAX_SUBMISSIONS:
                flag = "--workflows" if config.num_workflows else "--qps x --window"
                raise ConfigError(f"{flag}: {count} workflows exceed the limit of "
                                  f"{MAX_SUBMISSIONS}")
        submissions = schedule_of(config, trace)
        check_budget(submissions, config.budget_bytes)
        ideal_s = makespan_bound_s(submissions, config.speed)
        if ideal_s > MAX_SUBMIT_S:
            raise ConfigError(f"at --speed {config.speed:g} the replay needs at least "
                              f"{ideal_s:.0f} s, beyond a week ({MAX_SUBMIT_S:.0f} s); raise "
                              "--speed or --qps")
        require_writable_dir(config.out_dir, what="--out")
        if config.backend != "sim":  # the simulator keeps its state in a temporary directory
            require_writable_dir(config.state_dir, what="--state-dir")


def run_cli_bench(*, console: Console, base: dict[str, Any], sweep: str | None,
                  qps: str | None, json_path: Path | None) -> None:
    param, configs = bench_configs(base, sweep, qps)
    preflight(configs)
    if json_path is not None:
        require_writable_file(json_path, what="--json")
    points = []
    for value, config in configs:
        summary = _run_one(console, config)
        points.append({"value": value, **summary})
    if json_path is not None:
        result = points[0] if param is None else {"sweep": param, "points": points}
        write_text(json_path, json.dumps(result, indent=2) + "\n", what="--json")
        console.print(f"results: {json_path}")


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """SIGINT and SIGTERM both stop the bench the way Ctrl-C does (cleanup, partial results).

    A process started in the background by a non-interactive shell inherits SIGINT ignored,
    and Python then leaves it ignored, so `kill -INT` alone would do nothing; SIGTERM (what
    a service manager or `kill` sends) would skip cleanup. Both are sent to asyncio's SIGINT
    path.
    """
    def forward(signum: int, frame: object) -> None:
        del signum, frame
        os.kill(os.getpid(), signal.SIGINT)

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, forward)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run_one(console: Console, config: BenchConfig) -> dict[str, Any]:
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, transient=False)
    tasks: dict[str, Any] = {}
    failures: dict[str, int] = {}

    def started(name: str, total: int) -> None:
        tasks[name] = progress.add_task(f"{name:<24}", total=total)
        failures[name] = 0

    def done(name: str, record: WorkflowRecord) -> None:
        failures[name] += record.failed_attempts
        progress.update(tasks[name], advance=1,
                        description=f"{name:<24} failed attempts {failures[name]:>3}")

    console.print(f"[bold]replay[/bold] {config.trace} on {config.backend}, budget "
                  f"{config.budget_bytes / 2**30:.2f} GiB, speed {config.speed}x -> "
                  f"{config.out_dir}")
    start = time.monotonic()
    e2b_driver = None
    if config.via != "inproc":  # the service (FastAPI, the E2B SDK) only when asked for
        from tenon.service.replay_e2b import replay_via_e2b

        e2b_driver = replay_via_e2b
    with progress, interruptible():
        summary = asyncio.run(run_bench(config, on_policy_start=started, on_done=done,
                                        e2b_driver=e2b_driver))
    written = draw(config.out_dir)
    console.print(Markdown(table_markdown(summary)))
    delays = config.out_dir / "delays.md"
    if delays.exists():
        console.print(Markdown(delays.read_text()))
    console.print(f"{time.monotonic() - start:.0f} s; wrote " +
                  ", ".join(str(p) for p in written))
    return summary


def actuators_cmd(
    trials: Annotated[int, typer.Option(help="Trials per actuator and thread count.")] = 3,
    json_path: Annotated[Path | None, typer.Option(
        "--json", help="Also write the full result here.")] = None,
) -> None:
    """The cgroup freezer against the sched_ext gate on real sandbox cgroups: how fast a
    growing sandbox stops and resumes, how fast a held sandbox dies when killed, and the
    idle CPU cost of the loaded scheduler (needs root and cgroup v2; sched_ext for scx)."""
    from tenon.replay.actuator_bench import run, table

    console = make_console()
    if trials < 1:
        fail(ConfigError(f"--trials must be at least 1, got {trials}"))
    if json_path is not None:
        require_writable_file(json_path, what="--json")
    try:
        result = run(num_trials=trials)
    except (OSError, TimeoutError) as exc:
        fail(exc)
    console.print(Markdown(table(result)))
    if json_path is not None:
        write_text(json_path, json.dumps(result, indent=2) + "\n", what="--json")
        console.print(f"results: {json_path}")


def faults_cmd(
    trace: Annotated[Path, typer.Option(help="Trace to replay (tenon-trace JSONL).")],
    budget: Annotated[str, typer.Option(help="Memory budget of the workload domain.")] = "2GiB",
    kills: Annotated[int, typer.Option(help="SIGKILLs of the controller.")] = 20,
    seed: Annotated[int, typer.Option(help="Seeds kill delays and the phase order.")] = 1,
    speed: Annotated[float, typer.Option(help="Divides model waits and durations.")] = 10.0,
    workflows: Annotated[int, typer.Option(help="Workflows replayed.")] = 12,
    qps: Annotated[float, typer.Option(help="Submission rate of the burst.")] = 2.0,
    out: Annotated[Path | None, typer.Option(help="Campaign directory (fresh).")] = None,
    state_dir: Annotated[Path, typer.Option(help="Where the base images are.")] = Path(
        "/var/lib/tenon"),
    json_path: Annotated[Path | None, typer.Option(
        "--json", help="Also write the compact summary here.")] = None,
) -> None:
    """SIGKILL the controller at random points of a real replay (process backend), restart
    it each time, and check every workflow completes, no committed byte is lost and nothing
    is left on the host."""
    from tenon.replay.faults import FaultConfig, compact_summary, run_campaign

    console = make_console()
    try:
        out_dir = out or Path("bench/runs") / time.strftime("faults-%Y%m%d-%H%M%S")
        config = FaultConfig(trace=trace, budget_bytes=parse_size(budget, what="--budget"),
                             num_kills=kills, seed=seed, speed=speed,
                             num_workflows=workflows, qps=qps, out_dir=out_dir,
                             state_dir=state_dir)
        if json_path is not None:
            require_writable_file(json_path, what="--json")
        console.print(f"[bold]fault campaign[/bold]: {kills} SIGKILLs of the controller "
                      f"replaying {workflows} workflows of {trace} -> {out_dir}")
        summary = run_campaign(config)
    except ValidationError as exc:
        fail(exc, {"budget_bytes": "--budget", "num_kills": "--kills",
                   "num_workflows": "--workflows"})
    except ConfigError as exc:
        fail(exc)
    compact = compact_summary(summary)
    if json_path is not None:
        write_text(json_path, json.dumps(compact, indent=2) + "\n", what="--json")
    leftover = compact["leftover"]
    console.print(
        f"{compact['num_kills']} kills landed in " +
        ", ".join(f"{phase} {n}" for phase, n in compact["landed"].items()) +
        f"; workflows completed {compact['completed']}/{compact['workflows']}; committed "
        f"bytes lost {compact['committed_bytes_lost']} of {compact['committed_bytes_checked']} "
        f"checked; digest mismatches {compact['digest_mismatches']}; left: "
        f"{len(leftover['cgroups'])} cgroups, {leftover['containers']} containers, "
        f"{len(leftover['mounts'])} mounts, {len(leftover['processes'])} processes; "
        f"{compact['wall_s']} s")
    if not compact["passed"]:
        console.print("[red]the campaign failed a check[/red]")
        raise typer.Exit(1)


@contextlib.contextmanager
def bench_backend(name: str, state_dir: Path) -> Iterator[SandboxBackend]:
    """A real backend `name` over a workload domain of its own, for a lifecycle benchmark;
    TenonError when the host cannot run it. The domain goes afterwards."""
    import uuid

    from tenon.host.domain import WorkloadDomain
    from tenon.sandbox.registry import make_backend

    domain = WorkloadDomain.open(f"tenon-bench-{uuid.uuid4().hex[:8]}")
    backend = None
    try:
        backend = make_backend(name, domain, state_dir)
        if problems := backend.check():
            raise TenonError("; ".join(problems))
        yield backend
    finally:
        domain.remove()
        if backend is not None:
            backend.release_domain()


def capture_lifecycle(files: str, runs: int, out: Path | None, state_dir: Path,
                      backend_name: str = "process") -> None:
    """`tenon bench lifecycle --files N,N,...`: teardown and rebuild costs per tree size
    (`replay.capture_bench`), with a real sandbox of `backend_name` destroyed and rebuilt in
    each cycle ("none": the workspace's part alone); a table, and JSON written to `out`."""
    from tenon.replay.capture_bench import bench_capture, table

    try:
        sizes = [int(v) for v in files.split(",") if v.strip()]
    except ValueError:
        fail(ConfigError(f"--files: expected counts like 10,5000,50000, got {files!r}"))
    if not sizes or any(not 1 <= n <= 1_000_000 for n in sizes):
        fail(ConfigError(f"--files: counts must be 1 to 1000000, got {files!r}"))
    if runs < 1:
        fail(ConfigError(f"--runs: must be at least 1, got {runs}"))
    if out is not None:
        require_writable_file(out, what="--out")
    if backend_name == "none":
        result = bench_capture(sizes, runs, state_dir)
    else:
        try:
            with bench_backend(backend_name, state_dir) as backend:
                result = bench_capture(sizes, runs, state_dir, backend)
        except TenonError as exc:
            fail(exc)
    make_console().print(table(result))
    if out is not None:
        write_text(out, json.dumps(result, indent=2) + "\n", what="--out")
