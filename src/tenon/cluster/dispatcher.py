"""The dispatcher: places each new agent on a node of the cluster, moves torn-down agents
off a node that stays saturated, and continues a lost node's agents on another node.

It reads every node's `NodeLoad` each `refresh_s` and decides with the pure placement
policy (`policy.placement`), counting each decision it made into the view until the next
reading, so a burst of placements between two readings does not all land on one node.
When no node has room, `place` raises `ClusterFull` (retryable, with the time to wait);
`create_agent` waits and asks again unless told not to.

Agents live on nodes; a `ClusterAgent` is the caller's handle, with `Agent`'s `run` and
`close`. Before each action of an agent whose node stays saturated, the dispatcher asks
that node to release it: an idle agent at a restartable boundary is torn down, its
committed workspace moves to a node with room (`runtime.handoff`), and the action rebuilds
it there. Workspaces live under the cluster's shared path (each node's state directory),
so the move is a rename on one filesystem; across filesystems it is a copy.

When a node is lost (a call raises `NodeLost`), one surviving node takes over its state
directory as a restarted controller would: agents committed to disk (torn down, or
resident at a restartable boundary) are adopted there and their interrupted action runs
again; resident-only agents fail with `AgentLost` naming what was lost.

The dispatcher has the members the replay driver needs of a runtime (`clock`, `backend`,
`events`, `recovered`, `create_agent`), so a trace replays through a cluster unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tenon.clock import Clock
from tenon.cluster.handles import NodeHandle
from tenon.cluster.node import TakeOverReport
from tenon.errors import AgentLost, ClusterFull, NodeLost
from tenon.policy.placement import NodeLoad, NoRoom, PlacementConfig, choose_node, move_target
from tenon.runtime.events import EventLog
from tenon.runtime.handoff import Handoff
from tenon.runtime.results import ActionResult
from tenon.state.statedir import StateDirBusy

logger = logging.getLogger(__name__)

# How long a lost node's state directory may stay locked by its dying process.
TAKE_OVER_WAIT_S = 60.0


@dataclass(frozen=True)
class ClusterKind:
    simulated: bool


@dataclass
class DispatchStats:
    """The dispatcher's own figures: its decisions, their cost, what it moved and lost."""

    placements: int = 0
    refusals: int = 0
    moves: int = 0
    move_attempts: int = 0
    nodes_lost: int = 0
    agents_adopted: int = 0
    agents_lost: int = 0
    decision_ns: list[int] = field(default_factory=list)
    cpu_s: float = 0.0
    per_node: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        ns = sorted(self.decision_ns)

        def pct(q: float) -> float | None:
            return round(ns[min(int(q * len(ns)), len(ns) - 1)] / 1000, 2) if ns else None

        return {"placements": self.placements, "refusals": self.refusals,
                "moves": self.moves, "move_attempts": self.move_attempts,
                "nodes_lost": self.nodes_lost, "agents_adopted": self.agents_adopted,
                "agents_lost": self.agents_lost, "decision_p50_us": pct(0.5),
                "decision_p99_us": pct(0.99), "dispatcher_cpu_s": round(self.cpu_s, 4),
                "agents_per_node": dict(sorted(self.per_node.items()))}


class ClusterAgent:
    """One logical agent on some node of the cluster; `run` and `close` as `Agent`'s."""

    def __init__(self, dispatcher: Dispatcher, agent_id: str, node: str, peak_bytes: int,
                 workflow: str | None) -> None:
        self._dispatcher = dispatcher
        self.id = agent_id
        self.node = node
        self.peak_bytes = peak_bytes
        self.workflow = workflow
        self.num_actions_done = 0
        self.failed = False
        self.interrupted: ActionResult | None = None
        self.lost_reason: str | None = None

    async def run(self, command: str, *, timeout: float,  # noqa: ASYNC109 - the action's
                  action_class: str | None = None,
                  issued_command: str | None = None) -> ActionResult:
        """Run one action on the agent's node (moving the agent first when its node stays
        saturated); on a lost node, again on the node that adopted it. AgentLost when the
        agent could not continue."""
        await self._dispatcher.maybe_move(self)
        while True:
            if self.lost_reason is not None:
                raise AgentLost(self.lost_reason)
            node = self._dispatcher.node(self.node)
            try:
                result = await node.run(self.id, command, timeout=timeout,
                                        action_class=action_class,
                                        issued_command=issued_command)
            except NodeLost:
                await self._dispatcher.continue_elsewhere(self)
                continue
            self.num_actions_done += 1
            return result

    async def close(self) -> None:
        await self._dispatcher.close_agent(self)


