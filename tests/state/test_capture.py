"""Incremental capture and verification of persistent roots (plain directories)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tenon.errors import WorkspaceError
from tenon.host import treewalk
from tenon.state.capture import CaptureLimits, CaptureRefused
from tenon.state.capture import scan as capture_scan
from tenon.state.filehash import HashBudget, block_digest
from tenon.state.manifest import Manifest
from tenon.state.recovery import RecoveryStore
from tenon.state.workspace import WorkspaceStore
from tenon.units import GIB


@dataclass
class CountingHasher:
    """The store's hasher, counting which files it read."""

    paths: list[str] = field(default_factory=list)

    def __call__(self, path: str, budget: HashBudget) -> tuple[str, int]:
        self.paths.append(path)
        return block_digest(path, budget)


def make_store(tmp_path: Path, **kwargs: object) -> tuple[WorkspaceStore, CountingHasher, Path]:
    hasher = CountingHasher()
    store = WorkspaceStore(tmp_path / "state", hasher=hasher, **kwargs)  # type: ignore[arg-type]
    root = store.create("agent")
    for i in range(20):
        (root / "workspace" / f"f{i}.txt").write_text(f"file {i}\n" * 50)
    (root / "workspace" / "sub").mkdir()
    (root / "workspace" / "sub" / "deep.py").write_text("print('hi')\n")
    os.symlink("sub/deep.py", root / "workspace" / "link")
    return store, hasher, root


def settled(root: Path) -> None:
    """Let the tree's timestamps age past the racy window (trusted by the next capture)."""
    time.sleep(0.06)


def test_unchanged_files_are_not_read_again(tmp_path: Path) -> None:
    store, hasher, root = make_store(tmp_path)
    settled(root)
    first = store.capture("agent")
    assert len(hasher.paths) == 21
    hasher.paths.clear()
    (root / "workspace" / "f3.txt").write_text("changed\n")
    second = store.capture("agent")
    assert hasher.paths == [str(root / "workspace" / "f3.txt")]
    assert second.digest != first.digest
    hasher.paths.clear()
    store.verify("agent", second.digest, second)
    # the changed file was captured within the racy window: read once more, nothing else
    assert hasher.paths == [str(root / "workspace" / "f3.txt")]


def test_changed_content_with_restored_mtime_is_seen_through_ctime(tmp_path: Path) -> None:
    store, hasher, root = make_store(tmp_path)
    victim = root / "workspace" / "f7.txt"
    settled(root)
    before = store.capture("agent")
    st = victim.stat()
    victim.write_text("FILE 7\n" * 50)  # same size
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert victim.stat().st_mtime_ns == st.st_mtime_ns
    after = store.capture("agent")
    assert after.digest != before.digest
    assert "f7.txt" in after.first_difference(before) or ""  # type: ignore[operator]


def test_verify_catches_a_tampered_file(tmp_path: Path) -> None:
    store, _, root = make_store(tmp_path)
    settled(root)
    committed = store.capture("agent")
    victim = root / "workspace" / "sub" / "deep.py"
    st = victim.stat()
    victim.write_text("print('HI')\n")
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(WorkspaceError, match=r"sub/deep.py' differs in sha256"):
        store.verify("agent", committed.digest, committed)


def test_sparse_8_gib_file_is_captured_without_reading_its_holes(tmp_path: Path) -> None:
    store, hasher, root = make_store(tmp_path)
    big = root / "workspace" / "big.img"
    with big.open("wb") as f:
        f.truncate(8 * GIB)
        f.seek(4 * GIB)
        f.write(b"middle")
    start = time.monotonic()
    manifest = store.capture("agent")
    assert time.monotonic() - start < 2.0
    assert store.last_scan is not None
    assert store.last_scan.bytes_hashed < 1024 * 1024  # one block, plus the small files
    entry = manifest.by_path["workspace/big.img"]
    assert entry.size_bytes == 8 * GIB
    # equal bytes, other holes: a dense copy of the data block hashes the same
    dense = tmp_path / "dense"
    with dense.open("wb") as f:
        f.truncate(8 * GIB)
        f.seek(4 * GIB - 4096)
        f.write(bytes(4096) + b"middle")
    assert block_digest(str(dense))[0] == entry.sha256


