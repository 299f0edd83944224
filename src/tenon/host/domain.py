"""The workload domain: one parent cgroup (the budget) and a child cgroup per sandbox."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from tenon.errors import ConfigError, HostError
from tenon.host.layout import CgroupLayout, detect_layout
from tenon.host.types import CgroupVersion, GateResult, MemoryReading, OomEvent

logger = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_UNLIMITED_V1 = 1 << 62  # v1 reports "no limit" as a huge page-aligned number
FREEZE_TIMEOUT_S = 5.0


def _check_name(name: str, what: str) -> str:
    if not _NAME_RE.match(name):
        raise ConfigError(f"{what} {name!r} must match {_NAME_RE.pattern}")
    return name


def _read_int(path: Path) -> int:
    return int(path.read_text().split()[0])


def _read_keyed(path: Path) -> dict[str, int]:
    return {k: int(v) for k, v in (line.split() for line in path.read_text().splitlines() if line)}


@dataclass
class SandboxCgroup:
    """One sandbox's cgroup: a directory per v1 controller, or one v2 directory."""

    sandbox_id: str
    layout: CgroupLayout
    dirs: dict[str, Path]  # controller -> directory (v2: every controller -> the same dir)
    _seen_oom_kills: int = field(default=0)

    @property
    def _v1(self) -> bool:
        return self.layout.version is CgroupVersion.V1

    def procs_files(self) -> list[Path]:
        """Every cgroup.procs a new process must be written into."""
        return sorted({d / "cgroup.procs" for d in self.dirs.values()})

    def add_pid(self, pid: int) -> None:
        for procs in self.procs_files():
            procs.write_text(str(pid))

    def pids(self) -> list[int]:
        text = (self.dirs["memory"] / "cgroup.procs").read_text()
        return [int(p) for p in text.split()]

    def set_max_pids(self, max_pids: int) -> None:
        if max_pids < 1:
            raise ConfigError(f"max_pids must be at least 1, got {max_pids}")
        (self.dirs["pids"] / "pids.max").write_text(str(max_pids))

    def reading(self) -> MemoryReading:
        mem = self.dirs["memory"]
        if self._v1:
            usage_file = mem / "memory.memsw.usage_in_bytes"
            if not usage_file.exists():
                usage_file = mem / "memory.usage_in_bytes"
            peak_file = mem / "memory.memsw.max_usage_in_bytes"
            if not peak_file.exists():
                peak_file = mem / "memory.max_usage_in_bytes"
            limit = _read_int(mem / "memory.limit_in_bytes")
            cpu_s = _read_int(self.dirs["cpuacct"] / "cpuacct.usage") / 1e9
            ooms = _read_keyed(mem / "memory.oom_control").get("oom_kill", 0)
            return MemoryReading(_read_int(usage_file), _read_int(peak_file),
                                 None if limit >= _UNLIMITED_V1 else limit, cpu_s, ooms)
        usage = _read_int(mem / "memory.current")
        swap = mem / "memory.swap.current"
        if swap.exists():
            usage += _read_int(swap)
        peak_file = mem / "memory.peak"
        peak = _read_int(peak_file) if peak_file.exists() else usage
        limit_text = (mem / "memory.max").read_text().strip()
        cpu_s = _read_keyed(mem / "cpu.stat").get("usage_usec", 0) / 1e6
        ooms = _read_keyed(mem / "memory.events").get("oom_kill", 0)
        return MemoryReading(usage, peak, None if limit_text == "max" else int(limit_text),
                             cpu_s, ooms)

    def new_oom_kills(self) -> int:
        """OOM kills in this cgroup since the previous call."""
        total = self.reading().num_oom_kills
        fresh, self._seen_oom_kills = total - self._seen_oom_kills, total
        return max(fresh, 0)

    def is_frozen(self) -> bool:
        if self._v1:
            return (self.dirs["freezer"] / "freezer.state").read_text().strip() == "FROZEN"
        return _read_keyed(self.dirs["memory"] / "cgroup.events").get("frozen", 0) == 1

    def _set_frozen(self, frozen: bool) -> GateResult:
        start = time.perf_counter()
        if self.is_frozen() == frozen:
            return GateResult(frozen, False, time.perf_counter() - start)
        if self._v1:
            (self.dirs["freezer"] / "freezer.state").write_text("FROZEN" if frozen else "THAWED")
        else:
            (self.dirs["memory"] / "cgroup.freeze").write_text("1" if frozen else "0")
        while self.is_frozen() != frozen:
            if time.perf_counter() - start > FREEZE_TIMEOUT_S:
                raise HostError(f"cgroup of {self.sandbox_id} did not reach frozen={frozen} "
                                f"within {FREEZE_TIMEOUT_S} s")
            time.sleep(0.0005)
        return GateResult(frozen, True, time.perf_counter() - start)

    def freeze(self) -> GateResult:
        """Deny execution: the cgroup's processes stop at once (idempotent)."""
        return self._set_frozen(True)

    def thaw(self) -> GateResult:
        """Allow execution again (idempotent)."""
        return self._set_frozen(False)

    def kill_all(self, timeout_s: float = 5.0) -> None:
        """SIGKILL every process until the cgroup is empty (thawed first so kills land)."""
        if not self.dirs["memory"].exists():
            return
        self.thaw()
        deadline = time.monotonic() + timeout_s
        while pids := self.pids():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                raise HostError(f"cgroup of {self.sandbox_id} still has pids {pids}")
            time.sleep(0.005)

    def remove(self) -> None:
        """Kill everything and remove the cgroup directories (idempotent)."""
        self.kill_all()
        for directory in sorted(set(self.dirs.values()), reverse=True):
            for _ in range(100):  # rmdir can race the exit of the last task
                try:
                    directory.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)
            else:
                raise HostError(f"cannot remove cgroup {directory}")


