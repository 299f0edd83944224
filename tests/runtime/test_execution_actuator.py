"""The execution loop acts through its gate actuator: holds and releases go to it, and a
fallback to the freezer is recorded once as an event."""

from __future__ import annotations

from pathlib import Path

from tenon.host.actuator import FreezerActuator, ScxActuator
from tenon.host.scx.fake import FakeScxGate, RecordingCgroup
from tenon.policy.config import PolicyConfig
from tenon.predict.base import Prediction
from tenon.runtime.events import EventLog
from tenon.runtime.execution import ExecutionLoop, RunningAction
from tenon.sandbox.sim import SimDomain
from tenon.units import GIB, MIB


def make_loop(actuator: ScxActuator | None = None) -> tuple[ExecutionLoop, EventLog]:
    events = EventLog(None, lambda: 0.0, keep_in_memory=True)
    loop = ExecutionLoop(domain=SimDomain(GIB), config=PolicyConfig(), events=events,
                         use_gate=True, agentcgroup=False, now=lambda: 0.0, actuator=actuator)
    return loop, events


def make_action(cgroup: RecordingCgroup, action_id: str = "a1") -> RunningAction:
    action = RunningAction(action_id, "agent-1", Prediction(64 * MIB, 64 * MIB), 64 * MIB, 0.0,
                           gate_id=action_id, launched=True)
    action.meter = cgroup  # type: ignore[assignment]  # only freeze/thaw are used
    return action


def test_the_default_actuator_is_the_freezer() -> None:
    loop, _ = make_loop()
    assert isinstance(loop.actuator, FreezerActuator)


def test_holds_and_releases_go_through_the_actuator() -> None:
    gate = FakeScxGate()
    loop, _ = make_loop(ScxActuator(gate))
    cgroup = RecordingCgroup(Path("/sys/fs/cgroup/dom/sb"), journal=gate.journal)
    action = make_action(cgroup)
    loop._actuate([(action, False)])
    assert not action.allowed
    assert gate.denied == {cgroup.v2_dir}
    assert not cgroup.frozen
    loop.release_all([action])
    assert action.allowed
    assert gate.denied == set()


def test_a_fallback_is_recorded_once() -> None:
    gate = FakeScxGate()
    loop, events = make_loop(ScxActuator(gate))
    cgroup = RecordingCgroup(Path("/sys/fs/cgroup/dom/sb"))
    loop._actuate([(make_action(cgroup), False)])
    gate.is_healthy = False
    loop._check_actuator()
    loop._check_actuator()
    fallbacks = [e for e in events.events or [] if e["kind"] == "gate_actuator_fallback"]
    assert len(fallbacks) == 1
    assert fallbacks[0]["actuator"] == "scx"
    assert cgroup.frozen
    loop.close()
    assert gate.closed
