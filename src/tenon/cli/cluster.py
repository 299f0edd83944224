"""`tenon cluster`: Tenon on a Ray cluster (bench, simulation, the E2B front door)."""

from __future__ import annotations

import asyncio
import json
import secrets
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from tenon.cli.errors import fail, require_writable_dir, write_text
from tenon.errors import TenonError
from tenon.units import parse_size

cluster_app = typer.Typer(no_args_is_help=True,
                          help="Tenon on a Ray cluster: one Tenon per node, one dispatcher.")

_NAMES = {"node_budget_bytes": "--node-budget", "num_nodes": "--nodes", "qps": "--qps",
          "window_s": "--window", "num_workflows": "--workflows", "trace": "--trace",
          "remove_node_at_s": "--remove-node-at", "out_dir": "--out"}


def _seconds(text: str | None, what: str) -> float | None:
    if text is None:
        return None
    from tenon.cli.bench import parse_seconds

    return parse_seconds(text, what=what)


@cluster_app.command("bench")
def bench_cmd(
    trace: Annotated[Path, typer.Option(help="Trace file (tenon-trace JSON lines).")],
    node_budget: Annotated[str, typer.Option(help="Each node's Tenon budget, e.g. 2GiB.")],
    out: Annotated[Path, typer.Option(help="Run directory (summary.json, events).")],
    nodes: Annotated[int, typer.Option(help="Tenon nodes (Ray nodes).")] = 4,
    placements: Annotated[str, typer.Option(
        help="Comma-separated: tenon, least-loaded, round-robin, ray-memory, single.")] = (
        "tenon,single,round-robin,ray-memory"),
    speed: Annotated[float, typer.Option(help="Divides model waits and durations.")] = 10.0,
    qps: Annotated[float, typer.Option(help="Submission rate during the window.")] = 16.0,
    window: Annotated[str, typer.Option(help="Submission window, e.g. 26s.")] = "10s",
    workflows: Annotated[int | None, typer.Option(help="Override the count.")] = None,
    retries: Annotated[int, typer.Option(help="Re-runs of a failed attempt.")] = 5,
    address: Annotated[str | None, typer.Option(
        help="An existing Ray cluster (default: start Ray's multi-node test cluster here).")
    ] = None,
    remove_node_at: Annotated[str | None, typer.Option(
        help="Remove the last node this long into each Tenon replay, e.g. 60s.")] = None,
    resident_only_every: Annotated[int | None, typer.Option(
        help="Every Nth workflow leaves a process running (its agent is resident-only).")
    ] = None,
    workspace_write: Annotated[str, typer.Option(
        help="Bytes each action writes into the workspace (checked at each workflow's end).")
    ] = "0",
    shared_dir: Annotated[Path | None, typer.Option(
        help="Where the nodes' state directories live; every node must reach it.")] = None,
    setting: Annotated[list[str] | None, typer.Option(
        "--set", help="Per-node policy parameter key=value (repeatable).")] = None,
) -> None:
    """Replay a trace through a Ray cluster of Tenon nodes, placement by placement."""
    from tenon.cli.bench import interruptible, parse_settings
    from tenon.cluster.bench import ClusterBenchConfig, run_cluster_bench

    try:
        require_writable_dir(out, what="--out")
        config = ClusterBenchConfig.model_validate(dict(
            trace=trace, num_nodes=nodes,
            node_budget_bytes=parse_size(node_budget, what="--node-budget"),
            placements=[p.strip() for p in placements.split(",") if p.strip()],
            speed=speed, qps=qps, window_s=_seconds(window, "--window"),
            num_workflows=workflows, max_retries=retries, out_dir=out, address=address,
            remove_node_at_s=_seconds(remove_node_at, "--remove-node-at"),
            resident_only_every=resident_only_every,
            workspace_write_bytes=parse_size(workspace_write, what="--workspace-write"),
            shared_dir=shared_dir, policy_config=parse_settings(setting or [])))
        with interruptible():
            summary = asyncio.run(run_cluster_bench(
                config, on_placement=lambda p: typer.echo(f"placement {p}...", err=True)))
    except (TenonError, ValidationError, ValueError) as exc:
        fail(exc, _NAMES)
    typer.echo(table(summary))


def table(summary: dict[str, object]) -> str:
    """The summary as a markdown table, one row per placement."""
    runs = summary["placements"]
    assert isinstance(runs, dict)
    lines = [f"{summary['workflows']} workflows, {summary['nodes']} nodes, "
             f"{summary['oversubscription']}x the cluster's budget",
             "", "| placement | makespan s | vs single | completed | OOM kills | failed "
             "attempts | moves | lost agents | safe |", "|---|---|---|---|---|---|---|---|---|"]
    for name, f in runs.items():
        d = f.get("dispatcher", {})
        lines.append(f"| {name} | {f['makespan_s']} | {f.get('vs_single')} | {f['completed']} "
                     f"| {f['oom_kills']} | {f['failed_attempts']} | {d.get('moves', '-')} | "
                     f"{d.get('agents_lost', '-')} | {f['safe']} |")
    return "\n".join(lines)


