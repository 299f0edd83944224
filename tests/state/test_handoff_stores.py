"""The store operations an agent's move between runtimes rests on: a record exported from one
recovery store and imported into another, and a persistent root moved between two state
directories' workspace stores (by rename, or by copy across filesystems)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tenon.errors import RecoveryError, WorkspaceError
from tenon.host import diskfs
from tenon.host.diskfs import DiskLimits
from tenon.state.recovery import RecoveryRecord, RecoveryStore
from tenon.state.workspace import WorkspaceStore
from tenon.units import MIB

IMAGE = "tenon-base:bookworm"
SMALL = DiskLimits(disk_bytes=64 * MIB, max_inodes=512)


def committed_record(state_dir: Path, agent_id: str = "a1") -> RecoveryRecord:
    """A store in `state_dir` whose agent ran two actions, the second interrupted by a
    crash, and was torn down at generation 3."""
    workspaces = WorkspaceStore(state_dir)
    root = workspaces.create(agent_id)
    (root / "workspace" / "notes.txt").write_text("kept")
    store = RecoveryStore(state_dir / "recovery.sqlite")
    store.register(agent_id, IMAGE, "process", {"network": False})
    store.note_action_start(agent_id, f"{agent_id}-a0001", agent_meta={"workflow": "wf-1"})
    store.note_action_done(agent_id, boundary="restartable", reason="restartable")
    store.note_action_start(agent_id, f"{agent_id}-a0002")
    store.mark_interrupted(agent_id)
    manifest = workspaces.capture(agent_id)
    record = store.commit_teardown(agent_id, 3, manifest.digest, IMAGE, "process",
                                   {"network": False}, manifest=manifest)
    store.close()
    return record


# -- records ----------------------------------------------------------------------------------


def test_a_record_survives_json_and_imports_with_everything_but_the_action_in_flight(tmp_path):
    record = committed_record(tmp_path / "a")
    doc = json.loads(json.dumps(record.to_dict()))  # what crosses between nodes
    assert RecoveryRecord.from_dict(doc) == record

    store = RecoveryStore(tmp_path / "b" / "recovery.sqlite")
    imported = store.import_record(RecoveryRecord.from_dict(doc))
    assert (imported.generation, imported.manifest_digest, imported.manifest) == (
        3, record.manifest_digest, record.manifest)
    assert imported.state == "torn_down"
    assert imported.agent_meta == {"workflow": "wf-1"}
    assert (imported.num_actions, imported.num_restartable) == (1, 1)
    assert imported.interrupted == "a1-a0002"
    assert imported.in_flight is None
    assert imported.backend_config == {"network": False}
    assert imported.committed_at == record.committed_at
    assert store.import_record(record).generation == 3  # again: the same record
    assert [r.agent_id for r in store.all()] == ["a1"]


def test_import_refuses_an_older_generation_and_an_uncommitted_record(tmp_path):
    record = committed_record(tmp_path / "a")
    store = RecoveryStore(tmp_path / "b" / "recovery.sqlite")
    store.import_record(record)
    older = RecoveryRecord.from_dict({**record.to_dict(), "generation": 2})
    with pytest.raises(RecoveryError, match="refusing to import generation 2"):
        store.import_record(older)
    resident = RecoveryRecord.from_dict({**record.to_dict(), "agent_id": "a2",
                                         "state": "resident"})
    with pytest.raises(RecoveryError, match="only a committed record"):
        store.import_record(resident)
    assert store.get("a2") is None
    kept = store.get("a1")
    assert kept is not None
    assert kept.generation == 3


def test_from_dict_refuses_unknown_fields_and_a_manifest_that_is_not_the_digest(tmp_path):
    doc = committed_record(tmp_path).to_dict()
    with pytest.raises(RecoveryError, match="unknown recovery record fields"):
        RecoveryRecord.from_dict({**doc, "extra": 1})
    with pytest.raises(RecoveryError, match="does not match its digest"):
        RecoveryRecord.from_dict({**doc, "manifest_digest": "0" * 64})
    without_image = {k: v for k, v in doc.items() if k != "base_image"}
    with pytest.raises(RecoveryError, match="unreadable"):
        RecoveryRecord.from_dict(without_image)


# -- plain roots --------------------------------------------------------------------------------


@pytest.fixture
def other_fs() -> Iterator[Path]:
    """A directory on another filesystem than pytest's tmp_path (tmpfs)."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    path = Path(tempfile.mkdtemp(prefix="tenon-handoff-", dir="/dev/shm"))
    yield path
    for point in reversed(diskfs.mounts()):
        if path in point.mount_point.parents:
            subprocess.run(["umount", "--lazy", str(point.mount_point)], check=False)
    shutil.rmtree(path, ignore_errors=True)


