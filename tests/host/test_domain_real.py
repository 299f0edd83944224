"""The workload domain against the real kernel (cgroup v1 here, v2 where the host has it)."""

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tenon.errors import ConfigError
from tenon.host.domain import WorkloadDomain
from tenon.units import MIB

pytestmark = pytest.mark.cgroups


@pytest.fixture
def domain():
    if os.geteuid() != 0 or not Path("/sys/fs/cgroup").exists():
        pytest.skip("real cgroup tests need root and /sys/fs/cgroup")
    d = WorkloadDomain.open(f"tenon-test-{uuid.uuid4().hex[:8]}", budget_bytes=96 * MIB)
    yield d
    d.remove()
    leftovers = list(Path("/sys/fs/cgroup").glob(f"*/{d.name}"))
    assert leftovers == [], f"cgroups left behind: {leftovers}"


def start_in(cgroup, code: str) -> subprocess.Popen:
    """Start python3 -c CODE with its pid already in every controller of `cgroup`."""
    files = " ".join(str(f) for f in cgroup.procs_files())
    script = f'for f in {files}; do echo $$ > "$f"; done; exec "$0" -c "$1"'
    return subprocess.Popen(["sh", "-c", script, sys.executable, code],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)


GROW = """
import time
blocks = []
while True:
    blocks.append(bytearray(4 * 1024 * 1024))
    for i in range(0, len(blocks[-1]), 4096):
        blocks[-1][i] = 1
    time.sleep(0.02)
"""


def test_exhausting_the_budget_is_oom_killed_and_attributed(domain):
    idle = domain.sandbox("idle")
    greedy = domain.sandbox("greedy")
    sleeper = start_in(idle, "import time; time.sleep(30)")
    hog = start_in(greedy, "b = bytearray(512 * 1024 * 1024)\n"
                           "for i in range(0, len(b), 4096): b[i] = 1")
    try:
        hog.communicate(timeout=30)
        assert hog.returncode == -9
        events = domain.poll_oom()
        assert [(e.sandbox_id, e.num_kills >= 1) for e in events] == [("greedy", True)]
        assert domain.poll_oom() == []  # counted once
        assert sleeper.poll() is None  # the idle sandbox was not the victim
    finally:
        sleeper.kill()
        sleeper.communicate()


def test_frozen_sandbox_stops_growing_and_resumes_when_thawed(domain):
    domain.set_budget(None)
    box = domain.sandbox("grower")
    proc = start_in(box, GROW)
    try:
        time.sleep(0.3)
        first = box.freeze()
        assert first.frozen
        assert first.changed
        assert not box.freeze().changed  # idempotent
        frozen_at = box.reading().usage_bytes
        time.sleep(0.4)
        assert box.reading().usage_bytes - frozen_at < 2 * MIB
        assert box.thaw().changed
        time.sleep(0.4)
        assert box.reading().usage_bytes - frozen_at > 8 * MIB
    finally:
        box.kill_all()
        proc.communicate()


def test_readings_and_pids_limit(domain):
    box = domain.sandbox("busy")
    box.set_max_pids(8)
    before = box.reading()
    proc = start_in(box, "import os, time\nkids = 0\nfor _ in range(30):\n"
                         "    try:\n        os.fork() or time.sleep(5)\n        kids += 1\n"
                         "    except OSError:\n        break\nprint(kids, flush=True)\n"
                         "x = sum(range(3_000_000))")
    out = proc.stdout.readline().decode().strip()
    assert int(out) < 8
    proc.communicate(timeout=30)
    after = box.reading()
    assert after.cpu_usage_s > before.cpu_usage_s
    assert after.peak_bytes > 0


def test_negative_budget_is_rejected():
    with pytest.raises(ConfigError, match="negative"):
        WorkloadDomain.open("tenon-test-neg", budget_bytes=-1)
