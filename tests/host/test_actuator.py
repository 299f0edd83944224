"""Gate actuators on the host: the freezer, the sched_ext actuator over a fake gate (holds,
escalation of long holds to the freezer, fallback when the scheduler is ejected), the
choice on a host without sched_ext, and the object build's missing-tool errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tenon.errors import ConfigError
from tenon.host.actuator import (
    ActuatorConfig,
    FreezerActuator,
    ScxActuator,
    choose_actuator,
)
from tenon.host.scx.build import BuildToolMissing, Toolchain
from tenon.host.scx.fake import FakeScxGate, RecordingCgroup
from tenon.host.scx.loader import ScxUnavailable, availability


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def make_scx(*, max_hold_s: float = 5.0) -> tuple[ScxActuator, FakeScxGate, FakeClock]:
    gate, clock = FakeScxGate(), FakeClock()
    return ScxActuator(gate, max_hold_s=max_hold_s, now=clock), gate, clock


def make_cgroup(gate: FakeScxGate, name: str = "sb1", *, v2: bool = True) -> RecordingCgroup:
    return RecordingCgroup(Path(f"/sys/fs/cgroup/dom/{name}") if v2 else None,
                           journal=gate.journal)


def test_freezer_actuator_freezes_and_thaws() -> None:
    cgroup = RecordingCgroup(Path("/x"))
    actuator = FreezerActuator()
    actuator.hold(cgroup)
    assert cgroup.frozen
    actuator.release(cgroup)
    assert not cgroup.frozen
    assert actuator.check() is None


def test_scx_hold_denies_in_the_map_without_freezing() -> None:
    actuator, gate, _ = make_scx()
    cgroup = make_cgroup(gate)
    actuator.hold(cgroup)
    assert gate.denied == {cgroup.v2_dir}
    assert not cgroup.frozen
    actuator.release(cgroup)
    assert gate.denied == set()
    # the hold clock runs over the hold (an action's timeout does not count it), no freeze
    box = str(cgroup.v2_dir)
    assert gate.journal == [("deny", box), ("held", box), ("unheld", box), ("allow", box)]


def test_a_sandbox_cgroup_counts_a_hold_noted_without_the_freezer(tmp_path: Path) -> None:
    import time

    from tenon.host.cgroup import SandboxCgroup
    from tenon.host.fake import FakeCgroupV2Tree

    tree = FakeCgroupV2Tree(tmp_path)
    tree.make_cgroup("dom")
    path = tree.make_cgroup("dom/s1")
    box = SandboxCgroup("s1", tree.layout(), {c: path for c in ("memory", "cpu", "pids")})
    box.note_held(True)
    box.note_held(True)  # idempotent: the clock keeps its start
    time.sleep(0.05)
    box.note_held(False)
    held = box.held_s()
    assert held >= 0.05
    time.sleep(0.02)
    assert box.held_s() == held  # stopped


def test_a_hold_past_the_limit_freezes_first_then_allows() -> None:
    actuator, gate, clock = make_scx(max_hold_s=5.0)
    cgroup = make_cgroup(gate)
    actuator.hold(cgroup)
    clock.now_s += 4.9
    assert actuator.check() is None
    assert not cgroup.frozen  # still within the limit
    clock.now_s += 0.2
    assert actuator.check() is None
    assert cgroup.frozen
    assert gate.denied == set()
    # freeze before allow: the tasks leave the wait queue only into the freezer
    assert gate.journal[1:] == [("held", str(cgroup.v2_dir)), ("freeze", str(cgroup.v2_dir)),
                                ("allow", str(cgroup.v2_dir))]
    assert actuator.num_escalations == 1
    actuator.release(cgroup)
    assert not cgroup.frozen


def test_ejection_falls_back_to_the_freezer_and_reports_once() -> None:
    actuator, gate, _ = make_scx()
    held, other = make_cgroup(gate, "a"), make_cgroup(gate, "b")
    actuator.hold(held)
    gate.is_healthy = False
    reason = actuator.check()
    assert reason is not None
    assert "ejected" in reason
    assert actuator.fallback_reason == reason
    assert held.frozen  # held sandboxes stay held, now by the freezer
    assert actuator.check() is None  # reported once
    actuator.hold(other)
    assert other.frozen
    assert other.v2_dir not in gate.denied
    actuator.release(held)
    actuator.release(other)
    assert not held.frozen
    assert not other.frozen


def test_an_ejection_a_hold_runs_into_is_reported_by_the_next_check() -> None:
    actuator, gate, _ = make_scx()
    gate.is_healthy = False
    cgroup = make_cgroup(gate)
    actuator.hold(cgroup)
    assert cgroup.frozen
    assert actuator.check() == actuator.fallback_reason
    assert actuator.fallback_reason is not None
    assert actuator.check() is None


def test_a_cgroup_without_a_v2_directory_is_frozen() -> None:
    actuator, gate, _ = make_scx()
    cgroup = make_cgroup(gate, v2=False)
    actuator.hold(cgroup)
    assert cgroup.frozen
    assert gate.denied == set()
    actuator.release(cgroup)
    assert not cgroup.frozen


def test_close_freezes_what_is_still_held_before_unloading() -> None:
    actuator, gate, _ = make_scx()
    cgroup = make_cgroup(gate)
    actuator.hold(cgroup)
    actuator.close()
    assert cgroup.frozen
    assert gate.journal[-1] == ("close", "")


def test_actuator_config_rejects_bad_values() -> None:
    with pytest.raises(ConfigError):
        ActuatorConfig("bpf")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        ActuatorConfig(max_hold_s=30.0)


@pytest.mark.skipif(Path("/sys/kernel/sched_ext").exists(), reason="this kernel has sched_ext")
def test_a_host_without_sched_ext_gets_the_freezer_and_says_why() -> None:
    available, reason = availability()
    assert not available
    assert "sched_ext" in reason
    actuator, why = choose_actuator("auto")
    assert isinstance(actuator, FreezerActuator)
    assert "sched_ext" in why
    with pytest.raises(ScxUnavailable, match="sched_ext"):
        choose_actuator("scx")
    assert isinstance(choose_actuator("freezer")[0], FreezerActuator)


def test_build_names_the_missing_tool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TENON_BPFTOOL", "/nonexistent/bpftool")
    with pytest.raises(BuildToolMissing, match="bpftool"):
        Toolchain.from_env()
    monkeypatch.setenv("TENON_BPFTOOL", sys.executable)
    monkeypatch.setenv("TENON_BPF_CLANG", "/nonexistent/clang")
    with pytest.raises(BuildToolMissing, match="clang"):
        Toolchain.from_env()


def test_build_cli_fails_in_one_line_without_bpftool(tmp_path: Path) -> None:
    env = {"PATH": "/nonexistent", "TENON_SCX_CACHE": str(tmp_path),
           "TENON_BPFTOOL": "/nonexistent/bpftool"}
    done = subprocess.run([sys.executable, "-m", "tenon.host.scx", "build"], env=env,
                          capture_output=True, text=True, check=False, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip().count("\n") == 0
    assert "bpftool" in done.stderr
