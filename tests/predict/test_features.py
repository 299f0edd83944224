"""Features are causal: step i's row depends on steps < i and on step i's command only."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from sklearn.ensemble import RandomForestClassifier, RandomForestRegressor

from tenon.predict.episodes import Episode, trace_workflow_id
from tenon.predict.features import FeatureBuilder, text_document
from tenon.predict.trees import FlatForest

from .factories import GIB, make_action, make_episode


def fitted_builder(*episodes: Episode) -> FeatureBuilder:
    training = episodes or (make_episode("a"), make_episode("b"))
    contexts = [c for e in training for c, _ in e.contexts()]
    return FeatureBuilder(heavy_peak_bytes=GIB).fit(contexts)


def rows(builder: FeatureBuilder, episode: Episode) -> np.ndarray:
    return builder.transform([c for c, _ in episode.contexts()])


def test_contexts_hold_only_earlier_actions() -> None:
    episode = make_episode()
    for index, (context, measured) in enumerate(episode.contexts()):
        assert context.step_index == index
        assert context.history == episode.actions[:index]
        assert context.command == measured.command
        assert measured not in context.history


def test_a_row_is_unchanged_by_later_steps_and_by_the_actions_own_figures() -> None:
    builder = fitted_builder()
    episode = make_episode()
    step = 3
    before = rows(builder, episode)[step]
    actions = list(episode.actions)
    # the action's own measured figures, and everything after it, change completely
    actions[step] = dataclasses.replace(
        actions[step], avg_bytes=7 * GIB, peak_bytes=9 * GIB, duration_s=500.0
    )
    actions[step + 1 :] = [
        make_action("cargo build --release", action_class="compiler", peak_mib=5000)
    ] * 5
    changed = dataclasses.replace(episode, actions=tuple(actions))
    after = rows(builder, changed)
    assert np.array_equal(after[step], before)
    assert np.array_equal(after[:step], rows(builder, episode)[:step])
    # the row does depend on what came before (so the comparison above can fail)
    actions[step - 1] = dataclasses.replace(actions[step - 1], peak_bytes=3 * GIB)
    earlier_changed = rows(builder, dataclasses.replace(episode, actions=tuple(actions)))
    assert not np.array_equal(earlier_changed[step], before)


def test_history_columns_carry_the_measured_figures() -> None:
    builder = fitted_builder()
    history = [
        make_action("python -m pytest", peak_mib=900, duration_s=30.0),
        make_action("Grep x", action_class="search", peak_mib=20),
        make_action("python -m pytest", peak_mib=1500, duration_s=31.0),
    ]
    probe = make_action("python -m pytest", peak_mib=1)
    episode = make_episode(actions=[*history, probe])
    row = dict(zip(builder.names, rows(builder, episode)[-1], strict=True))
    assert row["step_index"] == 3
    assert row["class=test_runner"] == 1
    assert row["last_class=test_runner"] == 1
    assert row["last_peak_mib"] == pytest.approx(1500)
    assert row["max_peak_mib"] == pytest.approx(1500)
    assert row["num_heavy"] == 1
    assert row["num_same_class"] == 2
    assert row["same_class_max_peak_mib"] == pytest.approx(1500)
    assert row["num_same_command"] == 2
    assert row["same_command_max_duration_s"] == pytest.approx(31.0)
    assert row["family=unknown"] == 0  # "demo" has two training workflows


def test_families_seen_once_and_new_families_share_the_unknown_column() -> None:
    builder = fitted_builder(
        make_episode("a", family="twice"),
        make_episode("b", family="twice"),
        make_episode("c", family="once"),
    )
    assert builder.families == ("twice",)
    for family, column in (
        ("twice", "family=twice"),
        ("once", "family=unknown"),
        ("never", "family=unknown"),
        (None, "family=unknown"),
    ):
        row = dict(zip(builder.names, rows(builder, make_episode(family=family))[0], strict=True))
        assert row[column] == 1, family


def test_text_features_match_scikit_learns_tfidf_and_see_the_trajectory() -> None:
    builder = fitted_builder()
    assert builder.text is not None
    episode = make_episode(task_prompt="fix the parser")
    contexts = [c for c, _ in episode.contexts()]
    documents = [text_document(c, builder.trajectory_length) for c in contexts]
    expected = builder.text.transform(documents).toarray()
    text_columns = rows(builder, episode)[:, -expected.shape[1] :]
    assert np.allclose(text_columns, expected, atol=1e-6)
    assert len(builder.names) == rows(builder, episode).shape[1]
    assert "traj:pip" in documents[4]
    assert "cmd:pytest" in documents[4]
    assert "task:parser" in documents[0]
    assert "traj:" not in documents[0]


def test_flat_forest_gives_scikit_learns_numbers() -> None:
    rng = np.random.default_rng(0)
    x = rng.random((300, 12)).astype(np.float32)
    y = np.column_stack([x[:, 0] * 3, x[:, 1] + x[:, 2]])
    labels = x[:, 3] > 0.8
    regressor = RandomForestRegressor(n_estimators=7, random_state=0).fit(x, y)
    classifier = RandomForestClassifier(n_estimators=7, random_state=0).fit(x, labels)
    probe = rng.random((40, 12)).astype(np.float32)
    assert np.allclose(FlatForest(regressor).predict(probe), regressor.predict(probe))
    assert np.allclose(FlatForest(classifier).predict(probe), classifier.predict_proba(probe))


def test_bench_submission_ids_map_to_trace_workflow_ids() -> None:
    assert trace_workflow_id("tobymao__sqlglot-4014/attempt_1#3") == (
        "tobymao__sqlglot-4014/attempt_1"
    )
    assert trace_workflow_id("a#b#12") == "a#b"
    assert trace_workflow_id("plain") == "plain"
    assert trace_workflow_id("issue#fix") == "issue#fix"
