"""The `tenon` command line."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from tenon.errors import TenonError
from tenon.units import parse_size

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
image_app = typer.Typer(no_args_is_help=True, help="Build and inspect the base image.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks.")
app.add_typer(image_app, name="image")
app.add_typer(bench_app, name="bench")

console = Console()
DEFAULT_STATE_DIR = Path("/var/lib/tenon")
DEFAULT_IMAGE = "tenon-base:bookworm"

StateDir = Annotated[Path, typer.Option(help="Tenon's state directory.")]
Image = Annotated[str, typer.Option(help="Base image name.")]


def _fail(exc: Exception) -> None:
    console.print(f"[red]error:[/red] {exc}")
    raise typer.Exit(2)


@app.callback()
def _main(verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False) -> None:
    """Tenon: serve many LLM agents' sandboxes under one memory budget."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING)


@app.command()
def doctor(state_dir: StateDir = DEFAULT_STATE_DIR, image: Image = DEFAULT_IMAGE) -> None:
    """Print what this host supports and what is missing, with the command that fixes it."""
    from tenon.cli.doctor import run_checks

    table = Table("check", "status", "detail", "fix")
    checks = run_checks(state_dir, image)
    for check in checks:
        status = "[green]ok[/green]" if check.ok else "[red]missing[/red]"
        table.add_row(check.name, status, check.detail, check.fix)
    console.print(table)
    if not all(c.ok for c in checks):
        console.print("[yellow]some features are unavailable; see the fix column[/yellow]")


@image_app.command("build")
def image_build(
    state_dir: StateDir = DEFAULT_STATE_DIR,
    image: Image = DEFAULT_IMAGE,
    force: Annotated[bool, typer.Option(help="Rebuild even if present.")] = False,
) -> None:
    """Build the base image locally (mmdebstrap; nothing is pulled)."""
    from tenon.sandbox.image import build_image

    try:
        info = build_image(image, state_dir=state_dir, force=force)
    except TenonError as exc:
        _fail(exc)
    console.print(f"base image {image}: {info}")


@bench_app.command("lifecycle")
def bench_lifecycle_cmd(
    backend: Annotated[str, typer.Option(help="process or docker")] = "process",
    runs: Annotated[int, typer.Option(help="Repetitions (median reported).")] = 10,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results here.")] = None,
    state_dir: StateDir = DEFAULT_STATE_DIR,
    image: Image = DEFAULT_IMAGE,
) -> None:
    """Materialize -> exec `true` -> dematerialize (docker: against bare `docker run`/`rm`)."""
    from tenon.host.domain import WorkloadDomain
    from tenon.replay.lifecycle import bench_lifecycle
    from tenon.sandbox.registry import make_backend

    try:
        impl_domain = WorkloadDomain.open(f"tenon-bench-{uuid.uuid4().hex[:8]}")
    except TenonError as exc:
        _fail(exc)
    try:
        impl = make_backend(backend, impl_domain, state_dir)
        problems = impl.check()
        if problems:
            raise TenonError("; ".join(problems))
        result = asyncio.run(bench_lifecycle(impl, image=image, num_runs=runs))
        if backend == "docker":
            import docker

            from tenon.sandbox.docker import bare_docker_lifecycle

            bare = bare_docker_lifecycle(docker.from_env(), image, runs)
            result["bare_run_ms"] = round(bare["bare_run_ms"], 2)
            result["bare_rm_ms"] = round(bare["bare_rm_ms"], 2)
    except TenonError as exc:
        _fail(exc)
    finally:
        impl_domain.remove()
        if backend == "docker":
            from tenon.sandbox.docker import remove_parent_cgroups

            remove_parent_cgroups(impl_domain.name)
    if backend == "docker":
        ratio = result["materialize_ms"] / result["bare_run_ms"]
        console.print(f"materialize / bare docker run = {ratio:.3f} (target <= 1.25)")
    console.print_json(json.dumps(result))
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2) + "\n")


def _write_json(result: dict[str, object], json_path: Path | None) -> None:
    console.print_json(json.dumps(result))
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2) + "\n")


JsonOut = Annotated[Path | None, typer.Option("--json", help="Write results here.")]


@bench_app.command("gate")
def bench_gate_cmd(
    sandboxes: Annotated[int, typer.Option(help="Live sandboxes the gate decides for.")] = 1000,
    iterations: Annotated[int, typer.Option(help="Decisions timed.")] = 200,
    json_path: JsonOut = None,
) -> None:
    """Time one execution-gate decision (observe + decide) for N sandboxes."""
    from tenon.policy.bench import bench_gate

    try:
        result = bench_gate(sandboxes, iterations)
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
    from tenon.runtime.bench import bench_sampling

    try:
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
        asyncio.run(run_demo(backend=backend, budget_bytes=budget_bytes, num_agents=agents,
                             state_dir=state_dir, image=image, console=console))
    except TenonError as exc:
        _fail(exc)
