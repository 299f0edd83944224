"""Workspaces on their own ext4 images: limits, privacy, reconcile, and escapes tried from
real sandboxes (process backend here; Docker in test_workspace_limits_docker.py)."""

from __future__ import annotations

import stat
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tenon.errors import WorkspaceError
from tenon.host import diskfs
from tenon.host.diskfs import DiskLimits
from tenon.sandbox import launcher
from tenon.state.workspace import PERSISTENT_DIRS, WorkspaceStore
from tenon.units import MIB

SMALL = DiskLimits(disk_bytes=64 * MIB, max_inodes=512)
OTHER_UID = 100001  # a host uid that is neither root nor the sandbox's


# -- without root: what the store refuses before touching anything ---------------------------


def test_plain_store_refuses_disk_limits_it_cannot_enforce(tmp_path):
    store = WorkspaceStore(tmp_path)
    with pytest.raises(WorkspaceError, match="disk_bytes set, but this store keeps plain"):
        store.create("a1", {"disk_bytes": 64 * MIB})
    assert not store.root.exists()


@pytest.mark.parametrize(
    ("config", "named"),
    [({"disk_bytes": "1MiB"}, "disk_bytes 1048576 is outside"),
     ({"max_inodes": -3}, "max_inodes -3 is outside"),
     ({"max_inodes": "many"}, "max_inodes must be an integer")],
)
def test_bad_limits_in_the_config_fail_in_one_line_before_anything_exists(tmp_path, config,
                                                                           named):
    store = WorkspaceStore(tmp_path, limits=SMALL)
    with pytest.raises(WorkspaceError, match=named) as info:
        store.create("a1", config)
    assert "\n" not in str(info.value)
    assert not store.root.exists()


def test_plain_roots_are_private_and_report_no_usage(tmp_path):
    store = WorkspaceStore(tmp_path)
    root = store.create("a1")
    assert _mode(store.root) == 0o711
    assert [_mode(p) for p in (root, *(root / sub for sub in PERSISTENT_DIRS))] == [0o700] * 4
    assert store.usage("a1") is None
    assert store.full_reason("a1") is None


# -- with root: real images ----------------------------------------------------------------


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _loops_under(directory: Path) -> dict[str, Path]:
    return {dev: f for dev, f in diskfs.loop_devices().items() if directory in f.parents}


def _mounts_under(directory: Path) -> list[Path]:
    return [m.mount_point for m in diskfs.mounts() if directory in m.mount_point.parents]


def assert_nothing_left(directory: Path) -> None:
    """No mount below `directory`; no loop device backed by a file below it, once the
    kernel's autoclear (which may lag the last unmount by a moment) has run."""
    assert _mounts_under(directory) == []
    deadline = time.monotonic() + 10.0
    while _loops_under(directory) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _loops_under(directory) == {}


@pytest.fixture
def state_dir(tmp_path):
    if problems := diskfs.check():
        pytest.skip("; ".join(problems))
    yield tmp_path
    for point in reversed(_mounts_under(tmp_path)):
        subprocess.run(["umount", "--lazy", str(point)], check=False)
    assert_nothing_left(tmp_path)


@pytest.fixture
def store(state_dir):
    return WorkspaceStore(state_dir, limits=SMALL)


def as_other_uid(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups", "--",
         *argv], capture_output=True, text=True, check=False)


@pytest.mark.disk
def test_create_mounts_a_private_root_of_its_limits_and_delete_leaves_nothing(store):
    root = store.create("a1", {"disk_bytes": "48MiB", "max_inodes": 256})
    assert store.is_mounted("a1")
    used = store.usage("a1")
    assert used is not None
    assert used.max_inodes == 256
    assert used.capacity_bytes <= 48 * MIB
    assert store.image_for("a1").stat().st_size == 48 * MIB
    assert sorted(p.name for p in root.iterdir()) == sorted(PERSISTENT_DIRS)  # no lost+found
    assert [_mode(p) for p in (root, *(root / sub for sub in PERSISTENT_DIRS))] == [0o700] * 4
    assert _mode(store.root) == 0o711
    assert _mode(store.image_for("a1").parent) == 0o700
    assert _mode(store.image_for("a1")) == 0o600  # the raw image would bypass every mode
    assert store.create("a1") == root  # idempotent: same filesystem, no second mount
    assert len([m for m in diskfs.mounts() if m.mount_point == root]) == 1
    store.delete("a1")
    assert not root.exists()
    assert not store.image_for("a1").exists()
    assert_nothing_left(store.root)
    store.delete("a1")  # idempotent


@pytest.mark.disk
def test_create_refuses_to_hide_files_under_a_new_filesystem(store):
    root = store.path_for("a1")
    root.mkdir(parents=True)
    (root / "left.txt").write_text("from a plain-directory store")
    with pytest.raises(WorkspaceError, match="refusing to hide them"):
        store.create("a1")
    assert not store.is_mounted("a1")
    assert not store.image_for("a1").exists()
    assert (root / "left.txt").exists()