class Dispatcher:
    """Places agents on `nodes` (see the module docstring)."""

    def __init__(self, nodes: Sequence[NodeHandle], config: PlacementConfig | None = None, *,
                 clock: Clock, event_log: Path | None = None, seed: int = 0,
                 simulated: bool = False, id_prefix: str = "agent") -> None:
        self.config = config or PlacementConfig()
        self.clock = clock
        self.backend = ClusterKind(simulated)
        self.events = EventLog(event_log, clock.now)
        self.recovered: dict[str, ClusterAgent] = {}  # the replay driver's contract: none
        self.stats = DispatchStats()
        self._nodes = {node.name: node for node in nodes}
        self._loads: dict[str, NodeLoad] = {}
        self._agents: dict[str, ClusterAgent] = {}
        self._takeovers: dict[str, asyncio.Future[TakeOverReport]] = {}
        self._lost: set[str] = set()
        self._rng = random.Random(seed)
        self._turn = 0
        self._ids = itertools.count(1)
        self._prefix = id_prefix
        self._poller: asyncio.Task[None] | None = None

    # -- the view of the nodes ---------------------------------------------------------

    def node(self, name: str) -> NodeHandle:
        return self._nodes[name]

    @property
    def loads(self) -> dict[str, NodeLoad]:
        return dict(self._loads)

    def alive(self) -> list[str]:
        return [name for name, load in self._loads.items() if load.alive]

    async def start(self) -> None:
        await self.refresh()
        self._poller = asyncio.ensure_future(self._poll())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        self.events.emit("dispatcher_stop", **self.stats.summary())
        self.events.close()

    async def __aenter__(self) -> Dispatcher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _poll(self) -> None:
        while True:
            await self.clock.sleep(self.config.refresh_s)
            await self.refresh()

    async def refresh(self) -> None:
        """Read every node's load; a node that does not answer is lost."""
        names = list(self._nodes)
        readings = await asyncio.gather(*(self._nodes[n].load() for n in names),
                                        return_exceptions=True)
        for name, reading in zip(names, readings, strict=True):
            if isinstance(reading, NodeLoad):
                if name not in self._lost:
                    self._loads[name] = reading
            elif isinstance(reading, NodeLost):
                self._mark_lost(name)
            elif isinstance(reading, BaseException):
                logger.warning("node %s: load unreadable: %r", name, reading)

    def _mark_lost(self, name: str) -> None:
        old = self._loads.get(name)
        if name in self._lost:
            return
        self._lost.add(name)
        budget = old.budget_bytes if old is not None else 0
        self._loads[name] = NodeLoad(name, budget, alive=False)
        self.stats.nodes_lost += 1
        self.events.emit("node_lost", node=name)
        logger.warning("node %s lost", name)

    # -- placement --------------------------------------------------------------------

    def place(self, peak_bytes: int) -> str:
        """The node for a new agent of predicted `peak_bytes`; ClusterFull when none has
        room. Counts the agent into that node's view."""
        cpu = time.thread_time()
        start = time.perf_counter_ns()
        decision = choose_node(list(self._loads.values()), peak_bytes, self.config,
                               rng=self._rng, turn=self._turn)
        self.stats.decision_ns.append(time.perf_counter_ns() - start)
        if isinstance(decision, NoRoom):
            self.stats.refusals += 1
            self.stats.cpu_s += time.thread_time() - cpu
            raise ClusterFull(f"no node has room for an agent of {peak_bytes >> 20} MiB: "
                              f"{decision.reason}; retry in {self.config.retry_after_s:g} s",
                              retry_after_s=self.config.retry_after_s)
        self._turn += 1
        self._loads[decision.node] = self._loads[decision.node].with_agent(peak_bytes)
        self.stats.placements += 1
        self.stats.per_node[decision.node] = self.stats.per_node.get(decision.node, 0) + 1
        self.stats.cpu_s += time.thread_time() - cpu
        return decision.node

    async def create_agent(self, *, image: str, family: str | None = None,
                           task_prompt: str | None = None,
                           profile_peak_bytes: int | None = None,
                           workflow: str | None = None, task: str | None = None,
                           wait: bool = True) -> ClusterAgent:
        """A new agent on the node `place` chooses. With `wait`, a full cluster is asked
        again after its retry time; without, ClusterFull goes to the caller."""
        peak = profile_peak_bytes or self.config.default_peak_bytes
        agent_id = f"{self._prefix}-{next(self._ids):06d}"
        while True:
            try:
                name = self.place(peak)
            except ClusterFull as exc:
                self.events.emit("placement_refused", agent_id=agent_id, reason=str(exc))
                if not wait:
                    raise
                await self.clock.sleep(exc.retry_after_s)
                continue
            try:
                await self._nodes[name].create_agent(
                    agent_id, image=image, family=family, task_prompt=task_prompt,
                    profile_peak_bytes=profile_peak_bytes, workflow=workflow, task=task)
            except NodeLost:
                self._mark_lost(name)
                continue
            break
        agent = ClusterAgent(self, agent_id, name, peak, workflow)
        self._agents[agent_id] = agent
        self.events.emit("agent_placed", agent_id=agent_id, node=name, peak_bytes=peak,
                         workflow=workflow)
        return agent

    async def close_agent(self, agent: ClusterAgent) -> None:
        self._agents.pop(agent.id, None)
        load = self._loads.get(agent.node)
        if load is not None and load.alive:
            self._loads[agent.node] = load.without_agent(agent.peak_bytes)
        if agent.lost_reason is not None:
            return
        with contextlib.suppress(NodeLost):
            await self._nodes[agent.node].close_agent(agent.id)

    # -- moving agents ------------------------------------------------------------------

    async def maybe_move(self, agent: ClusterAgent) -> None:
        """Move `agent` off its node when that node stays saturated and another has room
        (only an idle, torn-down agent moves; anything else stays)."""
        current = self._loads.get(agent.node)
        if current is None or not current.alive or agent.lost_reason is not None:
            return
        cpu = time.thread_time()
        target = move_target(current, list(self._loads.values()), agent.peak_bytes,
                             self.config)
        self.stats.cpu_s += time.thread_time() - cpu
        if target is None:
            return
        self.stats.move_attempts += 1
        source = self._nodes[agent.node]
        try:
            released = await source.release(agent.id)
        except NodeLost:
            return  # the action's own call finds the node lost and continues elsewhere
        if not isinstance(released, Handoff):
            return
        await self._hand_over(agent, released, target.node, target.reason)

    async def _hand_over(self, agent: ClusterAgent, handoff: Handoff, target: str,
                         reason: str) -> None:
        source = self._nodes[agent.node]
        try:
            await self._nodes[target].adopt(handoff)
        except NodeLost:
            self._mark_lost(target)
            await source.adopt(handoff)  # back where it was: its root never left the path
            return
        await source.forget(agent.id)
        self._loads[agent.node] = self._loads[agent.node].without_agent(agent.peak_bytes)
        self._loads[target] = self._loads[target].with_agent(agent.peak_bytes)
        self.events.emit("agent_moved", agent_id=agent.id, source=agent.node, target=target,
                         reason=reason)
        agent.node = target
        self.stats.moves += 1

    # -- lost nodes ---------------------------------------------------------------------

    async def continue_elsewhere(self, agent: ClusterAgent) -> None:
        """After `agent`'s node was lost: where it continues (its `node` changes), or its
        `lost_reason` set when it cannot."""
        lost = agent.node
        report = await self.node_lost(lost)
        if agent.node != lost:
            return  # the take-over already moved it
        reason = report.failed.get(agent.id)
        agent.lost_reason = (
            f"agent {agent.id} was on node {lost}, which was lost: {reason}"
            if reason is not None else
            f"agent {agent.id} was on node {lost}, which was lost, and no committed record "
            f"of it was found there")

    async def node_lost(self, name: str) -> TakeOverReport:
        """Have one surviving node take over lost node `name` (once; later callers share
        the result)."""
        self._mark_lost(name)
        future = self._takeovers.get(name)
        if future is None:
            future = asyncio.ensure_future(self._take_over(name))
            self._takeovers[name] = future
        return await asyncio.shield(future)

    async def _take_over(self, name: str) -> TakeOverReport:
        dead = self._nodes[name]
        deadline = self.clock.now() + TAKE_OVER_WAIT_S
        while True:
            survivors = sorted((load for load in self._loads.values() if load.alive),
                               key=lambda load: (load.ratio(), load.node))
            if not survivors:
                raise NodeLost(f"node {name} was lost and no node survives to take over")
            heir = self._nodes[survivors[0].node]
            try:
                report = await heir.take_over(dead.node_dir, same_host=heir.host == dead.host)
                break
            except NodeLost:
                self._mark_lost(heir.name)
            except StateDirBusy:  # the lost node's process has not exited yet
                if self.clock.now() > deadline:
                    raise
                await self.clock.sleep(0.5)
        self._settle(name, heir.name, report)
        return report

    def _settle(self, lost: str, heir: str, report: TakeOverReport) -> None:
        for agent_id in report.adopted:
            agent = self._agents.get(agent_id)
            if agent is not None:
                agent.node = heir
                self._loads[heir] = self._loads[heir].with_agent(agent.peak_bytes)
        for agent_id, reason in report.failed.items():
            agent = self._agents.get(agent_id)
            if agent is not None:
                agent.lost_reason = f"agent {agent_id} was on node {lost}, which was lost: " \
                                    f"{reason}"
        self.stats.agents_adopted += len(report.adopted)
        self.stats.agents_lost += len(report.failed)
        self.events.emit("node_taken_over", node=lost, heir=heir,
                         adopted=list(report.adopted), failed=report.failed,
                         interrupted=report.interrupted)
        logger.warning("node %s lost: %s adopted %d agent(s), %d could not continue",
                       lost, heir, len(report.adopted), len(report.failed))
