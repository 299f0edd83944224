"""The cluster bench: one trace replayed through a Ray cluster of Tenon nodes, placement
by placement, in one invocation.

    tenon cluster bench --trace T --nodes 4 --node-budget 2GiB --qps 16 --window 26s

Placements (`--placements`, run one after another on the same cluster and schedule):

- `tenon`: one Tenon per node, the dispatcher placing by power of two choices on committed
  plus predicted memory, moving torn-down agents off a node that stays saturated;
- `least-loaded`: the same, with a full scan instead of two choices;
- `round-robin`: one Tenon per node, agents dealt to nodes in turn;
- `ray-memory`: no Tenon placement: each workflow is a Ray task asking Ray for its profiled
  peak as `memory` (reservation by peak, Ray's own way), each node's `memory` resource its
  budget; the task runs its workflow on its node's Tenon, which executes eagerly inside the
  node's budget;
- `single`: one Tenon host with the whole cluster's budget (the yardstick).

Without `--address` the bench starts Ray's own multi-node test cluster
(`ray.cluster_utils.Cluster`) on this machine: `--nodes` Ray nodes, each with its own Tenon
domain and budget. `--remove-node-at` removes the last node that many seconds into each
Tenon placement's replay: its agents continue on other nodes, or fail with the reason.
Each node's state directory (its agents' workspaces) lies under `--shared-dir`, reachable
from every node: the same disk here, a shared filesystem on a real cluster.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import ray
from pydantic import BaseModel, ConfigDict, Field

from tenon.clock import SystemClock
from tenon.cluster.dispatcher import Dispatcher
from tenon.cluster.node import NodeSpec
from tenon.cluster.ray_nodes import RayNode, alive_node_ids, start_nodes
from tenon.cluster.reserve import run_reserved
from tenon.errors import ConfigError
from tenon.host.procs import is_alive
from tenon.policy.config import PolicyConfig
from tenon.policy.placement import PlacementConfig
from tenon.predict.online import OnlinePredictor
from tenon.replay.bench import check_budget, profiled_static_predictor, summarize, write_summary
from tenon.replay.cpu import CpuMark, cpu_spent
from tenon.replay.driver import WorkflowRecord, replay
from tenon.replay.loadprog import SCRATCH_DIR
from tenon.replay.schedule import (
    Submission,
    make_schedule,
    makespan_bound_s,
    memory_bound_s,
    oversubscription,
)
from tenon.replay.trace import Trace, load_trace

logger = logging.getLogger(__name__)

PLACEMENTS = ("tenon", "least-loaded", "round-robin", "ray-memory", "single")
_STRATEGY = {"tenon": "p2c", "least-loaded": "least-loaded", "round-robin": "round-robin",
             "single": "p2c"}
# A background process left running: the boundary after it is resident-only.
RESIDENT_ONLY_SUFFIX = "; rc=$?; (sleep 86400 </dev/null >/dev/null 2>&1 &); exit $rc"
# The same, started before the command (a command may end with its own `exit`).
RESIDENT_ONLY_PREFIX = "(sleep 86400 </dev/null >/dev/null 2>&1 &); "


class ClusterBenchConfig(BaseModel):
    """One cluster bench invocation; unknown fields are rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    trace: Path
    num_nodes: int = Field(default=4, ge=1, le=64, description="Tenon nodes (Ray nodes).")
    node_budget_bytes: int = Field(gt=0, description="Each node's Tenon budget.")
    placements: list[Literal["tenon", "least-loaded", "round-robin", "ray-memory",
                             "single"]] = Field(min_length=1)
    speed: float = Field(default=10.0, gt=0)
    qps: float | None = Field(default=16.0, gt=0)
    window_s: float = Field(default=10.0, gt=0)
    num_workflows: int | None = Field(default=None, gt=0)
    max_retries: int = Field(default=5, ge=0)
    policy_config: dict[str, Any] = Field(default_factory=dict)
    placement_config: dict[str, Any] = Field(default_factory=dict)
    out_dir: Path
    shared_dir: Path | None = Field(
        default=None, description="Where the nodes' state directories live (default: "
        "<out>/nodes); every node must reach it.")
    image_dir: Path = Path("/var/lib/tenon")
    address: str | None = Field(default=None, description="An existing Ray cluster; None "
                                "starts a local multi-node test cluster.")
    remove_node_at_s: float | None = Field(default=None, gt=0)
    resident_only_every: int | None = Field(
        default=None, ge=1, description="Every Nth workflow leaves a process running after "
        "its first action, so its agent stays resident-only.")
    workspace_write_bytes: int = Field(
        default=0, ge=0, description="Each action also writes this many bytes into the "
        "workspace, and each workflow ends by checking they are all there.")
    gate_actuator: Literal["auto", "scx", "freezer"] = "auto"


