"""The dispatcher's view of a node: the `NodeHandle` contract. A `TenonNode` in this process
(the simulated cluster, tests) is one; `cluster.ray_nodes.RayNode` is the same contract over
a Ray actor on another node."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from tenon.cluster.node import TakeOverReport
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
