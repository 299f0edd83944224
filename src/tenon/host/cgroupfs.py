"""The few operations that change a cgroup tree, behind one seam so a fake tree can stand in.

Reads go straight to the files (the fake's files are real files in a temp directory); writes,
directory changes and signals go through a `CgroupIO`, because on a real cgroupfs they have
side effects (a write to cgroup.freeze freezes; rmdir works on a non-empty-looking directory)
that a plain directory can only show if something plays the kernel's part.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Protocol

from tenon.errors import HostError

logger = logging.getLogger(__name__)


class CgroupIO(Protocol):
    def write(self, path: Path, text: str) -> None:
        """Write one control value; HostError when the kernel refuses it."""

    def mkdir(self, path: Path) -> None:
        """Create a cgroup directory (no error when it exists)."""

    def rmdir(self, path: Path) -> None:
        """Remove a cgroup directory; FileNotFoundError when absent, OSError when busy."""

    def kill(self, pid: int, sig: int) -> None:
        """Signal one process; silently nothing when it is gone."""

    def open_reset(self, path: Path) -> int:
        """Open a file whose reset holds for the writer's open file only (v2 memory.peak),
        reset it, and return that descriptor (the caller closes it); OSError when the
        kernel offers no reset there."""


class KernelIO:
    """The real kernel's cgroupfs."""

    def write(self, path: Path, text: str) -> None:
        try:
            with path.open("w") as f:  # one write(2): cgroupfs parses each write whole
                f.write(text)
        except OSError as exc:
            raise HostError(f"cannot write {text!r} to {path}: {exc.strerror or exc}") from exc

    def mkdir(self, path: Path) -> None:
        try:
            path.mkdir(exist_ok=True)
        except OSError as exc:
            raise HostError(f"cannot create cgroup {path}: {exc.strerror or exc}") from exc

    def rmdir(self, path: Path) -> None:
        path.rmdir()

    def kill(self, pid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)

    def open_reset(self, path: Path) -> int:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            os.write(fd, b"reset\n")  # any non-empty write resets (Linux 6.12+)
        except OSError:
            os.close(fd)
            raise
        return fd


def _read_small(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 4096)
    finally:
        os.close(fd)


def read_raw(path: str) -> bytes:
    """One small cgroup file's bytes through bare os calls (no pathlib or text layer: for
    readings taken every control period); HostError when it cannot be read."""
    try:
        return _read_small(path)
    except OSError as exc:
        raise HostError(f"cannot read {path}: {exc.strerror or exc}") from exc


def read_raw_if_present(path: str) -> bytes | None:
    """`read_raw`, or None when the file does not exist (an optional interface file)."""
    try:
        return _read_small(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise HostError(f"cannot read {path}: {exc.strerror or exc}") from exc


def keyed_value(raw: bytes, key: bytes) -> int:
    """The value of `key` in a flat-keyed file's bytes (0 when absent)."""
    for line in raw.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key:
            return int(parts[1])
    return 0


def read_text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise HostError(f"cannot read {path}: {exc.strerror or exc}") from exc


def read_int(path: Path) -> int:
    return int(read_text(path).split()[0])


def read_keyed(path: Path) -> dict[str, int]:
    """A flat-keyed file ("key value" per line), e.g. memory.events, cpu.stat."""
    pairs = (line.split() for line in read_text(path).splitlines())
    return {p[0]: int(p[1]) for p in pairs if len(p) == 2}
