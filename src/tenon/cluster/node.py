"""One Tenon per node: a runtime over the node's workload domain and budget, and the calls
a dispatcher makes on it (by agent id, since agents live in the node's process).

`TenonNode` is plain asyncio: a Ray actor wraps it on a real cluster (`cluster.ray_nodes`),
and the simulated cluster calls it directly (`cluster.sim`). `NodeSpec` says how to open
its runtime: the node's state directory (`node_dir`) lies under the cluster's shared path,
so another node can adopt its agents' committed workspaces (`runtime.handoff`).
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tenon.errors import ConfigError, UnknownAgent
from tenon.policy.placement import NodeLoad
from tenon.predict.base import Predictor
from tenon.runtime.controller import Agent, Runtime
from tenon.runtime.handoff import Handoff, adopt_agent, forget_agent, release_agent, take_over
from tenon.runtime.load import node_load
from tenon.runtime.results import ActionResult

logger = logging.getLogger(__name__)

RuntimeOpener = Callable[[], contextlib.AbstractAsyncContextManager[Runtime]]


@dataclass(frozen=True)
class NodeSpec:
    """How a node opens its runtime on a real backend; picklable (it crosses Ray)."""

    name: str
    budget_bytes: int | None
    node_dir: Path
    """The node's state directory, under the cluster's shared path."""
    image_dir: Path = Path("/var/lib/tenon")
    backend: str = "process"
    policy: str = "tenon"
    policy_config: dict[str, Any] = field(default_factory=dict)
    backend_config: dict[str, Any] = field(default_factory=dict)
    predictor: Predictor | None = None
    gate_actuator: str = "auto"
    keep_agents: bool = False
    """A serving node keeps its agents across a restart, as `tenon serve` does."""

    def opener(self) -> RuntimeOpener:
        """Opens this node's runtime (imported here: the simulated cluster never needs it)."""
        from tenon.policy.config import PolicyConfig
        from tenon.runtime.open import open_runtime

        def open_it() -> contextlib.AbstractAsyncContextManager[Runtime]:
            return open_runtime(
                budget_bytes=self.budget_bytes, backend=self.backend,
                state_dir=self.image_dir, run_dir=self.node_dir, policy=self.policy,
                config=PolicyConfig.model_validate(self.policy_config),
                predictor=self.predictor, backend_config=self.backend_config,
                keep_agents=self.keep_agents,
                gate_actuator=self.gate_actuator)  # type: ignore[arg-type]
        return open_it


@dataclass(frozen=True)
class TakeOverReport:
    """What a node adopted of a dead node's agents (ids), and what could not continue."""

    adopted: tuple[str, ...]
    failed: dict[str, str]
    interrupted: dict[str, str]


class TenonNode:
    """A started runtime and its open agents; every call names an agent by id. In this
    process it is itself the dispatcher's `NodeHandle`."""

    def __init__(self, name: str, opener: RuntimeOpener, node_dir: Path) -> None:
        self.name = name
        self.node_dir = node_dir
        """The node's state directory (what another node takes over when this one is lost)."""
        self._opener = opener
        self._stack = contextlib.AsyncExitStack()
        self._runtime: Runtime | None = None
        self._agents: dict[str, Agent] = {}
        self.host = socket.gethostname()

    @property
    def runtime(self) -> Runtime:
        if self._runtime is None:
            raise ConfigError(f"node {self.name}: not started")
        return self._runtime

    async def start(self) -> None:
        self._runtime = await self._stack.enter_async_context(self._opener())

    async def stop(self) -> dict[str, Any]:
        """Close the runtime (every open agent ends); the node's figures."""
        figures = self.figures()
        await self._stack.aclose()
        self._runtime = None
        return figures

    def figures(self) -> dict[str, Any]:
        rt = self.runtime
        reading = rt.domain.reading()
        tally = rt.boundary.tally
        return {"node": self.name, "peak_memory_bytes": reading.peak_bytes,
                "oom_kills": reading.num_oom_kills, "cpu_s": round(reading.cpu_usage_s, 2),
                "teardowns": tally.num_teardowns, "rebuilds": tally.num_rebuilds}

    async def load(self) -> NodeLoad:
        return node_load(self.runtime, self.name)

    async def serve(self, host: str, api_key: str, state_dir: Path, image: str) -> str:
        """Serve this node's runtime over E2B's API on `host` (any free port) until `stop`;
        the URL (a cluster's front door routes each sandbox here)."""
        from tenon.service.server import serving

        return await self._stack.enter_async_context(serving(
            self.runtime, state_dir, api_keys=[api_key], host=host, port=0, image=image,
            image_root=self.runtime.backend.image_root, node_name=self.name))

    async def create_agent(self, agent_id: str, **kwargs: Any) -> None:
        agent = await self.runtime.create_agent(agent_id=agent_id, **kwargs)
        self._agents[agent.id] = agent

    async def run(self, agent_id: str, command: str, **kwargs: Any) -> ActionResult:
        return await self._agent(agent_id).run(command, **kwargs)

    async def close_agent(self, agent_id: str) -> None:
        agent = self._agents.pop(agent_id, None)
        if agent is not None:
            await agent.close()

    async def release(self, agent_id: str, *, tear_down: bool = False) -> Handoff | str:
        """Release an idle, torn-down agent for another node (a reason when it cannot go).
        A resident agent goes only with `tear_down` (torn down first, when restartable):
        moving it costs a teardown the node's own policy did not choose."""
        if agent_id not in self._agents:
            return f"no open agent {agent_id!r} on node {self.name}"
        where = self.runtime.residency_of(agent_id)
        if where != "torn_down" and not (tear_down and where == "resident"):
            return f"{where}: only a torn-down agent moves"
        released = await release_agent(self.runtime, agent_id)
        if isinstance(released, Handoff):
            self._agents.pop(agent_id, None)
        return released

    async def adopt(self, handoff: Handoff) -> None:
        agent = await adopt_agent(self.runtime, handoff)
        self._agents[agent.id] = agent

    async def forget(self, agent_id: str) -> None:
        forget_agent(self.runtime, agent_id)

    async def take_over(self, dead_node_dir: Path, *, same_host: bool) -> TakeOverReport:
        report = await take_over(self.runtime, dead_node_dir, same_host=same_host)
        self._agents.update(report.adopted)
        return TakeOverReport(tuple(sorted(report.adopted)), dict(report.failed),
                              dict(report.interrupted))

    def _agent(self, agent_id: str) -> Agent:
        agent = self._agents.get(agent_id)
        if agent is None:
            raise UnknownAgent(f"node {self.name}: no open agent {agent_id!r}")
        return agent


@contextlib.asynccontextmanager
async def started(node: TenonNode) -> AsyncIterator[TenonNode]:
    await node.start()
    try:
        yield node
    finally:
        await node.stop()
