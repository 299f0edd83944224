"""The workload domain against the real kernel (cgroup v1 here, v2 where the host has it)."""

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tenon.errors import CgroupUnavailable, ConfigError, HostError
from tenon.host.domain import WorkloadDomain
from tenon.host.layout import detect_layout
from tenon.host.types import CgroupVersion
from tenon.units import MIB

pytestmark = pytest.mark.cgroups
CGROUP_ROOT = Path("/sys/fs/cgroup")


def real_layout_or_skip():
    if os.geteuid() != 0:
        pytest.skip("real cgroup tests need root")
    try:
        return detect_layout(CGROUP_ROOT)
    except CgroupUnavailable as exc:
        pytest.skip(f"no usable cgroup memory controller: {exc}")


def leftovers(name: str) -> list[Path]:
    return sorted(CGROUP_ROOT.glob(f"*/{name}")) + sorted(CGROUP_ROOT.glob(name))


@pytest.fixture
def domain():
    real_layout_or_skip()
    d = WorkloadDomain.open(f"tenon-test-{uuid.uuid4().hex[:8]}", budget_bytes=64 * MIB)
    yield d
    d.remove()
    assert leftovers(d.name) == [], "cgroups left behind"


def start_in(cgroup, code: str) -> subprocess.Popen:
    """Start python3 -c CODE with its pid already in every controller of `cgroup`."""
    files = " ".join(str(f) for f in cgroup.procs_files())
    script = f'for f in {files}; do echo $$ > "$f"; done; exec "$0" -c "$1"'
    proc = subprocess.Popen(["sh", "-c", script, sys.executable, code],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while not all(str(proc.pid) in f.read_text().split() for f in cgroup.procs_files()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.communicate()
            raise AssertionError(f"pid {proc.pid} never joined {cgroup.procs_files()}")
        time.sleep(0.005)
    return proc


GROW = """
import time
blocks = []
while True:  # about 10 MiB every 50 ms, every page touched
    blocks.append(bytearray(10 * 1024 * 1024))
    for i in range(0, len(blocks[-1]), 4096):
        blocks[-1][i] = 1
    time.sleep(0.05)
"""


def wait_for_usage(cgroup, min_bytes, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while cgroup.reading().usage_bytes < min_bytes:
        assert time.monotonic() < deadline, f"usage never reached {min_bytes} bytes"
        time.sleep(0.02)


def test_exhausting_the_budget_is_oom_killed_and_attributed(domain):
    idle = domain.sandbox("idle")
    greedy = domain.sandbox("greedy")
    sleeper = start_in(idle, "import time; time.sleep(60)")
    hog = start_in(greedy, "b = bytearray(256 * 1024 * 1024)\n"
                           "for i in range(0, len(b), 4096): b[i] = 1")
    try:
        hog.communicate(timeout=60)
        assert hog.returncode == -9
        events = domain.poll_oom()
        assert [(e.sandbox_id, e.num_kills >= 1) for e in events] == [("greedy", True)]
        assert domain.poll_oom() == []  # counted once
        assert domain.num_oom_kills() >= 1
        assert greedy.reading().num_oom_kills >= 1
        assert idle.reading().num_oom_kills == 0
        assert sleeper.poll() is None  # the idle sandbox was not the victim
        assert domain.reading().peak_bytes <= 64 * MIB
    finally:
        sleeper.kill()
        sleeper.communicate()


def test_frozen_sandbox_stops_growing_and_resumes_when_thawed(domain):
    domain.set_budget(None)
    box = domain.sandbox("grower")
    proc = start_in(box, GROW)
    try:
        wait_for_usage(box, 30 * MIB)
        first = box.freeze()
        assert (first.frozen, first.changed) == (True, True)
        assert 0 < first.elapsed_s < 5
        assert box.is_frozen()
        again = box.freeze()
        assert (again.frozen, again.changed) == (True, False)
        frozen_at = box.reading().usage_bytes
        time.sleep(0.5)
        assert box.reading().usage_bytes - frozen_at < 1 * MIB
        thawed = box.thaw()
        assert (thawed.frozen, thawed.changed) == (False, True)
        assert not box.thaw().changed
        time.sleep(0.5)
        assert box.reading().usage_bytes - frozen_at > 30 * MIB
    finally:
        box.kill_all()
        proc.communicate()


def test_readings_grow_for_a_busy_process(domain):
    domain.set_budget(None)
    box = domain.sandbox("busy")
    before = box.reading()
    proc = start_in(box, "import time\nb = bytearray(40 * 1024 * 1024)\n"
                         "for i in range(0, len(b), 4096): b[i] = 1\n"
                         "t = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
                         "print('ok', flush=True)\ntime.sleep(30)")
    try:
        assert proc.stdout.readline().strip() == b"ok"
        after = box.reading()
        assert after.usage_bytes - before.usage_bytes > 30 * MIB
        assert after.peak_bytes >= after.usage_bytes
        assert after.cpu_usage_s - before.cpu_usage_s > 0.2
        usage, cpu_s = box.sample()  # the execution loop's cheap read agrees
        assert abs(usage - after.usage_bytes) < 4 * MIB
        assert abs(cpu_s - after.cpu_usage_s) < 0.1
        assert box.pids() == [proc.pid]
    finally:
        box.remove()
        proc.communicate()


FORK_LOOP = """
import os, time
made = 0
for _ in range(60):
    try:
        if os.fork() == 0:
            time.sleep(5)
            os._exit(0)
        made += 1
    except OSError:
        break
print(made, flush=True)
time.sleep(5)
"""


def test_reset_peak_restarts_the_high_water_mark(domain):
    domain.set_budget(None)
    box = domain.sandbox("peaky")
    proc = start_in(box, "import time\nb = bytearray(48 * 1024 * 1024)\n"
                         "for i in range(0, len(b), 4096): b[i] = 1\n"
                         "del b\nprint('freed', flush=True)\ntime.sleep(30)")
    try:
        assert proc.stdout.readline().strip() == b"freed"
        before = box.reading()
        assert before.peak_bytes - before.usage_bytes > 40 * MIB
        assert box.reset_peak() is True  # v1: max_usage_in_bytes; v2: memory.peak per fd
        after = box.reading()
        assert after.peak_bytes - after.usage_bytes < 4 * MIB
    finally:
        box.kill_all()
        proc.communicate()


def test_pids_limit_is_enforced(domain):
    box = domain.sandbox("forker")
    box.set_max_pids(20)
    proc = start_in(box, FORK_LOOP)
    try:
        made = int(proc.stdout.readline())
        assert made == 19  # the parent holds the 20th slot
        assert len(box.pids()) <= 20
    finally:
        box.kill_all()
        proc.communicate()


def test_cpu_quota_memory_high_and_pressure(domain):
    box = domain.sandbox("limits")
    box.set_cpu_quota(0.5)
    box.set_cpu_quota(None)
    if domain.version is CgroupVersion.V1:
        quota = box.dirs["cpu"] / "cpu.cfs_quota_us"
        box.set_cpu_quota(0.5)
        assert int(quota.read_text()) == 50_000
        box.set_cpu_quota(None)
        assert int(quota.read_text()) == -1
        with pytest.raises(CgroupUnavailable, match="v2"):
            box.set_memory_high(10 * MIB)
        assert box.pressure() is None
    else:
        box.set_memory_high(10 * MIB)
        assert box.pressure() is not None


def test_create_adopt_and_remove_leave_nothing_behind():
    layout = real_layout_or_skip()
    name = f"tenon-test-{uuid.uuid4().hex[:8]}"
    domain = WorkloadDomain.open(name, budget_bytes=128 * MIB)
    try:
        assert leftovers(name)
        adopted_again = WorkloadDomain.open(name, budget_bytes=32 * MIB)
        assert adopted_again.reading().limit_bytes == 32 * MIB
        domain.sandbox("a")
        # a cgroup someone else made, as Docker does for --cgroup-parent=/<domain>
        made = [m / name / "ctr-1" for m in set(layout.mounts.values())] \
            if layout.version is CgroupVersion.V1 else [layout.root / name / "ctr-1"]
        for d in made:
            d.mkdir()
        box = domain.adopt("agent-1", "ctr-1")
        assert sorted(domain.sandbox_ids()) == ["a", "agent-1"]
        proc = start_in(box, "import time; time.sleep(60)")
        (made[0] / "nested").mkdir()  # a stray grandchild in one hierarchy
        domain.remove()
        proc.communicate(timeout=10)
        assert proc.returncode == -9
    finally:
        domain.remove()
        domain.remove()  # idempotent
    assert leftovers(name) == []


def test_negative_budget_is_rejected():
    with pytest.raises(ConfigError, match="negative"):
        WorkloadDomain.open("tenon-test-neg", budget_bytes=-1)
    assert leftovers("tenon-test-neg") == []


def remove_behind_its_back(box) -> None:
    """rmdir every directory of `box`, as Docker removes a container's cgroup."""
    box.kill_all()
    for directory in sorted(set(box.dirs.values()), reverse=True):
        directory.rmdir()


def test_sample_reopens_a_cgroup_removed_and_made_again_behind_its_back(domain):
    domain.set_budget(None)
    box = domain.sandbox("again")
    box.sample()  # its files are open now
    remove_behind_its_back(box)
    for directory in sorted(set(box.dirs.values())):
        directory.mkdir()
    proc = start_in(box, "b = bytearray(20 * 1024 * 1024)\n"
                         "for i in range(0, len(b), 4096): b[i] = 1\n"
                         "print('ok', flush=True)\nimport time; time.sleep(60)")
    try:
        assert proc.stdout.readline().strip() == b"ok"
        usage, _ = box.sample()  # the kept descriptors fail (ENODEV): opened afresh
        assert usage > 15 * MIB
        assert abs(usage - box.reading().usage_bytes) < 4 * MIB
    finally:
        remove_behind_its_back(box)
        proc.communicate()
    with pytest.raises(HostError, match="cannot sample cgroup of again"):
        box.sample()


def cgroup_files_open(domain_name: str) -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor listdir itself used, closed by now
            continue
        if target.startswith(str(CGROUP_ROOT)) and f"/{domain_name}/" in target:
            found.append(target)
    return sorted(found)


def test_removing_the_domain_closes_every_sampled_file(domain):
    boxes = [domain.sandbox(f"s{i}") for i in range(3)]
    for box in boxes:
        box.sample()
    assert {Path(f).parent.name for f in cgroup_files_open(domain.name)} == {"s0", "s1", "s2"}
    boxes[0].remove()
    assert {Path(f).parent.name for f in cgroup_files_open(domain.name)} == {"s1", "s2"}
    domain.remove()
    assert cgroup_files_open(domain.name) == []
