"""`tenon bench actuators`: the freezer against the sched_ext gate on real sandbox cgroups.

For each actuator, on a fresh child cgroup of a workload domain holding a process that
allocates memory steadily (one thread, or four):

- stop: from the hold request until memory.current stops growing (no change for
  `STABLE_S`; the time of the last change counts);
- resume: from the release until memory.current grows again;
- kill: with the sandbox held, from writing cgroup.kill until the cgroup is empty (the write
  itself must return at once: the controller never blocks on it);

and, once per actuator, the host's CPU busy share while idle over a few seconds (/proc/stat),
with the scheduler loaded and without it. Needs root, cgroup v2 and, for scx, sched_ext
(the test VM: scripts/vm/run.sh).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tenon.host.actuator import FreezerActuator, GateActuator, ScxActuator
from tenon.host.cgroup import SandboxCgroup
from tenon.host.domain import WorkloadDomain
from tenon.host.scx.loader import ScxGate, availability

POLL_S = 0.001
STABLE_S = 0.05
TIMEOUT_S = 10.0
IDLE_S = 3.0
HOLD_S = 1.0
MIB = 1 << 20

GROW = """
import sys, threading, time
num_threads = int(sys.argv[1])
blocks = []
def grow():
    while len(blocks) < 600:  # 1 MiB a millisecond per thread, every page touched
        blocks.append(bytearray(1 << 20))
        time.sleep(0.001)
    time.sleep(3600)
for _ in range(num_threads - 1):
    threading.Thread(target=grow, daemon=True).start()
grow()
"""


def _usage(box: SandboxCgroup) -> int:
    return box.sample()[0]


def _start(box: SandboxCgroup, num_threads: int) -> subprocess.Popen[bytes]:
    files = " ".join(str(f) for f in box.procs_files())
    script = f'for f in {files}; do echo $$ > "$f"; done; exec "$0" -c "$1" "$2"'
    proc = subprocess.Popen(["sh", "-c", script, sys.executable, GROW, str(num_threads)])
    _wait(lambda: _usage(box) > 32 * MIB, "the process to start growing")
    return proc


def _wait(done: Callable[[], bool], what: str) -> float:
    start = time.perf_counter()
    while not done():
        if time.perf_counter() - start > TIMEOUT_S:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(POLL_S)
    return time.perf_counter() - start


def _time_to_stable(box: SandboxCgroup, since: float) -> float:
    last, last_change = _usage(box), time.perf_counter()
    while time.perf_counter() - last_change < STABLE_S:
        if time.perf_counter() - since > TIMEOUT_S:
            raise TimeoutError("memory never stopped growing")
        time.sleep(POLL_S)
        now_usage = _usage(box)
        if now_usage != last:
            last, last_change = now_usage, time.perf_counter()
    return last_change - since


def _trial(domain: WorkloadDomain, actuator: GateActuator, num_threads: int,
           index: int) -> dict[str, float]:
    box = domain.sandbox(f"{actuator.name}-{num_threads}-{index}")
    proc = _start(box, num_threads)
    try:
        start = time.perf_counter()
        try:
            actuator.hold(box, timeout_s=TIMEOUT_S)
        finally:
            hold_call_s = time.perf_counter() - start
        stop_s = _time_to_stable(box, start)
        time.sleep(HOLD_S)
        held_usage = _usage(box)
        start = time.perf_counter()
        actuator.release(box, timeout_s=TIMEOUT_S)
        resume_s = _wait(lambda: _usage(box) > held_usage, "growth to resume")
        actuator.hold(box, timeout_s=TIMEOUT_S)
        _time_to_stable(box, time.perf_counter())
        assert box.v2_dir is not None
        start = time.perf_counter()
        (box.v2_dir / "cgroup.kill").write_text("1")
        kill_write_s = time.perf_counter() - start
        kill_s = _wait(lambda: not box.pids(), "the killed sandbox to empty")
        proc.wait(timeout=TIMEOUT_S)
        actuator.release(box, timeout_s=TIMEOUT_S)  # an empty cgroup, frozen or denied
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        box.remove()
    return {"hold_call_s": hold_call_s, "stop_s": stop_s, "resume_s": resume_s,
            "kill_write_s": kill_write_s, "kill_s": kill_s}


def idle_busy_share(seconds: float = IDLE_S) -> float:
    """The host's CPU busy share over `seconds` of doing nothing here (/proc/stat)."""
    def totals() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        idle = fields[3] + fields[4]
        return sum(fields[:8]) - idle, sum(fields[:8])
    busy0, total0 = totals()
    time.sleep(seconds)
    busy1, total1 = totals()
    return (busy1 - busy0) / max(total1 - total0, 1)


def run(*, num_trials: int = 3, thread_counts: tuple[int, ...] = (1, 4)) -> dict[str, Any]:
    """Every measurement for the freezer and, where available, sched_ext."""
    available, reason = availability()
    result: dict[str, Any] = {"scx_available": available, "scx_reason": reason,
                              "idle_busy_share": {"none": round(idle_busy_share(), 4)},
                              "actuators": {}}
    domain = WorkloadDomain.open(f"tenon-actbench-{uuid.uuid4().hex[:8]}")
    try:
        actuators: list[tuple[str, Callable[[], GateActuator]]] = [
            ("freezer", FreezerActuator)]
        if available:
            actuators.append(("scx", lambda: ScxActuator(ScxGate.load(), max_hold_s=20.0)))
        for name, make in actuators:
            actuator = make()
            try:
                if name == "scx":
                    result["idle_busy_share"]["scx"] = round(idle_busy_share(), 4)
                rows: dict[str, Any] = {}
                for num_threads in thread_counts:
                    trials = [_trial(domain, actuator, num_threads, i)
                              for i in range(num_trials)]
                    rows[f"{num_threads}-thread"] = {
                        key: round(statistics.median(t[key] for t in trials), 4)
                        for key in trials[0]} | {"trials": trials}
                if isinstance(actuator, ScxActuator):
                    rows["scheduler_stats"] = actuator.scheduler_stats()
                result["actuators"][name] = rows
            finally:
                actuator.close()
    finally:
        domain.remove()
    return result


def table(result: dict[str, Any]) -> str:
    """The medians as a markdown table."""
    lines = ["| actuator | threads | stop ms | resume ms | kill ms | kill write ms |",
             "|---|---|---|---|---|---|"]
    for name, rows in result["actuators"].items():
        for threads, row in rows.items():
            if threads == "scheduler_stats":
                continue
            lines.append(f"| {name} | {threads.split('-')[0]} | {row['stop_s'] * 1e3:.1f} | "
                         f"{row['resume_s'] * 1e3:.1f} | {row['kill_s'] * 1e3:.1f} | "
                         f"{row['kill_write_s'] * 1e3:.2f} |")
    idle = ", ".join(f"{k}: {v * 100:.2f}%" for k, v in result["idle_busy_share"].items())
    lines.append("")
    lines.append(f"idle CPU busy share (scheduler loaded or not): {idle}")
    lines.append(f"sched_ext: {result['scx_reason']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tenon.replay.actuator_bench")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    result = run(num_trials=args.trials)
    print(table(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
