"""Tenon on a real Ray cluster (Ray's multi-node test cluster on this machine, process
sandboxes): node actors pinned to their Ray nodes, a replay through the dispatcher, a node
removed under its agents, and E2B sandboxes through one front door over serving nodes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from tenon.clock import SystemClock
from tenon.cluster.bench import RESIDENT_ONLY_SUFFIX, _node_order, local_cluster
from tenon.cluster.dispatcher import Dispatcher
from tenon.cluster.node import NodeSpec
from tenon.cluster.ray_nodes import RayNode, alive_node_ids, start_nodes
from tenon.errors import AgentLost
from tenon.host import diskfs
from tenon.host.leftovers import domain_cgroups, mounts_under
from tenon.policy.placement import NodeLoad, PlacementConfig
from tenon.replay.driver import replay
from tenon.replay.schedule import make_schedule
from tenon.replay.trace import Action, Memory, Reproduce, Step, Workflow
from tenon.sandbox import launcher

pytestmark = [pytest.mark.ray, pytest.mark.sandbox, pytest.mark.cgroups, pytest.mark.disk,
              pytest.mark.slow]

STATE_DIR = Path("/var/lib/tenon")
GIB = 1 << 30
MIB = 1 << 20


@dataclass
class RayCluster:
    cluster: Any
    base: Path
    temp: Path

    def order(self) -> list[str]:
        return _node_order(self.cluster)

    def specs(self, prefix: str, count: int = 3, **kw: Any) -> list[NodeSpec]:
        return [NodeSpec(name=f"{prefix}{i}", budget_bytes=GIB,
                         node_dir=self.base / prefix / f"{prefix}{i}", image_dir=STATE_DIR,
                         **kw) for i in range(count)]


def _need_real() -> None:
    if os.geteuid() != 0:
        pytest.skip("real sandboxes need root")
    if problems := launcher.check():
        pytest.skip(problems[0])
    if not (STATE_DIR / "images").exists():
        pytest.skip("needs the base image (tenon image build)")
    if problems := diskfs.check():
        pytest.skip("; ".join(problems))


def _ray_processes_under(temp: Path) -> list[str]:
    listed = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True,
                            check=True).stdout
    return [line for line in listed.splitlines() if str(temp) in line]


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    _need_real()
    base = tmp_path_factory.mktemp("ray-cluster")
    temp = Path("/tmp") / f"tenon-ray-test-{os.getpid()}"
    with local_cluster(3, GIB, temp) as cluster:
        assert len(alive_node_ids()) == 3
        yield RayCluster(cluster, base, temp)
    assert not temp.exists()
    deadline = time.monotonic() + 20.0
    while _ray_processes_under(temp) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _ray_processes_under(temp) == []
    assert mounts_under(base) == []
    # uid leases are flocks of the actors' processes, all gone above
    deadline = time.monotonic() + 10.0  # the kernel's autoclear may lag the last unmount
    while _orphan_loops_under(base) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _orphan_loops_under(base) == {}


def _orphan_loops_under(base: Path) -> dict[str, Path]:
    """Loop devices of workspaces under `base` still attached though no mount namespace on
    the host holds their filesystem. (A sandbox another Tenon on this host started while a
    workspace was mounted keeps a copy of that mount in its namespace: the device detaches
    when that sandbox ends; that is not a leftover of these tests.)"""
    attached = {dev: f for dev, f in diskfs.loop_devices().items() if base in f.parents}
    if not attached:
        return {}
    numbers = {Path(f"/sys/block/{Path(dev).name}/dev").read_text().strip(): dev
               for dev in attached}
    held: set[str] = set()
    for mountinfo in Path("/proc").glob("[0-9]*/mountinfo"):
        try:
            text = mountinfo.read_text()
        except OSError:
            continue
        held.update(line.split()[2] for line in text.splitlines()
                    if line.split()[2] in numbers)
    return {dev: attached[dev] for number, dev in numbers.items() if number not in held}


def _domain(spec: NodeSpec) -> str:
    return (spec.node_dir / "domain").read_text().strip()


@asynccontextmanager
async def started(ray_cluster: RayCluster, specs: list[NodeSpec]
                  ) -> AsyncIterator[list[RayNode]]:
    nodes = await start_nodes(specs, ray_cluster.order())
    try:
        yield nodes
    finally:
        for node in nodes:
            await node.stop()
    for spec in specs:
        if (spec.node_dir / "domain").exists():
            assert domain_cgroups(_domain(spec)) == [], spec.name


def _workflow(wid: str, commands: list[str]) -> Workflow:
    memory = Memory(avg_bytes=8 * MIB, peak_bytes=32 * MIB, resident_after_bytes=MIB)
    return Workflow(id=wid, submit_s=0.0, base_image="tenon-base:bookworm", family="ray-test",
                    steps=[Step(model_wait_s=0.2, action=Action(
                        command=command, tool="Bash", action_class="other", duration_s=0.2,
                        memory=memory, reproduce=Reproduce(mode="literal")))
                        for command in commands])


async def test_node_actors_are_pinned_to_the_ray_nodes_asked_for(ray_cluster: RayCluster):
    order = ray_cluster.order()
    assert len(set(order)) == 3
    assert order[0] == ray_cluster.cluster.head_node.node_id
    async with started(ray_cluster, ray_cluster.specs("pin")) as nodes:
        assert [n.node_id for n in nodes] == order
        assert len({n.pid for n in nodes}) == 3
        loads = [await n.load() for n in nodes]
        assert [(x.node, x.budget_bytes, x.alive) for x in loads] == [
            ("pin0", GIB, True), ("pin1", GIB, True), ("pin2", GIB, True)]


async def test_a_replay_through_the_dispatcher_completes_every_workflow(
        ray_cluster: RayCluster):
    workflows = [_workflow(f"w{i}", [f"echo {i} > /workspace/out.txt",
                                     "cat /workspace/out.txt && ls / >/dev/null",
                                     f"test $(cat /workspace/out.txt) = {i}"])
                 for i in range(6)]
    subs = make_schedule(workflows, qps=6.0, window_s=1.0, speed=1.0)
    async with started(ray_cluster, ray_cluster.specs("rep")) as nodes:
        async with Dispatcher(nodes, PlacementConfig(), clock=SystemClock()) as dispatcher:
            records = await replay(dispatcher, subs, speed=1.0, max_retries=1)
        assert [r.errors for r in records] == [[]] * len(subs)
        assert all(r.completed for r in records)
        assert sum(r.oom_events for r in records) == 0
        assert dispatcher.stats.placements == len(subs)
        assert len(dispatcher.stats.per_node) > 1
        figures = [await node.actor.figures.remote() for node in nodes]
        assert sum(f["oom_kills"] for f in figures) == 0
        assert sum(f["peak_memory_bytes"] > 0 for f in figures) == len(dispatcher.stats.per_node)


def test_sandboxes_through_one_front_door_land_on_several_nodes(ray_cluster: RayCluster):
    import httpx
    from e2b import Sandbox

    from tenon.cluster.serve import serving_nodes
    from tenon.service.frontdoor import FrontDoorSettings
    from tenon.service.testing import running_front_door

    front_key = "e2b_ray_front_door_test_key"

    async def with_nodes() -> None:
        specs = ray_cluster.specs("srv", keep_agents=True)
        async with serving_nodes(specs) as served:
            settings = FrontDoorSettings(
                nodes=tuple(s for _, s in served), port=0, api_keys=(front_key,),
                placement=PlacementConfig(refresh_s=30.0))
            with running_front_door(settings) as url:
                await asyncio.to_thread(_through_sdk, url, front_key,
                                        {s.name: s for _, s in served}, httpx, Sandbox)

    asyncio.run(with_nodes())


def _through_sdk(url: str, key: str, served: dict[str, Any], httpx: Any, sandbox: Any) -> None:
    env = {"E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": key}
    with mock.patch.dict(os.environ, env):
        sandboxes = [sandbox.create(metadata={"suite": "ray"}) for _ in range(4)]
        try:
            ids = {s.sandbox_id for s in sandboxes}
            where = {}
            for name, node in served.items():
                listed = httpx.get(f"{node.url}/v2/sandboxes",
                                   headers={"X-API-Key": node.api_key}).json()
                for sid in {s["sandboxID"] for s in listed} & ids:
                    where[sid] = name
            assert set(where) == ids
            assert len(set(where.values())) > 1, where
            for i, sbx in enumerate(sandboxes):
                result = sbx.commands.run(f"echo ray-{i} > /workspace/f && cat /workspace/f")
                assert result.stdout == f"ray-{i}\n"
        finally:
            for sbx in sandboxes:
                sbx.kill()
        for name, node in served.items():
            listed = httpx.get(f"{node.url}/v2/sandboxes",
                               headers={"X-API-Key": node.api_key}).json()
            assert listed == [], name


async def _exited(pid: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        assert time.monotonic() < deadline, f"the removed node's actor {pid} still runs"
        await asyncio.sleep(0.1)


class _Gated:
    """A node handle that reports no room while `closed` (so placement lands elsewhere)."""

    def __init__(self, node: RayNode) -> None:
        self._node = node
        self.closed = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._node, name)

    @property
    def name(self) -> str:
        return self._node.name

    @property
    def node_dir(self) -> Path:
        return self._node.node_dir

    @property
    def host(self) -> str:
        return self._node.host

    async def load(self) -> NodeLoad:
        load = await self._node.load()
        return replace(load, max_live_agents=0) if self.closed else load


async def test_a_removed_node_s_agents_continue_elsewhere_or_fail_naming_why(
        ray_cluster: RayCluster):
    specs = ray_cluster.specs("rm")
    async with started(ray_cluster, specs) as nodes:
        last = nodes[-1]
        assert last.node_id != ray_cluster.cluster.head_node.node_id
        gated = [_Gated(n) for n in nodes[:-1]]
        config = PlacementConfig(refresh_s=0.2)
        async with Dispatcher([*gated, last], config, clock=SystemClock()) as dispatcher:
            safe = await dispatcher.create_agent(image="tenon-base:bookworm")
            held = await dispatcher.create_agent(image="tenon-base:bookworm")
            assert (safe.node, held.node) == (last.name, last.name)
            for g in gated:
                g.closed = False
            wrote = await safe.run(
                "mkdir -p /workspace/d && seq 1 50000 > /workspace/d/seq.txt && "
                "head -c 200000 /dev/urandom > /workspace/blob.bin && "
                "sha256sum /workspace/d/seq.txt /workspace/blob.bin", timeout=60)
            assert wrote.ok, wrote.output
            kept = await held.run("echo held > /workspace/f" + RESIDENT_ONLY_SUFFIX,
                                  timeout=60)
            assert kept.ok, kept.output
            dead_domain = _domain(specs[-1])
            assert domain_cgroups(dead_domain) != []

            target = next(n for n in ray_cluster.cluster.list_all_nodes()
                          if n.node_id == last.node_id)
            await asyncio.to_thread(ray_cluster.cluster.remove_node, target, False)
            # the actor's worker answers direct calls until it sees its raylet gone
            await _exited(last.pid)

            seen = await safe.run("sha256sum /workspace/d/seq.txt /workspace/blob.bin",
                                  timeout=120)
            assert seen.ok, seen.output
            assert seen.output == wrote.output
            assert safe.node in {n.name for n in nodes[:-1]}
            with pytest.raises(AgentLost, match="resident-only"):
                await held.run("cat /workspace/f", timeout=60)
            assert dispatcher.stats.nodes_lost == 1
            assert dispatcher.stats.agents_adopted == 1
            assert dispatcher.stats.agents_lost == 1
            assert not dispatcher.loads[last.name].alive
            assert domain_cgroups(dead_domain) == []
            again = await safe.run("cat /workspace/d/seq.txt | wc -l", timeout=60)
            assert again.output.strip() == "50000"
            await safe.close()
            await held.close()
