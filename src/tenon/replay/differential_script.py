"""What the differential check runs: a script (a scripted agent run) and its steps.

Apart from the harness (`replay.differential`) so the corpus (`replay.differential_corpus`)
can build scripts without importing the harness that runs them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Script", "Step"]


@dataclass(frozen=True)
class Step:
    """One action of a script."""

    command: str  # run under /bin/sh -c in /workspace
    timeout_s: float = 60.0
    # What the action must do in both runs (so a broken image cannot pass as "the same in
    # both"): its exit code (None: any) and whether it runs into its timeout.
    expect_exit: int | None = 0
    expect_timed_out: bool = False
    # The boundary after this step is resident-only by design; the check's reason must
    # contain this fragment (case-insensitive). None: the boundary must be torn down.
    resident_because: str | None = None
    # Who runs it: None is the sandbox's default (unprivileged) user; "root" is root of the
    # sandbox's user namespace.
    user: str | None = None


@dataclass(frozen=True)
class Script:
    """A scripted agent run: its steps and the agent's sandbox config."""

    name: str
    steps: tuple[Step, ...]
    config: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.steps:
            raise ValueError(f"script {self.name!r} has no steps")
