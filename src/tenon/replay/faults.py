"""The SIGKILL campaign: kill the controller mid-replay, restart it, prove nothing is lost.

    tenon bench faults --trace T --budget 2GiB --kills 20 --seed 1 --out DIR

A child process runs a resumable replay (`replay(journal=...)`) on the process backend over
a fixed state directory, `DIR/state`. The parent follows the child's event log and SIGKILLs
it at random points chosen to land in each phase in turn: teardown, rebuild, admission and
execution (the runtime's `lifecycle_events` mark each teardown and rebuild step as it
starts). Where a kill landed is read back from the event log as the child left it. After
each kill the parent checks that every committed record's workspace is still on disk byte
for byte (its manifest), then restarts the child, which reconciles and resumes. After the
last kill the child runs to the end. The summary (`DIR/faults.json`) says: how many kills
and where they landed, whether every workflow completed, committed bytes checked and lost,
digest mismatches at rebuild, and what was left on the host (cgroups, containers, mounts,
processes).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tenon.errors import ConfigError
from tenon.runtime.residency import REMATERIALIZE_STEPS, TEARDOWN_STEPS
from tenon.state.statedir import DOMAIN_FILE, EVENTS_FILE, RECOVERY_DB

logger = logging.getLogger(__name__)

PHASES = ("teardown", "rebuild", "admission", "execution")
JOURNAL_FILE = "journal.jsonl"
SUMMARY_FILE = "faults.json"
POLL_S = 0.002
# How long after the target phase shows up the kill lands, at most: a random point inside
# it (teardowns and rebuilds last tens of milliseconds, actions seconds).
MAX_DELAY_S = {"teardown": 0.002, "rebuild": 0.03, "admission": 0.03, "execution": 0.3}
MISMATCH_TEXT = "does not match its manifest"
CHURN = {"teardown_cost_s": 0.02, "rebuild_cost_s": 0.03}


class FaultConfig(BaseModel):
    """One campaign; unknown fields are rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    trace: Path = Field(description="Trace file (tenon-trace JSON lines).")
    budget_bytes: int = Field(gt=0, description="Memory budget of the workload domain.")
    out_dir: Path = Field(description="Campaign directory: state/, child logs, faults.json.")
    num_kills: int = Field(default=20, ge=0, description="SIGKILLs of the controller.")
    seed: int = Field(default=1, description="Seeds the kill delays and the phase order.")
    speed: float = Field(default=10.0, gt=0, description="Divides model waits and durations.")
    num_workflows: int = Field(default=12, gt=0, description="Workflows replayed.")
    qps: float = Field(default=2.0, gt=0, description="Submission rate of the burst.")
    window_s: float = Field(default=10.0, gt=0, description="Burst length at `qps`.")
    write_bytes: int = Field(default=65536, ge=0,
                             description="Bytes each action writes into its workspace.")
    min_uptime_s: float = Field(default=1.0, ge=0,
                                description="A restarted child runs this long before a kill.")
    phase_wait_s: float = Field(default=20.0, gt=0,
                                description="Wait for the target phase before killing anyway.")
    child_timeout_s: float = Field(default=900.0, gt=0, description="The final run's limit.")
    policy_config: dict[str, Any] = Field(
        default_factory=lambda: dict(CHURN),
        description="PolicyConfig overrides; by default `CHURN`: every model wait of a "
        "sped-up replay amortizes a teardown, so the run tears down and rebuilds often "
        "and kills have lifecycle operations to land in.")
    state_dir: Path = Field(default=Path("/var/lib/tenon"), description="Base images.")

    @property
    def run_dir(self) -> Path:
        return self.out_dir / "state"


# -- the child: a resumable replay -------------------------------------------------------


