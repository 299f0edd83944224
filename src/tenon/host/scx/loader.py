"""Load and unload the tenon_gate scheduler, and set a cgroup's allow/deny in its map.

`ScxGate.load()` builds the object (build.py), registers it with
`bpftool struct_ops register` (the link is pinned under /sys/fs/bpf/tenon-gate-<pid>; the
scheduler runs while that pin exists), pins its `gate` and `gate_stats` maps next to it and
opens them with bpf(2). `close()` removes the pins, which unregisters the scheduler.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import struct
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from tenon.errors import HostError
from tenon.host.scx import bpfsys
from tenon.host.scx.build import VMLINUX_BTF, BuildToolMissing, Toolchain, build

logger = logging.getLogger(__name__)

SCHED_EXT = Path("/sys/kernel/sched_ext")
CGROUP_ROOT = Path("/sys/fs/cgroup")
BPF_FS = Path("/sys/fs/bpf")
OPS_NAME = "tenon_gate"
STAT_NAMES = ("held", "released", "spared", "preempted", "dispatched")  # gate.bpf.c gate_stat
WATCHDOG_TIMEOUT_S = 30.0  # tenon_gate's timeout_ms: a hold must end well before it
SETTLE_TIMEOUT_S = 10.0
CAP_SYS_ADMIN = 21
CAP_BPF = 39
DENY = b"\x01"


class ScxUnavailable(HostError):
    """sched_ext cannot be used on this host (the reason says why)."""


def sched_ext_state() -> str:
    """The kernel's sched_ext state ("disabled", "enabled", ...), or "" without sched_ext."""
    try:
        return (SCHED_EXT / "state").read_text().strip()
    except OSError:
        return ""


def loaded_ops() -> str | None:
    """The name of the loaded sched_ext scheduler, if any."""
    try:
        return (SCHED_EXT / "root" / "ops").read_text().strip() or None
    except OSError:
        return None


def _capabilities() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def availability() -> tuple[bool, str]:
    """Whether this host can run tenon_gate now, and why (or why not)."""
    if not SCHED_EXT.is_dir():
        return False, "kernel lacks sched_ext (no /sys/kernel/sched_ext: CONFIG_SCHED_CLASS_EXT)"
    if not (CGROUP_ROOT / "cgroup.controllers").is_file():
        return False, "cgroup v1 at /sys/fs/cgroup: the gate needs pure cgroup v2 ids"
    caps = _capabilities()
    if not (caps >> CAP_SYS_ADMIN) & 1 or not (caps >> CAP_BPF) & 1:
        return False, "not root: loading a sched_ext scheduler needs CAP_SYS_ADMIN and CAP_BPF"
    if not VMLINUX_BTF.is_file():
        return False, f"no kernel BTF ({VMLINUX_BTF}: CONFIG_DEBUG_INFO_BTF)"
    try:
        Toolchain.from_env()
    except BuildToolMissing as exc:
        return False, str(exc)
    state = sched_ext_state()
    if state != "disabled":
        return False, (f"another sched_ext scheduler is loaded ({loaded_ops() or 'unknown'}, "
                       f"state {state})")
    return True, f"sched_ext available (kernel {platform.release()})"


def cgroup_id(cgroup: Path | int) -> int:
    """A v2 cgroup's id: its directory's inode number (an int is taken as the id)."""
    return cgroup if isinstance(cgroup, int) else os.stat(cgroup).st_ino