class WorkloadDomain:
    """The parent cgroup whose memory limit is the budget Tenon manages."""

    def __init__(self, name: str, layout: CgroupLayout, budget_bytes: int | None) -> None:
        self.name = name
        self.layout = layout
        self.budget_bytes = budget_bytes
        self._children: dict[str, SandboxCgroup] = {}

    @property
    def version(self) -> CgroupVersion:
        return self.layout.version

    def _dirs(self, relative: str) -> dict[str, Path]:
        if self.version is CgroupVersion.V1:
            return {c: m / self.name / relative for c, m in self.layout.mounts.items()}
        return {c: self.layout.root / self.name / relative for c in self.layout.mounts}

    @classmethod
    def open(cls, name: str = "tenon", budget_bytes: int | None = None,
             layout: CgroupLayout | None = None) -> WorkloadDomain:
        """Create or adopt the domain `name` and set its budget."""
        _check_name(name, "domain name")
        if budget_bytes is not None and budget_bytes < 0:
            raise ConfigError(f"budget must not be negative, got {budget_bytes}")
        layout = layout or detect_layout()
        domain = cls(name, layout, None)
        if layout.version is CgroupVersion.V2:
            for d in (layout.root, layout.root / name):
                d.mkdir(exist_ok=True)
                (d / "cgroup.subtree_control").write_text("+memory +pids +cpu")
        else:
            for d in set(domain._dirs("").values()):
                d.mkdir(exist_ok=True)
        domain.set_budget(budget_bytes)
        return domain

    def set_budget(self, budget_bytes: int | None) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise ConfigError(f"budget must not be negative, got {budget_bytes}")
        if self.version is CgroupVersion.V2:
            d = self.layout.root / self.name
            (d / "memory.max").write_text("max" if budget_bytes is None else str(budget_bytes))
        else:
            mem = self.layout.mounts["memory"] / self.name
            memsw = mem / "memory.memsw.limit_in_bytes"
            value = "-1" if budget_bytes is None else str(budget_bytes)
            # memsw must stay >= the memory limit: order the writes by direction.
            current = _read_int(mem / "memory.limit_in_bytes")
            growing = budget_bytes is None or budget_bytes >= current
            files = [memsw, mem / "memory.limit_in_bytes"] if growing else [
                mem / "memory.limit_in_bytes", memsw]
            for f in files:
                if f.exists():
                    f.write_text(value)
        self.budget_bytes = budget_bytes

    def sandbox(self, sandbox_id: str) -> SandboxCgroup:
        """Create (or adopt) the child cgroup of `sandbox_id`."""
        return self.adopt(sandbox_id, sandbox_id, create=True)

    def adopt(self, sandbox_id: str, relative_path: str, *, create: bool = False) -> SandboxCgroup:
        _check_name(sandbox_id, "sandbox id")
        dirs = self._dirs(relative_path)
        for d in set(dirs.values()):
            if create:
                d.mkdir(exist_ok=True)
            elif not d.exists():
                raise HostError(f"cgroup {d} does not exist")
        child = SandboxCgroup(sandbox_id, self.layout, dirs)
        self._children[sandbox_id] = child
        return child

    def reading(self) -> MemoryReading:
        return SandboxCgroup(self.name, self.layout, self._dirs("")).reading()

    def poll_oom(self) -> list[OomEvent]:
        """OOM kills since the previous poll, attributed to the child they hit."""
        events = []
        for sandbox_id, child in list(self._children.items()):
            if child.dirs["memory"].exists() and (n := child.new_oom_kills()):
                events.append(OomEvent(sandbox_id, n))
        return events

    def remove(self) -> None:
        """Remove every child (killing its processes), then the domain (idempotent)."""
        for child in list(self._children.values()):
            child.remove()
        self._children.clear()
        SandboxCgroup(self.name, self.layout, self._dirs("")).remove()
