"""Model files: round trip, version checks, clear errors; cross-fitted predictors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import joblib
import pytest

from tenon.errors import ConfigError, ModelError
from tenon.predict.crossfit import CrossFitPredictor, crossfit_predictor
from tenon.predict.features import FEATURE_VERSION
from tenon.predict.forest import ForestPredictor
from tenon.predict.history import HistoryPredictor
from tenon.predict.model import load_model, save_model, train_model
from tenon.predict.static import StaticPredictor
from tenon.replay.predictors import crossfit_trace_predictor, episodes_from_trace, trace_predictor
from tenon.replay.trace import Trace, make_header

from .factories import GIB, MIB, big_family_trace, make_workflow


def test_train_save_load_predict_round_trip(tmp_path: Path) -> None:
    episodes = episodes_from_trace(big_family_trace())
    model = train_model(episodes, heavy_peak_bytes=GIB)
    loaded = load_model(save_model(model, tmp_path / "sub" / "model.joblib"))
    assert loaded.feature_version == FEATURE_VERSION
    assert loaded.heavy_peak_bytes == GIB
    assert loaded.static_table == model.static_table
    assert loaded.train_workflows == tuple(e.workflow_id for e in episodes)
    assert set(loaded.predictors()) == {"static", "history", "forest"}
    assert isinstance(loaded.predictor("history"), HistoryPredictor)
    contexts = [c for e in episodes for c, _ in e.contexts()]
    for kind in ("static", "history", "forest"):
        before, after = model.predictor(kind), loaded.predictor(kind)
        assert [after.predict(c) for c in contexts] == [before.predict(c) for c in contexts]
    # static's table is the fitted one: mean average and high peak of the test runs
    assert model.static_table["test_runner"][1] == 2048 * MIB
    with pytest.raises(ConfigError, match="unknown predictor"):
        model.predictor("oracle")


def test_a_model_of_another_feature_version_is_refused(tmp_path: Path) -> None:
    model = train_model(episodes_from_trace(big_family_trace()), heavy_peak_bytes=GIB)
    old = dataclasses.replace(model, feature_version=FEATURE_VERSION + 1)
    path = save_model(old, tmp_path / "old.joblib")
    with pytest.raises(
        ModelError,
        match=rf"feature version {FEATURE_VERSION + 1}.*"
        rf"feature version {FEATURE_VERSION}\b",
    ):
        load_model(path)


def test_unreadable_or_foreign_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="no such model file"):
        load_model(tmp_path / "missing.joblib")
    garbage = tmp_path / "garbage.joblib"
    garbage.write_bytes(b"not a pickle at all")
    with pytest.raises(ModelError, match="cannot read model"):
        load_model(garbage)
    foreign = tmp_path / "foreign.joblib"
    joblib.dump({"weights": [1, 2, 3]}, foreign)
    with pytest.raises(ModelError, match="not a Tenon predictor model"):
        load_model(foreign)


def test_crossfit_never_predicts_a_workflow_with_a_model_that_saw_it() -> None:
    # one odd workflow whose test runs need 3 GiB: the in-sample static figure shows it
    workflows = [make_workflow(f"w{i}", family=f"f{i}") for i in range(4)]
    workflows.append(make_workflow("odd", family="f-odd", test_peak_mib=3072, loops=3))
    trace = Trace(header=make_header("test"), workflows=workflows)
    crossfit = crossfit_trace_predictor(trace, folds=5, kind="static", heavy_peak_bytes=GIB)
    assert isinstance(crossfit, CrossFitPredictor)
    in_sample = trace_predictor(trace, kind="static", heavy_peak_bytes=GIB)
    odd_test = next(
        c for c, m in episodes_from_trace(trace)[-1].contexts() if m.action_class == "test_runner"
    )
    assert in_sample.predict(odd_test).peak_bytes == 3072 * MIB
    for copy in ("odd", "odd#0", "odd#7"):
        context = dataclasses.replace(odd_test, workflow_id=copy)
        assert crossfit.predict(context).peak_bytes == 200 * MIB
    # each workflow has its own fold here; an unknown id gets the model fitted on everything
    assert crossfit.predictor_for("w0#1") is not crossfit.predictor_for("w1#1")
    assert crossfit.predictor_for("w0#1") is crossfit.predictor_for("w0")
    unknown = dataclasses.replace(odd_test, workflow_id="elsewhere#0")
    assert crossfit.predict(unknown).peak_bytes == 3072 * MIB
    assert crossfit.name == "static"


def test_crossfit_builds_every_kind() -> None:
    trace = big_family_trace(num_big=2, num_small=4)
    for kind, inner in (
        ("forest", ForestPredictor),
        ("history", HistoryPredictor),
        ("static", StaticPredictor),
    ):
        crossfit = crossfit_predictor(episodes_from_trace(trace), folds=3, kind=kind,
                                      heavy_peak_bytes=GIB)
        assert isinstance(crossfit, CrossFitPredictor)
        assert isinstance(crossfit.predictor_for("big-0#0"), inner)
    with pytest.raises(ConfigError, match="unknown predictor"):
        crossfit_predictor(episodes_from_trace(trace), kind="oracle")
