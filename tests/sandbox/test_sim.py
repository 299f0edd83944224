"""The simulated host's physics, which the scenario tests rely on."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tenon.clock import FakeClock, run_simulated
from tenon.errors import ConfigError, SandboxFrozen
from tenon.sandbox.base import SandboxSpec
from tenon.sandbox.sim import (
    SimBackend,
    SimDomain,
    SimLoad,
    UnknownSimCommand,
    anon_level,
    parse_sim_command,
    sim_load_command,
)

MIB = 1024 * 1024


def spec(tmp_path: Path, name: str) -> SandboxSpec:
    return SandboxSpec(sandbox_id=name, image="sim", workspace=tmp_path)


def test_command_round_trip_and_refusals() -> None:
    cmd = sim_load_command(10 * MIB, 20 * MIB, 1.5, 5 * MIB, exit_code=3)
    assert parse_sim_command(cmd) == SimLoad(10 * MIB, 20 * MIB, 1.5, 5 * MIB, 3)
    with pytest.raises(UnknownSimCommand, match="pytest"):
        parse_sim_command("pytest -x")
    with pytest.raises(ConfigError, match="peak"):
        sim_load_command(20, 10, 1.0, 0)


def test_profile_ramps_holds_then_levels_to_the_average() -> None:
    load = SimLoad(100 * MIB, 300 * MIB, 10.0, 0)
    assert anon_level(load, 0, 0.5) == 150 * MIB  # half way up the 1 s ramp
    assert anon_level(load, 0, 1.5) == 300 * MIB  # holding the peak
    steps = [anon_level(load, 0, t / 100) for t in range(1000)]
    assert sum(steps) / len(steps) == pytest.approx(100 * MIB, rel=0.03)


def test_frozen_sandbox_makes_no_progress_and_gains_no_cpu(tmp_path: Path) -> None:
    clock = FakeClock()
    domain = SimDomain(None)
    backend = SimBackend(domain, clock)

    async def main() -> tuple[float, float, float]:
        box = await backend.materialize(spec(tmp_path, "a"))
        task = asyncio.ensure_future(box.exec(sim_load_command(0, 0, 2.0, 0), timeout_s=60))
        await clock.sleep(0.5)
        box.cgroup.freeze()
        cpu_frozen = box.cgroup.reading().cpu_usage_s
        await clock.sleep(3.0)
        assert box.cgroup.reading().cpu_usage_s == cpu_frozen
        with pytest.raises(SandboxFrozen):
            await box.exec(sim_load_command(0, 0, 1.0, 0), timeout_s=60)
        box.cgroup.thaw()
        result = await task
        return cpu_frozen, result.duration_s, box.cgroup.reading().cpu_usage_s

    cpu_frozen, duration_s, cpu_total = asyncio.run(run_simulated(main(), clock))
    assert cpu_frozen == pytest.approx(0.5, abs=0.06)
    assert duration_s == pytest.approx(5.0, abs=0.1)  # 2 s of work + 3 s held
    assert cpu_total == pytest.approx(2.0, abs=0.06)


def test_domain_oom_kills_the_largest_running_action(tmp_path: Path) -> None:
    clock = FakeClock()
    domain = SimDomain(600 * MIB)
    backend = SimBackend(domain, clock)

    async def main():
        small = await backend.materialize(spec(tmp_path, "small"))
        big = await backend.materialize(spec(tmp_path, "big"))
        return await asyncio.gather(
            small.exec(sim_load_command(200 * MIB, 250 * MIB, 2.0, 0), timeout_s=60),
            big.exec(sim_load_command(350 * MIB, 450 * MIB, 2.0, 0), timeout_s=60),
        ), small.cgroup.new_oom_kills(), big.cgroup.new_oom_kills()

    (small_res, big_res), small_kills, big_kills = asyncio.run(run_simulated(main(), clock))
    assert big_res.exit_code == -9
    assert big_kills == 1
    assert small_res.exit_code == 0
    assert small_kills == 0
    assert domain.num_oom_kills == 1


def test_memory_high_throttles_progress(tmp_path: Path) -> None:
    clock = FakeClock()
    backend = SimBackend(SimDomain(None), clock)

    async def main() -> float:
        box = await backend.materialize(spec(tmp_path, "a"))
        box.cgroup.set_memory_high(50 * MIB)
        result = await box.exec(sim_load_command(100 * MIB, 100 * MIB, 2.0, 0), timeout_s=600)
        return result.duration_s

    assert asyncio.run(run_simulated(main(), clock)) > 10.0  # a tenth of the speed above it
