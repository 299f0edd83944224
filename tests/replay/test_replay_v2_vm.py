"""A replay of the shared trace on the process backend under a real cgroup v2 kernel (the test
VM): copies of one workflow whose peaks sum to 4x the budget. Eager is OOM-killed for real by
the kernel's memory.max; Tenon completes every workflow without an OOM kill."""

from __future__ import annotations

import glob
from pathlib import Path

import pytest

from tenon.replay.bench import BenchConfig, run_bench

pytestmark = [pytest.mark.vm, pytest.mark.slow]

TRACE = Path(__file__).resolve().parents[2] / "bench" / "traces" / "agentcgroup-haiku.jsonl"
WORKFLOW = "facelessuser__soupsieve-147/attempt_1"  # 13 steps, peaks at 92 MiB
MIB = 1 << 20


async def test_a_4x_replay_on_v2_oom_kills_eager_and_not_tenon(tmp_path: Path) -> None:
    copies, budget = 5, 115 * MIB
    config = BenchConfig(trace=TRACE, budget_bytes=budget, policies=["tenon", "eager"],
                         backend="process", speed=20.0, copies=copies,
                         of=WORKFLOW, out_dir=tmp_path / "run")
    summary = await run_bench(config)

    assert summary["oversubscription"] >= 3.9
    tenon, eager = summary["policies"]["tenon"], summary["policies"]["eager"]
    assert tenon["completed"] == copies
    assert tenon["oom_events"] == 0
    assert tenon["peak_memory_bytes"] <= budget
    assert eager["oom_events"] > 0  # the kernel's memory.max killed for real
    assert eager["failed_attempts"] > 0
    assert not glob.glob("/sys/fs/cgroup/tenon*/")  # every domain removed
