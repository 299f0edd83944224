"""The `oracle` predictor: every action's own recorded figures, for the bench's ablation.

A replay knows what each action will use, because the trace recorded it. Handing Tenon
those figures measures what better prediction could still gain: a policy that is slow with
the oracle is slow for a reason no predictor fixes. It is not a predictor a user can deploy
(nothing outside a replay knows the future), so only `tenon bench --predictor oracle`
offers it.

Actions are looked up by the workflow instance the runtime names (`ActionContext.workflow_id`,
the replay's `<workflow id>#<copy>`) and the step's index within the attempt. An action the
oracle was not given is a caller's mistake and fails loudly rather than being guessed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from tenon.errors import ConfigError
from tenon.policy.admission import Prediction
from tenon.predict.base import ActionContext
from tenon.units import MIB

if TYPE_CHECKING:
    from tenon.replay.trace import Workflow

logger = logging.getLogger(__name__)


class OraclePredictor:
    """Each action's recorded (avg, peak), looked up by workflow instance and step."""

    name = "oracle"

    def __init__(self, workflows: Mapping[str, Workflow], *,
                 heavy_peak_bytes: int = 1024 * MIB) -> None:
        self._workflows = dict(workflows)
        self.heavy_peak_bytes = heavy_peak_bytes

    def predict(self, context: ActionContext) -> Prediction:
        workflow = self._workflows.get(context.workflow_id)
        if workflow is None:
            raise ConfigError(f"oracle predictor: no recorded workflow {context.workflow_id!r}")
        if not 0 <= context.step_index < len(workflow.steps):
            raise ConfigError(f"oracle predictor: workflow {context.workflow_id!r} has "
                              f"{len(workflow.steps)} steps, asked for step {context.step_index}")
        memory = workflow.steps[context.step_index].action.memory
        return Prediction(memory.avg_bytes, memory.peak_bytes,
                          heavy_risk=memory.peak_bytes > self.heavy_peak_bytes)