@cluster_app.command("sim")
def sim_cmd(
    trace: Annotated[Path, typer.Option(help="Trace file (tenon-trace JSON lines).")],
    out: Annotated[Path, typer.Option(help="JSON file for the points.")],
    hosts: Annotated[str, typer.Option(help="Comma-separated host counts.")] = "10,25,50,100",
    agents_per_host: Annotated[str, typer.Option(help="Comma-separated.")] = "50,200",
    node_budget: Annotated[str, typer.Option(help="Each simulated host's budget.")] = "2GiB",
    steps: Annotated[int, typer.Option(
        help="Each workflow cut to its first N steps (0: whole workflows).")] = 3,
    window: Annotated[str, typer.Option(help="Submission window.")] = "60s",
    single: Annotated[bool, typer.Option(
        help="After each point, the same workflows on one host with the whole budget.")
    ] = False,
    strategy: Annotated[str, typer.Option(
        help="Placement: p2c, least-loaded or round-robin.")] = "p2c",
) -> None:
    """The same dispatcher and per-node Tenon on simulated hosts: placement cost as hosts
    and agents grow."""
    from tenon.cluster.sim import simulate_cluster
    from tenon.policy.placement import PlacementConfig
    from tenon.replay.trace import load_trace

    try:
        placement = PlacementConfig.model_validate({"strategy": strategy})
        points = simulate_cluster(
            load_trace(trace), hosts=[int(h) for h in hosts.split(",")],
            agents_per_host=[int(a) for a in agents_per_host.split(",")],
            node_budget_bytes=parse_size(node_budget, what="--node-budget"), steps=steps,
            window_s=_seconds(window, "--window") or 60.0, single=single,
            placement=placement)
        write_text(out, json.dumps(points, indent=2) + "\n", what="--out")
    except (TenonError, ValidationError, ValueError) as exc:
        fail(exc)
    for p in points:
        typer.echo(f"{p['hosts']:>4} hosts x {p['agents_per_host']:>4} agents "
                   f"({p['node_budget_bytes'] >> 20} MiB each): makespan {p['makespan_s']} s, "
                   f"{p['oom_events']} OOM, {p['moves']} moves; decision p50 "
                   f"{p['decision_p50_us']} us p99 {p['decision_p99_us']} us, "
                   f"dispatcher CPU {p['dispatcher_cpu_s']} s of {p['process_cpu_s']} s, "
                   f"{p['completed']}/{p['workflows']} completed")


@cluster_app.command("serve")
def serve_cmd(
    node_budget: Annotated[str, typer.Option(help="Each node's Tenon budget.")],
    shared_dir: Annotated[Path, typer.Option(
        help="Where the nodes' state directories live; every node must reach it.")],
    nodes: Annotated[int, typer.Option(help="Tenon nodes (one per Ray node).")] = 0,
    address: Annotated[str | None, typer.Option(
        help="A Ray cluster to join (default: start Ray's multi-node test cluster here with "
             "--nodes nodes).")] = None,
    listen: Annotated[str, typer.Option(help="HOST:PORT of the front door.")] = (
        "127.0.0.1:49982"),
    image_dir: Annotated[Path, typer.Option(help="Where the base images are.")] = Path(
        "/var/lib/tenon"),
) -> None:
    """One Tenon per Ray node, each serving E2B's API, and one front door for all of them:
    clients point the e2b SDK at the front door only."""
    from tenon.cluster.serve import serve_cluster

    try:
        host, _, port = listen.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--listen: expected HOST:PORT, got {listen!r}")
        require_writable_dir(shared_dir, what="--shared-dir")
        key_file = shared_dir / "api-key"
        if not key_file.exists():
            key_file.write_text(f"e2b_{secrets.token_hex(20)}\n")
            key_file.chmod(0o600)
        asyncio.run(serve_cluster(
            node_budget_bytes=parse_size(node_budget, what="--node-budget"),
            num_nodes=nodes, address=address, shared_dir=shared_dir, image_dir=image_dir,
            host=host, port=int(port), api_key=key_file.read_text().strip(),
            ready=lambda url: typer.echo(f"tenon cluster serve: front door on {url}; "
                                         f"API key in {key_file}")))
    except (TenonError, ValidationError, ValueError) as exc:
        fail(exc)
