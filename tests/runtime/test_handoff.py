"""Agents moving between two runtimes (two nodes' state directories under one directory) on
real process sandboxes with image-backed roots: release and adoption of a torn-down agent,
the refusals, and the take-over of a SIGKILLed runtime's state directory."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tenon.errors import WorkspaceError
from tenon.host import diskfs
from tenon.host.domain import WorkloadDomain
from tenon.host.leftovers import domain_cgroups, mounts_under
from tenon.runtime.controller import Runtime
from tenon.runtime.handoff import Handoff, adopt_agent, forget_agent, release_agent, take_over
from tenon.runtime.open import open_runtime
from tenon.runtime.results import AgentClosed
from tenon.sandbox import launcher
from tenon.sandbox.uids import shared_allocator, shared_range_allocator
from tenon.state.recovery import RecoveryRecord, RecoveryStore
from tenon.state.statedir import StateDirBusy
from tenon.state.workspace import WorkspaceStore

pytestmark = [pytest.mark.sandbox, pytest.mark.cgroups, pytest.mark.disk, pytest.mark.slow]

STATE_DIR = Path("/var/lib/tenon")
GIB = 1024 ** 3


def _need_real() -> None:
    if os.geteuid() != 0:
        pytest.skip("real sandboxes need root")
    if problems := launcher.check():
        pytest.skip(problems[0])
    if not (STATE_DIR / "images").exists():
        pytest.skip("needs the base image (tenon image build)")
    if problems := diskfs.check():
        pytest.skip("; ".join(problems))


def node(base: Path, name: str) -> contextlib.AbstractAsyncContextManager[Runtime]:
    return open_runtime(budget_bytes=GIB, backend="process", state_dir=STATE_DIR,
                        run_dir=base / name, keep_events=True)


def assert_nothing_left(base: Path, domains: list[str]) -> None:
    """No cgroup of the nodes' domains, no mount or loop device under `base`, no uid lease
    of this process."""
    for name in domains:
        assert domain_cgroups(name) == []
    assert mounts_under(base) == []
    deadline = time.monotonic() + 10.0  # the kernel's autoclear may lag the last unmount
    while (any(base in f.parents for f in diskfs.loop_devices().values())
           and time.monotonic() < deadline):
        time.sleep(0.05)
    assert not any(base in f.parents for f in diskfs.loop_devices().values())
    assert shared_allocator().held() == []
    assert shared_range_allocator().held() == []


def domain_of(run_dir: Path) -> str:
    return (run_dir / "domain").read_text().strip()


@pytest.fixture
async def two_nodes(tmp_path: Path) -> AsyncIterator[tuple[Runtime, Runtime]]:
    _need_real()
    async with node(tmp_path, "node-a") as a, node(tmp_path, "node-b") as b:
        yield a, b
    assert_nothing_left(tmp_path, [domain_of(tmp_path / "node-a"),
                                   domain_of(tmp_path / "node-b")])


async def test_a_released_agent_continues_on_the_adopting_runtime_with_its_files(two_nodes):
    a, b = two_nodes
    agent = await a.create_agent(workflow="wf-move")
    made = await agent.run("echo made-on-a > /workspace/out.txt && echo at-home > $HOME/note",
                           timeout=60)
    assert made.ok, made.output
    assert (await agent.run("true", timeout=60)).ok
    assert await a.teardown_now(agent.id) is None

    handoff = await release_agent(a, agent.id)
    assert isinstance(handoff, Handoff)
    assert pickle.loads(pickle.dumps(handoff)) == handoff
    assert (handoff.workflow, handoff.num_actions) == ("wf-move", 2)
    assert agent.id not in a.agents
    assert a.events.of_kind("workflow_end") == []
    assert not a.workspaces.is_mounted(agent.id)
    assert a.workspaces.image_for(agent.id).is_file()  # kept until adopted
    with pytest.raises(AgentClosed):
        await agent.run("true", timeout=5)
    with pytest.raises(WorkspaceError, match="still in"):  # not adopted yet: keep the record
        forget_agent(a, agent.id)

    moved = await adopt_agent(b, handoff)
    assert (moved.num_actions_done, moved.workflow) == (2, "wf-move")
    assert b.workspaces.image_for(agent.id).is_file()
    assert not a.workspaces.image_for(agent.id).exists()
    assert not a.workspaces.path_for(agent.id).exists()
    assert b.residency_of(agent.id) == "torn_down"
    assert [e["agent_id"] for e in b.events.of_kind("agent_adopted")] == [agent.id]
    assert (await adopt_agent(b, handoff)).id == agent.id  # again: nothing left to move

    seen = await moved.run("cat /workspace/out.txt $HOME/note", timeout=60)
    assert seen.ok, seen.output
    assert seen.output == "made-on-a\nat-home\n"
    assert seen.action_id == f"{agent.id}-a0003"
    assert moved.num_actions_done == 3

    assert a._recovery.get(agent.id) is not None  # until the adopter has it
    forget_agent(a, agent.id)
    assert a._recovery.get(agent.id) is None
    forget_agent(a, agent.id)


async def test_release_tears_a_resident_restartable_agent_down_itself(two_nodes):
    a, b = two_nodes
    agent = await a.create_agent()
    assert (await agent.run("echo warm > /workspace/f", timeout=60)).ok
    assert a.residency_of(agent.id) == "resident"
    handoff = await release_agent(a, agent.id)
    assert isinstance(handoff, Handoff), handoff
    assert [e["agent_id"] for e in a.events.of_kind("teardown")] == [agent.id]
    assert a.residency.sandbox_for(agent.id) is None
    # an adoption cut short after the record and the root moved: adopting again finishes it
    b._recovery.import_record(RecoveryRecord.from_dict(handoff.record))
    source = WorkspaceStore(handoff.source_state_dir, limits=b.workspaces.limits)
    b.workspaces.move_in(agent.id, source)
    moved = await adopt_agent(b, handoff)
    assert moved.num_actions_done == 1
    seen = await moved.run("cat /workspace/f", timeout=60)
    assert seen.output == "warm\n"
    forget_agent(a, agent.id)


async def test_an_agent_that_never_ran_is_released_with_an_empty_root(two_nodes):
    a, b = two_nodes
    agent = await a.create_agent(workflow="wf-new")
    handoff = await release_agent(a, agent.id)
    assert isinstance(handoff, Handoff), handoff
    assert (handoff.num_actions, handoff.record["generation"]) == (0, 0)
    moved = await adopt_agent(b, handoff)
    assert b.residency_of(agent.id) == "new"
    first = await moved.run("ls -A /workspace; echo first", timeout=60)
    assert first.output == "first\n"
    assert first.action_id == f"{agent.id}-a0001"
    forget_agent(a, agent.id)


async def test_release_refuses_busy_resident_only_and_unknown_agents_changing_nothing(
        two_nodes):
    a, _ = two_nodes
    busy = await a.create_agent()
    kept = await a.create_agent()
    assert (await kept.run("sleep 300 >/dev/null 2>&1 &", timeout=60)).ok
    assert a.residency_of(kept.id) == "resident_only"
    ready = asyncio.Event()
    stop = a.events.subscribe(
        lambda e: ready.set() if e["kind"] == "action_start" and e["agent_id"] == busy.id
        else None)
    running = asyncio.ensure_future(busy.run("sleep 3", timeout=60))
    await ready.wait()
    stop()
    assert a.residency_of(busy.id) == "busy"

    why = await release_agent(a, busy.id)
    assert isinstance(why, str)
    assert why.startswith("busy")
    why = await release_agent(a, kept.id)
    assert isinstance(why, str)
    assert why.startswith("resident-only")
    assert (await release_agent(a, "nobody")).startswith("unknown")  # type: ignore[union-attr]

    assert (await running).ok
    assert {busy.id, kept.id} <= set(a.agents)
    assert a.residency_of(kept.id) == "resident_only"  # still live, and still runs
    assert (await kept.run("echo still", timeout=60)).output == "still\n"
    assert a.events.of_kind("agent_released") == []


# -- take-over of a dead runtime -----------------------------------------------------------------

CHILD = """
import asyncio, json, sys
from pathlib import Path
from tenon.runtime.open import open_runtime

