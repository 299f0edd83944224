"""The recovery store: one durable record per logical agent, in SQLite.

A record says which physical incarnation (generation) an agent is on, whether that
sandbox is resident, torn down or blocked, and everything needed to rebuild it: the
workspace manifest digest, base image, backend name and backend config. Teardown
commits the record *before* destroying anything, so after a crash either the sandbox
is alive or the record describes how to rebuild it.

Actions leave marks too, so a restart knows what the dead controller was doing: the action
in flight (set at its start, cleared at its end), and at each action's end what the
restart-safe check said about that boundary. A sandbox lost while resident is rebuilt from
its persistent root only if its last boundary was restartable; otherwise it blocks.

The database runs in WAL mode with synchronous=FULL: a commit returns only after the
WAL is fsynced, so a committed teardown survives power loss. Every write is one
`BEGIN IMMEDIATE` transaction. The two per-action marks (in flight, boundary) are the
exception: they commit without an fsync (synchronous=NORMAL), which survives a controller
crash, the failure they are for; the next fsynced commit makes them durable too. Two
fsyncs per action on the controller's loop cost more than the marks are worth.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tenon.errors import RecoveryError, WorkspaceError
from tenon.state.workspace import Manifest

logger = logging.getLogger(__name__)

STATES = ("resident", "torn_down", "blocked")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    agent_id TEXT PRIMARY KEY,
    generation INTEGER NOT NULL CHECK (generation >= 0),
    manifest_digest TEXT,
    manifest_json TEXT,
    base_image TEXT NOT NULL,
    backend TEXT NOT NULL,
    backend_config_json TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('resident', 'torn_down', 'blocked')),
    reason TEXT,
    updated_at REAL NOT NULL
)
"""
_BASE_COLUMNS = (
    "agent_id, generation, manifest_digest, manifest_json, base_image, backend, "
    "backend_config_json, state, reason, updated_at"
)
# Columns a database written by an older Tenon may lack, with their declarations: they are
# added on open (ALTER TABLE ... ADD COLUMN keeps every row).
_ADDED_COLUMNS = (
    ("agent_json", "TEXT"),  # what the caller said about the agent (workflow, task, ...)
    ("num_actions", "INTEGER NOT NULL DEFAULT 0"),  # actions completed
    ("num_restartable", "INTEGER NOT NULL DEFAULT 0"),  # of those, restartable boundaries
    ("last_boundary", "TEXT"),  # None before the first action ends, else BOUNDARIES
    ("last_boundary_reason", "TEXT"),
    ("in_flight", "TEXT"),  # the action id between its start and its end
    ("interrupted", "TEXT"),  # an action cut short by a controller crash, until the next
    ("committed_at", "REAL"),  # wall-clock time of the last committed teardown
)
_COLUMNS = _BASE_COLUMNS + ", " + ", ".join(name for name, _ in _ADDED_COLUMNS)
# What a read selects: whether a manifest is stored, not its text (megabytes for a large
# tree); the text is read and parsed only when the store has not the manifest at hand.
_SELECT_COLUMNS = _COLUMNS.replace("manifest_json", "manifest_json IS NOT NULL", 1)
# What the restart-safe check said at an action's end: `unchecked` when the policy keeps
# every sandbox resident and never asks.
BOUNDARIES = ("restartable", "resident_only", "unchecked")


