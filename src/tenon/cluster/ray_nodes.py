"""One Tenon per node of a Ray cluster: a Ray actor pinned to its node.

`start_nodes` starts one `TenonNodeActor` per given Ray node, pinned there with a hard
node-affinity strategy (it never runs elsewhere, and is not restarted elsewhere: a lost node
is taken over by the dispatcher, not by Ray). The actor is asynchronous: its runtime's
loops run on the actor's event loop and the dispatcher's calls interleave with them. It
asks Ray for no CPU and no memory: what the node's sandboxes may use is the node's Tenon
budget, enforced by the node's workload domain, not Ray's accounting.

`RayNode` is the dispatcher's `NodeHandle` over such an actor: a call on an actor that
died (its node removed, its process killed) raises `NodeLost`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tenon.cluster.node import NodeSpec, TakeOverReport, TenonNode
from tenon.errors import NodeLost
from tenon.policy.placement import NodeLoad
from tenon.runtime.handoff import Handoff
from tenon.runtime.results import ActionResult

logger = logging.getLogger(__name__)

NAMESPACE = "tenon"
ACTOR_PREFIX = "tenon-node-"
_LOST = (RayActorError, ActorDiedError, ActorUnavailableError)


class TenonNodeActor:
    """The actor's class (made remote by `start_nodes`): a `TenonNode` from a `NodeSpec`."""

    def __init__(self, spec: NodeSpec) -> None:
        logging.basicConfig(level=logging.WARNING)
        self._spec = spec
        self._node = TenonNode(spec.name, spec.opener(), spec.node_dir)

    async def start(self) -> dict[str, Any]:
        await self._node.start()
        return {"pid": os.getpid(), "host": self._node.host,
                "node_id": ray.get_runtime_context().get_node_id()}

    async def stop(self) -> dict[str, Any]:
        return await self._node.stop()

    async def serve(self, api_key: str, image: str) -> str:
        """Serve E2B's API on this node's address; the URL."""
        host: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        return await self._node.serve(host, api_key, self._spec.node_dir, image)

    async def figures(self) -> dict[str, Any]:
        return self._node.figures()

    async def load(self) -> NodeLoad:
        return await self._node.load()

    async def create_agent(self, agent_id: str, kwargs: dict[str, Any]) -> None:
        await self._node.create_agent(agent_id, **kwargs)

    async def run(self, agent_id: str, command: str, kwargs: dict[str, Any]) -> ActionResult:
        return await self._node.run(agent_id, command, **kwargs)

    async def close_agent(self, agent_id: str) -> None:
        await self._node.close_agent(agent_id)

    async def release(self, agent_id: str) -> Handoff | str:
        return await self._node.release(agent_id)

    async def adopt(self, handoff: Handoff) -> None:
        await self._node.adopt(handoff)

    async def forget(self, agent_id: str) -> None:
        await self._node.forget(agent_id)

    async def take_over(self, dead_node_dir: str, same_host: bool) -> TakeOverReport:
        return await self._node.take_over(Path(dead_node_dir), same_host=same_host)


class RayNode:
    """`NodeHandle` over a `TenonNodeActor`."""

    def __init__(self, name: str, actor: Any, node_dir: Path, host: str, node_id: str,
                 pid: int) -> None:
        self._name = name
        self.actor = actor
        self._node_dir = node_dir
        self._host = host
        self.node_id = node_id
        self.pid = pid

    @property
    def name(self) -> str:
        return self._name

    @property
    def node_dir(self) -> Path:
        return self._node_dir

    @property
    def host(self) -> str:
        return self._host

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            return await getattr(self.actor, method).remote(*args)
        except _LOST as exc:
            raise NodeLost(f"node {self._name}: {type(exc).__name__}") from exc
        except RayTaskError as exc:  # the node's own error, without Ray's wrapping
            cause = exc.cause
            if isinstance(cause, Exception):
                raise cause from None
            raise

    async def load(self) -> NodeLoad:
        load: NodeLoad = await self._call("load")
        return load

    async def create_agent(self, agent_id: str, **kwargs: Any) -> None:
        await self._call("create_agent", agent_id, kwargs)

    async def run(self, agent_id: str, command: str, **kwargs: Any) -> ActionResult:
        result: ActionResult = await self._call("run", agent_id, command, kwargs)
        return result

    async def close_agent(self, agent_id: str) -> None:
        await self._call("close_agent", agent_id)

    async def release(self, agent_id: str) -> Handoff | str:
        released: Handoff | str = await self._call("release", agent_id)
        return released

    async def adopt(self, handoff: Handoff) -> None:
        await self._call("adopt", handoff)

    async def forget(self, agent_id: str) -> None:
        await self._call("forget", agent_id)

    async def take_over(self, dead_node_dir: Path, *, same_host: bool) -> TakeOverReport:
        report: TakeOverReport = await self._call("take_over", str(dead_node_dir), same_host)
        return report

    async def stop(self) -> dict[str, Any] | None:
        """Close the node's runtime and end the actor; None when it was already gone."""
        try:
            figures: dict[str, Any] = await self._call("stop")
        except NodeLost:
            return None
        ray.kill(self.actor)
        return figures


def alive_node_ids() -> list[str]:
    """The Ray node ids of the cluster's live nodes, in a stable order."""
    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    return sorted(node["NodeID"] for node in nodes if node.get("Alive"))


async def start_nodes(specs: Sequence[NodeSpec], node_ids: Sequence[str]) -> list[RayNode]:
    """One Tenon actor per spec, pinned to the Ray node of the same position, started."""
    if len(specs) > len(node_ids):
        raise ValueError(f"{len(specs)} Tenon nodes asked for, the cluster has "
                         f"{len(node_ids)} live nodes")
    remote: Any = ray.remote(TenonNodeActor)
    actors = []
    for spec, node_id in zip(specs, node_ids, strict=False):
        actors.append(remote.options(
            name=f"{ACTOR_PREFIX}{spec.name}", namespace=NAMESPACE, num_cpus=0,
            max_restarts=0, max_concurrency=10_000,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(spec))
    started = [await actor.start.remote() for actor in actors]
    return [RayNode(spec.name, actor, spec.node_dir, info["host"], info["node_id"],
                    info["pid"])
            for spec, actor, info in zip(specs, actors, started, strict=True)]
