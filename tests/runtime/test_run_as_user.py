"""`Agent.run(user=...)` on the real process backend: root's change outside the persistent
directories lasts across a teardown and rebuild of the agent's sandbox; the default user
stays unprivileged."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tenon.predict.static import FixedPredictor
from tenon.runtime.controller import with_user
from tenon.runtime.open import open_runtime
from tenon.runtime.results import Outcome
from tenon.sandbox import launcher
from tenon.sandbox.base import ExecIO

pytestmark = [pytest.mark.sandbox, pytest.mark.cgroups]

STATE_DIR = Path("/var/lib/tenon")
MIB = 1024 * 1024


def test_with_user_sets_the_user_on_a_copy_or_a_new_io() -> None:
    assert with_user(None, None) is None
    assert with_user(None, "root") == ExecIO(user="root")
    io = ExecIO(cwd="/testbed")
    assert with_user(io, None) is io
    rooted = with_user(io, "root")
    assert rooted is not None
    assert (rooted.user, rooted.cwd, io.user) == ("root", "/testbed", None)


async def test_an_agent_runs_as_root_and_its_changes_survive_a_rebuild(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("real sandboxes need root")
    if problems := launcher.check():
        pytest.skip(problems[0])
    async with open_runtime(budget_bytes=1024 * MIB, backend="process", state_dir=STATE_DIR,
                            run_dir=tmp_path / "run",
                            predictor=FixedPredictor(32 * MIB, 64 * MIB)) as rt:
        agent = await rt.create_agent()
        try:
            done = await agent.run("echo 10.3.3.3 probe >> /etc/hosts && id -u", timeout=30,
                                   user="root")
            assert (done.outcome, done.output) == (Outcome.OK, "0\n")
            denied = await agent.run("touch /etc/x", timeout=30)
            assert denied.exit_code != 0
            assert await rt.teardown_now(agent.id) is None
            assert rt.residency_of(agent.id) == "torn_down"  # the next run rebuilds
            again = await agent.run("grep probe /etc/hosts; id -u", timeout=30)
            assert again.output == "10.3.3.3 probe\n1000\n"
        finally:
            await agent.close()
