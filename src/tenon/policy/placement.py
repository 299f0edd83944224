"""Placement of agents on the nodes of a cluster (pure): which node a new agent goes to,
whether a torn-down agent should move, and why a request finds no room.

Each node runs its own Tenon and publishes a `NodeLoad`: its budget, what its admitted
actions are charged (committed), what its queued actions are predicted to need, and how
many agents it keeps live. A node's *demand* is its committed memory (or its usage, when
idle resident sandboxes hold more) plus its queued predictions; its *load ratio* with a
new agent is that demand plus the agent's predicted peak, over its budget.

Strategies (`PlacementConfig.strategy`):

- `p2c`, the default: the power of two choices. Two nodes with room, drawn at random, and
  the one with the lower load ratio wins. Near the balance of a full scan at O(1) per
  decision, and two dispatchers reading the same stale loads do not herd onto one node.
- `least-loaded`: every node with room is scanned; the lowest load ratio wins (O(nodes)).
- `round-robin`: the next node in turn that has room, load ignored (the baseline).

A node has room for an agent when it is alive, below its live-agent limit, its budget can
hold the agent's predicted peak at all, and its load ratio with the agent stays within
`max_load_ratio`. No node with room is a `NoRoom`: a value with a reason per node, which
the dispatcher turns into a retryable error.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MIB = 1024 * 1024

Strategy = Literal["p2c", "least-loaded", "round-robin"]
STRATEGIES: tuple[Strategy, ...] = ("p2c", "least-loaded", "round-robin")


class PlacementConfig(BaseModel):
    """The dispatcher's parameters; unknown keys are rejected."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    strategy: Strategy = Field(
        default="p2c", description="How a new agent's node is chosen (see the module).")
    max_load_ratio: float = Field(
        default=8.0, gt=0.0,
        description="A node whose demand with the new agent would exceed this many times "
        "its budget has no room. Tenon queues actions inside a node, so a node takes far "
        "more agents than its budget holds at once; this bounds the queue.")
    default_peak_bytes: int = Field(
        default=256 * MIB, gt=0,
        description="An agent's predicted peak when its client gives none.")
    move_above_ratio: float = Field(
        default=1.5, gt=0.0,
        description="A torn-down agent is moved off its node only while that node's load "
        "ratio is at least this (it stays saturated).")
    move_gain: float = Field(
        default=0.5, ge=0.0,
        description="...and only to a node whose load ratio with the agent is at least this "
        "much lower than its own node's: moving costs a workspace move and a rebuild.")
    refresh_s: float = Field(
        default=0.25, gt=0.0, le=60.0,
        description="How often the dispatcher reads every node's load.")
    retry_after_s: float = Field(
        default=1.0, gt=0.0,
        description="What a refused request is told to wait before it asks again.")


@dataclass(frozen=True, slots=True)
class NodeLoad:
    """What one node publishes about itself."""

    node: str
    budget_bytes: int
    usage_bytes: int = 0
    committed_bytes: int = 0
    """Charges of the actions its admission let run."""
    queued_bytes: int = 0
    """Predicted peaks of the actions waiting for admission."""
    live_agents: int = 0
    max_live_agents: int | None = None
    pressure: int = 0
    """The node's pressure level (0 green, 1 yellow, 2 red)."""
    alive: bool = True

    @property
    def demand_bytes(self) -> int:
        return max(self.usage_bytes, self.committed_bytes) + self.queued_bytes

    def ratio(self, extra_bytes: int = 0) -> float:
        """Load ratio with `extra_bytes` more demand."""
        return (self.demand_bytes + extra_bytes) / max(self.budget_bytes, 1)

    def with_agent(self, peak_bytes: int) -> NodeLoad:
        """This load after one more agent of `peak_bytes` was placed here (the dispatcher's
        own view until the node's next reading)."""
        return NodeLoad(self.node, self.budget_bytes, self.usage_bytes, self.committed_bytes,
                        self.queued_bytes + peak_bytes, self.live_agents + 1,
                        self.max_live_agents, self.pressure, self.alive)

    def without_agent(self, peak_bytes: int) -> NodeLoad:
        return NodeLoad(self.node, self.budget_bytes, self.usage_bytes, self.committed_bytes,
                        max(self.queued_bytes - peak_bytes, 0), max(self.live_agents - 1, 0),
                        self.max_live_agents, self.pressure, self.alive)


