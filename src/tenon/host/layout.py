"""Which cgroup layout this host has: v1 controllers (as here) or pure v2."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tenon.errors import CgroupUnavailable
from tenon.host.cgroupfs import CgroupIO, KernelIO
from tenon.host.types import CgroupVersion

V1_CONTROLLERS = ("memory", "freezer", "pids", "cpu", "cpuacct")
CGROUP_ROOT = Path("/sys/fs/cgroup")  # where the hierarchies are mounted


@dataclass(frozen=True)
class CgroupLayout:
    """Where each controller lives, and what is missing (each entry names its fix)."""

    version: CgroupVersion
    root: Path
    # v1: controller -> its hierarchy's mount; v2: every controller -> the one root
    mounts: dict[str, Path] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    # the seam for writes, mkdir/rmdir and signals; a fake tree supplies its own
    io: CgroupIO = field(default_factory=KernelIO, compare=False, repr=False)

    @property
    def controllers(self) -> tuple[str, ...]:
        return tuple(sorted(self.mounts))


def detect_layout(cgroup_root: Path = CGROUP_ROOT) -> CgroupLayout:
    """Detect the layout under `cgroup_root`; CgroupUnavailable without a memory controller."""
    v2_controllers = cgroup_root / "cgroup.controllers"
    if v2_controllers.exists():
        names = v2_controllers.read_text().split()
        if "memory" not in names:
            raise CgroupUnavailable(
                f"cgroup v2 at {cgroup_root} has no memory controller (cgroup.controllers: "
                f"{' '.join(names) or 'empty'}); enable it with: echo +memory > "
                f"{cgroup_root}/cgroup.subtree_control"
            )
        missing = [f"v2 controller {c} not available at {cgroup_root}; enable it in the "
                   f"parent's cgroup.subtree_control or boot with it" for c in ("pids", "cpu")
                   if c not in names]
        return CgroupLayout(CgroupVersion.V2, cgroup_root,
                            {n: cgroup_root for n in names}, missing)
    mounts = {c: cgroup_root / c for c in V1_CONTROLLERS
              if (cgroup_root / c / "cgroup.procs").exists()}
    if "memory" not in mounts:
        raise CgroupUnavailable(
            f"no cgroup memory controller under {cgroup_root} (neither v2 cgroup.controllers "
            f"nor a v1 memory hierarchy); mount one, e.g.: mount -t cgroup2 none {cgroup_root}"
        )
    missing = [f"v1 controller {c} not mounted at {cgroup_root / c}; fix: mkdir -p "
               f"{cgroup_root / c} && mount -t cgroup -o {c} cgroup {cgroup_root / c}"
               for c in V1_CONTROLLERS if c not in mounts]
    return CgroupLayout(CgroupVersion.V1, cgroup_root, mounts, missing)
