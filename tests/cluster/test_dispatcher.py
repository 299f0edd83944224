"""The dispatcher over simulated nodes (a `TenonNode` over a simulated runtime per node, all
on one fake clock): spreading, refusals, waiting for room, a replay, moves off a saturated
node, and the simulated cluster bench at a tiny size."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tenon.clock import FakeClock, run_simulated
from tenon.cluster.dispatcher import Dispatcher
from tenon.cluster.node import TenonNode
from tenon.cluster.sim import _opener, simulate_cluster
from tenon.errors import ClusterFull, NodeLost
from tenon.policy.config import PolicyConfig
from tenon.policy.placement import NodeLoad, PlacementConfig
from tenon.replay.driver import replay
from tenon.replay.schedule import make_schedule
from tenon.replay.trace import Action, Memory, Step, Trace, Workflow, make_header
from tenon.sandbox.sim import sim_load_command

MIB = 1 << 20
GIB = 1 << 30
IMAGE = "tenon-base:bookworm"


def simulate(tmp_path: Path, main: Callable[[FakeClock, Path], Awaitable[Any]]) -> Any:
    clock = FakeClock()
    return asyncio.run(run_simulated(main(clock, tmp_path), clock, max_time_s=86_400))


@contextlib.asynccontextmanager
async def sim_nodes(clock: FakeClock, tmp: Path, count: int, budget: int = GIB
                    ) -> AsyncIterator[list[tuple[TenonNode, TenonNode]]]:
    async with contextlib.AsyncExitStack() as stack:
        nodes = []
        for i in range(count):
            name = f"s{i}"
            node = TenonNode(name, _opener(clock, budget, tmp / name, None,  # type: ignore[arg-type]
                                           PolicyConfig()), tmp / name)
            await node.start()
            stack.push_async_callback(node.stop)
            nodes.append((node, node))
        yield nodes


def load(avg_mib: int, peak_mib: int, duration_s: float) -> str:
    return sim_load_command(avg_mib * MIB, peak_mib * MIB, duration_s, 4 * MIB)


class Gated:
    """A node that reports no room while `closed` (placement goes elsewhere)."""

    def __init__(self, node: TenonNode) -> None:
        self._node = node
        self.closed = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._node, name)

    @property
    def name(self) -> str:
        return self._node.name

    async def load(self) -> NodeLoad:
        load = await self._node.load()
        return replace(load, max_live_agents=0) if self.closed else load


class LostNode:
    """A node whose every call finds it gone."""

    name = "gone"
    node_dir = Path("/nonexistent")
    host = "elsewhere"

    def __getattr__(self, name: str) -> Any:
        async def lost(*args: Any, **kwargs: Any) -> Any:
            raise NodeLost("node gone: its actor died")
        return lost


def test_agents_spread_over_the_nodes_and_run_there(tmp_path: Path) -> None:
    async def main(clock: FakeClock, tmp: Path) -> None:
        async with sim_nodes(clock, tmp, 3) as nodes, Dispatcher(
                [h for _, h in nodes], clock=clock, simulated=True, seed=7) as dispatcher:
            agents = [await dispatcher.create_agent(image=IMAGE) for _ in range(12)]
            counts = dispatcher.stats.per_node
            assert sorted(counts) == ["s0", "s1", "s2"]
            assert sum(counts.values()) == 12
            assert max(counts.values()) - min(counts.values()) <= 2, counts
            for node, _ in nodes:
                on_node = {a.id for a in agents if a.node == node.name}
                assert set(node.runtime.agents) == on_node
                assert len(on_node) == counts[node.name]
            results = await asyncio.gather(*(a.run(load(20, 40, 1.0), timeout=60)
                                             for a in agents))
            assert all(r.ok for r in results)
            assert {a.num_actions_done for a in agents} == {1}
            for agent in agents:
                await agent.close()
            assert all(not node.runtime.agents or all(
                s.closed for s in node.runtime.agents.values()) for node, _ in nodes)
    simulate(tmp_path, main)


def test_no_room_anywhere_is_cluster_full_naming_each_node(tmp_path: Path) -> None:
    async def main(clock: FakeClock, tmp: Path) -> None:
        async with sim_nodes(clock, tmp, 2) as nodes:
            config = PlacementConfig(retry_after_s=3.0)
            handles = [h for _, h in nodes] + [LostNode()]
            async with Dispatcher(handles, config, clock=clock, simulated=True) as dispatcher:
                assert sorted(dispatcher.alive()) == ["s0", "s1"]
                with pytest.raises(ClusterFull) as caught:
                    dispatcher.place(2 * GIB)
                message = str(caught.value)
                assert caught.value.retry_after_s == 3.0
                assert "s0: predicted peak 2048 MiB exceeds its budget 1024 MiB" in message
                assert "s1: predicted peak 2048 MiB exceeds its budget 1024 MiB" in message
                assert "gone: node lost" in message
                assert message.endswith("retry in 3 s")
                with pytest.raises(ClusterFull):
                    await dispatcher.create_agent(image=IMAGE, profile_peak_bytes=2 * GIB,
                                                  wait=False)
                assert dispatcher.stats.refusals == 2
                assert dispatcher.stats.placements == 0
                assert dispatcher.stats.nodes_lost == 1
    simulate(tmp_path, main)


def test_create_agent_waits_for_room_then_places(tmp_path: Path) -> None:
    async def main(clock: FakeClock, tmp: Path) -> None:
        async with sim_nodes(clock, tmp, 1) as nodes:
            config = PlacementConfig(max_load_ratio=0.8, retry_after_s=1.0)
            async with Dispatcher([h for _, h in nodes], config, clock=clock,
                                  simulated=True) as dispatcher:
                first = await dispatcher.create_agent(image=IMAGE,
                                                      profile_peak_bytes=600 * MIB)
                done_at: list[float] = []

                async def long_action() -> Any:
                    result = await first.run(load(500, 600, 30.0), timeout=600,
                                             action_class="test_runner")
                    done_at.append(clock.now())
                    return result

                running = asyncio.ensure_future(long_action())
                await clock.sleep(1.0)  # a reading with the action's charge
                assert dispatcher.loads["s0"].committed_bytes >= 250 * MIB
                with pytest.raises(ClusterFull, match="above 0.8x"):
                    dispatcher.place(600 * MIB)
                second = await dispatcher.create_agent(image=IMAGE,
                                                       profile_peak_bytes=600 * MIB)
                placed_at = clock.now()
                assert (await running).ok
                assert done_at
                assert placed_at >= done_at[0]
                assert dispatcher.stats.refusals >= 5
                assert second.node == "s0"
                assert (await second.run(load(10, 20, 1.0), timeout=60)).ok
    simulate(tmp_path, main)


def workflow(wid: str, steps: int = 3, peak_mib: int = 300) -> Workflow:
    memory = Memory(avg_bytes=peak_mib * MIB * 2 // 3, peak_bytes=peak_mib * MIB,
                    resident_after_bytes=16 * MIB)
    action = Action(command="pytest -x", tool="Bash", action_class="test_runner",
                    duration_s=2.0, memory=memory)
    return Workflow(id=wid, submit_s=0.0, base_image=IMAGE, family="demo",
                    steps=[Step(model_wait_s=1.0, action=action)] * steps)


def test_a_replay_through_the_dispatcher_completes_every_workflow(tmp_path: Path) -> None:
    subs = make_schedule([workflow(f"w{i}") for i in range(4)], qps=4.0, window_s=4.0,
                         speed=5.0)

    async def main(clock: FakeClock, tmp: Path) -> Any:
        async with sim_nodes(clock, tmp, 3) as nodes:
            async with Dispatcher([h for _, h in nodes], clock=clock, simulated=True
                                  ) as dispatcher:
                records = await replay(dispatcher, subs, speed=5.0, max_retries=2)
            return records, dispatcher.stats

    records, stats = simulate(tmp_path, main)
    assert len(records) == len(subs) == 16
    assert all(r.completed for r in records), [r.errors for r in records]
    assert sum(r.oom_events for r in records) == 0
    assert stats.placements == 16
    assert sorted(stats.per_node) == ["s0", "s1", "s2"]


def test_torn_down_agents_move_off_a_saturated_node_and_keep_running(tmp_path: Path) -> None:
    async def main(clock: FakeClock, tmp: Path) -> None:
        async with sim_nodes(clock, tmp, 2) as nodes:
            (hot, hot_handle), (cool, cool_handle) = nodes
            gate = Gated(cool_handle)
            config = PlacementConfig(move_above_ratio=1.5, move_gain=0.5, refresh_s=0.25)
            async with Dispatcher([hot_handle, gate], config, clock=clock,  # type: ignore[list-item]
                                  simulated=True) as dispatcher:
                agents = [await dispatcher.create_agent(image=IMAGE) for _ in range(6)]
                assert {a.node for a in agents} == {"s0"}
                idle = agents[-1]
                assert (await idle.run(load(10, 20, 0.5), timeout=60)).ok
                busy = [asyncio.ensure_future(a.run(load(300, 400, 20.0), timeout=600,
                                                    action_class="test_runner"))
                        for a in agents[:-1]]
                gate.closed = False
                await clock.sleep(1.0)
                assert dispatcher.loads["s0"].ratio() >= 1.5, dispatcher.loads["s0"]
                assert dispatcher.loads["s1"].live_agents == 0

                # resident (not torn down): it stays, its node's policy did not tear it down
                assert (await idle.run(load(10, 20, 0.5), timeout=60)).ok
                assert idle.node == "s0"
                assert dispatcher.stats.moves == 0
                assert await hot.runtime.teardown_now(idle.id) is None
                moved = await idle.run(load(10, 20, 0.5), timeout=60)
                assert moved.ok
                assert idle.node == "s1"
                assert dispatcher.stats.moves >= 1
                assert idle.id in cool.runtime.agents
                assert idle.id not in hot.runtime.agents
                assert idle.num_actions_done == 3
                assert cool.runtime.boundary.tally.num_rebuilds >= 1
                results = await asyncio.gather(*busy)
                assert all(r.ok for r in results), [r.output for r in results]
                # every agent keeps running wherever it is now
                again = await asyncio.gather(*(a.run(load(10, 20, 0.5), timeout=600)
                                               for a in agents))
                assert all(r.ok for r in again)
                for agent in agents:
                    await agent.close()
    simulate(tmp_path, main)


def test_the_simulated_cluster_returns_sane_figures_at_a_tiny_size() -> None:
    trace = Trace(header=make_header("test"), workflows=[workflow(f"w{i}") for i in range(3)])
    points = simulate_cluster(trace, hosts=[2, 1], agents_per_host=[3], node_budget_bytes=GIB,
                              steps=2, speed=10.0, window_s=5.0)
    assert [(p["hosts"], p["workflows"]) for p in points] == [(1, 3), (2, 6)]
    for point in points:
        assert point["completed"] == point["workflows"]
        assert point["oom_events"] == 0
        assert point["placements"] == point["workflows"]
        assert point["makespan_s"] > 0
        assert point["decision_p50_us"] > 0
        assert point["decision_p99_us"] >= point["decision_p50_us"]
        # a share of the process's CPU; at this size it can round to 0 on a busy host
        assert 0 <= point["dispatcher_share"] < 1
        assert set(point["decision_us_by_strategy"]) == {"p2c", "least-loaded"}
