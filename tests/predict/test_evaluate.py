"""Evaluation: causal replay, scores, splits, folds, the learning curve."""

from __future__ import annotations

import pytest

from tenon.errors import ConfigError
from tenon.predict.base import ActionContext, Prediction
from tenon.predict.evaluate import (
    evaluate_folds,
    evaluate_model,
    evaluate_split,
    learning_curve,
    replay,
    score,
)
from tenon.predict.forest import ForestConfig
from tenon.predict.model import train_model
from tenon.predict.splits import split_workflows, workflow_folds
from tenon.replay.predictors import episodes_from_trace

from .factories import GIB, MIB, big_family_trace, make_action, make_episode

SCORE_KEYS = {"mae_mib", "p90_ape_pct", "heavy_precision_pct", "heavy_recall_pct"}
SMALL = ForestConfig(num_trees=10)


class Recorder:
    """Predicts 1 MiB and remembers every context and observation it was given."""

    name = "recorder"

    def __init__(self) -> None:
        self.contexts: list[ActionContext] = []
        self.observed: list[str] = []

    def predict(self, context: ActionContext) -> Prediction:
        self.contexts.append(context)
        return Prediction(MIB, MIB)

    def observe(self, context: ActionContext, measured: object) -> None:
        self.observed.append(context.workflow_id)


def test_replay_is_causal_and_observes_after_each_action() -> None:
    episodes = [make_episode("a"), make_episode("b")]
    recorder = Recorder()
    outcomes = replay(recorder, episodes)
    assert len(outcomes) == len(recorder.contexts) == len(recorder.observed) == 12
    for context in recorder.contexts:
        episode = episodes[0] if context.workflow_id == "a" else episodes[1]
        assert context.history == episode.actions[: context.step_index]
    assert [m for _, m in outcomes] == [*episodes[0].actions, *episodes[1].actions]


def test_scores_by_hand() -> None:
    measured = [make_action(peak_mib=p) for p in (0, 8, 100, 2000, 1500)]
    predicted = [
        Prediction(0, 16 * MIB),
        Prediction(0, 8 * MIB),
        Prediction(0, 150 * MIB),
        Prediction(0, 1200 * MIB, heavy_risk=True),
        Prediction(0, 100 * MIB),
    ]
    scores = score(list(zip(predicted, measured, strict=True)), heavy_peak_bytes=GIB)
    assert scores.mae_mib == pytest.approx((16 + 0 + 50 + 800 + 1400) / 5)
    # APE with the 16 MiB floor: 100, 0, 50, 40, 93.3 -> P90 interpolates 93.3 and 100
    assert scores.p90_ape_pct == pytest.approx(97.3, abs=0.05)
    assert scores.heavy_precision_pct == 100.0
    assert scores.heavy_recall_pct == 50.0
    none_flagged = score([(Prediction(0, 1), m) for m in measured], heavy_peak_bytes=GIB)
    assert none_flagged.heavy_precision_pct is None
    assert none_flagged.heavy_recall_pct == 0.0
    with pytest.raises(ConfigError, match="nothing to score"):
        score([], heavy_peak_bytes=GIB)


def test_split_keeps_every_workflow_on_one_side_and_heavy_ones_on_both() -> None:
    episodes = episodes_from_trace(big_family_trace(num_big=4, num_small=8))
    train, test = split_workflows(episodes, test_fraction=0.3, seed=3, heavy_peak_bytes=GIB)
    train_ids, test_ids = {e.workflow_id for e in train}, {e.workflow_id for e in test}
    assert not train_ids & test_ids
    assert train_ids | test_ids == {e.workflow_id for e in episodes}
    assert any(i.startswith("big") for i in train_ids)
    assert any(i.startswith("big") for i in test_ids)
    again = split_workflows(
        list(reversed(episodes)), test_fraction=0.3, seed=3, heavy_peak_bytes=GIB
    )
    assert {e.workflow_id for e in again[1]} == test_ids  # the order of the input is irrelevant
    with pytest.raises(ConfigError, match="test fraction"):
        split_workflows(episodes, test_fraction=1.0, seed=0, heavy_peak_bytes=GIB)


def test_folds_cover_every_workflow_once() -> None:
    episodes = episodes_from_trace(big_family_trace(num_big=3, num_small=7))
    folds = workflow_folds(episodes, num_folds=3, seed=0, heavy_peak_bytes=GIB)
    ids = [e.workflow_id for fold in folds for e in fold]
    assert sorted(ids) == sorted(e.workflow_id for e in episodes)
    assert all(sum(e.workflow_id.startswith("big") for e in fold) == 1 for fold in folds)
    with pytest.raises(ConfigError, match="folds need"):
        workflow_folds(episodes, num_folds=11, seed=0, heavy_peak_bytes=GIB)


def test_evaluation_json_has_exactly_the_published_keys() -> None:
    episodes = episodes_from_trace(big_family_trace())
    for evaluation in (
        evaluate_split(episodes, heavy_peak_bytes=GIB, config=SMALL),
        evaluate_folds(episodes, heavy_peak_bytes=GIB, num_folds=3, config=SMALL),
        evaluate_model(train_model(episodes[:6], config=SMALL), episodes[6:]),
    ):
        result = evaluation.as_json()
        assert set(result) == {"predictors", "train_workflows", "test_workflows"}
        assert set(result["predictors"]) == {"static", "history", "forest"}
        for figures in result["predictors"].values():
            assert set(figures) == SCORE_KEYS
    folds = evaluate_folds(episodes, heavy_peak_bytes=GIB, num_folds=3, config=SMALL)
    assert folds.as_json()["test_workflows"] == 12


def test_learning_curve_trains_on_fewer_workflows_at_smaller_fractions() -> None:
    episodes = episodes_from_trace(big_family_trace())
    points = learning_curve(
        episodes, heavy_peak_bytes=GIB, fractions=(0.25, 1.0), num_folds=3, config=SMALL
    )
    assert [f for f, _ in points] == [0.25, 1.0]
    assert [e.train_workflows for _, e in points] == [2, 8]
    assert all(e.test_workflows == 12 for _, e in points)
    with pytest.raises(ConfigError, match="fractions"):
        learning_curve(episodes, heavy_peak_bytes=GIB, fractions=(0.0,))
