"""Gate actuators: how the execution gate holds and releases a sandbox's cgroup.

`FreezerActuator` freezes the cgroup (v1 freezer.state, v2 cgroup.freeze). `ScxActuator`
denies the cgroup in the tenon_gate sched_ext scheduler's map: its runnable tasks wait in the
scheduler's queue, keep their memory mapped and resume at the next dispatch once allowed.

The kernel ejects a sched_ext scheduler whose runnable task has not run for its timeout
(30 s for tenon_gate), so `ScxActuator` turns a hold longer than `max_hold_s` into a freeze
(frozen tasks sleep, which the watchdog does not count), and when the scheduler is gone
(ejected, unloaded from outside) it freezes every sandbox it holds and stays on the freezer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from tenon.errors import ConfigError, HostError
from tenon.host.cgroup import FREEZE_TIMEOUT_S
from tenon.host.types import GateResult

logger = logging.getLogger(__name__)

ActuatorPreference = Literal["auto", "scx", "freezer"]
PREFERENCES: tuple[ActuatorPreference, ...] = ("auto", "scx", "freezer")
DEFAULT_MAX_HOLD_S = 10.0
ESCALATE_WAIT_S = 0.02  # how long an escalating freeze may hold the caller


@dataclass(frozen=True, slots=True)
class ActuatorConfig:
    """Which gate actuator the runtime uses."""

    preference: ActuatorPreference = "auto"
    """auto: sched_ext where this host can run it, else the freezer; scx: sched_ext or fail;
    freezer: the cgroup freezer."""
    max_hold_s: float = DEFAULT_MAX_HOLD_S
    """A sched_ext hold longer than this becomes a freeze; must stay well under the
    scheduler's 30 s watchdog timeout."""

    def __post_init__(self) -> None:
        if self.preference not in PREFERENCES:
            raise ConfigError(f"gate actuator must be one of {', '.join(PREFERENCES)}, "
                              f"got {self.preference!r}")
        if not 0 < self.max_hold_s <= 20.0:
            raise ConfigError(f"max_hold_s must be in (0, 20] (the watchdog ejects at 30 s), "
                              f"got {self.max_hold_s}")


class Freezable(Protocol):
    """What an actuator needs of a sandbox's cgroup (`SandboxCgroup`, `SimCgroup`)."""

    def freeze(self, timeout_s: float = ...) -> GateResult: ...

    def thaw(self, timeout_s: float = ...) -> GateResult: ...


class GateActuator(Protocol):
    """Holds and releases sandboxes for the execution gate."""

    @property
    def name(self) -> str:
        """"freezer" or "scx"."""
        ...

    @property
    def fallback_reason(self) -> str | None:
        """Why this actuator now uses the freezer instead (None while it does not)."""
        ...

    def hold(self, meter: Freezable, timeout_s: float = FREEZE_TIMEOUT_S) -> None:
        """Stop the sandbox; HostError when a freeze has not settled within `timeout_s`."""
        ...

    def release(self, meter: Freezable, timeout_s: float = FREEZE_TIMEOUT_S) -> None:
        """Let the sandbox run again."""
        ...

    def forget(self, meter: Freezable) -> None:
        """The sandbox is gone or no longer gated: drop what is kept for it."""
        ...

    def check(self) -> str | None:
        """Periodic upkeep; returns the fallback reason the one time a fallback happens."""
        ...

    def close(self) -> None: ...


class FreezerActuator:
    """The cgroup freezer (v1 and v2)."""

    name = "freezer"
    fallback_reason: str | None = None

    def hold(self, meter: Freezable, timeout_s: float = FREEZE_TIMEOUT_S) -> None:
        meter.freeze(timeout_s=timeout_s)

    def release(self, meter: Freezable, timeout_s: float = FREEZE_TIMEOUT_S) -> None:
        meter.thaw(timeout_s=timeout_s)

    def forget(self, meter: Freezable) -> None:
        pass

    def check(self) -> str | None:
        return None

    def close(self) -> None:
        pass


class ScxGateLike(Protocol):
    """What ScxActuator needs of `scx.loader.ScxGate` (a fake in tests)."""

    def deny(self, cgroup: Path | int) -> None: ...

    def allow(self, cgroup: Path | int) -> None: ...

    def forget(self, cgroup: Path | int) -> None: ...

    def healthy(self) -> bool: ...

    def stats(self) -> dict[str, int]: ...

    def close(self) -> None: ...


@dataclass
class _Hold:
    meter: Freezable
    cgroup_dir: Path | None  # None: a cgroup without a v2 directory, held by the freezer
    cgroup_id: int  # -1 when it could not be read
    since_s: float
    frozen: bool

    @property
    def key(self) -> Path | int:
        """How the gate map knows it: the id read at hold time, which outlives the directory."""
        assert self.cgroup_dir is not None
        return self.cgroup_id if self.cgroup_id >= 0 else self.cgroup_dir


