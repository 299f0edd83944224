"""Workflow-level splits: a workflow's actions are all on one side, never on both.

Actions of one workflow are strongly correlated (memory figures are levels that carry over
from one action to the next), so splitting actions would let a model see a test action's
neighbours. Both splits are stratified by whether a workflow has a heavy action: heavy
workflows are rare (2 of 45 in the AgentCgroup trace), and a plain random split can leave
all of them on one side, where they can be neither learnt nor measured.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence

from tenon.errors import ConfigError
from tenon.predict.episodes import Episode

__all__ = ["split_workflows", "workflow_folds"]

logger = logging.getLogger(__name__)


def _strata(episodes: Sequence[Episode], heavy_peak_bytes: int, seed: int) -> list[list[Episode]]:
    """Heavy workflows, then the others, each shuffled by `seed` (independent of input order)."""
    rng = random.Random(seed)
    strata = []
    for heavy in (True, False):
        group = sorted(
            (e for e in episodes if e.has_heavy(heavy_peak_bytes) is heavy),
            key=lambda e: e.workflow_id,
        )
        rng.shuffle(group)
        strata.append(group)
    return strata


def split_workflows(
    episodes: Sequence[Episode], *, test_fraction: float, seed: int, heavy_peak_bytes: int
) -> tuple[list[Episode], list[Episode]]:
    """(train, test): about `test_fraction` of each stratum's workflows are tested."""
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"test fraction must be in (0, 1), got {test_fraction}")
    if len(episodes) < 2:
        raise ConfigError(f"need at least 2 workflows to split, got {len(episodes)}")
    train: list[Episode] = []
    test: list[Episode] = []
    for group in _strata(episodes, heavy_peak_bytes, seed):
        num_test = round(len(group) * test_fraction)
        test += group[:num_test]
        train += group[num_test:]
    if not test:  # tiny inputs: round() gave every stratum zero
        test, train = train[:1], train[1:]
    if not train:
        train, test = test[:1], test[1:]
    return train, test


def workflow_folds(
    episodes: Sequence[Episode], *, num_folds: int, seed: int, heavy_peak_bytes: int
) -> list[list[Episode]]:
    """`num_folds` disjoint groups covering every workflow once; heavy ones dealt first."""
    if num_folds < 2:
        raise ConfigError(f"need at least 2 folds, got {num_folds}")
    if num_folds > len(episodes):
        raise ConfigError(
            f"{num_folds} folds need at least {num_folds} workflows, got {len(episodes)}"
        )
    folds: list[list[Episode]] = [[] for _ in range(num_folds)]
    dealt = 0
    for group in _strata(episodes, heavy_peak_bytes, seed):
        for episode in group:
            folds[dealt % num_folds].append(episode)
            dealt += 1
    return folds