def test_limits_refuse_the_capture_naming_the_bound(tmp_path: Path) -> None:
    store, _, root = make_store(tmp_path, capture_limits=CaptureLimits(max_files=10))
    with pytest.raises(CaptureRefused, match="max_files=10"):
        store.capture("agent")
    bytes_store, _, _ = make_store(tmp_path / "b", capture_limits=CaptureLimits(
        max_hash_bytes=1000))
    with pytest.raises(CaptureRefused, match="max_hash_bytes=1000"):
        bytes_store.capture("agent")


def test_fifos_are_refused(tmp_path: Path) -> None:
    store, _, root = make_store(tmp_path)
    os.mkfifo(root / "tmp" / "pipe")
    with pytest.raises(CaptureRefused, match="fifo"):
        store.capture("agent")


@pytest.mark.skipif(os.geteuid() != 0, reason="whiteouts and trusted xattrs need root")
def test_overlay_whiteouts_and_opaque_dirs_round_trip(tmp_path: Path) -> None:
    store, _, root = make_store(tmp_path)
    upper = root / "upper"
    (upper / "etc" / "gone").mkdir(parents=True)
    os.mknod(upper / "etc" / "removed.conf", 0o600 | 0o020000, os.makedev(0, 0))
    os.setxattr(upper / "etc" / "gone", "trusted.overlay.opaque", b"y")
    (root / "work" / "work").mkdir(parents=True)
    (root / "work" / "work" / "scratch").write_text("overlay's own")
    committed = store.capture("agent")
    entries = committed.by_path
    assert entries["upper/etc/removed.conf"].kind == "whiteout"
    assert entries["upper/etc/gone"].opaque
    assert not any(p == "work" or p.startswith("work/") for p in entries)
    reloaded = Manifest.from_json(committed.to_json())
    assert reloaded.digest == committed.digest
    fresh = WorkspaceStore(tmp_path / "state")
    assert fresh.verify("agent", committed.digest, reloaded).digest == committed.digest
    assert list((root / "work").iterdir()) == []  # emptied before a rebuild
    os.removexattr(upper / "etc" / "gone", "trusted.overlay.opaque")
    with pytest.raises(WorkspaceError, match="differs in opaque"):
        fresh.verify("agent", committed.digest, reloaded)
    os.mknod(upper / "dev0", 0o600 | 0o020000, os.makedev(1, 3))
    with pytest.raises(CaptureRefused, match="character device"):
        fresh.capture("agent")


def test_version_1_manifest_still_loads_and_verifies(tmp_path: Path) -> None:
    store, _, root = make_store(tmp_path)
    v1 = capture_scan(root, version=1).manifest
    text = v1.to_json()
    assert json.loads(text)["version"] == 1
    loaded = Manifest.from_json(text)
    assert (loaded.version, loaded.digest) == (1, v1.digest)
    fresh = WorkspaceStore(tmp_path / "state")
    assert fresh.verify("agent", v1.digest, loaded).digest == v1.digest
    (root / "workspace" / "f1.txt").write_text("other")
    with pytest.raises(WorkspaceError, match="f1.txt"):
        fresh.verify("agent", v1.digest, loaded)


def test_restarted_controller_reloads_the_manifest_and_reads_nothing(tmp_path: Path) -> None:
    store, _, root = make_store(tmp_path)
    settled(root)
    manifest = store.capture("agent")
    records = RecoveryStore(tmp_path / "state" / "recovery.sqlite")
    records.register("agent", "img", "fake", {})
    records.commit_teardown("agent", 1, manifest.digest, "img", "fake", {}, manifest=manifest)
    records.close()
    # a new controller: new stores, the manifest comes back from the record
    hasher = CountingHasher()
    fresh = WorkspaceStore(tmp_path / "state", hasher=hasher)
    reopened = RecoveryStore(tmp_path / "state" / "recovery.sqlite")
    record = reopened.get("agent")
    assert record is not None
    assert record.manifest is not None
    assert record.manifest.version == 2
    fresh.verify("agent", manifest.digest, record.manifest)
    assert hasher.paths == []
    (root / "home" / "new.txt").write_text("after the restart")
    fresh.capture("agent")
    assert hasher.paths == [str(root / "home" / "new.txt")]
    reopened.close()