def schedule(config: ClusterBenchConfig, trace: Trace) -> list[Submission]:
    subs = make_schedule(trace.workflows, qps=config.qps, window_s=config.window_s,
                         speed=config.speed, num_workflows=config.num_workflows)
    check_budget(subs, config.node_budget_bytes)
    return subs


@contextmanager
def local_cluster(num_nodes: int, node_budget_bytes: int, temp_dir: Path) -> Iterator[Any]:
    """Ray's multi-node test cluster on this machine: `num_nodes` nodes, each declaring
    `node_budget_bytes` of Ray `memory` (what the ray-memory placement reserves against)."""
    from ray.cluster_utils import Cluster

    temp_dir.mkdir(parents=True, exist_ok=True)
    # Ray's test cluster writes its address file under the default temp dir (/tmp/ray), which
    # need not exist: point that default into `temp_dir` too, so the cluster leaves nothing behind.
    (temp_dir / "ray").mkdir(exist_ok=True)
    saved_tmpdir = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = str(temp_dir)
    args: dict[str, Any] = {"num_cpus": 2, "memory": node_budget_bytes, "include_dashboard": False,
            "object_store_memory": 100 * 1024 * 1024}
    cluster = Cluster(initialize_head=True, head_node_args={**args, "temp_dir": str(temp_dir)})
    try:
        for _ in range(num_nodes - 1):
            cluster.add_node(**args)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="tenon", log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()  # type: ignore[no-untyped-call]
        if saved_tmpdir is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = saved_tmpdir
        shutil.rmtree(temp_dir, ignore_errors=True)


def node_specs(config: ClusterBenchConfig, placement: str, shared: Path,
               trace: Trace) -> list[NodeSpec]:
    """The Tenon nodes of one placement run, each with its own predictor and state dir."""
    policy_config = PolicyConfig.model_validate(config.policy_config)
    static = profiled_static_predictor(trace, policy_config)
    count, budget = config.num_nodes, config.node_budget_bytes
    if placement == "single":
        count, budget = 1, config.num_nodes * config.node_budget_bytes
    policy = "eager" if placement == "ray-memory" else "tenon"
    return [NodeSpec(
        name=f"n{i}", budget_bytes=budget, node_dir=shared / placement / f"n{i}",
        image_dir=config.image_dir, policy=policy, policy_config=config.policy_config,
        backend_config={"disposable": [SCRATCH_DIR]},
        predictor=OnlinePredictor(copy.deepcopy(static),
                                  heavy_peak_bytes=policy_config.heavy_peak_bytes),
        gate_actuator=config.gate_actuator) for i in range(count)]


def decorator(config: ClusterBenchConfig, subs: Sequence[Submission]
              ) -> Callable[[Submission, int, str], str] | None:
    """Every `resident_only_every`-th submission (from the first) leaves a process running
    after its first action."""
    every = config.resident_only_every
    if every is None:
        return None
    chosen = {sub.instance for i, sub in enumerate(subs) if i % every == 0}

    def decorate(sub: Submission, number: int, command: str) -> str:
        if number == 1 and sub.instance in chosen:
            return RESIDENT_ONLY_PREFIX + command
        return command
    return decorate


async def run_placement(config: ClusterBenchConfig, placement: str, trace: Trace,
                        subs: Sequence[Submission], cluster: Any) -> dict[str, Any]:
    """One placement's replay on fresh Tenon nodes; its figures."""
    shared = config.shared_dir or config.out_dir / "nodes"
    shutil.rmtree(shared / placement, ignore_errors=True)
    specs = node_specs(config, placement, shared, trace)
    nodes = await start_nodes(specs, _node_order(cluster))
    run_dir = config.out_dir / placement
    run_dir.mkdir(parents=True, exist_ok=True)
    before, started = CpuMark.now(), time.monotonic()
    removal: asyncio.Task[dict[str, Any]] | None = None
    extra: dict[str, Any] = {}
    try:
        if placement == "ray-memory":
            records = await run_reserved(subs, nodes, speed=config.speed,
                                         max_retries=config.max_retries)
        else:
            placement_config = PlacementConfig.model_validate(
                {**config.placement_config, "strategy": _STRATEGY[placement]})
            dispatcher = Dispatcher(nodes, placement_config, clock=SystemClock(),
                                    event_log=run_dir / "dispatcher.jsonl")
            if config.remove_node_at_s is not None and cluster is not None and len(nodes) > 1:
                removal = asyncio.ensure_future(
                    _remove_node_later(cluster, nodes[-1], config.remove_node_at_s))
            async with dispatcher:
                records = await replay(
                    dispatcher, subs, speed=config.speed, max_retries=config.max_retries,
                    workspace_write_bytes=config.workspace_write_bytes,
                    check_workspace=config.workspace_write_bytes > 0,
                    decorate=decorator(config, subs))
            extra["dispatcher"] = dispatcher.stats.summary()
        if removal is not None:
            extra["removed"] = await removal
    finally:
        if removal is not None and not removal.done():
            removal.cancel()
        figures = [await node.stop() for node in nodes]
    cpu = cpu_spent(before, CpuMark.now(), sum(f["cpu_s"] for f in figures if f))
    summary = summarize(records, sum(f["peak_memory_bytes"] for f in figures if f))
    summary["oom_kills"] = sum(f["oom_kills"] for f in figures if f)
    summary["wall_s"] = round(time.monotonic() - started, 2)
    return {**summary, "cpu": cpu, "nodes": [f for f in figures if f],
            "errors": _errors(records), **extra}


