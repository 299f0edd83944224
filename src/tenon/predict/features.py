"""Causal features of one action: built only from its `ActionContext`.

A context holds what is known before the action starts: its command and class, its
workflow's scope (family, step index, task prompt) and the measured figures of the workflow's
earlier actions. `FeatureBuilder` turns it into one row of numbers:

- the action's class (one-hot) and step index;
- the family, one-hot over families with at least `min_family_workflows` training workflows,
  anything else in one "unknown" column (a new repository is the common case);
- the workflow's history: the previous action's class, average, peak and duration; the
  running maximum peak, mean and maximum average, total duration, number of heavy actions;
  the same figures restricted to earlier actions of the same class, and to earlier runs of
  the very same command (an agent re-running `python -m pytest` after an edit);
- TF-IDF over words of the command, the task prompt and the last `trajectory_length`
  commands, each word tagged with where it came from (`cmd:pytest`, `traj:pip`).

The measured figures of the action itself never reach the builder (a context has none), so
the features are causal by construction. `FEATURE_VERSION` names this layout: change the
columns or their meaning and it must change, so an old model file is refused on load.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Final

import numpy as np
from sklearn.feature_extraction.text import TfidfVectorizer  # type: ignore[import-untyped]

from tenon.predict.base import ActionContext, MeasuredAction
from tenon.predict.classify import ACTION_CLASSES

__all__ = ["FEATURE_VERSION", "FeatureBuilder", "text_document"]

logger = logging.getLogger(__name__)

FEATURE_VERSION: Final = 1
MIB: Final = 1 << 20

_WORD: Final = re.compile(r"[a-z0-9_]+")
# Bounds on how much text one action contributes, so inference time does not grow with it.
_MAX_TEXT_CHARS: Final = 2000
_MAX_WORDS: Final = 64

_HISTORY_NAMES: Final = (
    "last_avg_mib",
    "last_peak_mib",
    "last_duration_s",
    "max_peak_mib",
    "mean_avg_mib",
    "max_avg_mib",
    "total_duration_s",
    "num_heavy",
    "num_same_class",
    "same_class_max_peak_mib",
    "same_class_last_peak_mib",
    "same_class_max_duration_s",
    "num_same_command",
    "same_command_max_peak_mib",
    "same_command_last_peak_mib",
    "same_command_max_duration_s",
)


def _words(text: str, tag: str) -> list[str]:
    words = _WORD.findall(text[:_MAX_TEXT_CHARS].lower())[:_MAX_WORDS]
    return [f"{tag}:{word}" for word in words]


def text_document(context: ActionContext, trajectory_length: int) -> str:
    """The words TF-IDF sees for one action: command, task prompt, recent earlier commands."""
    words = _words(context.command, "cmd")
    if context.task_prompt:
        words += _words(context.task_prompt, "task")
    if trajectory_length > 0:
        for earlier in context.history[-trajectory_length:]:
            words += _words(earlier.command, "traj")
    return " ".join(words)


def _history_figures(
    history: Sequence[MeasuredAction], context: ActionContext, heavy_peak_bytes: int
) -> list[float]:
    """The values of `_HISTORY_NAMES`, in order; zeros when there is no such earlier action."""
    if not history:
        return [0.0] * len(_HISTORY_NAMES)
    last = history[-1]
    num_heavy = max_peak = max_avg = sum_avg = 0
    total_s = 0.0
    same_class: list[MeasuredAction] = []
    same_command: list[MeasuredAction] = []
    command = context.command.strip()
    for m in history:
        max_peak = max(max_peak, m.peak_bytes)
        max_avg = max(max_avg, m.avg_bytes)
        sum_avg += m.avg_bytes
        total_s += m.duration_s
        num_heavy += m.peak_bytes > heavy_peak_bytes
        if m.action_class == context.action_class:
            same_class.append(m)
        if command and m.command.strip() == command:
            same_command.append(m)
    return [
        last.avg_bytes / MIB,
        last.peak_bytes / MIB,
        last.duration_s,
        max_peak / MIB,
        sum_avg / len(history) / MIB,
        max_avg / MIB,
        total_s,
        float(num_heavy),
        *_group_figures(same_class),
        *_group_figures(same_command),
    ]


def _group_figures(group: list[MeasuredAction]) -> list[float]:
    """Count, max peak (MiB), last peak (MiB), max duration (s) of some earlier actions."""
    if not group:
        return [0.0, 0.0, 0.0, 0.0]
    return [
        float(len(group)),
        max(m.peak_bytes for m in group) / MIB,
        group[-1].peak_bytes / MIB,
        max(m.duration_s for m in group),
    ]


class FeatureBuilder:
    """Fitted on training contexts (text vocabulary, known families); then a pure function."""

    def __init__(
        self,
        *,
        heavy_peak_bytes: int,
        max_text_features: int = 256,
        trajectory_length: int = 3,
        min_family_workflows: int = 2,
    ) -> None:
        self.heavy_peak_bytes = heavy_peak_bytes
        self.max_text_features = max_text_features
        self.trajectory_length = trajectory_length
        self.min_family_workflows = min_family_workflows
        self.families: tuple[str, ...] = ()
        self.text: TfidfVectorizer | None = None
        self._vocabulary: dict[str, int] = {}
        self._idf = np.zeros(0, dtype=np.float32)
        self._family_index: dict[str, int] = {}
        self._class_index: dict[str, int] = {k: i for i, k in enumerate(ACTION_CLASSES)}

    def fit(self, contexts: Sequence[ActionContext]) -> FeatureBuilder:
        workflows_of: dict[str, set[str]] = {}
        for context in contexts:
            if context.family:
                workflows_of.setdefault(context.family, set()).add(context.workflow_id)
        self.families = tuple(
            sorted(f for f, ids in workflows_of.items() if len(ids) >= self.min_family_workflows)
        )
        self._family_index = {family: i for i, family in enumerate(self.families)}
        self.text = None
        if self.max_text_features > 0:
            vectorizer = TfidfVectorizer(
                token_pattern=r"\S+",
                lowercase=False,
                min_df=2,
                max_features=self.max_text_features,
                sublinear_tf=True,
                dtype=np.float32,
            )
            try:
                vectorizer.fit([text_document(c, self.trajectory_length) for c in contexts])
            except ValueError:  # no word occurs twice: a tiny training set, no text columns
                logger.info("no text features: the training commands share no words")
            else:
                self.text = vectorizer
                self._vocabulary = {str(w): int(i) for w, i in vectorizer.vocabulary_.items()}
                self._idf = vectorizer.idf_.astype(np.float32)
        return self

    @property
    def names(self) -> list[str]:
        names = ["step_index", "has_task_prompt"]
        names += [f"class={klass}" for klass in ACTION_CLASSES]
        names += [f"last_class={klass}" for klass in ACTION_CLASSES]
        names += [f"family={family}" for family in self.families] + ["family=unknown"]
        names += list(_HISTORY_NAMES)
        if self.text is not None:
            names += [f"tfidf={word}" for word in self.text.get_feature_names_out()]
        return names

    def transform(self, contexts: Sequence[ActionContext]) -> np.ndarray:
        """One float32 row per context, columns as in `names`."""
        numeric = np.array([self._numeric(c) for c in contexts], dtype=np.float32)
        if self.text is None:
            return numeric
        text = np.array([self._tfidf(c) for c in contexts], dtype=np.float32)
        return np.hstack([numeric, text])

    def _tfidf(self, context: ActionContext) -> np.ndarray:
        """What the fitted `TfidfVectorizer.transform` gives for this context's document.

        Computed here (sublinear tf times idf, L2-normalised) because the vectorizer's own
        transform costs about half a millisecond per call, most of the per-action budget.
        """
        row = np.zeros(len(self._idf), dtype=np.float32)
        for word in text_document(context, self.trajectory_length).split():
            column = self._vocabulary.get(word)
            if column is not None:
                row[column] += 1.0
        present = row > 0
        row[present] = (1.0 + np.log(row[present])) * self._idf[present]
        norm = float(np.linalg.norm(row))
        return row / norm if norm > 0 else row

    def _numeric(self, context: ActionContext) -> list[float]:
        num_classes = len(ACTION_CLASSES)
        klass = [0.0] * num_classes
        klass[self._class_index.get(context.action_class, num_classes - 1)] = 1.0
        last_class = [0.0] * num_classes
        if context.history:
            last = context.history[-1].action_class
            last_class[self._class_index.get(last, num_classes - 1)] = 1.0
        family = [0.0] * (len(self.families) + 1)
        family[self._family_index.get(context.family or "", len(self.families))] = 1.0
        scope = [float(context.step_index), float(bool(context.task_prompt))]
        history = _history_figures(context.history, context, self.heavy_peak_bytes)
        return scope + klass + last_class + family + history