def test_python_walk_matches_the_helper(tmp_path: Path) -> None:
    if not treewalk.helper_usable():
        pytest.skip("tenon-treewalk not built: python -m tenon.host.treewalk build")
    _, _, root = make_store(tmp_path)
    (root / "tmp" / "odd\nname").write_text("x")
    helper, python = treewalk.walk(root, ("work",)), treewalk.walk_python(root, ("work",))
    assert sorted(zip(*helper, strict=True)) == sorted(zip(*python, strict=True))


def image_backed_store(tmp_path: Path) -> tuple[WorkspaceStore, CountingHasher, Path]:
    """`make_store` over roots that are ext4 images of their own (as the runtime's are)."""
    from tenon.host import diskfs
    from tenon.host.diskfs import DiskLimits

    if os.geteuid() != 0:
        pytest.skip("image-backed roots need root (loop devices, mount)")
    if problems := diskfs.check():
        pytest.skip("; ".join(problems))
    return make_store(tmp_path, limits=DiskLimits(disk_bytes=64 * 1024 * 1024,
                                                  max_inodes=4096))


@pytest.fixture
def image_store(tmp_path: Path):  # type: ignore[no-untyped-def]
    store, hasher, root = image_backed_store(tmp_path)
    yield store, hasher, root
    store.reconcile(set())


def test_a_root_that_wrote_nothing_since_its_capture_verifies_without_a_walk(
        image_store) -> None:  # type: ignore[no-untyped-def]
    store, hasher, root = image_store
    settled(root)
    store.capture("agent")
    (root / "workspace" / "f2.txt").write_text("changed\n")
    settled(root)
    captured = store.capture("agent")
    scanned = store.last_scan
    hasher.paths.clear()
    assert store.verify("agent", captured.digest, None) == captured
    assert store.last_scan is scanned  # no walk at all
    assert hasher.paths == []
    # Sealed once: the next verify (nothing captured since) walks the tree again.
    store.verify("agent", captured.digest, None)
    assert store.last_scan is not scanned


def test_a_write_after_the_capture_breaks_the_seal_and_is_found(image_store) -> None:  # type: ignore[no-untyped-def]
    store, _, root = image_store
    settled(root)
    captured = store.capture("agent")
    victim = root / "workspace" / "sub" / "deep.py"
    st = victim.stat()
    victim.write_text("print('HI')\n")  # same size, mtime put back: only content differs
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(WorkspaceError, match=r"sub/deep.py' differs in sha256"):
        store.verify("agent", captured.digest, captured)


def test_a_large_manifest_is_written_when_the_record_store_closes(tmp_path: Path) -> None:
    from tenon.state import recovery

    store, _, root = make_store(tmp_path)
    for i in range(recovery.MAX_INLINE_MANIFEST_ENTRIES):
        (root / "tmp" / f"n{i}").write_text("")
    settled(root)
    manifest = store.capture("agent")
    assert len(manifest.entries) > recovery.MAX_INLINE_MANIFEST_ENTRIES
    path = tmp_path / "state" / "recovery.sqlite"
    records = RecoveryStore(path)
    records.register("agent", "img", "fake", {})
    records.commit_teardown("agent", 1, manifest.digest, "img", "fake", {}, manifest=manifest)
    record = records.get("agent")
    assert record is not None
    assert record.manifest == manifest  # this process still has it
    crashed = RecoveryStore(path)  # what a crash now would find: the digest, no manifest
    record = crashed.get("agent")
    assert record is not None
    assert (record.manifest_digest, record.manifest) == (manifest.digest, None)
    crashed.close()
    records.close()
    reopened = RecoveryStore(path)
    record = reopened.get("agent")
    assert record is not None
    assert record.manifest == manifest
    reopened.close()
