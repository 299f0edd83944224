"""The sched_ext gate against a real kernel (the test VM: scripts/vm/test.sh): tenon_gate
loads and unloads cleanly, holds a denied cgroup's tasks and lets them go, never holds a
sandbox being killed, turns long holds into freezes and falls back when ejected."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_domain_real import real_layout_or_skip, start_in

from tenon.host.actuator import ScxActuator
from tenon.host.cgroup import SandboxCgroup
from tenon.host.domain import WorkloadDomain
from tenon.host.scx.loader import BPF_FS, ScxGate, loaded_ops, sched_ext_state
from tenon.host.types import CgroupVersion

pytestmark = pytest.mark.vm

VM_TOOLS = Path("/var/cache/tenon/vm")  # scripts/vm/build.sh's bpftool and libbpf headers
SPIN = "while True: pass"
SPIN_THREADS = """
import threading
def spin():
    while True:
        pass
for _ in range(3):
    threading.Thread(target=spin, daemon=True).start()
spin()
"""


@pytest.fixture(autouse=True)
def _vm_tools(monkeypatch: pytest.MonkeyPatch) -> None:
    if not Path("/sys/kernel/sched_ext").is_dir():
        pytest.skip("this kernel has no sched_ext")
    if (VM_TOOLS / "bpftool").exists() and "TENON_BPFTOOL" not in os.environ:
        monkeypatch.setenv("TENON_BPFTOOL", str(VM_TOOLS / "bpftool"))
        monkeypatch.setenv("TENON_BPF_INCLUDE", str(VM_TOOLS / "root/usr/include"))


@pytest.fixture
def domain() -> Iterator[WorkloadDomain]:
    layout = real_layout_or_skip()
    if layout.version is not CgroupVersion.V2:
        pytest.skip(f"needs a pure cgroup v2 hierarchy, found {layout.version.value}")
    d = WorkloadDomain.open(f"tenon-scx-{uuid.uuid4().hex[:8]}")
    yield d
    d.remove()


@pytest.fixture
def gate() -> Iterator[ScxGate]:
    g = ScxGate.load()
    yield g
    g.close()
    assert sched_ext_state() == "disabled"


def cpu_s(box: SandboxCgroup) -> float:
    return box.sample()[1]


def progress_s(box: SandboxCgroup, over_s: float = 1.0) -> float:
    before = cpu_s(box)
    time.sleep(over_s)
    return cpu_s(box) - before


def wait_until(done: Callable[[], bool], timeout_s: float = 10.0) -> float:
    start = time.monotonic()
    while not done():
        assert time.monotonic() - start < timeout_s, "timed out"
        time.sleep(0.01)
    return time.monotonic() - start


def test_load_and_unload_leave_nothing_behind() -> None:
    before = set(BPF_FS.iterdir())
    gate = ScxGate.load()
    assert gate.healthy()
    assert sched_ext_state() == "enabled"
    assert loaded_ops() == "tenon_gate"
    assert {p.name for p in gate.pin_dir.iterdir()} >= {"map_gate", "map_gate_stats"}
    gate.close()
    assert not gate.healthy()
    assert sched_ext_state() == "disabled"
    assert loaded_ops() is None
    assert set(BPF_FS.iterdir()) == before


@pytest.mark.parametrize("code", [SPIN, SPIN_THREADS], ids=["one-thread", "four-threads"])
def test_a_denied_process_makes_no_progress_until_allowed(domain, gate, code) -> None:
    box = domain.sandbox("spin")
    proc = start_in(box, code)
    try:
        assert progress_s(box) > 0.1  # it runs
        assert box.v2_dir is not None
        gate.deny(box.v2_dir)
        assert gate.is_denied(box.v2_dir)
        time.sleep(0.2)  # the running tasks stop at their next tick
        assert progress_s(box) < 0.02
        assert gate.stats()["held"] > 0
        gate.allow(box.v2_dir)
        assert progress_s(box) > 0.1
        assert gate.stats()["released"] > 0
    finally:
        proc.kill()
        proc.communicate()
        box.remove()


def test_killing_a_denied_sandbox_completes(domain, gate) -> None:
    box = domain.sandbox("killed")
    proc = start_in(box, SPIN_THREADS)
    assert box.v2_dir is not None
    gate.deny(box.v2_dir)
    time.sleep(0.2)
    assert progress_s(box, 0.5) < 0.02
    start = time.monotonic()
    (box.v2_dir / "cgroup.kill").write_text("1")
    proc.communicate(timeout=10)
    assert time.monotonic() - start < 5.0
    assert box.pids() == []
    box.remove()  # still denied: removal must not wait for an allow
    gate.forget(box.v2_dir) if box.v2_dir.exists() else None


def test_a_hold_past_the_limit_becomes_a_freeze(domain, gate) -> None:
    box = domain.sandbox("long")
    proc = start_in(box, SPIN)
    actuator = ScxActuator(gate, max_hold_s=0.5)
    try:
        actuator.hold(box)
        time.sleep(0.7)
        assert actuator.check() is None
        wait_until(box.is_frozen)  # the held tasks run only into the freezer's trap
        assert box.v2_dir is not None
        assert not gate.is_denied(box.v2_dir)
        assert progress_s(box) < 0.02
        actuator.release(box)
        assert not box.is_frozen()
        assert progress_s(box) > 0.1
    finally:
        proc.kill()
        proc.communicate()
        box.remove()


def test_ejecting_the_scheduler_falls_back_to_the_freezer(domain, gate) -> None:
    box = domain.sandbox("ejected")
    proc = start_in(box, SPIN)
    actuator = ScxActuator(gate)
    try:
        actuator.hold(box)
        # Unregistered from outside, as an operator (or SysRq-S) would: removing the link's
        # pin disables the scheduler. SysRq-S is not used here: the VM session goes on to
        # other tests, and re-enabling sched_ext after it has crashed this guest kernel.
        (gate.pin_dir / "tenon_gate_ops").unlink()
        wait_until(lambda: sched_ext_state() == "disabled")
        reason = actuator.check()
        assert reason is not None
        assert "freezer" in reason
        assert actuator.fallback_reason == reason
        wait_until(box.is_frozen)
        assert progress_s(box) < 0.02
        assert actuator.check() is None  # reported once
        actuator.release(box)
        assert progress_s(box) > 0.1
    finally:
        proc.kill()
        proc.communicate()
        box.remove()