async def main(run_dir: Path) -> None:
    async with open_runtime(budget_bytes=1 << 30, backend="process",
                            state_dir=Path("/var/lib/tenon"), run_dir=run_dir) as rt:
        states = {}
        for agent_id, command in (("idle", "echo idle > /workspace/f; echo h > $HOME/h"),
                                  ("warm", "echo warm > /workspace/f; echo h > $HOME/h"),
                                  ("held", "echo held > /workspace/f; "
                                           "sleep 300 >/dev/null 2>&1 &")):
            agent = await rt.create_agent(agent_id=agent_id, workflow=f"wf-{agent_id}")
            result = await agent.run(command, timeout=60)
            assert result.ok, result.output
        assert await rt.teardown_now("idle") is None
        states = {a: rt.residency_of(a) for a in ("idle", "warm", "held")}
        (run_dir / "ready.tmp").write_text(json.dumps(states))
        (run_dir / "ready.tmp").rename(run_dir / "ready")
        await asyncio.sleep(600)

asyncio.run(main(Path(sys.argv[1])))
"""


def start_child_controller(run_dir: Path, log: Path) -> subprocess.Popen[bytes]:
    """A controller in a child process over `run_dir`, once its three agents are in place."""
    run_dir.mkdir(parents=True)
    with log.open("wb") as out:
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(run_dir)], stdout=out,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (run_dir / "ready").exists():
        assert child.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    return child


def clean_up_after(child: subprocess.Popen[bytes], domain: str, base: Path) -> None:
    """What a failed take-over test may leave: the child, its domain, mounts."""
    if child.poll() is None:
        child.kill()
        child.wait()
    if domain_cgroups(domain):  # the take-over did not get that far
        WorkloadDomain.open(domain).remove()
    for point in reversed(mounts_under(base)):
        subprocess.run(["umount", "--lazy", point], check=False)


async def test_take_over_adopts_what_a_killed_runtime_committed_and_fails_the_rest(tmp_path):
    _need_real()
    dead_dir = tmp_path / "node-a"
    child = start_child_controller(dead_dir, tmp_path / "node-a.log")
    dead_domain = domain_of(dead_dir)
    try:
        assert json.loads((dead_dir / "ready").read_text()) == {
            "idle": "torn_down", "warm": "resident", "held": "resident_only"}
        async with node(tmp_path, "node-b") as b:
            with pytest.raises(StateDirBusy):  # its controller still lives
                await take_over(b, dead_dir)
            assert domain_cgroups(dead_domain) != []
            os.kill(child.pid, signal.SIGKILL)
            child.wait()

            taken = await take_over(b, dead_dir)
            assert sorted(taken.adopted) == ["idle", "warm"]
            assert list(taken.failed) == ["held"]
            assert "resident-only" in taken.failed["held"]
            assert taken.interrupted == {}
            assert domain_cgroups(dead_domain) == []
            assert mounts_under(dead_dir) == []
            for agent_id, agent in taken.adopted.items():
                assert agent.workflow == f"wf-{agent_id}"
                assert agent.num_actions_done == 1
                seen = await agent.run("cat /workspace/f $HOME/h", timeout=60)
                assert seen.ok, seen.output
                assert seen.output == f"{agent_id}\nh\n"
            dead = RecoveryStore(dead_dir / "recovery.sqlite")
            try:  # the blocked one stays where it was, with its reason
                assert [(r.agent_id, r.state) for r in dead.all()] == [("held", "blocked")]
            finally:
                dead.close()
            assert not (dead_dir / "workspaces" / "idle").exists()
            assert (dead_dir / "workspaces" / ".images" / "held.ext4").is_file()
    finally:
        clean_up_after(child, dead_domain, tmp_path)
    assert_nothing_left(tmp_path, [dead_domain, domain_of(tmp_path / "node-b")])
