"""Fakes for the sched_ext gate: a scripted `ScxGate` and a cgroup that records what the
actuator did to it, in one shared journal so tests can check the order of operations."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tenon.host.types import GateResult


@dataclass
class FakeScxGate:
    """Stands for a loaded tenon_gate: a denied set, and health a test can take away."""

    journal: list[tuple[str, str]] = field(default_factory=list)
    denied: set[Path | int] = field(default_factory=set)
    is_healthy: bool = True
    closed: bool = False

    def deny(self, cgroup: Path | int) -> None:
        self.journal.append(("deny", str(cgroup)))
        self.denied.add(cgroup)

    def allow(self, cgroup: Path | int) -> None:
        self.journal.append(("allow", str(cgroup)))
        self.denied.discard(cgroup)

    def forget(self, cgroup: Path | int) -> None:
        self.journal.append(("forget", str(cgroup)))

    def healthy(self) -> bool:
        return self.is_healthy and not self.closed

    def stats(self) -> dict[str, int]:
        return {"held": sum(op == "deny" for op, _ in self.journal)}

    def close(self) -> None:
        self.journal.append(("close", ""))
        self.closed = True


@dataclass
class RecordingCgroup:
    """A sandbox cgroup that only records freezes and thaws (v2_dir None: a v1 cgroup)."""

    v2_dir: Path | None
    journal: list[tuple[str, str]] = field(default_factory=list)
    frozen: bool = False

    def freeze(self, timeout_s: float = 5.0) -> GateResult:
        self.journal.append(("freeze", str(self.v2_dir)))
        changed, self.frozen = not self.frozen, True
        return GateResult(True, changed, 0.0)

    def thaw(self, timeout_s: float = 5.0) -> GateResult:
        self.journal.append(("thaw", str(self.v2_dir)))
        changed, self.frozen = self.frozen, False
        return GateResult(False, changed, 0.0)

    def note_held(self, held: bool) -> None:
        self.journal.append(("held" if held else "unheld", str(self.v2_dir)))
