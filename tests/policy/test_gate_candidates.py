"""The order in which the gate serves sandboxes competing for room, and the growth-state
rule that order relies on."""

from hypothesis import given
from hypothesis import strategies as st

from tenon.policy.config import PolicyConfig
from tenon.policy.gate import gate_demand_bytes
from tenon.policy.growth import GrowthEstimate, GrowthState, classify
from tenon.policy.pressure import Pressure

from .factories import gate_decision

MIB = 1024 * 1024
CONFIG = PolicyConfig()
BAND = CONFIG.resident_band_bytes_per_s

rates = st.one_of(
    st.none(),
    st.sampled_from([0.0, BAND / 2, BAND, BAND + 1, -BAND]),
    st.floats(-64 * MIB, 512 * MIB, allow_nan=False),
)
caps = st.one_of(st.none(), st.integers(-512 * MIB, 512 * MIB),
                 st.sampled_from([0, 1, int(BAND * CONFIG.horizon_s)]))


@given(rates, st.one_of(st.none(), st.floats(0, 20)), st.booleans(), caps, st.floats(0, 20))
def test_a_positive_demand_is_growing_when_allowed_and_paused_when_held(
        rate, last_growth_at, allowed, cap, now) -> None:
    # The gate ranks candidates by permission alone, standing for this growth state.
    estimate = GrowthEstimate("sb", rate, last_growth_at, allowed)
    if gate_demand_bytes(estimate, cap, CONFIG) > 0:
        expected = GrowthState.GROWING if allowed else GrowthState.PAUSED_GROWING
        assert classify(estimate, now, CONFIG) is expected


def test_slots_go_to_running_then_holding_then_overdue_then_smaller_then_id() -> None:
    now = 100.0
    rate = 50 * MIB  # demand over the one-second horizon: 50 MiB
    estimates = {
        "a-start": GrowthEstimate("a-start", None, None, False),  # bootstrap: 16 MiB
        "b-held-small": GrowthEstimate("b-held-small", rate * 0.8, now, False),
        "c-held-big": GrowthEstimate("c-held-big", rate * 1.6, now, False),
        "d-held-late": GrowthEstimate("d-held-late", rate * 1.6, now, False),
        "e-run": GrowthEstimate("e-run", rate * 2, now, True),
    }
    d = gate_decision(
        estimates, Pressure.YELLOW, 4096 * MIB, now, CONFIG, budget_b=5,
        denied_since={"a-start": now - 4, "b-held-small": now - 2, "c-held-big": now - 2,
                      "d-held-late": now - 4},
        pending=frozenset({"a-start"}))
    assert d.allowed == frozenset(estimates)
    slot = {sid: d.reasons[sid].split(":")[0] for sid in estimates}
    assert slot == {
        "e-run": "yellow slot 1/5",  # already running
        "d-held-late": "yellow slot 2/5",  # overdue
        "b-held-small": "yellow slot 3/5",  # smaller demand
        "c-held-big": "yellow slot 4/5",
        "a-start": "yellow slot 5/5",  # a start holds no memory yet: last, overdue or not
    }
    assert d.reasons["d-held-late"].endswith("(overdue)")
    assert d.reasons["a-start"] == "yellow slot 5/5: demand 16777216 B fits (overdue)"


def test_every_slot_taken_denies_the_rest_with_one_shared_reason() -> None:
    now = 100.0
    estimates = {f"sb-{i}": GrowthEstimate(f"sb-{i}", 50 * MIB, now, True) for i in range(4)}
    d = gate_decision(estimates, Pressure.RED, 4096 * MIB, now, CONFIG, budget_b=3)
    assert d.allowed == {"sb-0"}
    assert d.reasons["sb-0"] == f"red probe: demand {50 * MIB} B fits"
    assert {d.reasons[f"sb-{i}"] for i in (1, 2, 3)} == {"red: all 1 growth slots taken"}
    assert len(d.reasons) == 4
    assert set(d.reasons) == set(estimates)
