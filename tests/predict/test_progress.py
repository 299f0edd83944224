"""What peers and finished workflows show about a workflow's remaining work."""

from __future__ import annotations

import pytest

from tenon.predict.progress import PeerProgress


def observe_all(progress: PeerProgress, task: str | None, attempt: str,
                costs: list[float], *, finish: bool = True) -> None:
    for index, cost in enumerate(costs):
        progress.observe(task, attempt, index, cost)
    if finish:
        progress.finish(attempt, complete=True)


def test_a_finished_peer_shows_exactly_the_work_after_each_step() -> None:
    progress = PeerProgress()
    observe_all(progress, "t", "lead", [1.0, 2.0, 3.0, 4.0])
    assert progress.remaining_s("t", "new", 0) == pytest.approx(10.0)
    assert progress.remaining_s("t", "new", 1) == pytest.approx(9.0)
    assert progress.remaining_s("t", "new", 3) == pytest.approx(4.0)


def test_an_unfinished_peer_adds_the_typical_residual_where_it_stands() -> None:
    progress = PeerProgress()
    observe_all(progress, "u", "other-task", [1.0, 1.0, 5.0, 5.0])  # after step 2: 10 s
    observe_all(progress, "t", "lead", [2.0, 2.0], finish=False)  # at step 2, unfinished
    assert progress.residual_s(2) == pytest.approx(10.0)
    assert progress.remaining_s("t", "new", 0) == pytest.approx(4.0 + 10.0)


def test_without_a_peer_ahead_the_residual_of_finished_workflows_applies() -> None:
    progress = PeerProgress()
    assert progress.remaining_s("t", "lead", 0) == 0.0  # nothing finished yet
    observe_all(progress, None, "a", [1.0, 1.0])
    observe_all(progress, None, "b", [1.0, 3.0, 3.0, 3.0])
    observe_all(progress, None, "c", [1.0, 5.0, 5.0])
    # after step 1: a did 1, b 9, c 10; the median is 9
    assert progress.remaining_s("t", "lead", 1) == pytest.approx(9.0)
    # only b and c had a step 2
    assert progress.remaining_s(None, "lead", 2) == pytest.approx((6.0 + 5.0) / 2)
    assert progress.remaining_s("t", "lead", 9) == 0.0


def test_a_failed_attempt_is_a_peer_but_not_a_finished_workflow() -> None:
    progress = PeerProgress()
    observe_all(progress, "t", "cut", [1.0, 1.0], finish=False)
    progress.finish("cut", complete=False)
    assert progress.residual_s(0) == 0.0
    assert progress.remaining_s("t", "new", 0) == pytest.approx(2.0)


def test_an_attempt_is_not_its_own_peer_and_tasks_do_not_mix() -> None:
    progress = PeerProgress()
    observe_all(progress, "t", "a", [1.0, 1.0, 1.0], finish=False)
    assert progress.remaining_s("t", "a", 0) == 0.0
    assert progress.remaining_s("other", "b", 0) == 0.0
    assert progress.remaining_s("t", "b", 0) == pytest.approx(3.0)


def test_steps_must_arrive_in_order_and_costs_be_non_negative() -> None:
    progress = PeerProgress()
    progress.observe("t", "a", 0, 1.0)
    with pytest.raises(ValueError, match="step 2 observed after 1 steps"):
        progress.observe("t", "a", 2, 1.0)
    with pytest.raises(ValueError, match="negative"):
        progress.observe("t", "a", 1, -0.5)


def test_only_the_most_recently_active_attempts_are_kept() -> None:
    progress = PeerProgress(max_peers_per_task=2)
    observe_all(progress, "t", "long", [10.0, 10.0], finish=False)
    observe_all(progress, "t", "b", [1.0], finish=False)
    observe_all(progress, "t", "c", [1.0], finish=False)  # "long" is dropped as a peer
    assert progress.remaining_s("t", "new", 0) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="at least 1"):
        PeerProgress(max_peers_per_task=0)
