"""What the service keeps of each E2B sandbox beyond the runtime's own records: template,
metadata, environment, timeout and paused state, in `<state>/service.sqlite`, so a restarted
server answers for every sandbox it had."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STORE_FILE = "service.sqlite"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    sandbox_id TEXT PRIMARY KEY,
    template TEXT NOT NULL,
    metadata TEXT NOT NULL,
    env_vars TEXT NOT NULL,
    started_at REAL NOT NULL,
    end_at REAL NOT NULL,
    auto_pause INTEGER NOT NULL,
    paused INTEGER NOT NULL,
    access_token TEXT NOT NULL,
    timeout_s REAL NOT NULL,
    network TEXT
)
"""
# Added after the first release of the table: stores made before it get the column.
_ADD_NETWORK = "ALTER TABLE sandboxes ADD COLUMN network TEXT"


@dataclass
class SandboxRecord:
    """One E2B sandbox as a client sees it. Times are Unix seconds (wall clock)."""

    sandbox_id: str
    template: str
    started_at: float
    end_at: float
    access_token: str
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    auto_pause: bool = False  # at its timeout: paused (torn down, kept) instead of killed
    paused: bool = False
    timeout_s: float = 300.0  # the lifetime a create, connect or resume grants
    # Its outbound rules (`NetworkPolicy.to_dict`), None for the server's default.
    network: dict[str, Any] | None = None


class SandboxStore:
    """A small SQLite table; every change is committed before the call returns."""

    def __init__(self, state_dir: Path) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(state_dir / STORE_FILE, isolation_level=None,
                                   check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(sandboxes)")}
        if "network" not in columns:
            self._db.execute(_ADD_NETWORK)

    def put(self, record: SandboxRecord) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO sandboxes VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (record.sandbox_id, record.template, json.dumps(record.metadata),
             json.dumps(record.env_vars), record.started_at, record.end_at,
             int(record.auto_pause), int(record.paused), record.access_token,
             record.timeout_s, None if record.network is None else json.dumps(record.network)))

    def delete(self, sandbox_id: str) -> None:
        self._db.execute("DELETE FROM sandboxes WHERE sandbox_id = ?", (sandbox_id,))

    def all(self) -> Iterator[SandboxRecord]:
        rows = self._db.execute(
            "SELECT sandbox_id, template, metadata, env_vars, started_at, end_at, auto_pause,"
            " paused, access_token, timeout_s, network FROM sandboxes ORDER BY started_at"
        ).fetchall()
        for (sid, template, metadata, env_vars, started, end, auto_pause, paused, token,
             timeout_s, network) in rows:
            yield SandboxRecord(sid, template, started, end, token, json.loads(metadata),
                                json.loads(env_vars), bool(auto_pause), bool(paused), timeout_s,
                                None if network is None else json.loads(network))

    def close(self) -> None:
        self._db.close()