@pytest.mark.disk
def test_content_survives_unmount_and_verifies_after_attach(store):
    root = store.create("a1")
    (root / "workspace" / "notes.txt").write_text("kept\n")
    (root / "home" / ".bashrc").write_text("export X=1\n")
    manifest = store.capture("a1")
    assert store.unmount_all() == 1  # what a runtime's exit (or a host restart) leaves
    assert not store.is_mounted("a1")
    with pytest.raises(WorkspaceError, match="does not match"):
        store.verify("a1", manifest.digest)  # the bare mount point is not the workspace
    assert store.attach("a1") == root
    assert store.verify("a1", manifest.digest) == manifest
    store.delete("a1")


@pytest.mark.disk
def test_reconcile_after_a_crash_keeps_and_removes_the_right_ones(store):
    for agent_id in ("kept-mounted", "kept-unmounted", "gone-mounted", "gone-unmounted"):
        (store.create(agent_id) / "workspace" / "f").write_text(agent_id)
    for agent_id in ("kept-unmounted", "gone-unmounted"):
        diskfs.unmount(store.path_for(agent_id))
    images = store.root / WorkspaceStore.IMAGES_DIR
    diskfs.create_image(images / "orphan.ext4", SMALL)  # an image whose root never got made
    (images / "half.ext4.partial").write_bytes(b"\0" * 4096)  # mkfs cut short
    (store.root / "plain-leftover").mkdir()
    # A crash between attaching kept-unmounted's image and mounting it.
    subprocess.run(["losetup", "--find", str(store.image_for("kept-unmounted"))], check=True)

    report = store.reconcile({"kept-mounted", "kept-unmounted", "kept-missing"})

    assert report.mounted == ("kept-unmounted",)
    assert report.removed == ("gone-mounted", "gone-unmounted", "half", "orphan",
                              "plain-leftover")
    assert report.missing == ("kept-missing",)
    assert report.detached_loops == 1
    for agent_id in ("kept-mounted", "kept-unmounted"):
        assert store.is_mounted(agent_id)
        assert (store.path_for(agent_id) / "workspace" / "f").read_text() == agent_id
    assert sorted(p.name for p in store.root.iterdir()) == [
        ".images", "kept-mounted", "kept-unmounted"]
    assert sorted(p.name for p in images.iterdir()) == ["kept-mounted.ext4",
                                                        "kept-unmounted.ext4"]
    assert len(_loops_under(store.root)) == 2
    assert store.reconcile(set()).removed == ("kept-mounted", "kept-unmounted")
    assert_nothing_left(store.root)


# -- escapes tried from process sandboxes ----------------------------------------------------

IMAGE = "tenon-base:bookworm"
SANDBOX_STATE_DIR = Path("/var/lib/tenon")


@pytest.fixture
def backend(state_dir):
    from tenon.errors import ImageNotFound
    from tenon.host.domain import WorkloadDomain
    from tenon.sandbox.images import image_rootfs
    from tenon.sandbox.process import ProcessBackend

    if problems := launcher.check():
        pytest.skip(problems[0])
    try:
        image_rootfs(IMAGE, SANDBOX_STATE_DIR)
    except ImageNotFound as exc:
        pytest.skip(str(exc))
    domain = WorkloadDomain.open(f"tenon-test-{uuid.uuid4().hex[:8]}")
    yield ProcessBackend(domain, state_dir=SANDBOX_STATE_DIR)
    domain.remove()


async def sandbox_for(backend, store: WorkspaceStore, agent_id: str):
    from tenon.sandbox.base import SandboxSpec

    spec = SandboxSpec(sandbox_id=f"sb-{uuid.uuid4().hex[:8]}", image=IMAGE,
                       workspace=store.path_for(agent_id), max_pids=128,
                       tmp_size_bytes=64 * MIB)
    return await backend.materialize(spec)


def allocated_bytes(path: Path) -> int:
    return path.stat().st_blocks * 512


@pytest.mark.disk
@pytest.mark.sandbox
async def test_process_sandbox_filling_its_workspace_gets_enospc_and_nobody_else(backend,
                                                                                 store):
    store.create("filler")
    neighbour = store.create("neighbour")
    sandbox = await sandbox_for(backend, store, "filler")
    try:
        filled = await sandbox.exec(
            "dd if=/dev/zero of=/workspace/fill bs=1M count=200 conv=fsync 2>&1", timeout_s=60)
        reason = store.full_reason("filler")
        freed = await sandbox.exec("rm /workspace/fill && echo ok > /workspace/more", timeout_s=10)
    finally:
        await sandbox.destroy()
    assert filled.exit_code != 0
    assert "No space left on device" in filled.output
    assert reason is not None
    assert "disk limit reached" in reason
    assert freed.exit_code == 0  # the agent recovers by deleting: the limit is its own
    assert store.full_reason("filler") is None
    # The host gave the agent at most its image: the fill never reached the host's disk.
    assert allocated_bytes(store.image_for("filler")) <= SMALL.disk_bytes
    assert store.full_reason("neighbour") is None
    (neighbour / "workspace" / "data").write_bytes(b"x" * (8 * MIB))
    assert (neighbour / "workspace" / "data").stat().st_size == 8 * MIB
    store.delete("filler")
    store.delete("neighbour")


