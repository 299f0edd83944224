"""The one typed config for Tenon's pure policies; every default lives here."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MIB = 1024 * 1024


class PolicyConfig(BaseModel):
    """Parameters of pressure, admission, residency and the execution gate.

    Defaults follow DESIGN.md (the paper's Table 5 and sweeps). Unknown keys are
    rejected, so a misspelt option fails loudly instead of silently using a default.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    control_period_s: float = Field(
        default=0.1,
        gt=0.0,
        le=10.0,
        description="Sampling and control period of the execution loop.",
    )
    horizon_s: float = Field(
        default=1.0,
        gt=0.0,
        le=60.0,
        description="Horizon over which a sandbox's growth is projected.",
    )
    ewma_alpha: float = Field(
        default=0.35, gt=0.0, le=1.0, description="EWMA weight of the newest valid growth sample."
    )
    resident_band_bytes_per_s: float = Field(
        default=4 * MIB,
        ge=0.0,
        description="Growth rate at or below which a sandbox counts as Resident (not growing).",
    )
    bootstrap_demand_bytes: int = Field(
        default=16 * MIB,
        ge=0,
        description="Projected demand assumed for a sandbox until its first valid sample.",
    )
    safety_margin_bytes: int = Field(
        default=256 * MIB, ge=0, description="S in H = max(limit - usage - S, 0)."
    )
    yellow_b0: int = Field(
        default=1, ge=1, description="Initial number of growing sandboxes under yellow."
    )
    yellow_bmax: int = Field(
        default=4, ge=1, description="Upper bound of the AIMD yellow budget b."
    )
    aimd_increase_after_s: float = Field(
        default=5.0, gt=0.0, description="Continuous green time that earns b one more slot (+1)."
    )
    min_denial_wait_s: float = Field(
        default=1.0,
        ge=0.0,
        description="A denied sandbox stays denied at least this long (unless green).",
    )
    overdue_after_s: float = Field(
        default=3.0,
        ge=0.0,
        description="A sandbox denied this long is considered before all others.",
    )
    plateau_patience_s: float = Field(
        default=5.0,
        ge=0.0,
        description=(
            "How long a denied grower waits for running actions at their plateau to end "
            "and make its room before the liveness probe lets one grower run anyway."
        ),
    )
    starvation_after_s: float = Field(
        default=30.0,
        gt=0.0,
        description=(
            "An action queued for admission this long goes ahead of every rank, oldest "
            "ready first: rank (least slack first) alone passed the leading attempts of a "
            "heavy task over for 108 s on the real 8x replay, and they finished last."
        ),
    )
    cooling_after_s: float = Field(
        default=2.0,
        ge=0.0,
        description=(
            "A sandbox whose estimate fell into the resident band within this long after "
            "it last grew is Cooling rather than Resident."
        ),
    )
    red_fraction: float = Field(
        default=0.125,
        ge=0.0,
        le=1.0,
        description="Red region: lowest fraction of the budget as headroom.",
    )
    yellow_fraction: float = Field(
        default=0.125, ge=0.0, le=1.0, description="Yellow region: the next fraction above red."
    )
    admission_window_bytes: int | None = Field(
        default=None,
        gt=0,
        description="Admission water-level window W; None means equal to the budget.",
    )
    rank_by_work_left: bool = Field(
        default=False,
        description=(
            "Rank workflows (admission order, reclaim order) by start time minus the work "
            "expected to be left (`predict.progress`: least slack first); False (the "
            "default) ranks by start time alone (oldest first). On the real 8x replays it "
            "cost p50 latency everywhere (process 61 -> 80 s; Docker 150 -> 360 s) and "
            "Docker makespan (342.6 -> 436.7 s); process makespan moved within run-to-run "
            "spread (199.2 -> 174.7 s in one pair of runs, 201.0 in another)."
        ),
    )
    max_admitted_actions: Annotated[int, Field(ge=1)] | Literal["auto"] | None = Field(
        default="auto",
        description=(
            "At most this many admitted actions at once; None means memory alone limits "
            "them; \"auto\" asks the sandbox backend (Docker: 4 per core, the process "
            "backend: none). Memory is not a host's only resource: on 2 cores the Docker "
            "daemon serving 50-60 concurrent execs made a 0.05 s action take 5 s and the "
            "control loop tick at a third of its rate; capped at 8 the same replay took "
            "342.6 s instead of 712.6 s (at 16, 418.4 s)."
        ),
    )
    max_live_workflows: Annotated[int, Field(ge=1)] | Literal["auto"] | None = Field(
        default="auto",
        description=(
            "Tenon starts at most this many workflows at once (a workflow is live from its "
            "start to its end, its sandbox resident or torn down); None means no bound; "
            "\"auto\" asks the sandbox backend (Docker: twice its action cap, the process "
            "backend: none). Workflows beyond what the backend can serve only wait in the "
            "queue, and their idle sandboxes are torn down and rebuilt: on the 8x Docker "
            "replay all 160 started within 60 s against a cap of 8 actions, and 403 of 416 "
            "teardowns were of sandboxes whose next action was queued, rebuilt a median "
            "20.5 s later at 0.3-0.7 s of daemon time each."
        ),
    )
    heavy_peak_bytes: int = Field(
        default=1024 * MIB,
        ge=0,
        description="An action whose predicted peak exceeds this is heavy.",
    )
    heavy_credit_rate_bytes_per_s: float = Field(
        default=64 * MIB,
        ge=0.0,
        description=(
            "beta: bytes per second of protected credit the oldest queued heavy action "
            "accrues; light actions may not admit into that credit, so the heavy one "
            "is eventually admitted even behind an endless stream of light ones."
        ),
    )
    hold_heavy_starts: bool = Field(
        default=False,
        description=(
            "Hold a start predicted heavy until its whole predicted growth (peak plus slack) "
            "fits, as every other start is. Off, it launches on the bootstrap demand (its whole "
            "demand still taken from the period's room) and the gate meters its measured "
            "growth; admission still charges its predicted peak. In a real 8x replay 12 of 31 "
            "heavy predictions peaked under 0.1 GiB, and room for each (2.3 GiB of a 3 GiB "
            "budget) was made by tearing down every idle sandbox."
        ),
    )
    prediction_slack_fraction: float = Field(
        default=0.25,
        ge=0.0,
        le=10.0,
        description=(
            "The gate trusts an action's predicted peak, plus this fraction and the bootstrap "
            "demand, as the bound on its growth; beyond that the prediction has failed and the "
            "measured projection counts, with `outgrown_demand_fraction` as a floor."
        ),
    )
    outgrown_demand_fraction: float = Field(
        default=1.0,
        ge=0.0,
        le=10.0,
        description=(
            "While an action that outgrew its bound still grows, its gate demand is at least "
            "this fraction of its overshoot (usage beyond the bound): a prediction that failed "
            "by 1 GiB says nothing about when the growth stops, and a growth rate measured "
            "between holds understates a burst. 0 trusts the measured rate alone."
        ),
    )
    peak_release_fraction: float = Field(
        default=0.5,
        ge=0.0,
        lt=1.0,
        description=(
            "A running action has passed its peak once its usage rose to at least this "
            "fraction of its predicted peak and then fell to at most this fraction of the "
            "peak it reached; its charge then drops to what it holds (at least its predicted "
            "average), and its predicted growth to that charge. 0 turns the release off."
        ),
    )
    lifecycle_limit: int = Field(
        default=2, ge=1, description="At most this many teardowns/rebuilds in flight at once."
    )
    reclaim_min_idle_s: float = Field(
        default=1.0,
        ge=0.0,
        description=(
            "Under yellow, a sandbox in a model wait is reclaimed only if its agent's next "
            "action is predicted at least this far off; one whose next action is queued for "
            "admission always may be, and red reclaims any. On the 8x replay the median "
            "torn-down sandbox was rebuilt 0.23 s later: 2,331 teardowns for little memory."
        ),
    )
    teardown_cost_s: float = Field(
        default=1.0, ge=0.0, description="Expected time to capture and destroy an idle sandbox."
    )
    rebuild_cost_s: float = Field(
        default=2.0, ge=0.0, description="Expected time to rematerialize a sandbox from its record."
    )

    agentcgroup_high_ratio: float = Field(
        default=0.25,
        gt=0.0,
        le=1.0,
        description=(
            "AgentCgroup baseline: a workflow whose profiled peak exceeds this fraction "
            "of the budget is High, else Low."
        ),
    )
    agentcgroup_low_high_mark_bytes: int = Field(
        default=400 * MIB,
        gt=0,
        description="AgentCgroup baseline: memory high-water mark given to Low sandboxes.",
    )

    @model_validator(mode="after")
    def _check_consistency(self) -> PolicyConfig:
        if self.yellow_b0 > self.yellow_bmax:
            raise ValueError(
                f"yellow_b0 ({self.yellow_b0}) must not exceed yellow_bmax ({self.yellow_bmax})"
            )
        if self.red_fraction + self.yellow_fraction > 1.0:
            raise ValueError("red_fraction + yellow_fraction must not exceed 1.0")
        return self

    def window_bytes(self, budget_bytes: int) -> int:
        """The admission window W for a domain of `budget_bytes` (never below 1)."""
        if self.admission_window_bytes is None:
            return max(budget_bytes, 1)
        return self.admission_window_bytes
