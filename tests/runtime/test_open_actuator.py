"""Which gate actuator `open_runtime` gives a policy (this host has no sched_ext)."""

from __future__ import annotations

import os

import pytest

from tenon.host.actuator import FreezerActuator
from tenon.host.scx.fake import FakeScxGate
from tenon.host.scx.loader import ScxUnavailable
from tenon.runtime.open import gate_actuator_for


def test_a_policy_without_the_gate_never_loads_a_scheduler() -> None:
    # even "scx", which would fail here: eager holds nothing, so it gets the idle freezer
    assert isinstance(gate_actuator_for("eager", "scx"), FreezerActuator)
    assert isinstance(gate_actuator_for("static-4", "auto"), FreezerActuator)


def test_an_actuator_given_is_used_as_it_is() -> None:
    from tenon.host.actuator import ScxActuator

    given = ScxActuator(FakeScxGate())
    assert gate_actuator_for("tenon", given) is given


@pytest.mark.skipif(os.path.exists("/sys/kernel/sched_ext"), reason="a host with sched_ext")
def test_on_a_host_without_sched_ext_auto_is_the_freezer_and_scx_is_refused() -> None:
    assert isinstance(gate_actuator_for("tenon", "auto"), FreezerActuator)
    with pytest.raises(ScxUnavailable, match="sched_ext"):
        gate_actuator_for("tenon", "scx")
