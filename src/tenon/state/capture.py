"""Capture a persistent root at the cost of what changed since the previous capture.

`scan` stats every entry (`host.treewalk`, no read) and compares each with the previous
manifest's metadata (`ManifestEntry.meta`): an entry whose type, mode, st_dev, st_ino,
size, mtime_ns, ctime_ns and (for devices) rdev are all equal keeps its previous entry;
only the others are hashed. ctime cannot be set from user space, so `touch -m` with the old
mtime still shows. Timestamps come from a coarse clock (a few milliseconds): an entry whose
ctime lies within `RACY_WINDOW_NS` of the scan's start could change again within the same
tick without its ctime moving, so its metadata are not trusted next time (`meta` None) and
it is read again then.

What cannot be captured makes the boundary resident_only (`CaptureRefused`, never a half
capture): fifos, sockets and devices other than overlay whiteouts (character device 0/0),
and a tree past a `CaptureLimits` bound. The top-level `work/` (the overlay workdir) is
never captured.
"""

from __future__ import annotations

import bisect
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tenon.errors import ConfigError, HostError, WorkspaceError
from tenon.host import treewalk
from tenon.host.treewalk import Header
from tenon.sandbox.base import OVERLAY_WORK_DIR
from tenon.state.filehash import HashBudget, HashBudgetExceeded, block_digest, plain_sha256
from tenon.state.manifest import MANIFEST_VERSION, Manifest, ManifestEntry
from tenon.units import GIB

NOT_CAPTURED = (OVERLAY_WORK_DIR,)
RACY_WINDOW_NS = 50_000_000
_REFUSED_KINDS = {"c": "a character device", "b": "a block device", "p": "a fifo",
                  "s": "a socket", "?": "of an unknown type"}

Hasher = Callable[[str, HashBudget], tuple[str, int]]


@dataclass(frozen=True)
class CaptureLimits:
    """Bounds on one capture; past any of them the boundary is resident_only."""

    max_files: int = 1_000_000  # entries in the persistent root (files, dirs, links)
    max_hash_bytes: int = 16 * GIB  # bytes one capture may read to hash changed files
    max_seconds: float = 120.0  # wall time one capture may take

    def __post_init__(self) -> None:
        for name in ("max_files", "max_hash_bytes", "max_seconds"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"capture limit {name} must be positive, got {value!r}")


class CaptureRefused(WorkspaceError):
    """The root holds what capture cannot keep, or passes a capture limit: the boundary
    stays resident_only (the message says which)."""


@dataclass(frozen=True)
class ScanResult:
    manifest: Manifest
    num_entries: int
    num_hashed: int  # files read
    bytes_hashed: int
    changed: tuple[str, ...]  # entries whose metadata differed (read, re-described)
    removed: tuple[str, ...]  # entries of the previous manifest gone now


def scan(root: Path, previous: Manifest | None = None, *,
         limits: CaptureLimits | None = None, hasher: Hasher = block_digest,
         version: int = MANIFEST_VERSION, fsync: bool = False) -> ScanResult:
    """Describe the tree under `root`, reading only entries changed since `previous`
    (everything with no version 2 `previous`); with `fsync`, make each changed entry and
    its directory durable. `version` 1 describes it the version 1 way (every file read)."""
    limits = limits or CaptureLimits()
    start_ns = time.time_ns()
    budget = HashBudget(limits.max_hash_bytes, time.monotonic() + limits.max_seconds)
    try:
        walked = treewalk.walk(root, NOT_CAPTURED)
    except HostError as exc:
        raise WorkspaceError(f"cannot read workspace {root}: {exc}") from exc
    if len(walked.paths) > limits.max_files:
        raise CaptureRefused(f"workspace {root} holds {len(walked.paths)} entries, more "
                             f"than the capture limit max_files={limits.max_files}")
    usable = previous is not None and previous.version == 2 and version == 2
    known = previous.by_path if previous is not None and usable else {}
    entries: dict[str, ManifestEntry] = {}
    changed: list[str] = []
    num_known = 0  # walked paths the previous manifest has
    for path, header, target in zip(walked.paths, walked.headers, walked.targets, strict=True):
        old = known.get(path)
        if old is not None:
            num_known += 1
            if old.meta == header:
                entries[path] = old
                continue
        changed.append(path)
        entries[path] = _describe(root, path, header, target, start_ns, budget,
                                  hasher if version == 2 else plain_sha256, version)
    removed = () if num_known == len(known) else tuple(p for p in known if p not in entries)
    if fsync:
        _make_durable(root, changed, removed, entries)
    if previous is not None and usable and num_known == len(known) == len(entries):
        manifest = _same_paths(previous, [entries[p] for p in changed])
    else:
        manifest = Manifest.from_entries(entries.values(), version=version)
    manifest.__dict__["by_path"] = entries  # its cached index: the dict just built
    return ScanResult(manifest, len(entries), budget.num_files, budget.num_bytes,
                      tuple(changed), removed)


def _same_paths(previous: Manifest, changed: list[ManifestEntry]) -> Manifest:
    """`previous` with `changed` entries (of paths it has) replaced: same sorted order."""
    items = list(previous.entries)
    for entry in changed:
        items[bisect.bisect_left(items, entry.path, key=lambda e: e.path)] = entry
    return Manifest.from_entries(items, version=previous.version, ordered=True)


def _describe(root: Path, path: str, header: str, target: str, start_ns: int,
              budget: HashBudget, hasher: Hasher, version: int) -> ManifestEntry:
    head = Header.parse(header)
    # v1 entries carry no metadata; v2 ones only when their timestamps can be trusted
    meta = header if version == 2 and head.ctime_ns < start_ns - RACY_WINDOW_NS else None
    if head.kind == "f":
        try:
            sha, size = hasher(os.path.join(root, path), budget)
        except HashBudgetExceeded as exc:
            raise CaptureRefused(f"workspace {root}: {exc} (capture limit)") from exc
        except OSError as exc:
            raise WorkspaceError(f"cannot read {root / path}: {exc}") from exc
        return ManifestEntry(path, "file", head.mode, size_bytes=size, sha256=sha, meta=meta)
    if head.kind == "d":
        return ManifestEntry(path, "dir", head.mode, opaque=head.opaque, meta=meta)
    if head.kind == "l":
        return ManifestEntry(path, "symlink", head.mode, target=target, meta=meta)
    if head.kind == "c" and head.rdev == (0, 0):
        return ManifestEntry(path, "whiteout", head.mode, meta=meta)
    raise CaptureRefused(f"cannot capture {root / path}: it is {_REFUSED_KINDS[head.kind]}; "
                         f"only files, directories, symlinks and overlay whiteouts are kept")


def _make_durable(root: Path, changed: list[str], removed: tuple[str, ...],
                  entries: dict[str, ManifestEntry]) -> None:
    """fsync each changed file and directory, and the directory of each changed or
    removed entry (its name, created or unlinked, lives there)."""
    dirs = {os.path.dirname(p) for p in (*changed, *removed)}
    dirs.update(p for p in changed if entries[p].kind == "dir")
    try:
        for path in changed:
            if entries[path].kind == "file":
                fsync_path(root / path, directory=False)
        for path in sorted(dirs):
            full = root / path if path else root
            if os.path.isdir(full):
                fsync_path(full, directory=True)
    except OSError as exc:
        raise WorkspaceError(f"cannot make workspace {root} durable: {exc}") from exc


def fsync_path(path: Path, *, directory: bool) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if directory else 0) | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
