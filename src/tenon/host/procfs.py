"""Facts about one process read from /proc: its mounts, namespaces, cgroups, and a sysctl.

Every function takes `proc_root` so a test can point it at a scripted directory laid out as
/proc is. A read that fails, or a line the kernel would not write, raises `HostError` (an
`OSError`), never a partial answer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tenon.errors import HostError

PROC_ROOT = Path("/proc")
NAMESPACE_KINDS = frozenset({"cgroup", "ipc", "mnt", "net", "pid", "time", "user", "uts"})


@dataclass(frozen=True)
class Mount:
    """One line of a process's mount table (proc(5), /proc/<pid>/mountinfo)."""

    mount_point: str  # as the process sees it, octal escapes (\040) left as the kernel wrote
    writable: bool  # "rw" among the per-mount options (field 6)
    fs_type: str  # the first field after the " - " separator
    root: str  # the directory of its filesystem mounted there ("/null": a bind of /dev/null)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise HostError(f"cannot read {path}: {exc.strerror or exc}") from exc


def mount_table(pid: int | str, proc_root: Path = PROC_ROOT) -> list[Mount]:
    """The mounts `pid` ("self" for this process) sees, in the kernel's order."""
    path = proc_root / str(pid) / "mountinfo"
    table = []
    for line in _read(path).splitlines():
        try:
            before, after = line.split(" - ", 1)
            fields = before.split()
            table.append(
                Mount(
                    mount_point=fields[4],
                    writable="rw" in fields[5].split(","),
                    fs_type=after.split()[0],
                    root=fields[3],
                )
            )
        except (ValueError, IndexError):
            raise HostError(f"{path}: malformed line {line!r}") from None
    return table


def _namespace_path(pid: int | str, kind: str, proc_root: Path) -> Path:
    if kind not in NAMESPACE_KINDS:
        raise ValueError(f"unknown namespace kind {kind!r}; known: {sorted(NAMESPACE_KINDS)}")
    return proc_root / str(pid) / "ns" / kind


def namespace_id(pid: int | str, kind: str, proc_root: Path = PROC_ROOT) -> str:
    """The identity of `pid`'s namespace of that kind, e.g. "net:[4026531840]"."""
    path = _namespace_path(pid, kind, proc_root)
    try:
        return os.readlink(path)
    except OSError as exc:
        raise HostError(f"cannot read {path}: {exc.strerror or exc}") from exc


def shares_namespace(pid: int, kind: str, proc_root: Path = PROC_ROOT) -> bool:
    """True when `pid` is in this process's namespace of that kind."""
    return namespace_id(pid, kind, proc_root) == namespace_id("self", kind, proc_root)


def open_namespace(pid: int, kind: str, proc_root: Path = PROC_ROOT) -> int:
    """A close-on-exec file descriptor on `pid`'s namespace of that kind (for setns(2) or an
    ioctl(2) on it); the caller closes it."""
    path = _namespace_path(pid, kind, proc_root)
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise HostError(f"cannot open {path}: {exc.strerror or exc}") from exc


def cgroups_of(pid: int, proc_root: Path = PROC_ROOT) -> list[tuple[tuple[str, ...], str]]:
    """(controllers, path from the hierarchy's root) for each hierarchy `pid` is in
    (/proc/<pid>/cgroup); the v2 hierarchy's entry has no controllers."""
    path = proc_root / str(pid) / "cgroup"
    found = []
    for line in _read(path).splitlines():
        try:
            _, controllers, cgroup = line.split(":", 2)
        except ValueError:
            raise HostError(f"{path}: malformed line {line!r}") from None
        found.append((tuple(c for c in controllers.split(",") if c), cgroup))
    return found


def stat_in_root(pid: int, path: str, proc_root: Path = PROC_ROOT) -> os.stat_result:
    """stat(2) of the absolute `path` as `pid` sees it (through its root, /proc/<pid>/root)."""
    if not path.startswith("/"):
        raise ValueError(f"path {path!r} must be absolute")
    return (proc_root / str(pid) / "root" / path.lstrip("/")).stat()


def max_user_namespaces(proc_root: Path = PROC_ROOT) -> int | None:
    """The user.max_user_namespaces sysctl (0: user namespaces are disabled); None when it
    cannot be read (a kernel without the knob)."""
    try:
        return int((proc_root / "sys" / "user" / "max_user_namespaces").read_text())
    except (OSError, ValueError):
        return None