async def child_main(config: FaultConfig) -> int:
    """Open the runtime over the fixed state directory, recover, resume the replay."""
    from tenon.policy.config import PolicyConfig
    from tenon.predict.online import OnlinePredictor
    from tenon.replay.bench import check_budget, profiled_static_predictor
    from tenon.replay.driver import replay
    from tenon.replay.loadprog import SCRATCH_DIR
    from tenon.replay.schedule import make_schedule
    from tenon.replay.trace import load_trace
    from tenon.runtime.open import open_runtime

    trace = load_trace(config.trace)
    submissions = make_schedule(trace.workflows, qps=config.qps, window_s=config.window_s,
                                speed=config.speed, num_workflows=config.num_workflows)
    check_budget(submissions, config.budget_bytes)
    policy_config = PolicyConfig.model_validate(config.policy_config)
    predictor = OnlinePredictor(profiled_static_predictor(trace, policy_config),
                                heavy_peak_bytes=policy_config.heavy_peak_bytes)
    async with open_runtime(budget_bytes=config.budget_bytes, backend="process",
                            state_dir=config.state_dir, run_dir=config.run_dir,
                            config=policy_config, predictor=predictor,
                            backend_config={"disposable": [SCRATCH_DIR]},
                            lifecycle_events=True) as rt:
        records = await replay(rt, submissions, speed=config.speed,
                               journal=config.run_dir / JOURNAL_FILE,
                               workspace_write_bytes=config.write_bytes)
    return 0 if all(r.completed for r in records) else 1


# -- the parent: where the controller is, from its event log -----------------------------


class PhaseTracker:
    """What the controller is in the middle of, from its events: actions waiting for
    admission or running, agents in a teardown or a rebuild."""

    def __init__(self) -> None:
        self.sets: dict[str, set[str]] = {phase: set() for phase in PHASES}
        self.reconciled = False

    def feed(self, event: dict[str, Any]) -> None:
        kind = event.get("kind")
        action, agent = str(event.get("action_id")), str(event.get("agent_id"))
        sets = self.sets
        if kind == "reconcile":
            self.reconciled = True
        elif kind == "action_ready":
            sets["admission"].add(action)
        elif kind == "action_start":  # admission, then the sandbox provisioned for it
            sets["admission"].discard(action)
            sets["execution"].add(action)
        elif kind == "action_done":
            sets["execution"].discard(action)
            sets["admission"].discard(action)
            sets["rebuild"].discard(agent)  # a failed rebuild emits no `rebuild`
        elif kind == "lifecycle_step":
            step = event.get("step")
            if step in TEARDOWN_STEPS and step != "destroy":  # destroy also ends workflows
                sets["teardown"].add(agent)
            elif event.get("step") in REMATERIALIZE_STEPS:
                sets["rebuild"].add(agent)
        elif kind == "teardown":
            sets["teardown"].discard(agent)
        elif kind == "rebuild":
            sets["rebuild"].discard(agent)
        elif kind == "workflow_end":
            for phase in ("teardown", "rebuild"):
                sets[phase].discard(agent)

    def active(self) -> list[str]:
        return [phase for phase in PHASES if self.sets[phase]]


