"""Durable per-agent state directories and their content manifests.

Each logical agent owns `<state_dir>/workspaces/<agent_id>`, its *persistent root*: a host
directory that outlives every physical sandbox bound onto it. It holds one subdirectory per
designated persistent directory of the sandbox (`PERSISTENT_DIRS`): the workspace, HOME and
/tmp. Everything a later action can read lives in one of them, or in a path the sandbox's
configuration explicitly declares disposable, or the boundary is not restartable. `capture()` makes the directory durable
(fsync of every file and directory) and describes it as a manifest whose digest goes into
the recovery record; `verify()` proves a rebuilt sandbox sees the same bytes.

The manifest records what a rebuild must preserve: relative path, type, permission
bits, size and sha256 for files, target for symlinks. Ownership and timestamps are left
out on purpose: backends re-own the workspace for their sandbox uid, and mtimes change
without the content changing. Anything other than files, directories and symlinks
(fifos, sockets, devices) cannot be captured, so capture refuses it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tenon.errors import WorkspaceError

logger = logging.getLogger(__name__)

# Subdirectory of the persistent root -> where a sandbox sees it. HOME is /home/user, as in
# E2B sandboxes, so `pip install --user`, ~/.cache and `git config --global` persist.
PERSISTENT_DIRS: dict[str, str] = {"workspace": "/workspace", "home": "/home/user", "tmp": "/tmp"}
AGENT_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MANIFEST_VERSION = 1
_CHUNK_BYTES = 1024 * 1024


@dataclass(frozen=True)
class ManifestEntry:
    """One path in a workspace, relative and POSIX-style."""

    path: str
    kind: str  # "file" | "dir" | "symlink"
    mode: int  # permission bits (stat.S_IMODE)
    size_bytes: int | None = None  # files only
    sha256: str | None = None  # files only
    target: str | None = None  # symlinks only

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "kind": self.kind,
            "mode": self.mode,
            "size_bytes": self.size_bytes,
            "sha256": self.sha256,
            "target": self.target,
        }


@dataclass(frozen=True)
class Manifest:
    """A workspace's content, sorted by path, and the digest that names it."""

    entries: tuple[ManifestEntry, ...]
    digest: str

    @classmethod
    def from_entries(cls, entries: list[ManifestEntry]) -> Manifest:
        ordered = tuple(sorted(entries, key=lambda e: e.path))
        return cls(entries=ordered, digest=_digest(ordered))

    def to_json(self) -> str:
        return _canonical(self.entries)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Rebuild a manifest from `to_json()` output; the digest is recomputed."""
        try:
            doc = json.loads(text)
            if doc.get("version") != MANIFEST_VERSION:
                raise ValueError(f"unsupported manifest version {doc.get('version')!r}")
            entries = [ManifestEntry(**item) for item in doc["entries"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise WorkspaceError(f"unreadable manifest: {exc}") from exc
        return cls.from_entries(entries)

    def first_difference(self, other: Manifest) -> str | None:
        """A description of the first path (in sort order) where the two differ."""
        mine = {e.path: e for e in self.entries}
        theirs = {e.path: e for e in other.entries}
        for path in sorted(mine.keys() | theirs.keys()):
            a, b = mine.get(path), theirs.get(path)
            if a == b:
                continue
            if a is None:
                return f"{path!r} is missing"
            if b is None:
                return f"{path!r} is unexpected"
            fields = [
                f
                for f in ("kind", "mode", "size_bytes", "sha256", "target")
                if getattr(a, f) != getattr(b, f)
            ]
            return f"{path!r} differs in {', '.join(fields)}"
        return None


def _canonical(entries: tuple[ManifestEntry, ...]) -> str:
    doc = {"version": MANIFEST_VERSION, "entries": [e.to_json() for e in entries]}
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _digest(entries: tuple[ManifestEntry, ...]) -> str:
    return hashlib.sha256(_canonical(entries).encode()).hexdigest()


def _fsync_path(path: Path, *, directory: bool) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if directory else 0) | os.O_NOFOLLOW
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _hash_file(path: Path, *, fsync: bool) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        if fsync:
            os.fsync(fd)
        while chunk := os.read(fd, _CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    return digest.hexdigest(), size


def scan(root: Path, *, fsync: bool) -> Manifest:
    """Describe the tree under `root` (never following symlinks), optionally fsyncing it."""
    entries: list[ManifestEntry] = []
    try:
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False, onerror=_raise):
            base = Path(dirpath)
            for name in sorted(dirnames + filenames):
                full = base / name
                rel = full.relative_to(root).as_posix()
                st = full.lstat()
                mode = stat.S_IMODE(st.st_mode)
                if stat.S_ISLNK(st.st_mode):
                    entries.append(ManifestEntry(rel, "symlink", mode, target=os.readlink(full)))
                elif stat.S_ISDIR(st.st_mode):
                    entries.append(ManifestEntry(rel, "dir", mode))
                elif stat.S_ISREG(st.st_mode):
                    sha, size = _hash_file(full, fsync=fsync)
                    entries.append(ManifestEntry(rel, "file", mode, size_bytes=size, sha256=sha))
                else:
                    raise WorkspaceError(f"cannot capture {full}: not a file, directory or symlink")
            if fsync:
                # A directory's fsync makes its entries (names, links) durable.
                _fsync_path(base, directory=True)
    except WorkspaceError:
        raise
    except OSError as exc:
        raise WorkspaceError(f"cannot read workspace {root}: {exc}") from exc
    return Manifest.from_entries(entries)


def _raise(exc: OSError) -> None:
    raise exc


class WorkspaceStore:
    """Workspaces under `<state_dir>/workspaces`, one directory per agent."""

    def __init__(self, state_dir: Path) -> None:
        self._state_dir = Path(state_dir)
        self._root = self._state_dir / "workspaces"

    @property
    def root(self) -> Path:
        return self._root

    def path_for(self, agent_id: str) -> Path:
        """The agent's workspace path; refuses unsafe ids and anything resolving elsewhere."""
        candidate = self._root / agent_id
        if not AGENT_ID_RE.fullmatch(agent_id):
            raise WorkspaceError(
                f"agent id {agent_id!r} is not safe for a workspace path ({candidate}); "
                f"use letters, digits, '.', '_' and '-', starting with a letter or digit"
            )
        state = self._state_dir.resolve()
        root = self._root.resolve()
        if root != state / "workspaces":
            raise WorkspaceError(
                f"workspace root {self._root} resolves to {root}, "
                f"outside the state directory {state}"
            )
        if candidate.is_symlink():
            raise WorkspaceError(
                f"workspace {candidate} is a symlink (to "
                f"{os.readlink(candidate)}); refusing to follow it"
            )
        resolved = candidate.resolve()
        if resolved.parent != root:
            raise WorkspaceError(
                f"workspace {candidate} resolves to {resolved}, outside the state directory {state}"
            )
        return resolved

    def exists(self, agent_id: str) -> bool:
        return self.path_for(agent_id).is_dir()

    def create(self, agent_id: str) -> Path:
        """Create the agent's persistent root and its subdirectories (idempotent), durably."""
        path = self.path_for(agent_id)
        try:
            self._root.mkdir(parents=True, exist_ok=True)
            path.mkdir(exist_ok=True)
            for sub in PERSISTENT_DIRS:
                (path / sub).mkdir(exist_ok=True)
                _fsync_path(path / sub, directory=True)
            _fsync_path(path, directory=True)
            _fsync_path(self._root, directory=True)
        except OSError as exc:
            raise WorkspaceError(f"cannot create workspace {path}: {exc}") from exc
        return path

    def capture(self, agent_id: str) -> Manifest:
        """fsync every file and directory in the workspace, then describe it."""
        path = self._existing(agent_id)
        manifest = scan(path, fsync=True)
        logger.debug(
            "captured workspace %s: %d entries, digest %s",
            path,
            len(manifest.entries),
            manifest.digest,
        )
        return manifest

    def manifest(self, agent_id: str) -> Manifest:
        """Describe the workspace without fsyncing it."""
        return scan(self._existing(agent_id), fsync=False)

    def verify(self, agent_id: str, digest: str, previous: Manifest | None = None) -> Manifest:
        """Recompute the manifest; raise WorkspaceError unless its digest is `digest`."""
        path = self._existing(agent_id)
        current = scan(path, fsync=False)
        if current.digest == digest:
            return current
        detail = ""
        if previous is not None and previous.digest == digest:
            diff = previous.first_difference(current)
            if diff is not None:
                detail = f"; first difference: {diff}"
        raise WorkspaceError(
            f"workspace {path} does not match its manifest: expected digest {digest}, "
            f"found {current.digest}{detail}"
        )

    def delete(self, agent_id: str) -> None:
        """Remove the agent's workspace (idempotent)."""
        path = self.path_for(agent_id)
        try:
            if path.exists():
                shutil.rmtree(path)
            if self._root.exists():
                _fsync_path(self._root, directory=True)
        except OSError as exc:
            raise WorkspaceError(f"cannot delete workspace {path}: {exc}") from exc

    def _existing(self, agent_id: str) -> Path:
        path = self.path_for(agent_id)
        if not path.is_dir():
            raise WorkspaceError(f"workspace {path} does not exist")
        return path
