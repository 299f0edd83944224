"""What a run left on the host: cgroups of a domain, processes, mounts (read-only checks)."""

from __future__ import annotations

import os
from pathlib import Path

from tenon.host.layout import CgroupLayout, detect_layout
from tenon.host.types import CgroupVersion


def domain_cgroups(domain_name: str, layout: CgroupLayout | None = None) -> list[Path]:
    """Every cgroup directory named after the domain, in every hierarchy (empty when the
    domain was removed)."""
    layout = layout or detect_layout()
    roots = {layout.root} if layout.version is CgroupVersion.V2 else set()
    roots |= set(layout.mounts.values())
    cgroup_fs = Path("/sys/fs/cgroup")
    if cgroup_fs.is_dir():  # hierarchies the layout does not use (Docker's driver makes some)
        roots |= {p for p in cgroup_fs.iterdir() if p.is_dir() and not p.is_symlink()}
        roots.add(cgroup_fs)
    return sorted(r / domain_name for r in roots if (r / domain_name).is_dir())


def processes_of(domain_name: str, path: Path) -> list[int]:
    """Pids of processes in a cgroup of the domain, or whose command line or working
    directory lies under `path`."""
    needle = str(path.resolve())
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cgroups = Path(f"/proc/{entry}/cgroup").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace")
            try:
                cwd = os.readlink(f"/proc/{entry}/cwd")
            except OSError:
                cwd = ""
        except OSError:  # exited meanwhile
            continue
        in_domain = any(f"/{domain_name}/" in line + "/" for line in cgroups.splitlines())
        if in_domain or needle in cmdline or cwd.startswith(needle):
            found.append(int(entry))
    return sorted(found)


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below `path` in this mount namespace."""
    prefix = str(path.resolve())
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == prefix or point.startswith(prefix + "/"):
            points.append(point)
    return points
