"""Reconcile on the real host: what a dead controller left is removed, its agents restored."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tenon.host.domain import WorkloadDomain
from tenon.host.leftovers import domain_cgroups
from tenon.runtime.open import leftover_remover, open_runtime
from tenon.sandbox import launcher
from tenon.state.recovery import RecoveryStore
from tenon.state.statedir import StateDirBusy, domain_name
from tenon.state.workspace import WorkspaceStore

STATE_DIR = Path("/var/lib/tenon")
MIB = 1024 * 1024
IMAGE = "tenon-base:bookworm"


def _need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("cgroups and sandboxes need root")


def _wait_dead(proc: subprocess.Popen[bytes]) -> bool:
    deadline = time.monotonic() + 10
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc.poll() is not None


def leave_a_dead_controllers_state(run_dir: Path) -> tuple[str, subprocess.Popen[bytes]]:
    """What a SIGKILLed controller leaves: its domain with a sandbox cgroup still running a
    process, a committed (torn-down) agent, and a workspace whose agent never got a record."""
    name = domain_name(run_dir, f"tenon-rt-{uuid.uuid4().hex[:8]}")
    domain = WorkloadDomain.open(name, budget_bytes=1024 * MIB)
    ghost = domain.sandbox("ghost-g1-0badf00d")
    proc = subprocess.Popen(["sleep", "600"])
    ghost.add_pid(proc.pid)
    workspaces = WorkspaceStore(run_dir)
    for agent_id in ("kept", "orphan"):
        workspaces.create(agent_id)
        (workspaces.path_for(agent_id) / "workspace" / "result.txt").write_text(agent_id * 100)
    store = RecoveryStore(run_dir / "recovery.sqlite")
    store.register("kept", IMAGE, "process")
    store.note_action_start("kept", "kept-a0001", agent_meta={"workflow": "wf-kept"})
    store.note_action_done("kept", boundary="restartable", reason="restartable")
    manifest = workspaces.capture("kept")
    store.commit_teardown("kept", 1, manifest.digest, IMAGE, "process", manifest=manifest)
    store.close()
    return name, proc


@pytest.mark.cgroups
@pytest.mark.sandbox
@pytest.mark.slow
async def test_start_removes_leftovers_and_restores_committed_agents(tmp_path: Path) -> None:
    _need_root()
    if problems := launcher.check():
        pytest.skip(problems[0])
    if not (STATE_DIR / "images").exists():
        pytest.skip("needs the base image (tenon image build)")
    name, leftover = leave_a_dead_controllers_state(tmp_path)
    try:
        async with open_runtime(budget_bytes=1024 * MIB, state_dir=STATE_DIR,
                                run_dir=tmp_path, keep_events=True) as rt:
            report = rt.last_reconcile
            assert report is not None
            assert report.removed_sandboxes == ("cgroup:ghost-g1-0badf00d",)
            assert _wait_dead(leftover)  # killed with its cgroup
            assert report.removed_workspaces == ("orphan",)
            assert not (tmp_path / "workspaces" / "orphan").exists()
            assert report.restored == ("kept",)
            agent = rt.recovered["kept"]
            assert agent.workflow == "wf-kept"
            assert agent.num_actions_done == 1
            with pytest.raises(StateDirBusy):  # a second controller on the same directory
                async with open_runtime(budget_bytes=1024 * MIB, state_dir=STATE_DIR,
                                        run_dir=tmp_path):
                    pass
            result = await agent.run("cat /workspace/result.txt", timeout=60)
            assert result.ok, result.output
            assert result.output == "kept" * 100  # rebuilt from the committed root
            assert result.action_id == "kept-a0002"
    finally:
        leftover.kill()
        leftover.wait()
    assert domain_cgroups(name) == []  # a clean exit removes the domain


@pytest.mark.cgroups
@pytest.mark.docker
@pytest.mark.slow
def test_leftover_containers_of_the_domain_are_removed(tmp_path: Path) -> None:
    _need_root()
    from tenon.sandbox.docker import DOMAIN_LABEL, SANDBOX_LABEL, DockerBackend
    from tenon.sandbox.dockerd import connect

    name = f"tenon-rt-{uuid.uuid4().hex[:8]}"
    client = connect()
    mine = client.containers.create(IMAGE, ["sleep", "600"], labels={
        DOMAIN_LABEL: name, SANDBOX_LABEL: "ghost-g1-0badf00d"})
    peer = client.containers.create(IMAGE, ["sleep", "600"], labels={
        DOMAIN_LABEL: name, SANDBOX_LABEL: "peer-g2-0badf00d"})
    other = client.containers.create(IMAGE, ["sleep", "600"], labels={
        DOMAIN_LABEL: f"{name}-other", SANDBOX_LABEL: "ghost-g1-0badf00d"})
    domain = WorkloadDomain.open(name, budget_bytes=None)
    backend = DockerBackend(domain, client)
    try:
        # one agent's sandboxes only (`tenon agents rm`): its peer's container stays
        assert backend.remove_leftovers("ghost-g") == [f"container:{mine.id[:12]}"]
        peer.reload()
        # a restart: every container of the domain goes
        assert leftover_remover(domain, backend) == [f"container:{peer.id[:12]}"]
        left = client.containers.list(all=True, filters={"label": f"{DOMAIN_LABEL}={name}"})
        assert left == []
        other.reload()  # another domain's container is not this controller's to remove
    finally:
        for container in (mine, peer, other):
            with contextlib.suppress(Exception):  # `mine` is expected to be gone already
                container.remove(force=True)
        domain.remove()
        client.close()
