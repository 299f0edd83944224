"""The main job end to end on real backends: teardown frees memory, rebuild keeps the workspace."""

import glob
import json
import os
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from tenon.cli.main import app
from tenon.replay.demo import run_demo
from tenon.units import MIB

STATE_DIR = Path("/var/lib/tenon")


def _need_root():
    if os.geteuid() != 0:
        pytest.skip("real sandboxes need root")


@pytest.mark.sandbox
@pytest.mark.cgroups
@pytest.mark.parametrize("backend", [
    "process", pytest.param("docker", marks=pytest.mark.docker),
])
async def test_demo_tears_down_and_rebuilds_with_workspaces_intact(backend):
    _need_root()
    console = Console(record=True, width=120)
    outcomes = await run_demo(backend=backend, budget_bytes=256 * MIB, num_agents=2,
                              state_dir=STATE_DIR, image="tenon-base:bookworm",
                              console=console, burst_mib=32)
    assert [o.teardown for o in outcomes] == ["torn_down", "torn_down"]
    assert all(o.workspace_intact and o.scratch_cleared for o in outcomes)
    assert "after teardown" in console.export_text()
    assert not glob.glob("/sys/fs/cgroup/*/tenon-demo-*")


@pytest.mark.sandbox
def test_bench_lifecycle_writes_the_documented_keys(tmp_path):
    _need_root()
    out = tmp_path / "lifecycle.json"
    result = CliRunner().invoke(app, ["bench", "lifecycle", "--backend", "process", "--runs", "2",
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert set(figures) == {"backend", "materialize_ms", "exec_ms", "dematerialize_ms"}
    assert figures["backend"] == "process"
    assert all(figures[k] > 0 for k in ("materialize_ms", "exec_ms", "dematerialize_ms"))


def test_unknown_backend_and_bad_budget_are_clear_errors():
    runner = CliRunner()
    bad_budget = runner.invoke(app, ["demo", "--budget", "-1GiB"])
    assert bad_budget.exit_code == 2
    assert "must not be negative" in bad_budget.output


@pytest.mark.cgroups
def test_unknown_backend_is_a_clear_error_and_leaves_no_cgroup():
    _need_root()
    result = CliRunner().invoke(app, ["demo", "--backend", "vm"])
    assert result.exit_code == 2
    assert "unknown backend 'vm'" in result.output
    assert not glob.glob("/sys/fs/cgroup/*/tenon-demo-*")
