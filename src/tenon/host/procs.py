"""Process facts from /proc: parentage, sessions, environment tokens, tolerant signalling."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from tenon.host.types import HostProcess

logger = logging.getLogger(__name__)

PROC_ROOT = Path("/proc")
_GONE = (FileNotFoundError, ProcessLookupError)  # a process can exit between listing and reading


def process_info(pid: int, proc_root: Path = PROC_ROOT) -> HostProcess | None:
    """`pid` as /proc shows it, or None when it is gone."""
    try:
        stat = (proc_root / str(pid) / "stat").read_text()
    except _GONE:
        return None
    # comm may hold spaces and parentheses: the fields start after the last ")".
    comm = stat[stat.index("(") + 1 : stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2 :].split()
    ppid, pgid, sid = int(fields[1]), int(fields[2]), int(fields[3])
    try:
        argv = (proc_root / str(pid) / "cmdline").read_bytes()
    except _GONE:
        argv = b""
    command = " ".join(a.decode(errors="replace") for a in argv.split(b"\0") if a)
    return HostProcess(pid=pid, ppid=ppid, sid=sid, pgid=pgid, command=command or f"[{comm}]")


def descendants(root_pid: int, candidates: Iterable[int], proc_root: Path = PROC_ROOT) -> list[int]:
    """The candidates whose parent chain reaches `root_pid` (root_pid itself excluded)."""
    parent: dict[int, int | None] = {}

    def ppid_of(pid: int) -> int | None:
        if pid not in parent:
            info = process_info(pid, proc_root)
            parent[pid] = info.ppid if info else None
        return parent[pid]

    found = []
    for pid in candidates:
        seen: set[int] = set()
        cur: int | None = ppid_of(pid) if pid != root_pid else None
        while cur is not None and cur > 1 and cur not in seen and cur != root_pid:
            seen.add(cur)
            cur = ppid_of(cur)
        if cur == root_pid and pid != root_pid:
            found.append(pid)
    return sorted(found)


def session_members(sid: int, candidates: Iterable[int], proc_root: Path = PROC_ROOT) -> list[int]:
    """The candidates whose session id is `sid`."""
    infos = (process_info(pid, proc_root) for pid in candidates)
    return sorted(i.pid for i in infos if i is not None and i.sid == sid)


def kill_pids(pids: Iterable[int], sig: int) -> list[int]:
    """Send `sig` to each pid; returns the pids that were still there to receive it."""
    signalled = []
    for pid in pids:
        if pid <= 1:  # never broadcast (-1, 0) or hit init by accident
            raise ValueError(f"refusing to signal pid {pid}")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
            signalled.append(pid)
    return signalled


def read_environ_token(pid: int, key: str, proc_root: Path = PROC_ROOT) -> str | None:
    """The value of `key` in `pid`'s initial environment; None when absent or unreadable."""
    try:
        raw = (proc_root / str(pid) / "environ").read_bytes()
    except (*_GONE, PermissionError):
        return None
    prefix = key.encode() + b"="
    for entry in raw.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode(errors="replace")
    return None


def exists(pid: int, proc_root: Path = PROC_ROOT) -> bool:
    """True while /proc still lists `pid` (zombies included)."""
    return (proc_root / str(pid)).exists()


def is_alive(pid: int, proc_root: Path = PROC_ROOT) -> bool:
    """True unless gone or a zombie (a zombie's parent reaps it; killing it again is moot)."""
    try:
        stat = (proc_root / str(pid) / "stat").read_text()
    except _GONE:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"