@pytest.mark.disk
@pytest.mark.sandbox
async def test_inode_flood_stops_at_the_inode_limit(backend, store):
    store.create("flood", {"max_inodes": 128})
    sandbox = await sandbox_for(backend, store, "flood")
    try:
        flood = await sandbox.exec(
            "i=0; while [ $i -lt 5000 ] && touch /workspace/f$i; do i=$((i+1)); done 2>&1; "
            "echo made=$i", timeout_s=60)
    finally:
        await sandbox.destroy()
    assert "No space left on device" in flood.output
    made = int(flood.output.rsplit("made=", 1)[1])
    assert 0 < made < 128
    reason = store.full_reason("flood")
    assert reason is not None
    assert "inode limit reached" in reason
    store.delete("flood")


@pytest.mark.disk
@pytest.mark.sandbox
async def test_another_uid_cannot_read_a_sandbox_workspace(backend, store):
    root = store.create("secretive")
    sandbox = await sandbox_for(backend, store, "secretive")
    try:
        wrote = await sandbox.exec("echo API_KEY=hunter2 > /workspace/.env; cat .env",
                                   timeout_s=10)
    finally:
        await sandbox.destroy()
    assert wrote.output == "API_KEY=hunter2\n"  # the sandbox itself reads it
    assert (root / "workspace").stat().st_uid == 1000  # the default user's canonical id
    assert (root.stat().st_uid, root.stat().st_mode & 0o777) == (0, 0o700)
    for argv in (["cat", str(root / "workspace" / ".env")], ["ls", str(root)],
                 ["ls", str(store.root)]):
        tried = as_other_uid(*argv)
        assert tried.returncode != 0, argv
        assert "Permission denied" in tried.stderr
        assert "hunter2" not in tried.stdout
    store.delete("secretive")



@pytest.mark.disk
@pytest.mark.sandbox
@pytest.mark.cgroups
async def test_runtime_names_a_full_workspace_and_rebuilds_onto_a_remounted_root(backend,
                                                                                 state_dir):
    from tenon.predict.static import FixedPredictor
    from tenon.runtime.open import open_runtime

    run_dir = state_dir / "run"
    async with open_runtime(budget_bytes=1024 * MIB, backend="process",
                            state_dir=SANDBOX_STATE_DIR, run_dir=run_dir, keep_events=True,
                            workspace_limits=SMALL,
                            predictor=FixedPredictor(16 * MIB, 32 * MIB)) as rt:
        agent = await rt.create_agent()
        full = await agent.run("dd if=/dev/zero of=/workspace/fill bs=1M count=200 2>&1",
                               timeout=60)
        freed = await agent.run("rm /workspace/fill; echo kept > /workspace/notes", timeout=10)
        torn = await rt.residency.teardown(agent.id)
        assert torn.outcome == "torn_down", torn.reason
        assert rt.workspaces.unmount_all() == 1  # as after a host restart
        rebuilt = await agent.run("cat /workspace/notes", timeout=10)
        events = rt.events.of_kind("workspace_full")
        await agent.close()
    assert "No space left on device" in full.output
    assert full.workspace_full is not None
    assert "disk limit reached" in full.workspace_full
    assert [e["action_id"] for e in events] == [full.action_id]
    assert freed.ok
    assert freed.workspace_full is None
    # the rebuild mounted the image again and verified the committed digest through it
    assert rebuilt.output == "kept\n"
    assert _mounts_under(state_dir) == []


@pytest.mark.disk
def test_workspace_bench_times_each_step_and_leaves_nothing(state_dir):
    from tenon.replay.workspace_bench import bench_workspaces

    limits = DiskLimits(disk_bytes=128 * MIB, max_inodes=2048)  # room for the capture tree
    result = bench_workspaces(num_runs=2, state_dir=state_dir, limits=limits)
    assert result["runs"] == 2
    assert result["disk_bytes"] == limits.disk_bytes
    for key in ("create_ms", "unmount_ms", "attach_ms", "delete_ms", "capture_image_ms",
                "capture_plain_ms"):
        assert result[key] > 0, key
    assert 0 < result["fresh_image_host_bytes"] < limits.disk_bytes
    assert sorted(p.name for p in state_dir.iterdir()) == []
    with pytest.raises(ValueError, match="num_runs"):
        bench_workspaces(num_runs=0, state_dir=state_dir)
