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


# -- AgentCgroup on cgroup v2: memory.high per tool call, tightened under pressure ----------
#
# As its authors describe it (Zheng et al., "AgentCgroup: Understanding and Controlling OS
# Resources of AI Agents", and their agentcgroupd's cgroup v2 controller): sessions are High
# or Low priority; each tool call runs under a memory.high mark from its hint; a controller
# polls for pressure (growth of the parent's memory PSI "some" stall total, the parent's usage
# at 85% of its memory.max, or memory.high events of High sessions) and, when it sees any,
# throttles Low sessions by lowering their memory.high to half of the parent's limit for a
# protection window (1 s), after which the normal marks return and pressure is checked again:
# the kernel throttles and reclaims over memory.high instead of OOM-killing.
#
# Implemented here: the classes, the per-tool-call mark for Low sandboxes (a sandbox is
# Tenon's per-agent cgroup, so the mark is set on it at each action's start rather than on a
# per-call child cgroup), the PSI and usage signals read from the workload domain, the Low
# share of the budget split equally among the Low sandboxes running (there is no common Low
# parent cgroup to put one mark on), and the window. Not implemented: memory.low protection
# of High sandboxes during the window (the sandbox meter has no memory.low), the High
# sessions' memory.high-event signal (High sandboxes carry no mark), the eBPF paths
# (memcg_bpf_ops over-high delays and below_low protection, which need a patched kernel;
# sched_ext CPU weights), and the agent's resource hints.


@dataclass(frozen=True, slots=True)
class AgentCgroupDomainObs:
    """One period's view of the workload domain."""

    usage_bytes: int
    limit_bytes: int | None
    psi_some_total_us: int | None
    """The domain's memory PSI "some" stall total; None without PSI."""


@dataclass(frozen=True, slots=True)
class AgentCgroupState:
    """What the v2 controller carries from one period to the next."""

    protected_since: float | None = None
    """When the Low marks were last tightened (None: the normal per-tool-call marks)."""
    psi_some_total_us: int | None = None
    """The PSI total last compared against (its growth is a pressure signal)."""


@dataclass(frozen=True, slots=True)
class AgentCgroupPlan:
    state: AgentCgroupState
    marks: tuple[AgentCgroupAction, ...]
    """memory.high for every sandbox given, sorted by id (None: no mark)."""
    trigger: str | None
    """The signal that tightened the marks this period, if one did."""


def agentcgroup_pressure(domain: AgentCgroupDomainObs, last_psi_total_us: int | None,
                         config: PolicyConfig) -> str | None:
    """Which pressure signal fires, if any: the domain's PSI stall grew, or its usage reached
    `agentcgroup_pressure_usage_fraction` of its limit."""
    psi = domain.psi_some_total_us
    if psi is not None and last_psi_total_us is not None and psi > last_psi_total_us:
        return f"psi some +{psi - last_psi_total_us} us"
    limit = domain.limit_bytes
    if limit and domain.usage_bytes >= config.agentcgroup_pressure_usage_fraction * limit:
        return f"usage {domain.usage_bytes / limit:.0%} of the limit"
    return None


def agentcgroup_v2_step(sandboxes: Iterable[AgentCgroupSandbox], domain: AgentCgroupDomainObs,
                        state: AgentCgroupState, budget_bytes: int, now: float,
                        config: PolicyConfig) -> AgentCgroupPlan:
    """One period of AgentCgroup on v2: the memory.high of each running sandbox."""
    since, trigger = state.protected_since, None
    if since is not None and now - since >= config.agentcgroup_protection_window_s:
        since = None  # the window is over: normal marks, and pressure is checked afresh
        psi_seen = domain.psi_some_total_us
    elif since is not None:
        psi_seen = state.psi_some_total_us  # stalls while protected count at the next check
    else:
        trigger = agentcgroup_pressure(domain, state.psi_some_total_us, config)
        since = now if trigger is not None else None
        psi_seen = domain.psi_some_total_us
    boxes = sorted(sandboxes, key=lambda b: b.sandbox_id)
    classes = [agentcgroup_class(b.profiled_peak_bytes, budget_bytes, config) for b in boxes]
    num_low = sum(k is AgentCgroupClass.LOW for k in classes)
    mark = config.agentcgroup_low_high_mark_bytes
    limit = domain.limit_bytes or budget_bytes
    share = int(config.agentcgroup_low_share_fraction * limit) // max(num_low, 1)
    marks = []
    for box, klass in zip(boxes, classes, strict=True):
        if klass is AgentCgroupClass.HIGH:
            marks.append(AgentCgroupAction(box.sandbox_id, klass, None, False, "high: no mark"))
        elif since is not None and share < mark:
            marks.append(AgentCgroupAction(box.sandbox_id, klass, share, False,
                                           f"low under pressure: {num_low} share "
                                           f"{config.agentcgroup_low_share_fraction:g} of "
                                           f"{limit} B"))
        else:
            marks.append(AgentCgroupAction(box.sandbox_id, klass, mark, False,
                                           f"low: per-tool-call mark {mark} B"))
    return AgentCgroupPlan(AgentCgroupState(since, psi_seen), tuple(marks), trigger)
