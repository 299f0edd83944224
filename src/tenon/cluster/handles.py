"""The dispatcher's view of a node: the `NodeHandle` contract, and `LocalNode`, a node in
this process (the simulated cluster, tests). `cluster.ray_nodes.RayNode` is the same
contract over a Ray actor on another node."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from tenon.cluster.node import TakeOverReport, TenonNode
from tenon.policy.placement import NodeLoad
from tenon.runtime.handoff import Handoff
from tenon.runtime.results import ActionResult


class NodeHandle(Protocol):
    """One node, as the dispatcher calls it. A call on a node that is gone raises
    `NodeLost`."""

    @property
    def name(self) -> str: ...

    @property
    def node_dir(self) -> Path:
        """The node's state directory on the cluster's shared path."""
        ...

    @property
    def host(self) -> str:
        """The machine the node runs on (a take-over on the same machine also removes what
        the dead node's sandboxes left)."""
        ...

    async def load(self) -> NodeLoad: ...

    async def create_agent(self, agent_id: str, **kwargs: Any) -> None: ...

    async def run(self, agent_id: str, command: str, **kwargs: Any) -> ActionResult: ...

    async def close_agent(self, agent_id: str) -> None: ...

    async def release(self, agent_id: str) -> Handoff | str: ...

    async def adopt(self, handoff: Handoff) -> None: ...

    async def forget(self, agent_id: str) -> None: ...

    async def take_over(self, dead_node_dir: Path, *, same_host: bool) -> TakeOverReport: ...


class LocalNode:
    """A `TenonNode` in this process."""

    def __init__(self, node: TenonNode, node_dir: Path) -> None:
        self._node = node
        self._node_dir = node_dir

    @property
    def name(self) -> str:
        return self._node.name

    @property
    def node_dir(self) -> Path:
        return self._node_dir

    @property
    def host(self) -> str:
        return self._node.host

    async def load(self) -> NodeLoad:
        return await self._node.load()

    async def create_agent(self, agent_id: str, **kwargs: Any) -> None:
        await self._node.create_agent(agent_id, **kwargs)

    async def run(self, agent_id: str, command: str, **kwargs: Any) -> ActionResult:
        return await self._node.run(agent_id, command, **kwargs)

    async def close_agent(self, agent_id: str) -> None:
        await self._node.close_agent(agent_id)

    async def release(self, agent_id: str) -> Handoff | str:
        return await self._node.release(agent_id)

    async def adopt(self, handoff: Handoff) -> None:
        await self._node.adopt(handoff)

    async def forget(self, agent_id: str) -> None:
        await self._node.forget(agent_id)

    async def take_over(self, dead_node_dir: Path, *, same_host: bool) -> TakeOverReport:
        return await self._node.take_over(dead_node_dir, same_host=same_host)
