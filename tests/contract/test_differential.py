"""Residency is invisible: the differential corpus on the process and Docker backends.

Each scripted run (`tenon.replay.differential_corpus`) runs twice through a
ResidencyManager on a real backend: resident throughout, and torn down at every boundary
the restart-safe check allows. Every action must give the same exit code, timed-out flag
and output; every boundary must be torn down except those resident-only by design (the
live server: "process"; the file in /dev/shm: "/dev/shm"), which must be kept with a
reason naming that cause.

How the suite was checked against the old /tmp hole: in a copy of the tree, the process
backend got its old behaviour back (bwrap mounted a fresh tmpfs at /tmp instead of binding
the agent's tmp/, HOME was /tmp in bwrap's and every action's environment, and
leftover_state kept accepting the /tmp mount, i.e. treated it as scratch), the Docker
backend likewise (a tmpfs at /tmp instead of the tmp/ volume, HOME=/tmp), and
`pytest tests/contract` ran with PYTHONPATH at the copy's src. On both backends
test_corpus_run_is_identical_resident_and_torn_down failed for git (step 1: `git commit`
exits 128 without the ~/.gitconfig identity), pip-user (step 2: `import tenonprobe` fails,
~/.local is gone), cache-tmp-shm (step 1: `cat ~/.cache/agent/value /tmp/draft.txt` exits
1) and failures (step 4: /tmp/after.txt is gone); and
test_random_operations_are_identical_resident_and_torn_down failed on its explicit
examples (a /tmp or ~ file written, then read or listed after a teardown) and, in two of
three runs without them, on a generated sequence. The hole was never committed.

How the writable-root runs (apt-root, pip-root, etc-root, testbed) were checked: in a git
worktree, the launcher's overlay took its upper and work directories from a tmpfs of the
sandbox's own instead of the persistent root's `upper/` and `work/` (built to another path
through the copy's `launcher.LAUNCHER`), and `docker_root.mount_root` likewise mounted a
tmpfs per sandbox for them; `pytest tests/contract -k "apt-root or pip-root or etc-root or
testbed"` with PYTHONPATH at the copy's src failed all 8 (4 runs x 2 backends), each on the
first step after a teardown: `tenon-hello` not found (exit 127), `import tenonprobe` failing,
the /etc/hosts line, user and whiteouts gone, /testbed missing.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tenon.replay.differential import differential, open_manager
from tenon.replay.differential_corpus import corpus
from tenon.sandbox import launcher
from tenon.sandbox.images import build_builtin

IMAGE = "tenon-base:bookworm"
STATE_DIR = Path("/var/lib/tenon")
SCRIPTS = {script.name: script for script in corpus()}

pytestmark = pytest.mark.slow

BACKENDS = [pytest.param("process", marks=pytest.mark.sandbox, id="process"),
            pytest.param("docker", marks=pytest.mark.docker, id="docker")]


def require_backend(backend: str) -> None:
    """Skip (a failure in CI) when `backend` cannot run; bring the base image up to date
    (a no-op when it was built from the current recipe)."""
    if os.geteuid() != 0:
        pytest.skip("real sandboxes need root (cgroups, namespaces)")
    if backend == "process" and (problems := launcher.check()):
        pytest.skip(problems[0])
    build_builtin(IMAGE, docker=backend == "docker")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(SCRIPTS))
async def test_corpus_run_is_identical_resident_and_torn_down(backend: str, name: str) -> None:
    require_backend(backend)
    script = SCRIPTS[name]
    async with open_manager(backend, state_dir=STATE_DIR) as manager:
        resident, torn_down, comparison = await differential(manager, script, image=IMAGE)
    assert comparison.ok, comparison.first_failure()
    assert comparison.divergences == ()
    # Designed: every boundary is torn down except the declared resident-only ones.
    designed = [step.resident_because is None for step in script.steps]
    torn = [step.boundary is not None and step.boundary.outcome == "torn_down"
            for step in torn_down.steps]
    assert torn == designed
    assert comparison.restartable_share == sum(designed) / len(designed)
    assert [s.output for s in resident.steps] == [s.output for s in torn_down.steps]