@dataclass(frozen=True, slots=True)
class Placed:
    node: str
    reason: str


@dataclass(frozen=True, slots=True)
class NoRoom:
    """No node can take the agent now; `reasons` says why, node by node."""

    reasons: tuple[tuple[str, str], ...]

    @property
    def reason(self) -> str:
        if not self.reasons:
            return "the cluster has no nodes"
        return "; ".join(f"{node}: {why}" for node, why in self.reasons)


Placement = Placed | NoRoom


def why_no_room(load: NodeLoad, peak_bytes: int, config: PlacementConfig) -> str | None:
    """None when the node has room for an agent of `peak_bytes`, else why not."""
    if not load.alive:
        return "node lost"
    if load.max_live_agents is not None and load.live_agents >= load.max_live_agents:
        return f"{load.live_agents} live agents, its limit"
    if peak_bytes > load.budget_bytes:
        return (f"predicted peak {peak_bytes >> 20} MiB exceeds its budget "
                f"{load.budget_bytes >> 20} MiB")
    if load.ratio(peak_bytes) > config.max_load_ratio:
        return (f"load {load.ratio(peak_bytes):.2f}x its budget with the agent, above "
                f"{config.max_load_ratio:g}x")
    return None


def choose_node(loads: Sequence[NodeLoad], peak_bytes: int, config: PlacementConfig, *,
                rng: random.Random, turn: int = 0) -> Placement:
    """The node for a new agent of predicted `peak_bytes`. `rng` draws p2c's pair; `turn`
    is round-robin's position (the dispatcher counts placements)."""
    room = [load for load in loads if why_no_room(load, peak_bytes, config) is None]
    if not room:
        return NoRoom(tuple((load.node, why_no_room(load, peak_bytes, config) or "")
                            for load in loads))
    if config.strategy == "round-robin":
        ordered = sorted(loads, key=lambda load: load.node)
        for step in range(len(ordered)):
            candidate = ordered[(turn + step) % len(ordered)]
            if candidate in room:
                return Placed(candidate.node, f"round-robin turn {turn}")
    if config.strategy == "least-loaded" or len(room) == 1:
        best = min(room, key=lambda load: (load.ratio(peak_bytes), load.node))
        return Placed(best.node, f"least loaded of {len(room)}: "
                                 f"{best.ratio(peak_bytes):.2f}x")
    first, second = rng.sample(room, 2)
    best = min((first, second), key=lambda load: (load.ratio(peak_bytes), load.node))
    other = second if best is first else first
    return Placed(best.node, f"p2c: {best.ratio(peak_bytes):.2f}x against {other.node} "
                             f"{other.ratio(peak_bytes):.2f}x")


def move_target(current: NodeLoad, loads: Sequence[NodeLoad], peak_bytes: int,
                config: PlacementConfig) -> Placed | None:
    """Where a torn-down agent of `peak_bytes` on `current` should move before its next
    action, or None to stay: only off a node that stays saturated, only to a node with room
    whose load ratio with the agent is lower by `move_gain`. Round-robin never moves."""
    if config.strategy == "round-robin" or current.ratio() < config.move_above_ratio:
        return None
    room = [load for load in loads if load.node != current.node
            and why_no_room(load, peak_bytes, config) is None]
    if not room:
        return None
    best = min(room, key=lambda load: (load.ratio(peak_bytes), load.node))
    if best.ratio(peak_bytes) + config.move_gain > current.ratio():
        return None
    return Placed(best.node, f"{current.node} at {current.ratio():.2f}x its budget, "
                             f"{best.node} at {best.ratio(peak_bytes):.2f}x with the agent")
