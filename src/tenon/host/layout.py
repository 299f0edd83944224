"""Which cgroup layout this host has: v1 controllers (as here) or pure v2."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tenon.errors import CgroupUnavailable
from tenon.host.types import CgroupVersion

V1_CONTROLLERS = ("memory", "freezer", "pids", "cpu", "cpuacct")


@dataclass(frozen=True)
class CgroupLayout:
    version: CgroupVersion
    root: Path
    # v1: controller -> its hierarchy's mount; v2: every controller -> the one root
    mounts: dict[str, Path] = field(default_factory=dict)
    missing: tuple[str, ...] = ()

    @property
    def controllers(self) -> tuple[str, ...]:
        return tuple(sorted(self.mounts))


def detect_layout(cgroup_root: Path = Path("/sys/fs/cgroup")) -> CgroupLayout:
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
        missing = tuple(f"v2 controller {c} not available" for c in ("pids", "cpu")
                        if c not in names)
        return CgroupLayout(CgroupVersion.V2, cgroup_root,
                            {n: cgroup_root for n in names}, missing)
    mounts = {c: cgroup_root / c for c in V1_CONTROLLERS
              if (cgroup_root / c / "cgroup.procs").exists()}
    if "memory" not in mounts:
        raise CgroupUnavailable(
            f"no cgroup memory controller under {cgroup_root} (neither v2 cgroup.controllers "
            f"nor a v1 memory hierarchy); mount one, e.g.: mount -t cgroup2 none {cgroup_root}"
        )
    missing = tuple(f"v1 controller {c} not mounted at {cgroup_root / c}"
                    for c in V1_CONTROLLERS if c not in mounts)
    return CgroupLayout(CgroupVersion.V1, cgroup_root, mounts, missing)
