"""The static and online predictors."""

from __future__ import annotations

import pytest

from tenon.errors import ConfigError
from tenon.predict.base import ActionContext, MeasuredAction
from tenon.predict.online import OnlinePredictor
from tenon.predict.static import StaticPredictor

MIB = 1 << 20


def ctx(klass: str = "test_runner", *, family: str = "repo", history=(),
        task: str | None = None) -> ActionContext:
    return ActionContext("w1", "pytest -x", klass, len(history), family, None, tuple(history),
                         task)


def test_static_fit_takes_class_means_and_high_peaks() -> None:
    measured = [MeasuredAction("test_runner", p * MIB // 2, p * MIB, 1.0) for p in range(1, 11)]
    predictor = StaticPredictor.fit(measured, peak_quantile=0.9)
    prediction = predictor.predict(ctx())
    assert prediction.avg_bytes == sum(p * MIB // 2 for p in range(1, 11)) // 10
    assert prediction.peak_bytes == 10 * MIB  # the 90th percentile of 1..10 MiB
    assert predictor.predict(ctx("vcs")) == StaticPredictor().predict(ctx("vcs"))
    with pytest.raises(ConfigError, match="unknown action class"):
        StaticPredictor({"tests": (1, 2)})


def test_online_learns_from_the_workflow_and_the_family_only() -> None:
    static = StaticPredictor({"test_runner": (100 * MIB, 200 * MIB)})
    online = OnlinePredictor(static)
    assert online.predict(ctx()).peak_bytes == 200 * MIB
    heavy = MeasuredAction("test_runner", 300 * MIB, 1600 * MIB, 10.0)
    # within the workflow: its own history raises the prediction
    assert online.predict(ctx(history=[heavy])).peak_bytes == 1600 * MIB
    assert online.predict(ctx(history=[heavy])).heavy_risk
    # across workflows: only once observed, and only for the same family and class
    online.observe(ctx(), heavy)
    assert online.predict(ctx()).peak_bytes == 1600 * MIB
    assert online.predict(ctx(family="other")).peak_bytes == 200 * MIB
    assert online.predict(ctx("vcs")).peak_bytes == static.predict(ctx("vcs")).peak_bytes
    assert online.predict(ctx()).avg_bytes == 300 * MIB


def test_online_learns_across_workflows_by_task_when_the_task_is_known() -> None:
    static = StaticPredictor({"test_runner": (100 * MIB, 200 * MIB)})
    online = OnlinePredictor(static)
    heavy = MeasuredAction("test_runner", 300 * MIB, 1600 * MIB, 10.0)
    online.observe(ctx(task="repo-17"), heavy)
    # another attempt at the same task expects the heavy run; another task of the same
    # repository does not (its test runs queued for a gigabyte they never used), nor does
    # a workflow that names no task (it falls back to the family, which saw nothing)
    assert online.predict(ctx(task="repo-17")).heavy_risk
    assert online.predict(ctx(task="repo-17")).peak_bytes == 1600 * MIB
    assert online.predict(ctx(task="repo-42")).peak_bytes == 200 * MIB
    assert online.predict(ctx()).peak_bytes == 200 * MIB
    online.observe(ctx(), heavy)
    assert online.predict(ctx()).heavy_risk


def test_online_raises_any_base_predictor_and_keeps_its_heavy_flag() -> None:
    from tenon.predict.static import FixedPredictor

    base = FixedPredictor(50 * MIB, 100 * MIB)
    online = OnlinePredictor(base, heavy_peak_bytes=1024 * MIB, name="online-fixed")
    assert online.name == "online-fixed"
    assert online.predict(ctx()).peak_bytes == 100 * MIB
    assert not online.predict(ctx()).heavy_risk
    online.observe(ctx(), MeasuredAction("test_runner", 400 * MIB, 1500 * MIB, 5.0))
    raised = online.predict(ctx())
    assert (raised.avg_bytes, raised.peak_bytes, raised.heavy_risk) == (400 * MIB, 1500 * MIB,
                                                                         True)
    flagged = OnlinePredictor(FixedPredictor(50 * MIB, 100 * MIB, heavy_risk=True))
    assert flagged.predict(ctx()).heavy_risk  # the base's own risk flag is kept


def test_a_running_peak_raises_the_peers_peak_but_not_their_average() -> None:
    from tenon.predict.static import FixedPredictor

    online = OnlinePredictor(FixedPredictor(50 * MIB, 100 * MIB), heavy_peak_bytes=1024 * MIB)
    online.observe_running(ctx(task="T"), 1600 * MIB)
    peer = online.predict(ctx(task="T"))
    assert (peer.avg_bytes, peer.peak_bytes, peer.heavy_risk) == (50 * MIB, 1600 * MIB, True)
    assert not online.predict(ctx(task="other")).heavy_risk
    assert not online.predict(ctx("file_read", task="T")).heavy_risk
