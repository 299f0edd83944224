"""Every predictor implements the whole `Predictor` Protocol, so the runtime can call
`observe` and `observe_running` without asking; those that do not learn during a run
predict the same afterwards."""

from __future__ import annotations

import inspect

import pytest

from tenon.predict.base import ActionContext, MeasuredAction, Prediction, Predictor
from tenon.predict.crossfit import CrossFitPredictor
from tenon.predict.forest import ForestConfig, ForestPredictor
from tenon.predict.history import HistoryPredictor
from tenon.predict.model import fit_predictor
from tenon.predict.online import OnlinePredictor
from tenon.predict.oracle import OraclePredictor
from tenon.predict.static import FixedPredictor, StaticPredictor

from .factories import GIB, MIB, make_action, make_episode

PROTOCOL_METHODS = ("predict", "observe", "observe_running")
COMMAND = "python -m pytest tests"


def context(workflow_id: str = "w1#0", *, step_index: int = 0) -> ActionContext:
    return ActionContext(workflow_id, COMMAND, "test_runner", step_index, "demo")


def every_predictor() -> list[Predictor]:
    static = StaticPredictor(heavy_peak_bytes=GIB)
    episodes = [make_episode(f"w{i}") for i in range(4)]
    recorded = {"w1#0": [make_action(COMMAND, peak_mib=100)]}
    return [
        static,
        FixedPredictor(10 * MIB, 20 * MIB),
        HistoryPredictor(static),
        fit_predictor(episodes, "forest", heavy_peak_bytes=GIB,
                      config=ForestConfig(num_trees=3)),
        OnlinePredictor(static),
        OraclePredictor(recorded, heavy_peak_bytes=GIB),
        CrossFitPredictor("static", {"w1": static}, StaticPredictor(heavy_peak_bytes=GIB)),
    ]


def _parameters(method: object) -> list[str]:
    return [name for name in inspect.signature(method).parameters  # type: ignore[arg-type]
            if name != "self"]


@pytest.mark.parametrize("predictor", every_predictor(), ids=lambda p: type(p).__name__)
def test_every_predictor_implements_the_whole_protocol(predictor: Predictor) -> None:
    assert isinstance(predictor.name, str)
    for method in PROTOCOL_METHODS:
        implemented = getattr(type(predictor), method, None)
        assert implemented is not None, f"{type(predictor).__name__} lacks {method}"
        assert _parameters(implemented) == _parameters(getattr(Predictor, method))


@pytest.mark.parametrize(
    "predictor",
    [p for p in every_predictor() if not isinstance(p, OnlinePredictor | ForestPredictor)],
    ids=lambda p: type(p).__name__,
)
def test_predictors_that_do_not_learn_online_predict_the_same_after_hearing(
        predictor: Predictor) -> None:
    # a peer of another workflow (family "demo") that needed 3 GiB, then OOM-killed
    peer = ActionContext("w9#0", "make -j8", "compiler", 0, "demo")
    before = predictor.predict(context())
    predictor.observe_running(peer, 3 * GIB)
    predictor.observe(peer, MeasuredAction("compiler", GIB, 3 * GIB, 5.0, "make -j8",
                                           oom_killed=True))
    assert predictor.predict(context()) == before


def test_crossfit_hands_a_running_peak_to_every_folds_predictor() -> None:
    folds = {"a": OnlinePredictor(StaticPredictor(heavy_peak_bytes=GIB)),
             "b": OnlinePredictor(StaticPredictor(heavy_peak_bytes=GIB))}
    fallback = OnlinePredictor(StaticPredictor(heavy_peak_bytes=GIB))
    crossfit = CrossFitPredictor("online", folds, fallback)
    crossfit.observe_running(context("a#0"), 1600 * MIB)
    for workflow_id in ("a#1", "b#0", "elsewhere#0"):
        raised = crossfit.predict(context(workflow_id))
        assert raised == Prediction(raised.avg_bytes, 1600 * MIB, heavy_risk=True)
