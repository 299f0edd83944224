"""The one typed config for Tenon's pure policies; every default lives here."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

MIB = 1024 * 1024


PAPER_RESERVES: dict[str, float] = {
    "safety_margin_fraction": 1.0, "red_fraction": 0.125, "yellow_fraction": 0.125}
"""The paper's reserves (a fixed 256 MiB margin, 12.5% regions), as `PolicyConfig` fields:
the defaults keep less (the margin an eighth of a budget under 2 GiB, 5% regions)."""


class PolicyConfig(BaseModel):
    """Parameters of pressure, admission, residency and the execution gate.

    The paper's parameters (its Table 5) come first, then the few Tenon adds, each with the
    reason it exists. What a backend can serve at once is the backend's
    (`sandbox.base.BackendCapacity`), not policy. Unknown keys are rejected, so a misspelt
    option fails loudly instead of silently using a default.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    # -- the paper's parameters --------------------------------------------------------
    control_period_s: float = Field(
        default=0.1, gt=0.0, le=10.0,
        description="Sampling and control period of the execution loop.")
    horizon_s: float = Field(
        default=1.0, gt=0.0, le=60.0,
        description="Horizon over which a sandbox's growth is projected.")
    ewma_alpha: float = Field(
        default=0.35, gt=0.0, le=1.0,
        description="EWMA weight of the newest valid growth sample.")
    resident_band_bytes_per_s: float = Field(
        default=4 * MIB, ge=0.0,
        description="Growth rate at or below which a sandbox counts as not growing.")
    bootstrap_demand_bytes: int = Field(
        default=16 * MIB, ge=0,
        description="Projected demand of a sandbox until its first valid sample.")
    safety_margin_bytes: int = Field(
        default=256 * MIB, ge=0,
        description="S in H = max(limit - usage - S, 0), at most: room for growth between "
        "samples (the paper's value, 3% of its 8 GB host).")
    yellow_b0: int = Field(
        default=1, ge=1, description="Initial number of growing sandboxes under yellow.")
    yellow_bmax: int = Field(
        default=4, ge=1, description="Upper bound of the AIMD yellow budget b.")
    aimd_increase_after_s: float = Field(
        default=5.0, gt=0.0, description="Continuous green time that earns b one more slot.")
    min_denial_wait_s: float = Field(
        default=1.0, ge=0.0,
        description="A denied sandbox stays denied at least this long (unless green): no "
        "flapping between freeze and thaw.")
    overdue_after_s: float = Field(
        default=3.0, ge=0.0,
        description="A sandbox denied this long is considered before all others.")
    red_fraction: float = Field(
        default=0.05, ge=0.0, le=1.0,
        description="Red region: the lowest fraction of the budget as headroom (the paper's "
        "12.5% holds back a quarter of a small budget with yellow).")
    yellow_fraction: float = Field(
        default=0.05, ge=0.0, le=1.0,
        description="Yellow region: the next fraction of the budget above red (the paper: "
        "12.5%).")
    admission_window_bytes: int | None = Field(
        default=None, gt=0,
        description="Admission water-level window W; None: equal to the budget.")
    heavy_peak_bytes: int = Field(
        default=1024 * MIB, ge=0,
        description="An action whose predicted peak exceeds this is heavy.")
    heavy_credit_rate_bytes_per_s: float = Field(
        default=64 * MIB, ge=0.0,
        description="beta: protected credit per second of the oldest queued heavy action, "
        "so that a stream of light actions cannot starve it.")
    lifecycle_limit: int = Field(
        default=2, ge=1,
        description="At most this many teardowns and rebuilds in flight at once.")
    teardown_cost_s: float = Field(
        default=1.0, ge=0.0,
        description="Expected time to capture and destroy an idle sandbox.")
    rebuild_cost_s: float = Field(
        default=2.0, ge=0.0,
        description="Expected time to rebuild a sandbox from its record; with the teardown "
        "cost, the model wait a teardown under green must amortize.")

    # -- what Tenon adds ----------------------------------------------------------------
    safety_margin_fraction: float = Field(
        default=1 / 8, gt=0.0, le=1.0,
        description="S is this fraction of the budget, up to `safety_margin_bytes`: with "
        "the paper's fixed 256 MiB and 12.5% regions a small budget is mostly held back "
        "(a 1.5 GiB budget more than a third).")
    plateau_patience_s: float = Field(
        default=5.0, ge=0.0,
        description="How long a held grower waits for actions at their plateau to end "
        "before the liveness probe lets one grower run anyway: their ends may be minutes off.")
    starvation_after_s: float = Field(
        default=30.0, gt=0.0,
        description="An action queued this long goes ahead of every rank, oldest first: "
        "rank order alone can pass a workflow's actions over indefinitely.")
    cooling_after_s: float = Field(
        default=2.0, ge=0.0,
        description="A sandbox that stopped growing this recently is Cooling, not Resident: "
        "a pause between two allocations is not the end of growth.")
    prediction_slack_fraction: float = Field(
        default=0.25, ge=0.0, le=10.0,
        description="The gate trusts a predicted peak plus this fraction (and the bootstrap "
        "demand) as the bound on an action's growth; beyond it the measured projection "
        "counts.")
    outgrown_demand_fraction: float = Field(
        default=1.0, ge=0.0, le=10.0,
        description="While an action past its bound still grows, its gate demand is at "
        "least this fraction of its overshoot: a failed prediction says nothing about when "
        "growth stops, and a rate measured between holds understates a burst.")
    peak_release_fraction: float = Field(
        default=0.5, ge=0.0, lt=1.0,
        description="An action that rose to this fraction of its predicted peak and fell to "
        "this fraction of the peak it reached has passed it: its charge drops to what it "
        "holds, so a short spike does not hold the window for the rest of the action. 0: "
        "never.")
    reclaim_min_idle_s: float = Field(
        default=1.0, ge=0.0,
        description="Under yellow, a sandbox in a model wait is reclaimed only if its next "
        "action is predicted at least this far off: a sandbox needed again at once frees "
        "nothing worth a teardown and a rebuild.")

    # -- the AgentCgroup baseline -------------------------------------------------------
    agentcgroup_high_ratio: float = Field(
        default=0.25, gt=0.0, le=1.0,
        description="AgentCgroup: a workflow whose profiled peak exceeds this fraction of "
        "the budget is High, else Low.")
    agentcgroup_low_high_mark_bytes: int = Field(
        default=400 * MIB, gt=0,
        description="AgentCgroup: the memory high-water mark given to Low sandboxes at each "
        "tool call (memory.high on v2; enforced by CPU throttling on v1).")
    agentcgroup_pressure_usage_fraction: float = Field(
        default=0.85, gt=0.0, le=1.0,
        description="AgentCgroup on v2: the domain's usage at this fraction of its limit is "
        "pressure (one of its signals, with any growth of the domain's memory PSI stall).")
    agentcgroup_low_share_fraction: float = Field(
        default=0.5, gt=0.0, le=1.0,
        description="AgentCgroup on v2: under pressure the Low sandboxes together get this "
        "fraction of the budget as memory.high, shared equally among those running.")
    agentcgroup_protection_window_s: float = Field(
        default=1.0, gt=0.0,
        description="AgentCgroup on v2: how long the tightened marks hold once pressure is "
        "seen; then the per-tool-call marks return and pressure is checked afresh.")

    @model_validator(mode="after")
    def _check_consistency(self) -> PolicyConfig:
        if self.yellow_b0 > self.yellow_bmax:
            raise ValueError(
                f"yellow_b0 ({self.yellow_b0}) must not exceed yellow_bmax ({self.yellow_bmax})"
            )
        if self.red_fraction + self.yellow_fraction > 1.0:
            raise ValueError("red_fraction + yellow_fraction must not exceed 1.0")
        return self

    def safety_margin(self, budget_bytes: int) -> int:
        """S for a domain of `budget_bytes`: its `safety_margin_fraction`, at most
        `safety_margin_bytes`."""
        return min(self.safety_margin_bytes, int(self.safety_margin_fraction * budget_bytes))

    def window_bytes(self, budget_bytes: int) -> int:
        """The admission window W for a domain of `budget_bytes` (never below 1)."""
        if self.admission_window_bytes is None:
            return max(budget_bytes, 1)
        return self.admission_window_bytes