@dataclass(frozen=True)
class RecoveryRecord:
    """A committed record; `manifest_digest` is None until the first teardown."""

    agent_id: str
    generation: int
    manifest_digest: str | None
    base_image: str
    backend: str
    backend_config: Mapping[str, Any] = field(default_factory=dict)
    state: str = "resident"
    reason: str | None = None  # why the agent is blocked
    updated_at: float = 0.0  # wall-clock seconds (persisted across restarts)
    manifest: Manifest | None = None  # the manifest behind the digest, when stored
    agent_meta: Mapping[str, Any] = field(default_factory=dict)
    num_actions: int = 0  # actions completed, over every generation
    num_restartable: int = 0  # boundaries the restart-safe check found restartable
    last_boundary: str | None = None  # one of BOUNDARIES; None before the first action ends
    last_boundary_reason: str | None = None
    in_flight: str | None = None  # the action running when the record was last written
    interrupted: str | None = None  # an action a controller crash cut short
    committed_at: float | None = None  # when the last teardown was committed (wall clock)

    def to_dict(self) -> dict[str, Any]:
        """The record as JSON-safe data (the manifest as its JSON document), for another
        runtime's store to `import_record` after `from_dict`."""
        doc = {name: getattr(self, name) for name in _RECORD_FIELDS}
        doc["backend_config"] = dict(self.backend_config)
        doc["agent_meta"] = dict(self.agent_meta)
        doc["manifest"] = None if self.manifest is None else json.loads(self.manifest.to_json())
        return doc

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> RecoveryRecord:
        """The record `to_dict` described; RecoveryError for unknown or missing fields or a
        manifest that does not match the digest."""
        unknown = set(doc) - set(_RECORD_FIELDS)
        if unknown:
            raise RecoveryError(f"unknown recovery record fields {sorted(unknown)}")
        values = dict(doc)
        manifest = values.get("manifest")
        try:
            if manifest is not None:
                values["manifest"] = Manifest.from_json(json.dumps(manifest))
            record = cls(**values)
        except (TypeError, ValueError, WorkspaceError) as exc:
            raise RecoveryError(f"unreadable recovery record: {exc}") from exc
        if record.manifest is not None and record.manifest.digest != record.manifest_digest:
            raise RecoveryError(f"agent {record.agent_id}: manifest does not match its digest")
        return record


_RECORD_FIELDS = tuple(f.name for f in fields(RecoveryRecord))


