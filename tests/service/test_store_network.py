"""The service store keeps each sandbox's network policy, and a store made before the
column existed gets it on open."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from tenon.service.store import STORE_FILE, SandboxRecord, SandboxStore

OLD_SCHEMA = """CREATE TABLE sandboxes (sandbox_id TEXT PRIMARY KEY, template TEXT NOT NULL,
    metadata TEXT NOT NULL, env_vars TEXT NOT NULL, started_at REAL NOT NULL,
    end_at REAL NOT NULL, auto_pause INTEGER NOT NULL, paused INTEGER NOT NULL,
    access_token TEXT NOT NULL, timeout_s REAL NOT NULL)"""


def test_a_records_network_policy_survives_a_reopen(tmp_path: Path) -> None:
    policy = {"allow_internet_access": False, "allow_out": ["pypi.org"], "deny_out": []}
    store = SandboxStore(tmp_path)
    store.put(SandboxRecord("a", "base", 1.0, 2.0, "t", network=policy))
    store.put(SandboxRecord("b", "base", 1.0, 2.0, "t"))
    store.close()
    reopened = SandboxStore(tmp_path)
    assert {r.sandbox_id: r.network for r in reopened.all()} == {"a": policy, "b": None}
    reopened.close()


def test_a_store_without_the_column_gets_it(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / STORE_FILE)
    db.execute(OLD_SCHEMA)
    db.execute("INSERT INTO sandboxes VALUES ('old', 'base', '{}', '{}', 1, 2, 0, 0, 't', 300)")
    db.commit()
    db.close()
    store = SandboxStore(tmp_path)
    assert [(r.sandbox_id, r.network) for r in store.all()] == [("old", None)]
    store.close()
