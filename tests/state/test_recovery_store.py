"""The SQLite recovery store."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from tenon.errors import RecoveryError
from tenon.state.recovery import RecoveryStore


def make_store(tmp_path: Path) -> RecoveryStore:
    return RecoveryStore(tmp_path / "recovery.db", wall_clock=lambda: 1000.0)


def test_store_uses_wal_and_full_sync(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    store.register("a1", "img", "fake")
    db = sqlite3.connect(tmp_path / "recovery.db")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    db.close()


def test_lifecycle_and_reopen(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    rec = store.register("a1", "img", "fake", {"network": True})
    assert (rec.state, rec.generation, rec.manifest_digest) == ("resident", 1, None)
    store.commit_teardown("a1", 1, "d" * 64, "img", "fake", {"network": True})
    store.mark_resident("a1", 2)
    store.commit_teardown("a1", 2, "e" * 64, "img", "fake", {"network": True})
    store.mark_blocked("a1", "verify failed")
    store.commit_teardown("b2", 1, "f" * 64, "img2", "fake", {})
    store.close()

    reopened = make_store(tmp_path)
    records = {r.agent_id: r for r in reopened.all()}
    assert set(records) == {"a1", "b2"}
    a1 = records["a1"]
    assert (a1.generation, a1.state, a1.reason) == (2, "blocked", "verify failed")
    assert a1.manifest_digest == "e" * 64
    assert a1.backend_config == {"network": True}
    assert records["b2"].state == "torn_down"
    assert reopened.get("zz") is None


def test_stale_generations_are_refused(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    store.commit_teardown("a1", 3, "d" * 64, "img", "fake")
    with pytest.raises(RecoveryError, match="generation 2"):
        store.commit_teardown("a1", 2, "d" * 64, "img", "fake")
    with pytest.raises(RecoveryError, match="older"):
        store.mark_resident("a1", 1)
    assert store.get("a1").generation == 3


def test_marking_an_unknown_agent_fails(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    with pytest.raises(RecoveryError):
        store.mark_resident("nobody", 1)
    with pytest.raises(RecoveryError):
        store.mark_blocked("nobody", "why")


def test_unserializable_config_is_refused_without_writing(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    with pytest.raises(RecoveryError, match="JSON"):
        store.commit_teardown("a1", 1, "d" * 64, "img", "fake", {"x": object()})
    assert store.all() == []
