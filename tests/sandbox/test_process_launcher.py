"""The launcher's lifetime rules on the real kernel: a sandbox dies with the controller that
started it, and leaves nothing running."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tenon.host import procs
from tenon.host.domain import WorkloadDomain
from tenon.sandbox import launcher

pytestmark = [pytest.mark.sandbox, pytest.mark.cgroups]

STATE_DIR = Path("/var/lib/tenon")
_CONTROLLER = """
import asyncio, sys
from pathlib import Path
from tenon.host.domain import WorkloadDomain
from tenon.sandbox.base import SandboxSpec
from tenon.sandbox.process import ProcessBackend

async def main() -> None:
    backend = ProcessBackend(WorkloadDomain.open(sys.argv[1]))
    sandbox = await backend.materialize(SandboxSpec(
        sandbox_id="orphan", image="tenon-base:bookworm", workspace=Path(sys.argv[2])))
    await sandbox.exec("setsid sleep 300 & sleep 301 &", timeout_s=10)
    print(sandbox.child_pid, *sorted(sandbox.cgroup.pids()), flush=True)
    await asyncio.sleep(300)

asyncio.run(main())
"""


def test_a_sandbox_dies_with_its_controller(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the process backend needs root")
    if problems := launcher.check():
        pytest.skip(problems[0])
    name = f"tenon-test-{uuid.uuid4().hex[:8]}"
    root = STATE_DIR / f"test-root-{uuid.uuid4().hex[:8]}"
    root.mkdir(mode=0o700)
    with subprocess.Popen([sys.executable, "-c", _CONTROLLER, name, str(root)],
                          stdout=subprocess.PIPE, text=True) as controller:
        try:
            assert controller.stdout is not None
            pids = [int(p) for p in controller.stdout.readline().split()]
            pid1, inside = pids[0], pids[1:]
            assert len(inside) >= 4  # the launcher, its pid 1, two sleeps
            assert procs.is_alive(pid1)
            os.kill(controller.pid, signal.SIGKILL)  # no destroy, no cleanup: a crash
            controller.wait()
            deadline = time.monotonic() + 5
            while any(map(procs.is_alive, inside)) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert not any(map(procs.is_alive, inside))
        finally:
            if controller.poll() is None:
                controller.kill()
            WorkloadDomain.open(name).remove()
            shutil.rmtree(root)
