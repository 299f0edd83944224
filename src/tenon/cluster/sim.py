"""The cluster at a scale one machine cannot hold, simulated: the same dispatcher and the
same per-node Tenon (policy, admission, gate, residency) on simulated hosts, all on one
fake clock in one process.

    tenon cluster sim --trace T --hosts 10,100 --agents-per-host 50,200

Each point replays `hosts * agents_per_host` workflows of the trace (each cut to its first
`steps` steps, so the largest point stays minutes long), submitted over `window_s`, through
a dispatcher over `hosts` simulated nodes of `node_budget_bytes` each. What it measures is
the dispatcher's cost as hosts and agents grow: the wall time of each placement decision
(p50, p99), the dispatcher's CPU (its decisions and its view's upkeep, on this thread)
against the whole process's (mostly the simulated nodes), and, for the same views, what a
full scan (`least-loaded`) would cost per decision instead of two choices.
"""

from __future__ import annotations

import contextlib
import copy
import random
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from tenon.clock import FakeClock, run_simulated
from tenon.cluster.dispatcher import Dispatcher
from tenon.cluster.node import TenonNode
from tenon.policy.config import PolicyConfig
from tenon.policy.placement import NodeLoad, PlacementConfig, choose_node
from tenon.predict.base import Predictor
from tenon.predict.online import OnlinePredictor
from tenon.replay.bench import profiled_static_predictor
from tenon.replay.driver import replay
from tenon.replay.schedule import make_schedule
from tenon.replay.trace import Trace, Workflow
from tenon.runtime.controller import Runtime
from tenon.runtime.residency import run_inline
from tenon.sandbox.sim import SimBackend, SimDomain


def cut(workflows: Sequence[Workflow], steps: int) -> list[Workflow]:
    """Each workflow cut to its first `steps` steps (0: whole)."""
    if steps <= 0:
        return list(workflows)
    return [w.model_copy(update={"steps": w.steps[:steps]}) for w in workflows]


def _opener(clock: FakeClock, budget_bytes: int, state: Path, predictor: Predictor,
            config: PolicyConfig) -> Any:
    @contextlib.asynccontextmanager
    async def open_sim() -> AsyncIterator[Runtime]:
        domain = SimDomain(budget_bytes)
        rt = Runtime(domain=domain, backend=SimBackend(domain, clock), state_dir=state,
                     clock=clock, blocking=run_inline, event_log=Path("/dev/null"),
                     policy="tenon", config=config, predictor=predictor)
        async with rt:
            yield rt
    return open_sim


def scan_cost_us(loads: Sequence[NodeLoad], peak_bytes: int, *,
                 repeats: int = 2000) -> dict[str, float]:
    """Median wall time of one decision over `loads`, by two choices and by a full scan."""
    out = {}
    for strategy in ("p2c", "least-loaded"):
        config = PlacementConfig.model_validate({"strategy": strategy})
        rng = random.Random(0)
        times = []
        for _ in range(repeats):
            start = time.perf_counter_ns()
            choose_node(loads, peak_bytes, config, rng=rng)
            times.append(time.perf_counter_ns() - start)
        out[strategy] = round(statistics.median(times) / 1000, 2)
    return out


async def _point(trace: Trace, *, hosts: int, agents_per_host: int, node_budget_bytes: int,
                 steps: int, speed: float, window_s: float, seed: int,
                 clock: FakeClock, tmp: Path,
                 placement: PlacementConfig | None = None) -> dict[str, Any]:
    config = PolicyConfig()
    static = profiled_static_predictor(trace, config)
    workflows = cut(trace.workflows, steps)
    num = hosts * agents_per_host
    subs = make_schedule(workflows, qps=num / window_s, window_s=window_s, speed=speed,
                         num_workflows=num)
    async with contextlib.AsyncExitStack() as stack:
        nodes = []
        for i in range(hosts):
            predictor = OnlinePredictor(copy.deepcopy(static),
                                        heavy_peak_bytes=config.heavy_peak_bytes)
            node = TenonNode(f"h{i:03d}", _opener(clock, node_budget_bytes, tmp / f"h{i:03d}",
                                                  predictor, config), tmp / f"h{i:03d}")
            await node.start()
            stack.push_async_callback(node.stop)
            nodes.append(node)
        dispatcher = Dispatcher(nodes, placement or PlacementConfig(), clock=clock,
                                simulated=True,
                                seed=seed)
        cpu0, wall0, sim0 = time.process_time(), time.perf_counter(), clock.now()
        async with dispatcher:
            records = await replay(dispatcher, subs, speed=speed, max_retries=5)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        loads = list(dispatcher.loads.values())
    stats = dispatcher.stats.summary()
    return {
        "hosts": hosts, "agents_per_host": agents_per_host, "workflows": num,
        "completed": sum(r.completed for r in records),
        "oom_events": sum(r.oom_events for r in records),
        "makespan_s": round(clock.now() - sim0, 2),
        "placements": stats["placements"], "refusals": stats["refusals"],
        "moves": stats["moves"],
        "decision_p50_us": stats["decision_p50_us"], "decision_p99_us": stats["decision_p99_us"],
        "dispatcher_cpu_s": stats["dispatcher_cpu_s"],
        "dispatcher_cpu_per_placement_us": round(
            stats["dispatcher_cpu_s"] / max(stats["placements"], 1) * 1e6, 2),
        "process_cpu_s": round(cpu, 2), "wall_s": round(wall, 2),
        "dispatcher_share": round(stats["dispatcher_cpu_s"] / cpu, 5) if cpu > 0 else None,
        "decision_us_by_strategy": scan_cost_us(loads, 256 << 20),
    }


def simulate_cluster(trace: Trace, *, hosts: Sequence[int], agents_per_host: Sequence[int],
                     node_budget_bytes: int, steps: int = 3, speed: float = 10.0,
                     window_s: float = 60.0, seed: int = 0,
                     placement: PlacementConfig | None = None,
                     single: bool = False) -> list[dict[str, Any]]:
    """Every (hosts, agents per host) point, smallest first; one dict of figures each.
    With `single`, each point is followed by the same workflows on one host with the whole
    cluster's budget (`single: true` in its figures)."""
    import asyncio

    points = []
    grid = [(h, a, node_budget_bytes, False) for h in sorted(hosts)
            for a in sorted(agents_per_host)]
    if single:
        grid = [p for h, a, b, _ in grid
                for p in ((h, a, b, False), (1, h * a, h * b, True))]
    for num_hosts, per_host, budget, alone in grid:
        clock = FakeClock()
        with tempfile.TemporaryDirectory(prefix="tenon-cluster-sim-") as tmp:
            point = asyncio.run(run_simulated(
                _point(trace, hosts=num_hosts, agents_per_host=per_host,
                       node_budget_bytes=budget, steps=steps, speed=speed,
                       window_s=window_s, seed=seed, clock=clock, tmp=Path(tmp),
                       placement=placement),
                clock, max_time_s=7 * 86_400))
        points.append({**point, "single": alone, "node_budget_bytes": budget})
    return points