class EventTail:
    """New whole lines of a growing JSON-lines file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = path.stat().st_size if path.exists() else 0
        self._partial = b""

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as fh:
            fh.seek(self._offset)
            data = fh.read()
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        events = []
        for line in lines:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return events


def _spawn(config_path: Path, log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "tenon.replay.faults", str(config_path)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _kill_one(config: FaultConfig, config_path: Path, number: int, target: str,
              rng: random.Random) -> dict[str, Any] | None:
    """Start the child, kill it in (or near) `target`; where it landed, or None when the
    replay finished first."""
    tail = EventTail(config.run_dir / EVENTS_FILE)
    tracker = PhaseTracker()
    started = time.monotonic()
    child = _spawn(config_path, config.out_dir / f"child-{number:02d}.log")
    deadline: float | None = None
    try:
        while child.poll() is None:
            for event in tail.read():
                tracker.feed(event)
            now = time.monotonic()
            ready = tracker.reconciled and now - started >= config.min_uptime_s
            if ready and deadline is None and (target in tracker.active()
                                               or now - started > config.phase_wait_s):
                deadline = now + rng.uniform(0.0, MAX_DELAY_S[target])
            if deadline is not None and now >= deadline:
                if target not in tracker.active() and now - started <= config.phase_wait_s:
                    deadline = None  # the phase ended before the chosen point: aim again
                    continue
                os.kill(child.pid, signal.SIGKILL)
                break
            time.sleep(POLL_S)
    finally:
        child.wait()
    for event in tail.read():  # everything the child wrote before it died
        tracker.feed(event)
    if deadline is None:
        return None
    active = tracker.active()
    landed = target if target in active else (active[0] if active else "idle")
    return {"kill": number, "target": target, "landed": landed, "active": active,
            "uptime_s": round(time.monotonic() - started, 3),
            "in_phase": {p: sorted(map(str, s)) for p, s in tracker.sets.items() if s}}


def committed_bytes(run_dir: Path) -> tuple[int, int, int]:
    """(records checked, committed bytes, bytes lost): every torn-down record's manifest
    against its workspace on disk, as a dead controller left them."""
    from tenon.state.recovery import RecoveryStore
    from tenon.state.workspace import WorkspaceStore, scan

    if not (run_dir / RECOVERY_DB).exists():
        return 0, 0, 0
    store = RecoveryStore(run_dir / RECOVERY_DB)
    workspaces = WorkspaceStore(run_dir)
    checked = total = lost = 0
    try:
        for record in store.all():
            if record.state != "torn_down" or record.manifest is None:
                continue
            files = {e.path: e for e in record.manifest.entries if e.kind == "file"}
            size = sum(e.size_bytes or 0 for e in files.values())
            path = workspaces.path_for(record.agent_id)
            if not path.is_dir():
                checked, total, lost = checked + 1, total + size, lost + size
                continue
            on_disk = {e.path: e for e in scan(path, fsync=False).entries}
            checked, total = checked + 1, total + size
            lost += sum(e.size_bytes or 0 for p, e in files.items() if on_disk.get(p) != e)
    finally:
        store.close()
    return checked, total, lost


def leftovers(config: FaultConfig) -> dict[str, Any]:
    """What the run left on the host after its last controller exited."""
    from tenon.host.leftovers import domain_cgroups, mounts_under, processes_of

    name = (config.run_dir / DOMAIN_FILE).read_text().strip()
    containers: int | None = None
    try:
        from tenon.sandbox.docker import DOMAIN_LABEL
        from tenon.sandbox.dockerd import connect

        client = connect(timeout_s=5.0)
        containers = len(client.containers.list(
            all=True, filters={"label": f"{DOMAIN_LABEL}={name}"}))
    except Exception as exc:  # no daemon: nothing can be left in it either
        logger.info("docker not reachable for the leftover check: %s", exc)
    return {"domain": name,
            "cgroups": [str(p) for p in domain_cgroups(name)],
            "containers": containers,
            "mounts": mounts_under(config.run_dir),
            "processes": processes_of(name, config.run_dir)}


def run_campaign(config: FaultConfig) -> dict[str, Any]:
    """Run the campaign (see the module docstring); the summary, also in faults.json."""
    if (config.run_dir / RECOVERY_DB).exists():
        raise ConfigError(f"{config.run_dir} holds an earlier campaign; use a fresh --out")
    config.out_dir.mkdir(parents=True, exist_ok=True)
    config_path = config.out_dir / "config.json"
    config_path.write_text(config.model_dump_json(indent=2))
    rng = random.Random(config.seed)
    order = list(PHASES)
    rng.shuffle(order)
    start = time.monotonic()
    kills: list[dict[str, Any]] = []
    checked = total = lost = 0
    for number in range(1, config.num_kills + 1):
        landed = _kill_one(config, config_path, number, order[(number - 1) % len(order)], rng)
        if landed is None:
            logger.warning("the replay finished before kill %d", number)
            break
        n, t, lo = committed_bytes(config.run_dir)
        landed.update(records_checked=n, committed_bytes=t, bytes_lost=lo)
        checked, total, lost = checked + n, total + t, lost + lo
        kills.append(landed)
        logger.info("kill %d landed in %s (target %s)", number, landed["landed"],
                    landed["target"])
    final = _spawn(config_path, config.out_dir / "child-final.log")
    try:
        exit_code = final.wait(timeout=config.child_timeout_s)
    except subprocess.TimeoutExpired:
        final.kill()
        exit_code = final.wait()
    summary = _summarize(config, kills, exit_code, (checked, total, lost),
                         time.monotonic() - start)
    (config.out_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _summarize(config: FaultConfig, kills: list[dict[str, Any]], exit_code: int,
               committed: tuple[int, int, int], wall_s: float) -> dict[str, Any]:
    from tenon.runtime.events import read_events

    journal = config.run_dir / JOURNAL_FILE
    completed = {json.loads(line)["workflow"] for line in journal.read_text().splitlines()
                 if '"completed"' in line} if journal.exists() else set()
    events = read_events(config.run_dir / EVENTS_FILE)
    logs = sorted(config.out_dir.glob("child-*.log"))
    mismatches = sum(p.read_text(errors="replace").count(MISMATCH_TEXT) for p in logs)
    landed = {phase: sum(k["landed"] == phase for k in kills) for phase in (*PHASES, "idle")}
    interrupted = {(agent, action) for e in events if e["kind"] == "reconcile"
                   for agent, action in e.get("interrupted", {}).items()}
    return {
        "num_kills": len(kills),
        "landed": landed,
        "workflows": config.num_workflows,
        "completed": len(completed),
        "all_completed": len(completed) == config.num_workflows and exit_code == 0,
        "final_exit_code": exit_code,
        "committed_records_checked": committed[0],
        "committed_bytes_checked": committed[1],
        "committed_bytes_lost": committed[2],
        "digest_mismatches": mismatches,
        "rebuilds": sum(e["kind"] == "rebuild" for e in events),
        "teardowns": sum(e["kind"] == "teardown" and e.get("outcome") == "torn_down"
                         for e in events),
        "recaptured": sum(len(e.get("recaptured", [])) for e in events
                          if e["kind"] == "reconcile"),
        "blocked": sum(len(e.get("blocked", {})) for e in events if e["kind"] == "reconcile"),
        "interrupted_actions": len(interrupted),
        "attempts_failed": sum(e["kind"] == "attempt_failed" for e in events),
        "leftover": leftovers(config),
        "wall_s": round(wall_s, 1),
        "config": json.loads(config.model_dump_json()),
        "kills": kills,
    }


def compact_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary to keep with results: each kill's target, landing and uptime, no ids;
    `passed` when every check holds."""
    out = {k: v for k, v in summary.items() if k not in ("kills", "config")}
    out["config"] = {k: v for k, v in summary["config"].items()
                     if k not in ("out_dir", "state_dir")}
    out["kills"] = [{k: kill[k] for k in ("kill", "target", "landed", "uptime_s",
                                          "committed_bytes", "bytes_lost")}
                    for kill in summary["kills"]]
    left = summary["leftover"]
    out["passed"] = bool(
        summary["all_completed"] and summary["committed_bytes_lost"] == 0
        and summary["digest_mismatches"] == 0 and not left["cgroups"]
        and not left["containers"] and not left["mounts"] and not left["processes"])
    return out


def main(argv: list[str]) -> int:
    """The child's entry point: `python -m tenon.replay.faults CONFIG_JSON`."""
    if len(argv) != 2:
        print("usage: python -m tenon.replay.faults CONFIG_JSON", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = FaultConfig.model_validate_json(Path(argv[1]).read_text())
    return asyncio.run(child_main(config))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
