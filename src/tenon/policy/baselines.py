"""Baseline policies and Tenon's ablations, as names and pure decisions.

Every policy runs on the same runtime; a `PolicySpec` says which of Tenon's
controls are active, and the baselines that decide something (static-N,
reservation, agentcgroup) do so here as pure functions.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tenon.errors import ConfigError
from tenon.policy.config import PolicyConfig


class PolicyKind(enum.Enum):
    TENON = "tenon"
    EAGER = "eager"
    STATIC = "static"
    RESERVATION = "reservation"
    AGENTCGROUP = "agentcgroup"


@dataclass(frozen=True, slots=True)
class PolicySpec:
    name: str
    kind: PolicyKind
    max_workflows: int | None = None
    """static-N: at most this many workflows at once."""
    use_admission: bool = False
    use_gate: bool = False
    use_residency: bool = False
    static_predictor: bool = False
    unlimited_memory: bool = False
    """The domain gets no memory limit: the same work with memory unconstrained (the floor
    every other policy is judged against)."""


_FIXED: dict[str, PolicySpec] = {
    "tenon": PolicySpec("tenon", PolicyKind.TENON, None, True, True, True),
    "tenon-no-admission": PolicySpec(
        "tenon-no-admission", PolicyKind.TENON, None, False, True, True
    ),
    "tenon-no-gate": PolicySpec("tenon-no-gate", PolicyKind.TENON, None, True, False, True),
    "tenon-always-resident": PolicySpec(
        "tenon-always-resident", PolicyKind.TENON, None, True, True, False
    ),
    "tenon-static-predictor": PolicySpec(
        "tenon-static-predictor", PolicyKind.TENON, None, True, True, True, True
    ),
    "eager": PolicySpec("eager", PolicyKind.EAGER),
    "unconstrained": PolicySpec("unconstrained", PolicyKind.EAGER, unlimited_memory=True),
    "reservation": PolicySpec("reservation", PolicyKind.RESERVATION),
    "agentcgroup": PolicySpec("agentcgroup", PolicyKind.AGENTCGROUP),
}
_STATIC_RE = re.compile(r"^static-([1-9][0-9]*)$")
POLICY_NAMES: tuple[str, ...] = (*_FIXED, "static-N")


def parse_policy(name: str) -> PolicySpec:
    """Parse a policy name; unknown names raise ConfigError listing the known ones."""
    key = name.strip().lower()
    if key in _FIXED:
        return _FIXED[key]
    match = _STATIC_RE.match(key)
    if match:
        n = int(match.group(1))
        return PolicySpec(key, PolicyKind.STATIC, max_workflows=n)
    raise ConfigError(
        f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES)} (N a positive integer)"
    )


@dataclass(frozen=True, slots=True)
class WorkflowRequest:
    workflow_id: str
    profiled_peak_bytes: int
    submitted_at: float


def eager_admit(queued: Iterable[WorkflowRequest]) -> list[str]:
    """eager: admit everything, never gate, always resident."""
    return [w.workflow_id for w in queued]


def static_admit(
    queued: Sequence[WorkflowRequest], num_running: int, max_workflows: int
) -> list[str]:
    """static-N: FIFO, at most `max_workflows` workflows running at once."""
    num_free = max(max_workflows - num_running, 0)
    ordered = sorted(queued, key=lambda w: (w.submitted_at, w.workflow_id))
    return [w.workflow_id for w in ordered[:num_free]]


def reservation_admit(
    queued: Sequence[WorkflowRequest], reserved_bytes: int, budget_bytes: int
) -> list[str]:
    """reservation: strict FIFO while each workflow's lifetime peak fits the budget.

    A workflow whose peak alone exceeds the budget is admitted only when nothing
    else is reserved, so it cannot block the queue forever.
    """
    admitted: list[str] = []
    total = reserved_bytes
    for w in sorted(queued, key=lambda w: (w.submitted_at, w.workflow_id)):
        peak = max(w.profiled_peak_bytes, 0)
        if total + peak <= budget_bytes or total == 0:
            admitted.append(w.workflow_id)
            total += peak
        else:
            break
    return admitted


class AgentCgroupClass(enum.Enum):
    HIGH = "high"
    LOW = "low"


@dataclass(frozen=True, slots=True)
class AgentCgroupSandbox:
    sandbox_id: str
    profiled_peak_bytes: int
    usage_bytes: int


@dataclass(frozen=True, slots=True)
class AgentCgroupAction:
    sandbox_id: str
    klass: AgentCgroupClass
    high_mark_bytes: int | None
    """memory.high to set (v2) or the mark to enforce by throttling (v1); None = no mark."""
    throttle_cpu: bool
    """v1 only: the sandbox is over its mark, so its CPU is throttled this period."""
    reason: str


def agentcgroup_class(peak_bytes: int, budget_bytes: int, config: PolicyConfig) -> AgentCgroupClass:
    if peak_bytes > config.agentcgroup_high_ratio * budget_bytes:
        return AgentCgroupClass.HIGH
    return AgentCgroupClass.LOW


def agentcgroup_actions(
    sandboxes: Iterable[AgentCgroupSandbox],
    budget_bytes: int,
    cgroup_version: int,
    config: PolicyConfig,
) -> list[AgentCgroupAction]:
    """Which sandboxes get the Low high-water mark, and (v1) which are throttled now."""
    if cgroup_version not in (1, 2):
        raise ConfigError(f"cgroup_version must be 1 or 2, got {cgroup_version}")
    mark = config.agentcgroup_low_high_mark_bytes
    actions: list[AgentCgroupAction] = []
    for box in sorted(sandboxes, key=lambda b: b.sandbox_id):
        klass = agentcgroup_class(box.profiled_peak_bytes, budget_bytes, config)
        if klass is AgentCgroupClass.HIGH:
            actions.append(AgentCgroupAction(box.sandbox_id, klass, None, False, "high: no mark"))
            continue
        over = box.usage_bytes > mark
        throttle = cgroup_version == 1 and over
        reason = f"low: mark {mark} B" + (", over it: CPU throttled (v1)" if throttle else "")
        actions.append(AgentCgroupAction(box.sandbox_id, klass, mark, throttle, reason))
    return actions