def _node_order(cluster: Any) -> list[str]:
    """Live Ray node ids, the local cluster's head first: the driver is connected to the
    head, so the node a replay removes (the last) is never it."""
    ids = alive_node_ids()
    if cluster is None:
        return ids
    head = cluster.head_node.node_id
    return [head, *(i for i in ids if i != head)]


def _errors(records: Sequence[WorkflowRecord]) -> dict[str, int]:
    """Distinct failure reasons (their first 160 characters) and how often each came."""
    counts: dict[str, int] = {}
    for record in records:
        for error in record.errors:
            counts[error[:160]] = counts.get(error[:160], 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1])[:20])


async def _remove_node_later(cluster: Any, node: RayNode, at_s: float) -> dict[str, Any]:
    """Remove `node`'s Ray node from the local cluster `at_s` seconds from now."""
    await asyncio.sleep(at_s)
    target = next(n for n in cluster.list_all_nodes() if n.node_id == node.node_id)
    await asyncio.to_thread(cluster.remove_node, target, False)
    # The node's actor answers until it notices its raylet is gone: wait for its process.
    waited = 0.0
    while waited < 30.0 and is_alive(node.pid):
        await asyncio.sleep(0.1)
        waited += 0.1
    logger.warning("removed Ray node %s (Tenon node %s)", node.node_id[:8], node.name)
    return {"node": node.name, "at_s": at_s, "actor_exited_after_s": round(waited, 1)}


async def run_cluster_bench(config: ClusterBenchConfig, *,
                            on_placement: Callable[[str], None] | None = None
                            ) -> dict[str, Any]:
    """Every placement, one after another; the summary (also in `out_dir/summary.json`)."""
    trace = load_trace(config.trace)
    subs = schedule(config, trace)
    total = config.num_nodes * config.node_budget_bytes
    summary: dict[str, Any] = {
        "nodes": config.num_nodes, "node_budget_bytes": config.node_budget_bytes,
        "budget_bytes": total, "workflows": len(subs),
        "oversubscription": round(oversubscription(subs, total), 3),
        "makespan_bound_s": round(makespan_bound_s(subs, config.speed), 3),
        "memory_bound_s": round(memory_bound_s(subs, config.speed, total), 3),
        "placements": {}, "meta": config.model_dump(mode="json")}
    write_summary(config.out_dir, summary)
    temp = Path("/tmp") / f"tenon-ray-{int(time.time())}"
    if config.address is not None:
        ray.init(address=config.address, namespace="tenon", log_to_driver=False)
    cluster_cm = local_cluster(config.num_nodes, config.node_budget_bytes, temp) \
        if config.address is None else _nothing()
    with cluster_cm as cluster:
        if len(alive_node_ids()) < config.num_nodes:
            raise ConfigError(f"the Ray cluster has {len(alive_node_ids())} live nodes, "
                              f"--nodes asks for {config.num_nodes}")
        for placement in config.placements:
            if on_placement is not None:
                on_placement(placement)
            result = await run_placement(config, placement, trace, subs, cluster)
            summary["placements"][placement] = result
            _judge(summary)
            write_summary(config.out_dir, summary)
    return summary


@contextmanager
def _nothing() -> Iterator[None]:
    try:
        yield None
    finally:
        ray.shutdown()


def _judge(summary: dict[str, Any]) -> None:
    """Each placement's makespan against the single host's (`vs_single`) and whether it was
    safe (every workflow completed, no OOM kill)."""
    runs = summary["placements"]
    single = runs.get("single", {}).get("makespan_s")
    for figures in runs.values():
        figures["safe"] = (figures["completed"] == summary["workflows"]
                           and figures["oom_events"] == 0 and figures["oom_kills"] == 0)
        figures["vs_single"] = (round(figures["makespan_s"] / single, 3)
                                if single else None)