def _encode_config(config: Mapping[str, Any]) -> str:
    try:
        return json.dumps(dict(config), sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise RecoveryError(f"backend config is not JSON-serializable: {exc}") from exc


# A manifest of more entries than this is not written with each teardown's commit (megabytes
# of text for a large repository, most of a teardown's cost) but when the store closes: the
# digest, which is what a rebuild must match, is always committed. Without the manifest a
# rebuild after a crash reads and hashes the whole tree once instead of its metadata.
MAX_INLINE_MANIFEST_ENTRIES = 4096


class RecoveryStore:
    """Recovery records in `db_path`; safe to reopen after a controller restart."""

    def __init__(self, db_path: Path, *, wall_clock: Callable[[], float] = time.time) -> None:
        self._path = Path(db_path)
        self._wall_clock = wall_clock
        self._manifests: dict[str, Manifest] = {}  # the last manifest committed or read
        # Manifests too large to write with each commit: written when the store closes.
        self._unwritten: dict[str, Manifest] = {}
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            # Autocommit mode: transactions are explicit, so nothing commits by accident.
            self._db = sqlite3.connect(self._path, isolation_level=None)
            mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise RecoveryError(f"{self._path}: SQLite refused WAL mode (got {mode!r})")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute(_SCHEMA)
            present = {row[1] for row in self._db.execute("PRAGMA table_info(records)")}
            for name, declaration in _ADDED_COLUMNS:
                if name not in present:
                    self._db.execute(f"ALTER TABLE records ADD COLUMN {name} {declaration}")
        except sqlite3.Error as exc:
            raise RecoveryError(f"cannot open recovery store {self._path}: {exc}") from exc

    @property
    def path(self) -> Path:
        return self._path

    def close(self) -> None:
        """Write the manifests left out of their commits (each still current), then close.
        After a crash they are missing: a rebuild then hashes the whole tree once."""
        try:
            if self._unwritten:
                with self._transaction() as db:
                    db.executemany(
                        "UPDATE records SET manifest_json = ? WHERE agent_id = ? "
                        "AND manifest_digest = ? AND manifest_json IS NULL",
                        [(m.to_json(), agent, m.digest) for agent, m in self._unwritten.items()])
                self._unwritten.clear()
        finally:
            self._db.close()

    @contextmanager
    def _transaction(self, *, fsync: bool = True) -> Iterator[sqlite3.Connection]:
        try:
            self._db.execute(f"PRAGMA synchronous={'FULL' if fsync else 'NORMAL'}")
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise RecoveryError(f"{self._path}: cannot begin a transaction: {exc}") from exc
        try:
            yield self._db
        except sqlite3.Error as exc:
            self._db.execute("ROLLBACK")
            raise RecoveryError(f"{self._path}: write failed: {exc}") from exc
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        try:
            self._db.execute("COMMIT")
        except sqlite3.Error as exc:
            self._db.execute("ROLLBACK")
            raise RecoveryError(f"{self._path}: commit failed: {exc}") from exc

    def register(
        self, agent_id: str, image: str, backend: str, config: Mapping[str, Any] | None = None
    ) -> RecoveryRecord:
        """Record a new agent whose first sandbox (generation 1) is resident.

        An existing record is left untouched and returned: registering is idempotent.
        """
        config_json = _encode_config(config or {})
        with self._transaction() as db:
            db.execute(
                f"INSERT INTO records ({_BASE_COLUMNS}) VALUES (?, 1, NULL, NULL, ?, ?, ?, "
                "'resident', NULL, ?) ON CONFLICT(agent_id) DO NOTHING",
                (agent_id, image, backend, config_json, self._wall_clock()),
            )
        return self._require(agent_id)

    def commit_teardown(
        self,
        agent_id: str,
        generation: int,
        digest: str,
        image: str,
        backend: str,
        config: Mapping[str, Any] | None = None,
        *,
        manifest: Manifest | None = None,
    ) -> RecoveryRecord:
        """Durably record that generation `generation` may be destroyed and how to rebuild it."""
        if manifest is not None and manifest.digest != digest:
            raise RecoveryError(
                f"agent {agent_id}: manifest digest {manifest.digest} "
                f"does not match the digest being committed {digest}"
            )
        config_json = _encode_config(config or {})
        inline = manifest is not None and len(manifest.entries) <= MAX_INLINE_MANIFEST_ENTRIES
        manifest_json = manifest.to_json() if manifest is not None and inline else None
        now = self._wall_clock()
        with self._transaction() as db:
            row = db.execute(
                "SELECT generation FROM records WHERE agent_id = ?", (agent_id,)
            ).fetchone()
            if row is not None and generation < row[0]:
                raise RecoveryError(
                    f"agent {agent_id}: refusing to commit generation "
                    f"{generation} over committed generation {row[0]}"
                )
            db.execute(
                f"INSERT INTO records ({_BASE_COLUMNS}, committed_at) VALUES (?, ?, ?, ?, ?, ?, "
                "?, 'torn_down', NULL, ?, ?) "
                "ON CONFLICT(agent_id) DO UPDATE SET generation=excluded.generation, "
                "manifest_digest=excluded.manifest_digest, manifest_json=excluded.manifest_json, "
                "base_image=excluded.base_image, backend=excluded.backend, "
                "backend_config_json=excluded.backend_config_json, state='torn_down', "
                "reason=NULL, updated_at=excluded.updated_at, committed_at=excluded.updated_at",
                (
                    agent_id,
                    generation,
                    digest,
                    manifest_json,
                    image,
                    backend,
                    config_json,
                    now,
                    now,
                ),
            )
        self._unwritten.pop(agent_id, None)
        if manifest is not None:
            self._manifests[agent_id] = manifest
            if not inline:
                self._unwritten[agent_id] = manifest
        logger.info(
            "agent %s: committed teardown of generation %d (digest %s)",
            agent_id,
            generation,
            digest[:12],
        )
        return self._require(agent_id)

    def import_record(self, record: RecoveryRecord) -> RecoveryRecord:
        """Durably make `record`, committed by another runtime's store, this store's record
        of its agent (the agent moves here): generation, manifest, metadata, counts and
        interrupted action as they were, nothing in flight. Only a committed record (torn
        down or blocked, with a manifest) moves; a record of the agent already here at a
        newer generation is refused. Importing the same record again changes nothing else."""
        if record.state not in ("torn_down", "blocked") or record.manifest_digest is None:
            raise RecoveryError(
                f"agent {record.agent_id}: only a committed record with a manifest can be "
                f"imported (state {record.state}, digest {record.manifest_digest})")
        manifest_json = record.manifest.to_json() if record.manifest is not None else None
        values = (
            record.agent_id, record.generation, record.manifest_digest, manifest_json,
            record.base_image, record.backend, _encode_config(record.backend_config),
            record.state, record.reason, self._wall_clock(),
            _encode_config(record.agent_meta), record.num_actions, record.num_restartable,
            record.last_boundary, record.last_boundary_reason, None, record.interrupted,
            record.committed_at,
        )
        with self._transaction() as db:
            row = db.execute(
                "SELECT generation FROM records WHERE agent_id = ?", (record.agent_id,)
            ).fetchone()
            if row is not None and record.generation < row[0]:
                raise RecoveryError(
                    f"agent {record.agent_id}: refusing to import generation "
                    f"{record.generation} over committed generation {row[0]}")
            db.execute(
                f"INSERT OR REPLACE INTO records ({_COLUMNS}) "
                f"VALUES ({', '.join('?' * len(values))})", values)
        logger.info("agent %s: imported generation %d (digest %s)", record.agent_id,
                    record.generation, record.manifest_digest[:12])
        return self._require(record.agent_id)

    def mark_resident(self, agent_id: str, generation: int) -> RecoveryRecord:
        """Record that generation `generation` is materialized and verified."""
        with self._transaction() as db:
            row = db.execute(
                "SELECT generation FROM records WHERE agent_id = ?", (agent_id,)
            ).fetchone()
            if row is None:
                raise RecoveryError(f"agent {agent_id} has no recovery record")
            if generation < row[0]:
                raise RecoveryError(
                    f"agent {agent_id}: generation {generation} is older "
                    f"than committed generation {row[0]}"
                )
            db.execute(
                "UPDATE records SET generation = ?, state = 'resident', reason = NULL, "
                "updated_at = ? WHERE agent_id = ?",
                (generation, self._wall_clock(), agent_id),
            )
        return self._require(agent_id)

    def mark_blocked(self, agent_id: str, reason: str) -> RecoveryRecord:
        """Block the agent; generation, digest and config stay as committed for a retry."""
        with self._transaction() as db:
            cursor = db.execute(
                "UPDATE records SET state = 'blocked', reason = ?, updated_at = ? "
                "WHERE agent_id = ?",
                (reason, self._wall_clock(), agent_id),
            )
            if cursor.rowcount != 1:
                raise RecoveryError(f"agent {agent_id} has no recovery record to block")
        logger.warning("agent %s blocked: %s", agent_id, reason)
        return self._require(agent_id)

    def note_action_start(
        self, agent_id: str, action_id: str, *, agent_meta: Mapping[str, Any] | None = None
    ) -> None:
        """Durably mark `action_id` in flight (a crash from here on interrupts it) and clear
        the report of an earlier interrupted action, which the caller has seen by now."""
        meta_json = None if agent_meta is None else _encode_config(agent_meta)
        self._update(
            agent_id,
            "in_flight = ?, interrupted = NULL, agent_json = COALESCE(?, agent_json)",
            (action_id, meta_json),
            fsync=False,
        )

    def note_agent_meta(self, agent_id: str, agent_meta: Mapping[str, Any]) -> None:
        """Record what the caller said about the agent (as an action's start does)."""
        self._update(agent_id, "agent_json = ?", (_encode_config(agent_meta),))

    def note_action_done(self, agent_id: str, *, boundary: str, reason: str | None) -> None:
        """The action in flight ended at a boundary the restart-safe check called `boundary`
        (one of BOUNDARIES); written before any teardown of that boundary can start."""
        if boundary not in BOUNDARIES:
            raise RecoveryError(f"boundary must be one of {BOUNDARIES}, got {boundary!r}")
        self._update(
            agent_id,
            "in_flight = NULL, num_actions = num_actions + 1, "
            "num_restartable = num_restartable + ?, last_boundary = ?, "
            "last_boundary_reason = ?",
            (int(boundary == "restartable"), boundary, reason),
            fsync=False,
        )

    def mark_interrupted(self, agent_id: str) -> str | None:
        """After a crash: the action that was in flight becomes the interrupted one (kept
        until the agent's next action starts). Returns its id, or the one already
        reported as interrupted, or None."""
        self._update(
            agent_id,
            "interrupted = COALESCE(in_flight, interrupted), in_flight = NULL",
            (),
        )
        return self._require(agent_id).interrupted

    def unblock(self, agent_id: str) -> RecoveryRecord:
        """A blocked agent whose committed record still describes its workspace goes back
        to torn down: its next action rebuilds it from that record."""
        with self._transaction() as db:
            cursor = db.execute(
                "UPDATE records SET state = 'torn_down', reason = NULL, updated_at = ? "
                "WHERE agent_id = ? AND state = 'blocked' AND manifest_digest IS NOT NULL",
                (self._wall_clock(), agent_id),
            )
            if cursor.rowcount != 1:
                raise RecoveryError(
                    f"agent {agent_id} is not blocked with a committed manifest"
                )
        return self._require(agent_id)

    def _update(self, agent_id: str, assignments: str, params: tuple[Any, ...], *,
                fsync: bool = True) -> None:
        with self._transaction(fsync=fsync) as db:
            cursor = db.execute(
                f"UPDATE records SET {assignments}, updated_at = ? WHERE agent_id = ?",
                (*params, self._wall_clock(), agent_id),
            )
            if cursor.rowcount != 1:
                raise RecoveryError(f"agent {agent_id} has no recovery record")

    def delete(self, agent_id: str) -> None:
        """Forget the agent (its workflow finished)."""
        self._manifests.pop(agent_id, None)
        self._unwritten.pop(agent_id, None)
        with self._transaction() as db:
            db.execute("DELETE FROM records WHERE agent_id = ?", (agent_id,))

    def get(self, agent_id: str) -> RecoveryRecord | None:
        try:
            row = self._db.execute(
                f"SELECT {_SELECT_COLUMNS} FROM records WHERE agent_id = ?", (agent_id,)
            ).fetchone()
        except sqlite3.Error as exc:
            raise RecoveryError(f"{self._path}: cannot read record {agent_id}: {exc}") from exc
        return None if row is None else self._from_row(row)

    def all(self) -> list[RecoveryRecord]:
        """Every record, sorted by agent id."""
        try:
            rows = self._db.execute(
                f"SELECT {_SELECT_COLUMNS} FROM records ORDER BY agent_id").fetchall()
        except sqlite3.Error as exc:
            raise RecoveryError(f"{self._path}: cannot read records: {exc}") from exc
        return [self._from_row(row) for row in rows]

    def _manifest_of(self, agent_id: str, digest: str | None) -> Manifest:
        known = self._manifests.get(agent_id)
        if known is not None and known.digest == digest:
            return known
        row = self._db.execute("SELECT manifest_json FROM records WHERE agent_id = ?",
                               (agent_id,)).fetchone()
        manifest = Manifest.from_json(row[0])
        self._manifests[agent_id] = manifest
        return manifest

    def _unwritten_of(self, agent_id: str, digest: str | None) -> Manifest | None:
        """The manifest committed in this process but not written yet, if still current."""
        known = self._unwritten.get(agent_id)
        return known if known is not None and known.digest == digest else None

    def _require(self, agent_id: str) -> RecoveryRecord:
        record = self.get(agent_id)
        if record is None:
            raise RecoveryError(f"agent {agent_id} has no recovery record")
        return record

    def _from_row(self, row: tuple[Any, ...]) -> RecoveryRecord:
        (
            agent_id,
            generation,
            digest,
            has_manifest,
            image,
            backend,
            config_json,
            state,
            reason,
            updated_at,
            agent_json,
            num_actions,
            num_restartable,
            last_boundary,
            last_boundary_reason,
            in_flight,
            interrupted,
            committed_at,
        ) = row
        try:
            config = json.loads(config_json)
            meta = json.loads(agent_json) if agent_json else {}
            manifest = (self._manifest_of(agent_id, digest) if has_manifest
                        else self._unwritten_of(agent_id, digest))
        except (ValueError, OSError, sqlite3.Error) as exc:
            raise RecoveryError(f"agent {agent_id}: corrupt recovery record: {exc}") from exc
        if manifest is not None and manifest.digest != digest:
            raise RecoveryError(f"agent {agent_id}: stored manifest does not match its digest")
        return RecoveryRecord(
            agent_id=agent_id,
            generation=generation,
            manifest_digest=digest,
            base_image=image,
            backend=backend,
            backend_config=config,
            state=state,
            reason=reason,
            updated_at=updated_at,
            manifest=manifest,
            agent_meta=meta,
            num_actions=num_actions,
            num_restartable=num_restartable,
            last_boundary=last_boundary,
            last_boundary_reason=last_boundary_reason,
            in_flight=in_flight,
            interrupted=interrupted,
            committed_at=committed_at,
        )