def _fill(root: Path) -> None:
    (root / "workspace" / "src").mkdir()
    (root / "workspace" / "src" / "main.py").write_text("print('hi')\n")
    (root / "workspace" / "run.sh").write_text("#!/bin/sh\n")
    (root / "workspace" / "run.sh").chmod(0o755)
    (root / "home" / "link").symlink_to("../workspace/run.sh")


def test_a_plain_root_moves_by_rename_and_moving_again_changes_nothing(tmp_path):
    source, dest = WorkspaceStore(tmp_path / "a"), WorkspaceStore(tmp_path / "b")
    _fill(source.create("a1"))
    before = source.manifest("a1")
    path = dest.move_in("a1", source)
    assert path == dest.path_for("a1")
    assert dest.manifest("a1") == before
    assert not source.path_for("a1").exists()
    assert dest.move_in("a1", source) == path  # finishing a finished move
    assert dest.manifest("a1") == before
    with pytest.raises(WorkspaceError, match="has no persistent root"):
        dest.move_in("nobody", source)


def test_a_plain_root_is_copied_across_filesystems_owners_and_modes_kept(tmp_path, other_fs):
    source, dest = WorkspaceStore(tmp_path / "a"), WorkspaceStore(other_fs)
    root = source.create("a1")
    _fill(root)
    if os.geteuid() == 0:
        os.lchown(root / "workspace" / "run.sh", 4242, 4243)
    before = source.manifest("a1")
    dest.move_in("a1", source)
    assert dest.manifest("a1") == before
    assert not source.path_for("a1").exists()
    assert not (other_fs / "workspaces" / "a1.partial").exists()
    if os.geteuid() == 0:
        st = (dest.path_for("a1") / "workspace" / "run.sh").lstat()
        assert (st.st_uid, st.st_gid) == (4242, 4243)


# -- roots on images ----------------------------------------------------------------------------


@pytest.fixture
def disk_dir(tmp_path: Path) -> Iterator[Path]:
    if problems := diskfs.check():
        pytest.skip("; ".join(problems))
    yield tmp_path
    for point in reversed(diskfs.mounts()):
        if tmp_path in point.mount_point.parents:
            subprocess.run(["umount", "--lazy", str(point.mount_point)], check=False)


@pytest.mark.disk
def test_an_image_root_moves_mounted_or_not_and_stays_sparse_across_filesystems(disk_dir,
                                                                                 other_fs):
    node_a = WorkspaceStore(disk_dir / "a", limits=SMALL)
    _fill(node_a.create("a1"))
    (node_a.path_for("a1") / "workspace" / "big.bin").write_bytes(os.urandom(2 * MIB))
    before = node_a.capture("a1")
    assert node_a.is_mounted("a1")

    far = WorkspaceStore(other_fs, limits=SMALL)
    far.move_in("a1", node_a)  # unmounts it, then copies it (another filesystem)
    assert not node_a.is_mounted("a1")
    assert not node_a.image_for("a1").exists()
    assert not node_a.path_for("a1").exists()
    image = far.image_for("a1")
    assert image.stat().st_size == SMALL.disk_bytes
    assert image.stat().st_blocks * 512 < SMALL.disk_bytes // 2  # only what was written
    assert not image.with_name(image.name + ".partial").exists()

    node_b = WorkspaceStore(disk_dir / "b", limits=SMALL)
    node_b.move_in("a1", far)  # copied back
    node_b.attach("a1")
    node_b.verify("a1", before.digest, before)
    node_b.unmount("a1")
    assert not node_b.is_mounted("a1")

    node_c = WorkspaceStore(disk_dir / "c", limits=SMALL)
    inode = node_b.image_for("a1").stat().st_ino
    node_c.move_in("a1", node_b)  # same filesystem: a rename
    assert node_c.image_for("a1").stat().st_ino == inode
    node_c.attach("a1")
    node_c.verify("a1", before.digest, before)
    node_c.unmount("a1")


@pytest.mark.disk
def test_a_move_cut_short_after_the_copy_is_finished_from_the_source(disk_dir, other_fs):
    """A crash after the copy landed but before the source went: both hold the image, the
    destination's perhaps mounted by a restart's reconcile; moving again unmounts it, takes
    the source's and removes the source."""
    source = WorkspaceStore(other_fs, limits=SMALL)
    source.create("a1")
    (source.path_for("a1") / "workspace" / "f").write_text("from the source")
    source.unmount("a1")
    dest = WorkspaceStore(disk_dir, limits=SMALL)
    dest.create("a1")  # an image of its own, mounted
    (dest.path_for("a1") / "workspace" / "f").write_text("stale")
    dest.move_in("a1", source)
    assert not dest.is_mounted("a1")
    assert not source.image_for("a1").exists()
    dest.attach("a1")
    assert (dest.path_for("a1") / "workspace" / "f").read_text() == "from the source"
    dest.unmount("a1")
