"""The history and forest predictors."""

from __future__ import annotations

import pickle

import pytest

from tenon.predict.base import ActionContext, MeasuredAction
from tenon.predict.evaluate import replay, score
from tenon.predict.forest import ForestConfig, ForestPredictor
from tenon.predict.history import HistoryPredictor
from tenon.predict.model import fit_predictor
from tenon.predict.splits import split_workflows
from tenon.predict.static import StaticPredictor
from tenon.replay.predictors import crossfit_trace_predictor, episodes_from_trace

from .factories import GIB, MIB, big_family_trace, make_action, make_episode


def test_history_predicts_the_previous_actions_figures() -> None:
    static = StaticPredictor({"test_runner": (100 * MIB, 300 * MIB)}, heavy_peak_bytes=GIB)
    history = HistoryPredictor(static)
    first = ActionContext("w", "pytest", "test_runner", 0)
    assert history.predict(first) == static.predict(first)
    earlier = (
        make_action("pytest", peak_mib=1500, avg_mib=400),
        make_action("ls", action_class="search", peak_mib=40, avg_mib=30),
    )
    prediction = history.predict(ActionContext("w", "pytest", "test_runner", 2, history=earlier))
    assert (prediction.avg_bytes, prediction.peak_bytes) == (30 * MIB, 40 * MIB)
    assert not prediction.heavy_risk
    after_heavy = history.predict(ActionContext("w", "ls", "search", 1, history=earlier[:1]))
    assert after_heavy.peak_bytes == 1500 * MIB
    assert after_heavy.heavy_risk


def test_forest_learns_a_family_pattern_that_static_cannot() -> None:
    episodes = episodes_from_trace(big_family_trace())
    train, test = split_workflows(episodes, test_fraction=0.34, seed=0, heavy_peak_bytes=GIB)
    assert {e.family for e in test} >= {"bigrepo"}
    static = fit_predictor(train, "static", heavy_peak_bytes=GIB)
    forest = fit_predictor(train, "forest", heavy_peak_bytes=GIB)
    static_scores = score(replay(static, test), heavy_peak_bytes=GIB)
    forest_scores = score(replay(forest, test), heavy_peak_bytes=GIB)
    assert forest_scores.heavy_recall_pct == 100.0
    assert forest_scores.heavy_precision_pct == 100.0
    assert static_scores.heavy_precision_pct is not None
    assert static_scores.heavy_precision_pct < 60.0  # every test run looks alike to static
    assert forest_scores.mae_mib < static_scores.mae_mib / 3
    big_test_run = next(
        c
        for e in test
        if e.family == "bigrepo"
        for c, m in e.contexts()
        if m.action_class == "test_runner"
    )
    assert forest.predict(big_test_run).peak_bytes > GIB


def test_forest_predict_many_matches_predict_and_light_observations_change_nothing() -> None:
    episodes = episodes_from_trace(big_family_trace())
    forest = fit_predictor(episodes, "forest", heavy_peak_bytes=GIB)
    assert isinstance(forest, ForestPredictor)
    contexts = [c for c, _ in episodes[0].contexts()]
    one_by_one = [forest.predict(c) for c in contexts]
    assert forest.predict_many(contexts) == one_by_one
    for context in contexts:
        forest.observe(context, make_action(context.command, peak_mib=900))
    assert [forest.predict(c) for c in contexts] == one_by_one
    assert all(p.avg_bytes <= p.peak_bytes for p in one_by_one)


def _light_forest(**config: object) -> ForestPredictor:
    """Trained on light workflows only: the forests alone cannot call anything heavy."""
    episodes = [make_episode(f"w{i}") for i in range(3)]
    forest = fit_predictor(episodes, "forest", heavy_peak_bytes=GIB,
                           config=ForestConfig(num_trees=5, **config))  # type: ignore[arg-type]
    assert isinstance(forest, ForestPredictor)
    return forest


def test_forest_without_heavy_examples_has_no_classifier() -> None:
    forest = _light_forest()
    assert forest.classifier is None
    assert forest.regressor.num_trees == 5
    assert not forest.predict(next(make_episode("w0").contexts())[0]).heavy_risk


