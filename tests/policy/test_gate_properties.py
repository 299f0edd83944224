"""Invariants of the execution gate and admission, over generated inputs."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from tenon.policy.admission import ActionRequest, AdmissionController, ChargeNotHeld, Prediction
from tenon.policy.config import PolicyConfig
from tenon.policy.gate import AimdBudget
from tenon.policy.growth import GrowthEstimate
from tenon.policy.pressure import Pressure

from .factories import gate_decision

MIB = 1024 * 1024
CONFIG = PolicyConfig()


def make_estimate(sid: str, *, rate_mib_s: float | None = 50.0, allowed: bool = True):
    rate = None if rate_mib_s is None else rate_mib_s * MIB
    return GrowthEstimate(sid, rate, None, allowed, 0 if rate is None else 3)


def test_recently_denied_sandbox_waits_before_reconsideration():
    estimates = {"a": make_estimate("a")}
    held = gate_decision(
        estimates, Pressure.YELLOW, 4096 * MIB, 10.0, CONFIG, budget_b=4, denied_since={"a": 9.5}
    )
    assert held.denied == {"a"}
    later = gate_decision(
        estimates, Pressure.YELLOW, 4096 * MIB, 10.6, CONFIG, budget_b=4, denied_since={"a": 9.5}
    )
    assert later.allowed == {"a"}


@given(levels=st.lists(st.sampled_from(list(Pressure)), max_size=60))
def test_aimd_budget_stays_in_bounds_and_halves_on_increase(levels):
    budget = AimdBudget(CONFIG.yellow_bmax, Pressure.GREEN, None)
    now = 0.0
    for level in levels:
        now += 1.0
        nxt = budget.step(level, now, CONFIG)
        assert 1 <= nxt.b <= CONFIG.yellow_bmax
        if level > budget.last_level:
            assert nxt.b == max(1, budget.b // 2)
        budget = nxt


def test_aimd_grows_one_per_period_of_green():
    budget = AimdBudget(1, Pressure.YELLOW, None).step(Pressure.GREEN, 0.0, CONFIG)
    assert budget.step(Pressure.GREEN, CONFIG.aimd_increase_after_s * 2, CONFIG).b == 3


@settings(deadline=None)
@given(peaks=st.lists(st.integers(1, 3000), min_size=1, max_size=30))
def test_admitted_charge_released_exactly_once(peaks):
    ctl = AdmissionController(CONFIG, window_bytes=4096 * MIB)
    for i, peak in enumerate(peaks):
        ctl.submit(ActionRequest(f"a{i}", f"w{i}", Prediction(peak * MIB // 2, peak * MIB), 0.0))
    admitted = ctl.decide(now=1.0, headroom_bytes=4096 * MIB)
    assert sum(d.charge_bytes for d in admitted) == ctl.admitted_total_bytes
    for d in admitted:
        assert ctl.release(d.action_id) == d.charge_bytes
        with pytest.raises(ChargeNotHeld):
            ctl.release(d.action_id)
    assert ctl.admitted_total_bytes == 0


def test_unknown_config_key_is_rejected_by_name():
    with pytest.raises(ValidationError, match="horizon_secs"):
        PolicyConfig(horizon_secs=2.0)  # type: ignore[call-arg]