class ScxGate:
    """The loaded tenon_gate scheduler and its `gate` map."""

    def __init__(self, *, bpftool: str, pin_dir: Path, gate_fd: int, stats_fd: int,
                 enable_seq: int) -> None:
        self._bpftool = bpftool
        self.pin_dir = pin_dir
        self._gate_fd = gate_fd
        self._stats_fd = stats_fd
        self._enable_seq = enable_seq
        self._closed = False

    @classmethod
    def load(cls, *, tools: Toolchain | None = None, pin_dir: Path | None = None) -> ScxGate:
        """Build (or reuse) the object and register it; ScxUnavailable when it cannot run."""
        available, reason = availability()
        if not available:
            raise ScxUnavailable(reason)
        tools = tools or Toolchain.from_env()
        obj = build(tools=tools)
        pin_dir = pin_dir or BPF_FS / f"tenon-gate-{os.getpid()}"
        if pin_dir.exists():
            _remove_pins(pin_dir)
        _bpftool(tools.bpftool, "struct_ops", "register", str(obj), str(pin_dir))
        try:
            _wait_for(lambda: sched_ext_state() == "enabled" and loaded_ops() == OPS_NAME,
                      "tenon_gate to be enabled")
            enable_seq = _enable_seq()
            maps = {m["name"]: int(m["id"])
                    for m in sorted(json.loads(_bpftool(tools.bpftool, "-j", "map", "show")),
                                    key=lambda m: int(m["id"]))
                    if m.get("name") in ("gate", "gate_stats")}  # the newest of each name
            fds = []
            for name in ("gate", "gate_stats"):
                _bpftool(tools.bpftool, "map", "pin", "id", str(maps[name]),
                         str(pin_dir / f"map_{name}"))
                fds.append(bpfsys.obj_get(str(pin_dir / f"map_{name}")))
        except BaseException:
            _remove_pins(pin_dir)
            raise
        logger.info("sched_ext gate loaded (pins under %s)", pin_dir)
        return cls(bpftool=tools.bpftool, pin_dir=pin_dir, gate_fd=fds[0], stats_fd=fds[1],
                   enable_seq=enable_seq)

    def deny(self, cgroup: Path | int) -> None:
        """Hold the cgroup's (and its descendants') runnable tasks from now on."""
        bpfsys.update(self._gate_fd, struct.pack("=Q", cgroup_id(cgroup)), DENY)

    def allow(self, cgroup: Path | int) -> None:
        """Let the cgroup's tasks run again (the next dispatch moves them)."""
        self.forget(cgroup)

    def forget(self, cgroup: Path | int) -> None:
        """Drop the cgroup's entry (also for a cgroup already removed, by its id)."""
        bpfsys.delete(self._gate_fd, struct.pack("=Q", cgroup_id(cgroup)))

    def is_denied(self, cgroup_dir: Path) -> bool:
        value = bpfsys.lookup(self._gate_fd, struct.pack("=Q", cgroup_id(cgroup_dir)), 1)
        return value == DENY

    def stats(self) -> dict[str, int]:
        """The scheduler's counters (tasks held, released, spared as dying, ...)."""
        counts = {}
        for index, name in enumerate(STAT_NAMES):
            raw = bpfsys.lookup(self._stats_fd, struct.pack("=I", index), 8)
            counts[name] = 0 if raw is None else struct.unpack("=Q", raw)[0]
        return counts

    def healthy(self) -> bool:
        """Still the running scheduler: not ejected (watchdog, SysRq-S, error) or replaced."""
        return (not self._closed and sched_ext_state() == "enabled"
                and loaded_ops() == OPS_NAME and _enable_seq() == self._enable_seq)

    def close(self) -> None:
        """Unregister the scheduler and remove every pin (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for fd in (self._gate_fd, self._stats_fd):
            os.close(fd)
        _remove_pins(self.pin_dir)
        try:
            _wait_for(lambda: loaded_ops() != OPS_NAME or sched_ext_state() == "disabled",
                      "tenon_gate to be disabled")
        except HostError as exc:
            logger.warning("%s", exc)
        logger.info("sched_ext gate unloaded")


def _enable_seq() -> int:
    try:
        return int((SCHED_EXT / "enable_seq").read_text())
    except (OSError, ValueError):
        return -1


def _remove_pins(pin_dir: Path) -> None:
    # Removing the link's pin releases the link, which disables the scheduler.
    shutil.rmtree(pin_dir, ignore_errors=True)


def _wait_for(done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while not done():
        if time.monotonic() > deadline:
            raise HostError(f"timed out after {SETTLE_TIMEOUT_S} s waiting for {what} "
                            f"(sched_ext state {sched_ext_state() or 'absent'})")
        time.sleep(0.01)


def _bpftool(bpftool: str, *args: str) -> str:
    try:
        done = subprocess.run([bpftool, *args], capture_output=True, text=True, timeout=60,
                              check=False)
    except (FileNotFoundError, subprocess.TimeoutExpired) as exc:
        raise HostError(f"bpftool {' '.join(args[:2])}: {exc}") from exc
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        raise HostError(f"bpftool {' '.join(args[:3])} failed: {lines[-1] if lines else '?'}")
    return done.stdout
