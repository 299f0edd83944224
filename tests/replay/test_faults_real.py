"""A reduced SIGKILL campaign on the process backend: the controller is killed mid-replay
five times and restarted; every workflow still completes, no committed byte is lost and
nothing is left on the host."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tenon.replay.faults import PHASES, FaultConfig, compact_summary, run_campaign
from tenon.sandbox import launcher

pytestmark = [pytest.mark.cgroups, pytest.mark.sandbox, pytest.mark.disk, pytest.mark.slow]

STATE_DIR = Path("/var/lib/tenon")
TRACE = Path(__file__).resolve().parents[2] / "bench" / "traces" / "agentcgroup-haiku.jsonl"
GIB = 1024 ** 3


def test_five_sigkills_lose_nothing_and_leave_nothing(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("real sandboxes need root")
    if problems := launcher.check():
        pytest.skip(problems[0])
    if not (STATE_DIR / "images").exists():
        pytest.skip("needs the base image (tenon image build)")
    config = FaultConfig(trace=TRACE, budget_bytes=2 * GIB, out_dir=tmp_path / "campaign",
                         num_kills=5, num_workflows=6, seed=3, state_dir=STATE_DIR)
    summary = run_campaign(config)

    assert summary["num_kills"] == 5
    assert {k["target"] for k in summary["kills"]} == set(PHASES)  # each phase was aimed at
    assert summary["landed"]["teardown"] + summary["landed"]["rebuild"] >= 1
    assert summary["completed"] == 6
    assert summary["all_completed"]
    assert summary["committed_bytes_checked"] > 0  # restarts had committed bytes to keep
    assert summary["committed_bytes_lost"] == 0
    assert summary["digest_mismatches"] == 0
    assert summary["rebuilds"] > 0
    assert summary["interrupted_actions"] >= 1  # the execution kill cut an action short
    left = summary["leftover"]
    assert left["cgroups"] == []
    assert left["mounts"] == []
    assert left["processes"] == []
    assert left["containers"] in (0, None)  # None: no Docker daemon, so none can be left
    assert compact_summary(summary)["passed"]
    assert (tmp_path / "campaign" / "faults.json").exists()
