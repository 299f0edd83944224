"""A workspace's content manifest and the digest that names it.

A manifest lists what a rebuild must preserve of an agent's persistent root, sorted by
path: relative path, type, permission bits, size and content digest for files, target
for symlinks, the overlay whiteouts (type "whiteout") and the opaque flag of directories
(overlayfs upper layers). Ownership and timestamps are not content: backends re-own the
root for their sandbox uid, and mtimes change without the content changing.

Version 2 (written now) also keeps, per entry, the metadata its capture saw (`meta`: the
header `host.treewalk` prints: type, mode, st_dev, st_ino, size, mtime_ns, ctime_ns,
rdev, opaque). The next capture or verification reads only entries whose metadata
differ; `meta` is None for an entry that must be read again whatever its metadata say
(an entry changed too close to its capture to trust its timestamps, or loaded from
version 1). The digest covers content fields only, so it is stable across rebuilds.
File digests are block digests (`state.filehash`).

Version 1 manifests (no metadata, plain sha256 of files, a digest over their JSON) are
still read; verifying one rehashes the whole tree the version 1 way.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tenon.errors import WorkspaceError

MANIFEST_VERSION = 2
READABLE_VERSIONS = (1, 2)
KINDS = ("file", "dir", "symlink", "whiteout")
_CONTENT_FIELDS = ("kind", "mode", "size_bytes", "sha256", "target", "opaque")


@dataclass(frozen=True)
class ManifestEntry:
    """One path in a workspace, relative and POSIX-style."""

    path: str
    kind: str  # one of KINDS
    mode: int  # permission bits (stat.S_IMODE)
    size_bytes: int | None = None  # files only
    sha256: str | None = None  # files only: block digest (v2) or plain sha256 (v1)
    target: str | None = None  # symlinks only
    opaque: bool = False  # directories only: an overlayfs opaque directory
    meta: str | None = field(default=None, compare=False)  # see the module docstring

    @functools.cached_property
    def digest_line(self) -> str:
        """What the version 2 digest hashes for this entry (fields NUL-terminated)."""
        return (f"{self.path}\0{self.kind}\0{self.mode:o}\0{_text(self.size_bytes)}\0"
                f"{_text(self.sha256)}\0{_text(self.target)}\0{int(self.opaque)}\0")

    @functools.cached_property
    def json_text(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"),
                          ensure_ascii=True)

    def to_json(self, version: int = MANIFEST_VERSION) -> dict[str, Any]:
        doc: dict[str, Any] = {"path": self.path, "kind": self.kind, "mode": self.mode,
                               "size_bytes": self.size_bytes, "sha256": self.sha256,
                               "target": self.target}
        if version >= 2:
            doc["opaque"] = self.opaque
            doc["meta"] = self.meta
        return doc


def _text(value: object) -> str:
    return "" if value is None else str(value)


@dataclass(frozen=True)
class Manifest:
    """A workspace's content, sorted by path, and the digest that names it."""

    entries: tuple[ManifestEntry, ...]
    digest: str
    version: int = MANIFEST_VERSION

    @classmethod
    def from_entries(cls, entries: Iterable[ManifestEntry], *, version: int = MANIFEST_VERSION,
                     ordered: bool = False) -> Manifest:
        """The manifest of `entries` (`ordered`: already sorted by path)."""
        items = tuple(entries) if ordered else tuple(sorted(entries, key=lambda e: e.path))
        return cls(entries=items, digest=_digest(items, version), version=version)

    @functools.cached_property
    def by_path(self) -> dict[str, ManifestEntry]:
        return {e.path: e for e in self.entries}

    def to_json(self) -> str:
        if self.version == 1:
            return _v1_canonical(self.entries)
        body = ",".join(e.json_text for e in self.entries)
        return f'{{"entries":[{body}],"version":{self.version}}}'

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Rebuild a manifest from `to_json()` output (version 1 or 2); the digest is
        recomputed."""
        try:
            doc = json.loads(text)
            version = doc.get("version")
            if version not in READABLE_VERSIONS:
                raise ValueError(f"unsupported manifest version {version!r}")
            entries = [ManifestEntry(**item) for item in doc["entries"]]
            if any(e.kind not in KINDS for e in entries):
                raise ValueError("unknown entry kind")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise WorkspaceError(f"unreadable manifest: {exc}") from exc
        return cls.from_entries(entries, version=version)

    def first_difference(self, other: Manifest) -> str | None:
        """A description of the first path (in sort order) where the two differ."""
        mine, theirs = self.by_path, other.by_path
        for path in sorted(mine.keys() | theirs.keys()):
            a, b = mine.get(path), theirs.get(path)
            if a == b:
                continue
            if a is None:
                return f"{path!r} is missing"
            if b is None:
                return f"{path!r} is unexpected"
            fields = [f for f in _CONTENT_FIELDS if getattr(a, f) != getattr(b, f)]
            return f"{path!r} differs in {', '.join(fields)}"
        return None


def _v1_canonical(entries: tuple[ManifestEntry, ...]) -> str:
    doc = {"version": 1, "entries": [e.to_json(1) for e in entries]}
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _digest(entries: tuple[ManifestEntry, ...], version: int) -> str:
    if version == 1:
        return hashlib.sha256(_v1_canonical(entries).encode()).hexdigest()
    text = "tenon-manifest-v2\0" + "".join(e.digest_line for e in entries)
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()
