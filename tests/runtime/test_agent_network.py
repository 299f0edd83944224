"""An agent's network policy (`create_agent(network=...)`) reaches its sandbox's spec, is
kept in its recovery record and applies again at every rebuild; bad rules are refused
before the agent exists. Simulated backend and clock."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tenon.clock import FakeClock, run_simulated
from tenon.predict.static import FixedPredictor
from tenon.runtime.controller import Runtime
from tenon.runtime.residency import run_inline
from tenon.sandbox.netpolicy import ALL_TRAFFIC, NetworkPolicy, NetworkRuleError
from tenon.sandbox.sim import SimBackend, SimDomain, sim_load_command

MIB = 1024 * 1024
PYPI = NetworkPolicy(allow_out=("pypi.org", "files.pythonhosted.org"), deny_out=(ALL_TRAFFIC,))


def simulate(tmp_path: Path, body: Any) -> Any:
    clock = FakeClock()

    async def main() -> Any:
        domain = SimDomain(1024 * MIB)
        backend = SimBackend(domain, clock)
        runtime = Runtime(domain=domain, backend=backend, state_dir=tmp_path / "state",
                          clock=clock, blocking=run_inline,
                          predictor=FixedPredictor(10 * MIB, 20 * MIB))
        async with runtime:
            return await body(runtime)

    return asyncio.run(run_simulated(main(), clock))


def test_the_policy_reaches_the_sandbox_and_every_rebuild(tmp_path: Path) -> None:
    async def body(rt: Runtime) -> Any:
        agent = await rt.create_agent(image="sim", network=PYPI)
        plain = await rt.create_agent(image="sim")
        command = sim_load_command(10 * MIB, 20 * MIB, 0.5, 0)
        await agent.run(command, timeout=60)
        await plain.run(command, timeout=60)
        first = rt.residency.sandbox_for(agent.id)
        assert first is not None
        seen = [first.spec.network]
        record = rt._recovery.get(agent.id)
        assert record is not None
        kept = record.backend_config["network"]
        await rt.teardown_now(agent.id)
        await agent.run(command, timeout=60)
        rebuilt = rt.residency.sandbox_for(agent.id)
        assert rebuilt is not None
        assert rebuilt is not first
        seen.append(rebuilt.spec.network)
        other = rt.residency.sandbox_for(plain.id)
        assert other is not None
        return seen, kept, other.spec.network

    seen, kept, other = simulate(tmp_path, body)
    assert seen == [PYPI, PYPI]
    assert NetworkPolicy.from_value(kept) == PYPI
    assert other == NetworkPolicy()  # the runtime's default: no network


def test_bad_rules_are_refused_before_the_agent_exists(tmp_path: Path) -> None:
    async def body(rt: Runtime) -> Any:
        with pytest.raises(NetworkRuleError, match="wildcard"):
            await rt.create_agent(image="sim", agent_id="bad",
                                  network={"allow_out": ["*.example.com"]})
        return "bad" in rt.agents

    assert simulate(tmp_path, body) is False
