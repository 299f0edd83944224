"""The typed backend config (a `type` tag picks the backend, imported lazily) and what every
backend states through the contract: its capacity, whether it simulates, its sandboxes'
meters."""

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tenon.clock import FakeClock, run_simulated
from tenon.errors import ConfigError, SandboxFrozen
from tenon.sandbox.base import BackendCapacity, SandboxSpec
from tenon.sandbox.config import (
    DockerBackendConfig,
    ProcessBackendConfig,
    SimBackendConfig,
    parse_backend_config,
)
from tenon.sandbox.docker import DockerBackend
from tenon.sandbox.fake import FakeBackend
from tenon.sandbox.process import ProcessBackend
from tenon.sandbox.registry import backend_config
from tenon.sandbox.sim import SimBackend, SimDomain


def make_spec(tmp_path: Path, sandbox_id: str = "sb-1") -> SandboxSpec:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return SandboxSpec(sandbox_id=sandbox_id, image="sim", workspace=tmp_path)


def test_the_type_tag_picks_the_config_and_fields_are_validated():
    assert parse_backend_config({"type": "process", "state_dir": "/srv/t"}) == ProcessBackendConfig(
        state_dir=Path("/srv/t")
    )
    assert isinstance(parse_backend_config({"type": "docker"}), DockerBackendConfig)
    sim = parse_backend_config({"type": "sim", "materialize_s": 0.5, "base_bytes": 1024})
    assert sim == SimBackendConfig(materialize_s=0.5, base_bytes=1024)


def test_an_unknown_field_is_refused_by_name():
    with pytest.raises(ConfigError, match="sim.materialise_s"):
        parse_backend_config({"type": "sim", "materialise_s": 0.5})
    with pytest.raises(ConfigError, match="docker.image_dir"):
        parse_backend_config({"type": "docker", "image_dir": "/srv/t"})


def test_an_unknown_or_missing_type_is_refused():
    with pytest.raises(ConfigError, match="'vm'.*process, docker, sim"):
        parse_backend_config({"type": "vm"})
    with pytest.raises(ConfigError, match="type"):
        parse_backend_config({"materialize_s": 0.5})


def test_bounds_are_checked():
    with pytest.raises(ConfigError, match="base_bytes"):
        parse_backend_config({"type": "sim", "base_bytes": -1})


def test_the_sim_config_makes_a_backend_on_the_given_clock(tmp_path):
    clock = FakeClock()
    domain = SimDomain(None)
    backend = SimBackendConfig(materialize_s=2.0, base_bytes=4096).make(domain, clock)
    assert isinstance(backend, SimBackend)
    sandbox = asyncio.run(run_simulated(backend.materialize(make_spec(tmp_path)), clock))
    assert clock.now() == pytest.approx(2.0)  # materializing took its clock time
    assert sandbox.cgroup.reading().usage_bytes == 4096


def test_a_config_refuses_a_domain_or_clock_it_cannot_run_with():
    with pytest.raises(ConfigError, match="clock"):
        SimBackendConfig().make(SimDomain(None))
    with pytest.raises(ConfigError, match="real workload domain"):
        ProcessBackendConfig().make(SimDomain(None))
    with pytest.raises(ConfigError, match="real workload domain"):
        DockerBackendConfig().make(SimDomain(None))


def test_the_flags_build_the_config_and_keep_their_error():
    assert backend_config("process", Path("/srv/t")) == ProcessBackendConfig(
        state_dir=Path("/srv/t")
    )
    assert backend_config("docker", Path("/srv/t")) == DockerBackendConfig(
        state_dir=Path("/srv/t")
    )
    with pytest.raises(ConfigError, match="unknown backend 'vm'; known backends: docker, process"):
        backend_config("vm", Path("/srv/t"))


def test_choosing_a_backend_imports_only_that_one():
    code = (
        "import sys\n"
        "from tenon.sandbox.config import parse_backend_config\n"
        "parse_backend_config({'type': 'process'})\n"
        "parse_backend_config({'type': 'sim'})\n"
        "print(sorted(m for m in sys.modules\n"
        "             if m == 'docker' or m.startswith('tenon.sandbox.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    assert "docker" not in out
    assert "tenon.sandbox.process" not in out
    assert "tenon.sandbox.sim" not in out


def test_capacity_only_the_docker_engine_limits_concurrency():
    num_cpus = len(os.sched_getaffinity(0))
    docker_cap = DockerBackend(domain=None).capacity()  # type: ignore[arg-type]
    assert docker_cap == BackendCapacity(
        max_admitted_actions=4 * num_cpus, max_live_workflows=8 * num_cpus
    )
    unlimited = BackendCapacity(max_admitted_actions=None, max_live_workflows=None)
    assert ProcessBackend.capacity(None) == unlimited  # type: ignore[arg-type]
    assert FakeBackend().capacity() == unlimited
    assert SimBackend(SimDomain(None), FakeClock()).capacity() == unlimited
    with pytest.raises(ValueError, match="at least 1"):
        BackendCapacity(max_admitted_actions=0)


def test_backends_without_state_outside_the_domain_remove_no_leftovers():
    for backend in (FakeBackend(), SimBackend(SimDomain(None), FakeClock())):
        assert backend.remove_leftovers() == []
        backend.release_domain()
    assert ProcessBackend.remove_leftovers(None) == []  # type: ignore[arg-type]


def test_only_the_sim_backend_is_simulated():
    assert SimBackend(SimDomain(None), FakeClock()).simulated
    assert not FakeBackend().simulated
    assert not ProcessBackend.simulated
    assert not DockerBackend.simulated


async def test_the_fake_sandbox_meter_gates_its_exec(tmp_path):
    sandbox = await FakeBackend(script=lambda sb, cmd: "ok").materialize(make_spec(tmp_path))
    meter = sandbox.cgroup
    first = meter.freeze()
    assert (first.frozen, first.changed) == (True, True)
    assert sandbox.frozen
    assert meter.is_frozen()
    with pytest.raises(SandboxFrozen):
        await sandbox.exec("true", timeout_s=1)
    again = meter.freeze()
    assert (again.frozen, again.changed) == (True, False)
    meter.thaw()
    assert (await sandbox.exec("true", timeout_s=1)).output == "ok"
    meter.usage_bytes, meter.num_oom_kills = 5000, 2
    assert meter.sample() == (5000, 0.0)
    assert meter.reading().peak_bytes == 5000
    assert meter.new_oom_kills() == 2
    assert meter.new_oom_kills() == 0
