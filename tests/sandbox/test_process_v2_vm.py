"""The process backend (tenon-launch) on a pure cgroup v2 hierarchy, in the test VM: sandboxes
in a domain run, are measured, held and let go through their meter, die of an OOM kill
attributed to them, stay out of the host's cgroup tree and of each other's files, and leave
nothing behind."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_process_backend import backend, base_image, make_spec, run  # noqa: F401 - fixtures

from tenon.errors import SandboxFrozen
from tenon.host.domain import WorkloadDomain
from tenon.host.procs import is_alive
from tenon.host.types import CgroupVersion
from tenon.units import MIB

pytestmark = pytest.mark.vm

CGROUP_ROOT = Path("/sys/fs/cgroup")
BUDGET_BYTES = 192 * MIB
HOLD_40_MIB = ("python3 -c \"import sys, time\nb = bytearray(40 * 1024 * 1024)\n"
               "for i in range(0, len(b), 4096): b[i] = 1\nprint('held', flush=True)\n"
               "time.sleep(4)\"")


@pytest.fixture
def domain(base_image) -> Iterator[WorkloadDomain]:  # noqa: F811 - the imported fixture
    d = WorkloadDomain.open(f"tenon-v2-{uuid.uuid4().hex[:8]}", budget_bytes=BUDGET_BYTES)
    if d.version is not CgroupVersion.V2:
        d.remove()
        pytest.skip("needs a pure cgroup v2 hierarchy")
    yield d
    d.remove()
    assert not (CGROUP_ROOT / d.name).exists(), "the domain's cgroup was left behind"


@pytest.fixture
async def make(backend, tmp_path):  # noqa: F811 - the imported fixture
    live = []

    async def materialize(name: str, **overrides):
        workspace = tmp_path / name
        workspace.mkdir()
        sandbox = await backend.materialize(make_spec(workspace, **overrides))
        live.append(sandbox)
        return sandbox

    yield materialize
    for sandbox in live:
        await sandbox.destroy()


async def test_sandboxes_live_in_their_own_v2_cgroups_and_are_measured(domain, make):
    first, second = await make("a"), await make("b")
    for sandbox in (first, second):
        directory = CGROUP_ROOT / domain.name / sandbox.spec.sandbox_id
        assert set(sandbox.cgroup.dirs.values()) == {directory}
        assert sandbox.child_pid in sandbox.cgroup.pids()
        assert (directory / "pids.max").read_text().strip() == "128"
    assert set(first.cgroup.pids()).isdisjoint(second.cgroup.pids())
    assert sorted(domain.sandbox_ids()) == sorted([first.spec.sandbox_id,
                                                   second.spec.sandbox_id])

    idle = first.cgroup.reading()
    assert first.cgroup.reset_peak() is True
    action = asyncio.ensure_future(run(first, HOLD_40_MIB, timeout_s=60))
    deadline = time.monotonic() + 30
    while first.cgroup.reading().usage_bytes - idle.usage_bytes < 35 * MIB:
        assert not action.done(), (await action).output
        assert time.monotonic() < deadline, "the action's memory never showed in its cgroup"
        await asyncio.sleep(0.05)
    assert second.cgroup.reading().usage_bytes < idle.usage_bytes + 20 * MIB  # not charged
    result = await action
    assert (result.exit_code, result.output.strip()) == (0, "held")
    after = first.cgroup.reading()
    assert after.usage_bytes - idle.usage_bytes < 20 * MIB  # released with the action
    assert after.peak_bytes - idle.usage_bytes > 35 * MIB  # but the mark remembers it
    assert after.cpu_usage_s > idle.cpu_usage_s
    assert domain.reading().usage_bytes >= after.usage_bytes


async def test_the_meter_holds_a_running_action_and_the_hold_is_not_its_time(make):
    sandbox = await make("held")
    meter = sandbox.cgroup
    # its running time stays under its timeout only if the hold is not counted
    action = asyncio.ensure_future(run(sandbox, "sleep 1; echo done", timeout_s=6.0))
    deadline = time.monotonic() + 20
    while "sleep 1" not in [p.command for p in sandbox.processes()]:
        assert not action.done(), (await action).output
        assert time.monotonic() < deadline, "the action never started"
        await asyncio.sleep(0.05)
    assert meter.freeze().changed
    assert meter.is_frozen()
    assert (meter.dirs["memory"] / "cgroup.freeze").read_text().strip() == "1"
    with pytest.raises(SandboxFrozen):
        await run(sandbox, "true")
    frozen_cpu = meter.reading().cpu_usage_s
    await asyncio.sleep(7.0)  # longer than the action's whole timeout
    assert meter.reading().cpu_usage_s - frozen_cpu < 0.02
    assert not action.done()
    assert meter.thaw().changed
    assert not meter.is_frozen()
    result = await action
    assert (result.exit_code, result.timed_out, result.output.strip()) == (0, False, "done"), \
        result
    assert result.duration_s > 7.0  # the hold is in its wall time, not against its timeout
    assert meter.held_s() >= 7.0


async def test_an_oom_kill_in_a_sandbox_is_attributed_to_it_and_the_sandbox_survives(domain,
                                                                                     make):
    victim, neighbour = await make("victim"), await make("neighbour")
    domain.poll_oom()  # the baseline
    victim.cgroup.new_oom_kills()
    result = await run(victim, "python3 -c \"b = bytearray(256 * 1024 * 1024)\n"
                               "for i in range(0, len(b), 4096): b[i] = 1\"", timeout_s=120)
    assert (result.exit_code, result.output.strip()) == (137, "Killed")  # sh saw SIGKILL
    assert victim.cgroup.new_oom_kills() >= 1
    assert neighbour.cgroup.new_oom_kills() == 0
    assert domain.num_oom_kills() >= 1
    # only the largest process died (no memory.oom.group): the sandbox serves the next action
    after = await run(victim, "echo alive")
    assert after.output.strip() == "alive"
    assert (await run(neighbour, "echo alive")).output.strip() == "alive"


async def test_a_sandbox_cannot_see_or_write_the_host_cgroup_tree(domain, make):
    sandbox = await make("confined")
    result = await run(
        sandbox,
        "cat /proc/self/cgroup; ls /sys/fs/cgroup 2>&1 | head -3; "
        f"ls /sys/fs/cgroup/{domain.name} >/dev/null 2>&1 && echo SEES_DOMAIN; "
        "echo 1 > /sys/fs/cgroup/cgroup.kill 2>/dev/null && echo WROTE_KILL; "
        "echo max > /sys/fs/cgroup/memory.max 2>/dev/null && echo WROTE_MAX; "
        "mkdir -p /tmp/cg && mount -t cgroup2 none /tmp/cg 2>/dev/null && echo MOUNTED; "
        "echo $$ > /sys/fs/cgroup/cgroup.procs 2>/dev/null && echo MOVED; true",
    )
    lines = result.output.splitlines()
    assert lines[0] == "0::/"  # its own cgroup namespace: the host's path stays hidden
    assert domain.name not in result.output
    for escape in ("SEES_DOMAIN", "WROTE_KILL", "WROTE_MAX", "MOUNTED", "MOVED"):
        assert escape not in result.output
    assert (CGROUP_ROOT / domain.name / "memory.max").read_text().strip() == str(BUDGET_BYTES)
    assert sandbox.cgroup.pids()  # still alive and in its cgroup


async def test_a_sandbox_cannot_reach_another_sandboxs_files(make):
    owner, other = await make("owner"), await make("other")
    marker = f"tenon-marker-{uuid.uuid4().hex[:8]}"
    await run(owner, f"echo secret > /workspace/{marker}; echo secret > /tmp/{marker}")
    assert (owner.spec.workspace / "workspace" / marker).read_text() == "secret\n"
    host_path = owner.spec.workspace / "workspace" / marker
    result = await run(
        other,
        f"cat {host_path} /workspace/{marker} /tmp/{marker} 2>/dev/null; "
        f"find / -xdev -name '{marker}' 2>/dev/null; "
        f"for p in /proc/[0-9]*/root/workspace/{marker}; do cat $p 2>/dev/null; done; true",
    )
    assert "secret" not in result.output
    assert marker not in result.output


async def test_destroy_leaves_no_process_and_no_cgroup(domain, make):
    sandbox = await make("doomed")
    await run(sandbox, "sleep 300 & (setsid sleep 301 &) ; true")
    pids = sandbox.cgroup.pids()
    assert len(pids) >= 4  # the launcher, its pid 1 (the reaper), two leftovers
    directory = CGROUP_ROOT / domain.name / sandbox.spec.sandbox_id
    await sandbox.destroy()
    assert not directory.exists()
    assert sandbox.spec.sandbox_id not in domain.sandbox_ids()
    assert not any(is_alive(pid) for pid in pids)