@pytest.mark.parametrize("oom_killed", [False, True])
def test_forest_remembers_a_heavy_run_for_the_rest_of_its_family(oom_killed: bool) -> None:
    forest = _light_forest()
    first = ActionContext("repo-1#1", "python3 -m pytest tests/", "test_runner", 15, "repo")
    if oom_killed:  # stopped at 600 MiB by the OOM killer: it needed more than that
        measured = MeasuredAction("test_runner", 400 * MIB, 600 * MIB, 3.0,
                                  first.command, oom_killed=True)
    else:
        measured = make_action(first.command, peak_mib=1600)
    before = forest.predict(first)
    assert not before.heavy_risk
    forest.observe(first, measured)

    copy = ActionContext("repo-1#2", "python -m pytest tests/ 2>&1 | tail", "test_runner", 15,
                         "repo")
    other_family = ActionContext("lib-9", first.command, "test_runner", 15, "lib")
    other_command = ActionContext("repo-1#2", "pytest tests/test_x.py", "test_runner", 3, "repo")
    flagged = forest.predict(copy)
    assert flagged.heavy_risk
    assert flagged.peak_bytes >= (GIB if oom_killed else 1600 * MIB)
    assert forest.predict(other_family) == before
    assert not forest.predict(other_command).heavy_risk
    # a model file carries what was trained, not what one run observed
    assert pickle.loads(pickle.dumps(forest)).predict(copy) == forest.predict(
        ActionContext("fresh", copy.command, "test_runner", 15, "fresh-family"))


def test_forest_remembers_a_heavy_run_by_task_when_the_task_is_known() -> None:
    forest = _light_forest()
    command = "python3 -m pytest tests/"

    def context(workflow: str, task: str) -> ActionContext:
        return ActionContext(workflow, command, "test_runner", 15, "repo", None, (), task)

    forest.observe(context("repo-1#1", "repo-1"), make_action(command, peak_mib=1600))
    assert forest.predict(context("repo-1#2", "repo-1")).heavy_risk
    # the same repository's other task runs the same command, but not the same tests
    assert not forest.predict(context("repo-2#1", "repo-2")).heavy_risk


def test_crossfit_hands_run_time_observations_to_every_fold() -> None:
    crossfit = crossfit_trace_predictor(big_family_trace(), folds=2, seed=0, kind="forest",
                                        config=ForestConfig(num_trees=5))
    command = "python3 -m pytest tests/ -x"
    # small-0 and small-4 are both of family lib0, whose test runs peak at 200 MiB
    context = ActionContext("small-4", command, "test_runner", 4, "lib0")
    assert not crossfit.predict(context).heavy_risk
    crossfit.observe(ActionContext("small-0", command, "test_runner", 4, "lib0"),
                     make_action(command, peak_mib=3000))
    after = crossfit.predict(context)
    assert after.heavy_risk
    assert after.peak_bytes >= 3000 * MIB


@pytest.mark.parametrize("repeat_heavy", [True, False])
def test_forest_flags_a_rerun_of_a_command_that_was_heavy_earlier_in_the_workflow(
    repeat_heavy: bool,
) -> None:
    forest = _light_forest(repeat_heavy=repeat_heavy)
    history = (
        make_action("python3 -m pytest tests/", peak_mib=1600),
        make_action("python3 -m pytest tests/", peak_mib=60),
        make_action("Read /testbed/setup.py", action_class="file_read", peak_mib=20),
    )

    def predict(command: str):
        return forest.predict(ActionContext("w9", command, "test_runner", 3, "demo", None, history))

    rerun = predict("cd /testbed && python -m pytest tests/ -v 2>&1 | grep FAILED")
    other = predict("python -m pytest tests/test_one.py")
    assert not other.heavy_risk
    assert other.peak_bytes < GIB
    if repeat_heavy:
        assert rerun.heavy_risk
        assert rerun.peak_bytes >= 1600 * MIB
        assert rerun.avg_bytes <= rerun.peak_bytes
    else:
        assert not rerun.heavy_risk
        assert rerun.peak_bytes < GIB


def test_forest_config_rejects_unknown_fields_and_bad_bounds() -> None:
    with pytest.raises(ValueError, match="num_trees"):
        ForestConfig(num_trees=0)
    with pytest.raises(ValueError, match="extra"):
        ForestConfig.model_validate({"trees": 5})
