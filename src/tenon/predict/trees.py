"""A fitted scikit-learn forest flattened into arrays, for fast inference on a few rows.

scikit-learn's `predict` on one row costs several milliseconds (input validation and a
joblib dispatch per call), too slow for the admission path, which predicts one action at a
time. `FlatForest` copies the trees' node arrays into padded (tree, node) arrays and walks
every tree at once, one numpy step per level, so one row costs well under a millisecond. It
gives the same numbers as the forest it was made from (tests check this).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

__all__ = ["FlatForest"]

logger = logging.getLogger(__name__)

_LEAF = -1  # scikit-learn's children_left / children_right at a leaf


class FlatForest:
    """The mean over trees of the leaf values a row reaches (regression or class fractions).

    Every tree's nodes are concatenated into one set of arrays, children as global indices.
    A leaf points to itself on both sides, so walking `depth` steps from each root ends on a
    leaf whatever the path length, with no per-step test for having arrived.
    """

    def __init__(self, forest: Any) -> None:
        """`forest`: a fitted RandomForestRegressor or RandomForestClassifier."""
        trees = [estimator.tree_ for estimator in forest.estimators_]
        sizes = [tree.node_count for tree in trees]
        self.roots = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.intp)
        is_classifier = hasattr(forest, "classes_")
        lefts, rights, features, thresholds, values = [], [], [], [], []
        for root, tree in zip(self.roots, trees, strict=True):
            own = np.arange(tree.node_count, dtype=np.intp) + root
            leaf = tree.children_left == _LEAF
            lefts.append(np.where(leaf, own, tree.children_left + root))
            rights.append(np.where(leaf, own, tree.children_right + root))
            # a leaf's feature is -2 in scikit-learn; 0 keeps the gather in bounds (unused)
            features.append(np.where(leaf, 0, tree.feature))
            thresholds.append(tree.threshold)
            leaf_values = tree.value.reshape(tree.node_count, -1)
            if is_classifier:  # per-tree class fractions, as predict_proba averages them
                totals = leaf_values.sum(axis=1, keepdims=True)
                leaf_values = leaf_values / np.where(totals > 0, totals, 1.0)
            values.append(leaf_values)
        self.left = np.concatenate(lefts).astype(np.intp)
        self.right = np.concatenate(rights).astype(np.intp)
        self.feature = np.concatenate(features).astype(np.intp)
        self.threshold = np.concatenate(thresholds).astype(np.float64)
        self.value = np.concatenate(values).astype(np.float64)
        self.depth = max(estimator.get_depth() for estimator in forest.estimators_)

    @property
    def num_trees(self) -> int:
        return len(self.roots)

    def predict(self, rows: np.ndarray) -> np.ndarray:
        """(num_rows, num_outputs): what the forest's predict / predict_proba returns."""
        x = np.asarray(rows, dtype=np.float32)  # scikit-learn compares float32 inputs
        node = np.broadcast_to(self.roots, (x.shape[0], self.num_trees))
        row_index = np.arange(x.shape[0])[:, None]
        for _ in range(self.depth):
            goes_left = x[row_index, self.feature[node]] <= self.threshold[node]
            node = np.where(goes_left, self.left[node], self.right[node])
        means: np.ndarray = self.value[node].mean(axis=1)
        return means
