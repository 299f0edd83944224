"""The `oracle` predictor: every action's own recorded figures, for the bench's ablation.

A replay knows what each action will use, because the trace recorded it. Handing Tenon
those figures measures what better prediction could still gain: a policy that is slow with
the oracle is slow for a reason no predictor fixes. It is not a predictor a user can deploy
(nothing outside a replay knows the future), so only `tenon bench --predictor oracle`
offers it.

Actions are looked up by the workflow instance the runtime names (`ActionContext.workflow_id`,
the replay's `<workflow id>#<copy>`) and the step's index within the attempt. An action the
oracle was not given is a caller's mistake and fails loudly rather than being guessed.
`replay.predictors.oracle_predictor` builds one from a trace's workflows.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from tenon.errors import ConfigError
from tenon.predict.base import ActionContext, MeasuredAction, Prediction
from tenon.units import MIB

logger = logging.getLogger(__name__)


class OraclePredictor:
    """Each action's recorded (avg, peak), looked up by workflow instance and step."""

    name = "oracle"

    def __init__(self, recorded: Mapping[str, Sequence[MeasuredAction]], *,
                 heavy_peak_bytes: int = 1024 * MIB) -> None:
        """`recorded`: per workflow instance, every step's recorded figures, in order."""
        self._recorded = {instance: tuple(steps) for instance, steps in recorded.items()}
        self.heavy_peak_bytes = heavy_peak_bytes

    def predict(self, context: ActionContext) -> Prediction:
        steps = self._recorded.get(context.workflow_id)
        if steps is None:
            raise ConfigError(f"oracle predictor: no recorded workflow {context.workflow_id!r}")
        if not 0 <= context.step_index < len(steps):
            raise ConfigError(f"oracle predictor: workflow {context.workflow_id!r} has "
                              f"{len(steps)} steps, asked for step {context.step_index}")
        recorded = steps[context.step_index]
        return Prediction(recorded.avg_bytes, recorded.peak_bytes,
                          heavy_risk=recorded.peak_bytes > self.heavy_peak_bytes)

    def observe(self, context: ActionContext, measured: MeasuredAction) -> None:
        """Learns nothing: it already knows every action's figures."""

    def observe_running(self, context: ActionContext, peak_bytes: int) -> None:
        """Learns nothing: it already knows every action's figures."""
