"""The workspace escapes tried from Docker containers: fill the disk, read another agent's
workspace. The store and helpers are those of test_workspace_limits.py."""

from __future__ import annotations

import contextlib
import stat
import subprocess
import uuid

import pytest

from tenon.host import diskfs
from tenon.host.diskfs import DiskLimits
from tenon.state.workspace import WorkspaceStore
from tenon.units import MIB

pytestmark = [pytest.mark.docker, pytest.mark.disk]

IMAGE = "tenon-base:bookworm"
SMALL = DiskLimits(disk_bytes=64 * MIB, max_inodes=512)
OTHER_UID = 100001


@pytest.fixture
def backend(docker_backend):
    if problems := diskfs.check():
        pytest.skip("; ".join(problems))
    return docker_backend


@pytest.fixture
def store(tmp_path):
    store = WorkspaceStore(tmp_path, limits=SMALL)
    yield store
    with contextlib.suppress(Exception):
        store.reconcile(set())
    assert [m for m in diskfs.mounts() if tmp_path in m.mount_point.parents] == []


async def container_for(backend, store: WorkspaceStore, agent_id: str):
    from tenon.sandbox.base import SandboxSpec

    spec = SandboxSpec(sandbox_id=f"sb-{uuid.uuid4().hex[:8]}", image=IMAGE,
                       workspace=store.path_for(agent_id), tmp_size_bytes=64 * MIB)
    return await backend.materialize(spec)


def as_other_uid(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups", "--",
         *argv], capture_output=True, text=True, check=False)


async def test_container_filling_its_workspace_gets_enospc_and_nobody_else(backend, store):
    store.create("filler")
    neighbour = store.create("neighbour")
    sandbox = await container_for(backend, store, "filler")
    try:
        filled = await sandbox.exec(
            "dd if=/dev/zero of=/workspace/fill bs=1M count=200 conv=fsync 2>&1", timeout_s=60)
        reason = store.full_reason("filler")
    finally:
        await sandbox.destroy()
    assert filled.exit_code != 0
    assert "No space left on device" in filled.output
    assert reason is not None
    assert "disk limit reached" in reason
    assert store.image_for("filler").stat().st_blocks * 512 <= SMALL.disk_bytes
    assert store.full_reason("neighbour") is None
    (neighbour / "workspace" / "data").write_bytes(b"x" * (8 * MIB))
    store.delete("filler")
    store.delete("neighbour")


async def test_another_uid_cannot_read_a_container_workspace(backend, store):
    root = store.create("secretive")
    sandbox = await container_for(backend, store, "secretive")
    try:
        wrote = await sandbox.exec("echo API_KEY=hunter2 > /workspace/.env; cat .env",
                                   timeout_s=10)
    finally:
        await sandbox.destroy()
    assert wrote.output == "API_KEY=hunter2\n"
    assert root.stat().st_uid != OTHER_UID
    for argv in (["cat", str(root / "workspace" / ".env")], ["ls", str(root)]):
        tried = as_other_uid(*argv)
        assert tried.returncode != 0, argv
        assert "Permission denied" in tried.stderr
        assert "hunter2" not in tried.stdout
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    store.delete("secretive")
