"""The pure placement policy: which node a new agent goes to, why none has room, and when a
torn-down agent moves."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tenon.policy.placement import (
    MIB,
    NodeLoad,
    NoRoom,
    Placed,
    PlacementConfig,
    choose_node,
    move_target,
    why_no_room,
)

BUDGET = 1024 * MIB
PEAK = 128 * MIB


def config(strategy: str = "p2c", **kw: object) -> PlacementConfig:
    return PlacementConfig.model_validate({"strategy": strategy, **kw})


def load(node: str, queued_mib: int = 0, **kw: object) -> NodeLoad:
    return NodeLoad(node, kw.pop("budget_bytes", BUDGET),  # type: ignore[arg-type]
                    queued_bytes=queued_mib * MIB, **kw)  # type: ignore[arg-type]


node_loads = st.lists(
    st.builds(
        lambda i, committed, queued, usage, live, limit, alive, budget: NodeLoad(
            f"n{i:02d}", budget * MIB, usage * MIB, committed * MIB, queued * MIB, live,
            limit, 0, alive),
        st.integers(0, 99), st.integers(0, 4096), st.integers(0, 8192), st.integers(0, 4096),
        st.integers(0, 20), st.none() | st.integers(1, 20), st.booleans(),
        st.integers(64, 2048)),
    min_size=1, max_size=12, unique_by=lambda load: load.node)
peaks = st.integers(1, 3072).map(lambda mib: mib * MIB)


@settings(max_examples=150, deadline=None)
@given(node_loads, peaks, st.sampled_from(["p2c", "least-loaded", "round-robin"]),
       st.integers(0, 2**32), st.integers(0, 50))
def test_a_chosen_node_always_has_room_and_no_room_names_every_node(loads, peak, strategy,
                                                                    seed, turn):
    cfg = config(strategy)
    decision = choose_node(loads, peak, cfg, rng=random.Random(seed), turn=turn)
    with_room = {x.node for x in loads if why_no_room(x, peak, cfg) is None}
    if with_room:
        assert isinstance(decision, Placed)
        assert decision.node in with_room
    else:
        assert isinstance(decision, NoRoom)
        assert [node for node, _ in decision.reasons] == [x.node for x in loads]
        assert all(why for _, why in decision.reasons)
        for node, why in decision.reasons:
            assert f"{node}: {why}" in decision.reason


@settings(max_examples=150, deadline=None)
@given(node_loads, peaks, st.integers(0, 2**32))
def test_p2c_picks_the_lower_ratio_of_the_pair_it_drew(loads, peak, seed):
    cfg = config("p2c")
    room = [x for x in loads if why_no_room(x, peak, cfg) is None]
    decision = choose_node(loads, peak, cfg, rng=random.Random(seed))
    if len(room) < 2:
        return
    # the same draw, replayed: the winner is the pair's lower ratio (ties: lower name)
    first, second = random.Random(seed).sample(room, 2)
    best = min((first, second), key=lambda x: (x.ratio(peak), x.node))
    assert isinstance(decision, Placed)
    assert decision.node == best.node
    other = second if best is first else first
    assert decision.node != other.node or first.node == second.node
    assert best.ratio(peak) <= other.ratio(peak)


def test_p2c_never_herds_onto_the_worst_node_and_spreads():
    loads = [load("a", 0), load("b", 200), load("c", 900)]
    rng = random.Random(1)
    picks = [choose_node(loads, PEAK, config("p2c"), rng=rng) for _ in range(300)]
    nodes = [p.node for p in picks if isinstance(p, Placed)]
    assert len(nodes) == 300
    assert "c" not in nodes  # c is the higher ratio of every pair it is in
    assert {"a", "b"} <= set(nodes)  # b wins every (b, c) draw


@settings(max_examples=150, deadline=None)
@given(node_loads, peaks)
def test_least_loaded_picks_the_minimum_ratio_with_room(loads, peak):
    cfg = config("least-loaded")
    decision = choose_node(loads, peak, cfg, rng=random.Random(0))
    room = [x for x in loads if why_no_room(x, peak, cfg) is None]
    if not room:
        assert isinstance(decision, NoRoom)
        return
    assert isinstance(decision, Placed)
    chosen = next(x for x in loads if x.node == decision.node)
    assert chosen.ratio(peak) == min(x.ratio(peak) for x in room)


def test_round_robin_deals_in_turn_ignoring_load():
    loads = [load("c", 900), load("a", 0), load("b", 500)]
    picks = [choose_node(loads, PEAK, config("round-robin"), rng=random.Random(0),
                         turn=turn) for turn in range(6)]
    assert [p.node for p in picks if isinstance(p, Placed)] == ["a", "b", "c"] * 2


def test_round_robin_skips_a_node_without_room_to_the_next_in_turn():
    loads = [load("a"), load("b", alive=False), load("c", live_agents=3, max_live_agents=3)]
    picks = [choose_node(loads, PEAK, config("round-robin"), rng=random.Random(0),
                         turn=turn) for turn in range(3)]
    assert [p.node for p in picks if isinstance(p, Placed)] == ["a", "a", "a"]
    loads = [load("a"), load("b", alive=False), load("c")]
    picks = [choose_node(loads, PEAK, config("round-robin"), rng=random.Random(0),
                         turn=turn) for turn in range(3)]
    assert [p.node for p in picks if isinstance(p, Placed)] == ["a", "c", "c"]


def test_no_room_says_why_for_each_node():
    cfg = config(max_load_ratio=2.0)
    loads = [
        load("dead", alive=False),
        load("full", live_agents=4, max_live_agents=4),
        load("small", budget_bytes=64 * MIB),
        load("busy", queued_mib=2000),
    ]
    decision = choose_node(loads, PEAK, cfg, rng=random.Random(0))
    assert isinstance(decision, NoRoom)
    reasons = dict(decision.reasons)
    assert reasons["dead"] == "node lost"
    assert reasons["full"] == "4 live agents, its limit"
    assert reasons["small"] == "predicted peak 128 MiB exceeds its budget 64 MiB"
    assert reasons["busy"] == "load 2.08x its budget with the agent, above 2x"
    assert decision.reason.startswith("dead: node lost; full: 4 live agents")
    assert NoRoom(()).reason == "the cluster has no nodes"
    # the ratio is exactly at the limit: still room
    assert why_no_room(load("edge", queued_mib=2048 - 128), PEAK, cfg) is None


def test_demand_is_the_larger_of_usage_and_committed_plus_queued():
    x = NodeLoad("n", BUDGET, usage_bytes=300 * MIB, committed_bytes=100 * MIB,
                 queued_bytes=50 * MIB)
    assert x.demand_bytes == 350 * MIB
    assert x.ratio(PEAK) == pytest.approx((350 + 128) / 1024)
    assert NodeLoad("z", 0).ratio(5) == 5.0  # no division by zero


@settings(max_examples=200, deadline=None)
@given(node_loads, peaks)
def test_with_agent_then_without_agent_restores_the_load(loads, peak):
    for x in loads:
        more = x.with_agent(peak)
        assert more.queued_bytes == x.queued_bytes + peak
        assert more.live_agents == x.live_agents + 1
        assert (more.node, more.budget_bytes, more.usage_bytes, more.committed_bytes,
                more.max_live_agents, more.alive) == (
            x.node, x.budget_bytes, x.usage_bytes, x.committed_bytes, x.max_live_agents,
            x.alive)
        assert more.without_agent(peak) == x
        fewer = x.without_agent(peak)
        assert fewer.queued_bytes == max(x.queued_bytes - peak, 0)
        assert fewer.live_agents == max(x.live_agents - 1, 0)


def test_move_only_off_a_saturated_node_to_one_lower_by_the_gain():
    cfg = config(move_above_ratio=1.5, move_gain=0.5)
    hot = load("hot", queued_mib=1600)  # 1.5625x
    cool = load("cool", queued_mib=0)   # 0.125x with the agent
    target = move_target(hot, [hot, cool], PEAK, cfg)
    assert isinstance(target, Placed)
    assert target.node == "cool"
    assert "hot at 1.56x" in target.reason
    # below move_above_ratio: stays
    warm = load("warm", queued_mib=1500)  # 1.46x
    assert move_target(warm, [warm, cool], PEAK, cfg) is None
    # the best other node is not lower by move_gain: stays
    near = load("near", queued_mib=1100)  # 1.2x with the agent; 1.2 + 0.5 > 1.5625
    assert move_target(hot, [hot, near], PEAK, cfg) is None
    # the gain is just met: moves
    just = load("just", queued_mib=1024 + 64 - 128 - 512)  # (1.0625 - 0.5) with agent
    assert move_target(load("at", queued_mib=1088), [just], PEAK,
                       config(move_above_ratio=1.0, move_gain=0.5)) == Placed(
        "just", "at at 1.06x its budget, just at 0.56x with the agent")
    # never to itself, never to a node without room
    assert move_target(hot, [hot], PEAK, cfg) is None
    assert move_target(hot, [hot, load("cool", alive=False)], PEAK, cfg) is None
    # the least loaded of the others
    target = move_target(hot, [hot, load("b", 300), cool, load("c", 100)], PEAK, cfg)
    assert target is not None
    assert target.node == "cool"


def test_round_robin_never_moves():
    hot = load("hot", queued_mib=4000)
    assert move_target(hot, [hot, load("cool")], PEAK, config("round-robin")) is None
    assert move_target(hot, [hot, load("cool")], PEAK, config("least-loaded")) is not None


@settings(max_examples=150, deadline=None)
@given(node_loads, peaks, st.sampled_from(["p2c", "least-loaded", "round-robin"]))
def test_a_move_target_always_has_room_and_the_gain(loads, peak, strategy):
    cfg = config(strategy)
    current = loads[0]
    target = move_target(current, loads, peak, cfg)
    if target is None:
        return
    assert strategy != "round-robin"
    assert current.ratio() >= cfg.move_above_ratio
    chosen = next(x for x in loads if x.node == target.node)
    assert chosen.node != current.node
    assert why_no_room(chosen, peak, cfg) is None
    assert chosen.ratio(peak) + cfg.move_gain <= current.ratio()
