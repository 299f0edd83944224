"""Pure policy decisions: pressure, admission, residency, the execution gate, baselines.

No I/O and no clock reads: every function takes a snapshot and `now`.
"""

from tenon.policy.admission import (
    ActionRequest,
    AdmissionController,
    AdmitDecision,
    ChargeNotHeld,
    admission_charge,
    water_level_charge,
)
from tenon.policy.baselines import PolicyKind, PolicySpec, parse_policy
from tenon.policy.config import PolicyConfig
from tenon.policy.gate import (
    AimdBudget,
    GateController,
    GateDecision,
    GateView,
    Verdict,
    Why,
    decide_gate,
)
from tenon.policy.growth import GrowthEstimate, GrowthEstimator, GrowthState, SandboxSample
from tenon.policy.pressure import Pressure, PressureState, classify_pressure
from tenon.policy.residency import (
    IdleSandbox,
    LifecycleSlots,
    Rebuild,
    RebuildDecision,
    Residency,
    ResidencyDecision,
    ResidencySnapshot,
    choose_reclaim,
    rebuild_decision,
    residency_decision,
)
from tenon.predict.base import Prediction

__all__ = [
    "ActionRequest",
    "AdmissionController",
    "AdmitDecision",
    "AimdBudget",
    "ChargeNotHeld",
    "GateController",
    "GateDecision",
    "GateView",
    "Verdict",
    "Why",
    "GrowthEstimate",
    "GrowthEstimator",
    "GrowthState",
    "IdleSandbox",
    "LifecycleSlots",
    "PolicyConfig",
    "PolicyKind",
    "PolicySpec",
    "Prediction",
    "Pressure",
    "PressureState",
    "Rebuild",
    "RebuildDecision",
    "Residency",
    "ResidencyDecision",
    "ResidencySnapshot",
    "SandboxSample",
    "choose_reclaim",
    "classify_pressure",
    "decide_gate",
    "parse_policy",
    "rebuild_decision",
    "residency_decision",
    "admission_charge",
    "water_level_charge",
]
