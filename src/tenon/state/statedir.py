"""The state directory: where one controller keeps everything a restart needs.

    <state dir>/
        controller.lock   held (flock) by the running controller; its pid inside
        domain            the workload domain's name, so a restart reopens the same cgroup
        recovery.sqlite   one recovery record per logical agent (`RecoveryStore`)
        workspaces/<id>/  each agent's persistent root (`WorkspaceStore`)
        events.jsonl      the event log, appended across restarts

One controller at a time: a second one on the same directory is refused (`StateDirBusy`)
rather than allowed to race the first on the records and the domain. The lock is an
`flock` on an open file, so it goes with the process however it dies (SIGKILL included);
a stale pid in the file means nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

from tenon.errors import ConfigError, TenonError

logger = logging.getLogger(__name__)

DEFAULT_STATE_DIR = Path("/var/lib/tenon")
LOCK_FILE = "controller.lock"
DOMAIN_FILE = "domain"
RECOVERY_DB = "recovery.sqlite"
WORKSPACES_DIR = "workspaces"
EVENTS_FILE = "events.jsonl"


class StateDirBusy(TenonError, RuntimeError):
    """Another controller holds the state directory."""


def holder_pid(state_dir: Path) -> int | None:
    """The pid written by the controller that holds (or last held) the lock, if readable."""
    try:
        return int((state_dir / LOCK_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def locked(state_dir: Path) -> Iterator[None]:
    """Hold the state directory's controller lock; StateDirBusy if another process has it."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = holder_pid(state_dir)
            raise StateDirBusy(
                f"state directory {state_dir} is in use by another controller"
                f"{f' (pid {pid})' if pid else ''}; stop it first ({path} is locked)"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)  # releases the flock


def is_locked(state_dir: Path) -> bool:
    """Whether a controller holds the state directory now (probes without keeping it)."""
    try:
        with locked(state_dir):
            return False
    except StateDirBusy:
        return True


def domain_name(state_dir: Path, requested: str | None = None) -> str:
    """The workload domain this state directory belongs to, fixed on first use.

    The first controller persists `requested` (or a fresh `tenon-<id>`); every later one
    reopens that domain, so cgroups a dead controller left behind are found again. A
    different `requested` name is refused: the records describe sandboxes of the other.
    """
    path = state_dir / DOMAIN_FILE
    try:
        stored = path.read_text().strip()
    except FileNotFoundError:
        stored = ""
    if stored:
        if requested is not None and requested != stored:
            raise ConfigError(
                f"state directory {state_dir} belongs to workload domain {stored!r}, "
                f"not {requested!r}; use another state directory"
            )
        return stored
    name = requested or f"tenon-{uuid.uuid4().hex[:8]}"
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as fh:
        fh.write(name + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)
    dir_fd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    logger.info("state directory %s belongs to workload domain %s", state_dir, name)
    return name