class ScxActuator:
    """Holds through the tenon_gate scheduler; the freezer for long holds and after ejection."""

    name = "scx"

    def __init__(self, gate: ScxGateLike, *, max_hold_s: float = DEFAULT_MAX_HOLD_S,
                 now: Callable[[], float] = time.monotonic) -> None:
        self._gate = gate
        self._max_hold_s = max_hold_s
        self._now = now
        self._holds: dict[int, _Hold] = {}  # by id(meter)
        self.fallback_reason: str | None = None
        self._fallback_reported = False
        self.num_escalations = 0

    @property
    def num_held(self) -> int:
        return len(self._holds)

    def scheduler_stats(self) -> dict[str, int]:
        """The scheduler's counters: tasks held, released, spared as dying, preempted."""
        return self._gate.stats()

    def hold(self, meter: Freezable, timeout_s: float = FREEZE_TIMEOUT_S) -> None:
        if id(meter) in self._holds:
            return
        cgroup_dir: Path | None = getattr(meter, "v2_dir", None)
        hold = _Hold(meter, cgroup_dir, _inode(cgroup_dir), self._now(), frozen=False)
        self._holds[id(meter)] = hold
        if cgroup_dir is None or not self._usable():
            hold.frozen = True
            meter.freeze(timeout_s=timeout_s)
            return
        self._gate.deny(hold.key)
        _note_held(meter, True)  # an action's timeout does not count the hold

    def release(self, meter: Freezable, timeout_s: float = FREEZE_TIMEOUT_S) -> None:
        hold = self._holds.pop(id(meter), None)
        if hold is None:  # not held here (say, frozen before this actuator took over)
            meter.thaw(timeout_s=timeout_s)
            return
        if hold.frozen:
            meter.thaw(timeout_s=timeout_s)
            return
        _note_held(meter, False)
        if hold.cgroup_dir is not None and self.fallback_reason is None:
            self._gate.allow(hold.key)

    def forget(self, meter: Freezable) -> None:
        hold = self._holds.pop(id(meter), None)
        if hold is not None and hold.cgroup_dir is not None and self.fallback_reason is None:
            try:
                self._gate.forget(hold.key)
            except OSError as exc:
                logger.debug("gate: forgetting cgroup %d: %r", hold.cgroup_id, exc)

    def check(self) -> str | None:
        if self._holds and self._usable():
            now = self._now()
            for hold in self._holds.values():
                if not hold.frozen and now - hold.since_s > self._max_hold_s:
                    self._escalate(hold)
        if self.fallback_reason is not None and not self._fallback_reported:
            self._fallback_reported = True  # also a fallback `hold` ran into
            return self.fallback_reason
        return None

    def _usable(self) -> bool:
        """The scheduler still runs; on the first sign it does not, fall back for good."""
        if self.fallback_reason is not None:
            return False
        if self._gate.healthy():
            return True
        self.fallback_reason = ("sched_ext scheduler tenon_gate was ejected or unloaded; "
                                "holding with the cgroup freezer")
        logger.warning("gate: %s (%d sandboxes held)", self.fallback_reason, len(self._holds))
        for hold in self._holds.values():
            if not hold.frozen:
                hold.frozen = True
                _freeze_quietly(hold.meter)
        return False

    def _escalate(self, hold: _Hold) -> None:
        # Freeze first, then allow: the tasks leave the wait queue only to stop in the
        # freezer, so they never run in between.
        hold.frozen = True
        self.num_escalations += 1
        _freeze_quietly(hold.meter)
        if hold.cgroup_dir is not None:
            try:
                self._gate.allow(hold.key)
            except OSError as exc:
                logger.warning("gate: allowing %s after its freeze: %r", hold.cgroup_dir, exc)
        logger.info("gate: hold of %s past %.1f s became a freeze", hold.cgroup_dir,
                    self._max_hold_s)

    def close(self) -> None:
        """Unload the scheduler; sandboxes still held are frozen first so they stay held."""
        if self.fallback_reason is None:
            for hold in self._holds.values():
                if not hold.frozen:
                    self._escalate(hold)
        self._gate.close()


def _note_held(meter: Freezable, held: bool) -> None:
    note = getattr(meter, "note_held", None)  # SandboxCgroup's hold clock; fakes have none
    if callable(note):
        note(held)


def _inode(cgroup_dir: Path | None) -> int:
    if cgroup_dir is None:
        return -1
    try:
        return cgroup_dir.stat().st_ino
    except OSError:
        return -1


def _freeze_quietly(meter: Freezable) -> None:
    try:
        meter.freeze(timeout_s=ESCALATE_WAIT_S)
    except HostError as exc:  # requested; the kernel finishes the transition
        logger.debug("gate: freeze not settled yet: %s", exc)
    except OSError as exc:
        logger.warning("gate: freeze failed: %r", exc)


def choose_actuator(preference: ActuatorPreference = "auto", *,
                    max_hold_s: float = DEFAULT_MAX_HOLD_S) -> tuple[GateActuator, str]:
    """The actuator this host gets for `preference`, and why. "scx" raises ScxUnavailable
    when sched_ext cannot be used; "auto" then takes the freezer."""
    from tenon.host.scx.loader import ScxGate, ScxUnavailable, availability

    ActuatorConfig(preference, max_hold_s)  # validates
    if preference == "freezer":
        return FreezerActuator(), "freezer requested"
    available, reason = availability()
    if not available:
        if preference == "scx":
            raise ScxUnavailable(reason)
        return FreezerActuator(), f"freezer: {reason}"
    try:
        gate = ScxGate.load()
    except HostError as exc:
        if preference == "scx":
            raise
        return FreezerActuator(), f"freezer: sched_ext scheduler failed to load: {exc}"
    return ScxActuator(gate, max_hold_s=max_hold_s), f"scx: {reason}"
