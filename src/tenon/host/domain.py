"""The workload domain: one parent cgroup (the budget) and a child cgroup per sandbox."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path, PurePosixPath

from tenon.errors import ConfigError, HostError
from tenon.host.cgroup import SandboxCgroup
from tenon.host.cgroupfs import read_int, read_keyed, read_text
from tenon.host.layout import CGROUP_ROOT, CgroupLayout, detect_layout
from tenon.host.types import CgroupVersion, MemoryReading, OomEvent, PressureReading

__all__ = ["SandboxCgroup", "WorkloadDomain", "remove_empty_domain_dirs"]

logger = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")
V2_DOMAIN_CONTROLLERS = ("memory", "pids", "cpu")


def _check_name(name: str, what: str) -> str:
    if not _NAME_RE.match(name):
        raise ConfigError(f"{what} {name!r} must match {_NAME_RE.pattern}")
    return name


def _check_relative(relative_path: str) -> str:
    parts = PurePosixPath(relative_path).parts
    if not parts or relative_path.startswith("/") or any(p in ("..", ".") for p in parts):
        raise ConfigError(f"cgroup path {relative_path!r} must be relative to the domain, "
                          f"without '.' or '..'")
    return relative_path


def _check_budget(budget_bytes: int | None) -> None:
    if budget_bytes is not None and budget_bytes < 0:
        raise ConfigError(f"budget must not be negative, got {budget_bytes}")


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
        base = Path(self.name, relative) if relative else Path(self.name)
        if self.version is CgroupVersion.V1:
            return {c: m / base for c, m in self.layout.mounts.items()}
        return {c: self.layout.root / base for c in self.layout.mounts}

    @property
    def _memory_dir(self) -> Path:
        return self._dirs("")["memory"]

    def _self_cgroup(self) -> SandboxCgroup:
        return SandboxCgroup(self.name, self.layout, self._dirs(""))

    @classmethod
    def open(cls, name: str = "tenon", budget_bytes: int | None = None,
             layout: CgroupLayout | None = None) -> WorkloadDomain:
        """Create or adopt the domain `name` and set its budget (None = unlimited)."""
        _check_name(name, "domain name")
        _check_budget(budget_bytes)
        layout = layout or detect_layout()
        domain = cls(name, layout, None)
        io = layout.io
        if layout.version is CgroupVersion.V2:
            enable = " ".join(f"+{c}" for c in V2_DOMAIN_CONTROLLERS if c in layout.mounts)
            io.write(layout.root / "cgroup.subtree_control", enable)
            io.mkdir(layout.root / name)
            io.write(layout.root / name / "cgroup.subtree_control", enable)
        else:
            for d in sorted(set(domain._dirs("").values())):
                io.mkdir(d)
            hierarchy = domain._memory_dir / "memory.use_hierarchy"
            # Children must charge the domain's limit; only settable while childless.
            if hierarchy.exists() and read_text(hierarchy).strip() == "0":
                io.write(hierarchy, "1")
        domain.set_budget(budget_bytes)
        logger.info("workload domain %s (%s) budget=%s bytes", name, layout.version.value,
                    budget_bytes)
        return domain

    def set_budget(self, budget_bytes: int | None) -> None:
        """Set the domain's memory limit (None = unlimited); swap is held inside it too."""
        _check_budget(budget_bytes)
        io, mem = self.layout.io, self._memory_dir
        if self.version is CgroupVersion.V2:
            io.write(mem / "memory.max", "max" if budget_bytes is None else str(budget_bytes))
            swap_max = mem / "memory.swap.max"
            if swap_max.exists():  # like v1 memsw = limit: swapping may not stretch the budget
                io.write(swap_max, "max" if budget_bytes is None else "0")
        else:
            memsw = mem / "memory.memsw.limit_in_bytes"
            limit = mem / "memory.limit_in_bytes"
            value = "-1" if budget_bytes is None else str(budget_bytes)
            # The kernel keeps memsw >= limit: raise memsw first when growing, last when shrinking.
            growing = budget_bytes is None or budget_bytes >= read_int(limit)
            for f in ([memsw, limit] if growing else [limit, memsw]):
                if f.exists():
                    io.write(f, value)
        self.budget_bytes = budget_bytes

    def reading(self) -> MemoryReading:
        """The whole domain: every sandbox together, against the budget."""
        return self._self_cgroup().reading()

    def pressure(self) -> PressureReading | None:
        """The domain's memory PSI on v2; None on v1."""
        return self._self_cgroup().pressure()

    def sandbox(self, sandbox_id: str) -> SandboxCgroup:
        """Create (or adopt) the child cgroup `<domain>/<sandbox_id>` in every controller."""
        _check_name(sandbox_id, "sandbox id")
        dirs = self._dirs(sandbox_id)
        for d in sorted(set(dirs.values())):
            self.layout.io.mkdir(d)
        return self._register(sandbox_id, dirs)

    def adopt(self, sandbox_id: str, relative_path: str) -> SandboxCgroup:
        """Adopt an existing cgroup at `<domain>/<relative_path>` (e.g. a Docker container's)."""
        _check_name(sandbox_id, "sandbox id")
        dirs = self._dirs(_check_relative(relative_path))
        if not dirs["memory"].is_dir():
            raise HostError(f"cgroup {dirs['memory']} does not exist (adopting {sandbox_id})")
        # A v1 hierarchy the creator did not populate is skipped rather than invented.
        return self._register(sandbox_id, {c: d for c, d in dirs.items() if d.is_dir()})

    def _register(self, sandbox_id: str, dirs: dict[str, Path]) -> SandboxCgroup:
        known = self._children.get(sandbox_id)
        if known is not None and known.dirs == dirs:
            return known
        child = SandboxCgroup(sandbox_id, self.layout, dirs)
        self._children[sandbox_id] = child
        return child

    def _present(self) -> list[SandboxCgroup]:
        """Known children that still exist, then any unknown child directories."""
        present = [c for c in self._children.values() if c.exists()]
        known_dirs = {c.dirs["memory"] for c in present}
        mem = self._memory_dir
        strays = sorted(d for d in mem.iterdir() if d.is_dir() and d not in known_dirs) \
            if mem.is_dir() else []
        for d in strays:
            present.append(self._register(d.name, self._dirs(d.name)))
        return present

    def sandbox_ids(self) -> list[str]:
        """The children present in the domain (known ids, or directory names for strays)."""
        return sorted(c.sandbox_id for c in self._present())

    def poll_oom(self) -> list[OomEvent]:
        """OOM kills since the previous poll, attributed to the child they hit."""
        events = []
        for child in self._present():
            try:
                fresh = child.new_oom_kills()
            except HostError:  # removed between listing and reading: nothing to attribute
                continue
            if fresh:
                logger.warning("OOM kill in sandbox %s (%d)", child.sandbox_id, fresh)
                events.append(OomEvent(child.sandbox_id, fresh))
        return sorted(events, key=lambda e: e.sandbox_id)

    def num_oom_kills(self) -> int:
        """Cumulative OOM kills anywhere in the domain."""
        mem = self._memory_dir
        if self.version is CgroupVersion.V2:  # memory.events is hierarchical on v2
            return read_keyed(mem / "memory.events").get("oom_kill", 0)
        # v1 counts a kill in the victim's own cgroup only: add the children to the domain.
        own = read_keyed(mem / "memory.oom_control").get("oom_kill", 0)
        return own + sum(c.reading().num_oom_kills for c in self._present())

    def remove(self) -> None:
        """Remove every child (killing its processes), then the domain (idempotent)."""
        self.remove_children()
        self._self_cgroup().remove()
        logger.info("removed workload domain %s", self.name)

    def remove_children(self) -> list[str]:
        """Kill and remove every cgroup below the domain, keeping the domain itself (what a
        dead controller left behind); the relative paths removed."""
        by_dir = {c.dirs["memory"]: c for c in self._children.values() if "memory" in c.dirs}
        removed = self._descendant_paths()
        for rel in removed:  # deepest first: rmdir needs empty children
            dirs = {c: d for c, d in self._dirs(rel).items() if d.is_dir()}
            child = by_dir.get(dirs.get("memory", Path())) or SandboxCgroup(rel, self.layout, dirs)
            child.remove()
        self._children.clear()
        return removed

    def _descendant_paths(self) -> list[str]:
        found: set[str] = set()
        for top in set(self._dirs("").values()):
            for parent, subdirs, _ in os.walk(top):
                found |= {os.path.relpath(os.path.join(parent, d), top) for d in subdirs}
        return sorted(found, key=lambda rel: rel.count("/"), reverse=True)


def remove_empty_domain_dirs(domain_name: str, cgroup_root: Path = CGROUP_ROOT) -> list[Path]:
    """Remove each `<hierarchy>/<domain_name>` directory under `cgroup_root` that has no
    child cgroup (a cgroup's own files are not directories); one that still has children is
    left, with a warning. The directories removed."""
    removed = []
    for directory in cgroup_root.glob(f"*/{domain_name}"):
        if any(child.is_dir() for child in directory.iterdir()):
            logger.warning("cgroup %s still has children; leaving it", directory)
            continue
        try:
            directory.rmdir()
        except FileNotFoundError:
            continue
        removed.append(directory)
    return removed
