"""The simulated replay of the shipped trace makes exactly the recorded decisions.

Every decision the runtime logs (admission, held starts, gate verdicts, residency, teardowns,
rebuilds, OOM kills, releases, workflow ends) is projected onto the fields that carry the
decision (times, ids, verdicts, charges; not the wording of reasons) and compared, line by
line, with a log recorded in `tests/data/decisions/`. A change to the control code that
changes any decision fails here, naming the first line that differs. A deliberate change of
behaviour re-records the logs:

    TENON_RECORD_DECISIONS=1 pytest tests/replay/test_decision_log.py
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from tenon.policy.config import PAPER_RESERVES
from tenon.replay.bench import BenchConfig, run_bench
from tenon.runtime.events import read_events

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO / "bench" / "traces" / "agentcgroup-haiku.jsonl"
RECORDED = REPO / "tests" / "data" / "decisions"
GIB = 1 << 30

# The fields that carry each kind's decision; any other field is observation or wording.
DECISION_FIELDS: dict[str, tuple[str, ...]] = {
    "action_ready": ("action_id", "action_class", "predicted_avg_bytes",
                     "predicted_peak_bytes", "heavy"),
    "admit": ("action_id", "charge_bytes", "heavy"),
    "start_held": ("action_id",),
    "action_start": ("action_id", "sandbox_id", "charge_bytes"),
    "gate": ("action_id", "allowed", "pressure"),
    "action_done": ("action_id", "outcome", "exit_code", "peak_bytes"),
    "release": ("action_id", "charge_bytes", "admitted_total_bytes"),
    "peak_passed": ("action_id", "charge_bytes", "freed_bytes"),
    "residency": ("agent_id", "decision", "restartable"),
    "teardown": ("agent_id", "outcome"),
    "rebuild": ("agent_id", "sandbox_id", "predictive"),
    "rebuild_wait": ("agent_id",),
    "materialize": ("agent_id", "sandbox_id"),
    "oom_kill": ("action_id", "num_kills"),
    "attempt_failed": ("workflow", "attempt", "outcome"),
    "workflow_start": ("agent_id", "workflow"),
    "workflow_end": ("agent_id", "failed", "num_actions"),
    "workflow_done": ("workflow", "completed", "attempts"),
}
# A sandbox id ends in a random suffix after its generation: agent-00030-g1-cc4b0cce.
_SANDBOX_SUFFIX = re.compile(r"(-g\d+)-[0-9a-f]{8}$")

# The logs were recorded with the paper's reserves: pinned, so that a change of defaults
# does not pass for a change of decisions.
RECORDED_WITH = PAPER_RESERVES

SCENARIOS: dict[str, dict[str, Any]] = {
    # every policy at trace times, 3 GiB: yellow pressure, reclaim, rebuilds
    "all-policies-3gib": {"budget_bytes": 3 * GIB, "speed": 10.0,
                          "policies": ["tenon", "eager", "static-4", "reservation",
                                       "agentcgroup"],
                          "policy_config": RECORDED_WITH},
    # a 5 s burst into 2 GiB: red pressure, held starts, an OOM kill and its retry
    "burst-2gib": {"budget_bytes": 2 * GIB, "speed": 10.0, "qps": 9.0, "window_s": 5.0,
                   "policies": ["tenon", "tenon-static-predictor", "tenon-no-gate"],
                   "policy_config": {**RECORDED_WITH, "lifecycle_limit": 4}},
}


def decision_log(events_path: Path) -> list[str]:
    lines = []
    for event in read_events(events_path):
        fields = DECISION_FIELDS.get(event["kind"])
        if fields is None:
            continue
        projected: dict[str, Any] = {"t": event["t"], "kind": event["kind"]}
        for name in fields:
            value = event.get(name)
            if name == "sandbox_id" and isinstance(value, str):
                value = _SANDBOX_SUFFIX.sub(r"\1", value)
            projected[name] = value
        lines.append(json.dumps(projected, separators=(",", ":")))
    return lines


def replay(name: str, tmp_path: Path) -> dict[str, list[str]]:
    config = BenchConfig.model_validate({
        "trace": TRACE, "backend": "sim", "out_dir": tmp_path / name,
        "state_dir": tmp_path / f"{name}-state", **SCENARIOS[name]})
    asyncio.run(run_bench(config))
    return {policy: decision_log(tmp_path / name / policy / "events.jsonl")
            for policy in config.policies}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_simulated_replay_makes_the_recorded_decisions(name: str, tmp_path: Path) -> None:
    logs = replay(name, tmp_path)
    for policy, lines in logs.items():
        path = RECORDED / f"{name}.{policy}.jsonl.gz"
        if os.environ.get("TENON_RECORD_DECISIONS") == "1":
            path.parent.mkdir(parents=True, exist_ok=True)
            text = "\n".join(lines) + "\n"  # no timestamp: the same decisions, the same bytes
            path.write_bytes(gzip.compress(text.encode(), compresslevel=9, mtime=0))
            continue
        with gzip.open(path, "rt", encoding="utf-8") as f:
            recorded = f.read().splitlines()
        assert len(lines) > 1000, f"{policy}: too few decisions to mean anything"
        for i, (got, want) in enumerate(zip(lines, recorded, strict=False)):
            assert got == want, f"{name} {policy}: decision {i + 1} differs"
        assert len(lines) == len(recorded), f"{name} {policy}: {len(lines)} decisions, " \
                                            f"recorded {len(recorded)}"
