"""Workspace paths, capture and verification on real directories."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tenon.errors import WorkspaceError
from tenon.state.workspace import Manifest, WorkspaceStore


def make_tree(root: Path) -> None:
    """Nested files, binary content, a symlink, an empty dir and unusual modes."""
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "src" / "pkg" / "mod.py").write_text("print('hi')\n")
    (root / "data.bin").write_bytes(bytes(range(256)) * 64)
    (root / "empty").mkdir()
    (root / "run.sh").write_text("#!/bin/sh\necho ok\n")
    (root / "run.sh").chmod(0o755)
    (root / "secret").write_text("s")
    (root / "secret").chmod(0o600)
    os.symlink("src/pkg/mod.py", root / "link")
    os.symlink("/nonexistent/target", root / "dangling")


def test_manifest_describes_every_entry_sorted(tmp_path: Path) -> None:
    store = WorkspaceStore(tmp_path)
    make_tree(store.create("a1"))
    manifest = store.capture("a1")
    paths = [e.path for e in manifest.entries]
    assert paths == sorted(paths)
    by_path = {e.path: e for e in manifest.entries}
    assert by_path["empty"].kind == "dir"
    assert by_path["link"].kind == "symlink"
    assert by_path["link"].target == "src/pkg/mod.py"
    assert by_path["dangling"].target == "/nonexistent/target"
    assert by_path["run.sh"].mode == 0o755
    assert by_path["secret"].mode == 0o600
    assert by_path["data.bin"].size_bytes == 256 * 64
    assert by_path["src/pkg/mod.py"].sha256 is not None


def test_digest_is_stable_and_round_trips_through_json(tmp_path: Path) -> None:
    store = WorkspaceStore(tmp_path)
    make_tree(store.create("a1"))
    first = store.capture("a1")
    assert store.capture("a1").digest == first.digest
    assert Manifest.from_json(first.to_json()) == first
    assert store.verify("a1", first.digest) == first


@pytest.mark.parametrize(
    ("tamper", "named"),
    [
        (lambda root: (root / "data.bin").write_bytes(b"x"), "data.bin"),
        (lambda root: (root / "run.sh").chmod(0o644), "run.sh"),
        (lambda root: (root / "empty").rmdir(), "empty"),
        (lambda root: (root / "new.txt").write_text("n"), "new.txt"),
        (lambda root: (os.remove(root / "link"), os.symlink("data.bin", root / "link")), "link"),
    ],
)
def test_verify_names_the_first_differing_path(tmp_path: Path, tamper, named: str) -> None:
    store = WorkspaceStore(tmp_path)
    root = store.create("a1")
    make_tree(root)
    manifest = store.capture("a1")
    tamper(root)
    with pytest.raises(WorkspaceError, match=named) as info:
        store.verify("a1", manifest.digest, previous=manifest)
    assert manifest.digest in str(info.value)


def test_verify_without_previous_still_fails(tmp_path: Path) -> None:
    store = WorkspaceStore(tmp_path)
    root = store.create("a1")
    digest = store.capture("a1").digest
    (root / "f").write_text("x")
    with pytest.raises(WorkspaceError, match="does not match"):
        store.verify("a1", digest)


@pytest.mark.parametrize("agent_id", ["../x", "..", ".", "a/b", "", "-x", "a b", "x" * 200])
def test_unsafe_agent_ids_are_refused_naming_the_path(tmp_path: Path, agent_id: str) -> None:
    store = WorkspaceStore(tmp_path)
    with pytest.raises(WorkspaceError, match="not safe") as info:
        store.path_for(agent_id)
    assert str(tmp_path / "workspaces") in str(info.value)


def test_symlinked_workspace_escaping_the_state_dir_is_refused(tmp_path: Path) -> None:
    state, outside = tmp_path / "state", tmp_path / "outside"
    outside.mkdir()
    (state / "workspaces").mkdir(parents=True)
    os.symlink(outside, state / "workspaces" / "evil")
    store = WorkspaceStore(state)
    with pytest.raises(WorkspaceError, match="symlink") as info:
        store.path_for("evil")
    assert str(state / "workspaces" / "evil") in str(info.value)
    with pytest.raises(WorkspaceError):
        store.capture("evil")
    with pytest.raises(WorkspaceError):
        store.delete("evil")
    assert outside.exists()


def test_symlinked_workspace_root_escaping_the_state_dir_is_refused(tmp_path: Path) -> None:
    state, outside = tmp_path / "state", tmp_path / "outside"
    state.mkdir()
    outside.mkdir()
    os.symlink(outside, state / "workspaces")
    with pytest.raises(WorkspaceError, match="outside the state directory"):
        WorkspaceStore(state).create("a1")
    assert not (outside / "a1").exists()


def test_state_dir_itself_may_be_a_symlink(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "state")
    path = WorkspaceStore(tmp_path / "state").create("a1")
    assert path == real / "workspaces" / "a1"


def test_capture_refuses_special_files(tmp_path: Path) -> None:
    store = WorkspaceStore(tmp_path)
    root = store.create("a1")
    os.mkfifo(root / "pipe")
    with pytest.raises(WorkspaceError, match="pipe"):
        store.capture("a1")


def test_delete_is_idempotent(tmp_path: Path) -> None:
    store = WorkspaceStore(tmp_path)
    make_tree(store.create("a1"))
    store.delete("a1")
    store.delete("a1")
    assert not store.exists("a1")
    with pytest.raises(WorkspaceError, match="does not exist"):
        store.capture("a1")
