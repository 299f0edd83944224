"""The residency demo (`tenon demo`): agents under a budget, torn down and rebuilt.

Each logical agent gets a workspace and a sandbox inside one workload domain. Every agent
runs an action that writes a file into its workspace and a memory burst on its tmpfs;
then every sandbox is torn down through the restart-safe protocol (memory returns to the
domain), rebuilt from its recovery record, and the workspace is checked byte for byte.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tenon.errors import BackendUnavailable, SandboxError
from tenon.host.diskfs import DiskLimits
from tenon.host.domain import WorkloadDomain
from tenon.replay.standalone import open_manager
from tenon.runtime.residency import ResidencyManager
from tenon.units import MIB, format_bytes

ACTION_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class AgentOutcome:
    agent_id: str
    first_exit: int
    teardown: str
    rebuilt_exit: int
    workspace_intact: bool
    scratch_cleared: bool  # the file in the disposable /scratch did not survive the rebuild


SCRATCH = "/scratch"


def _action(agent_id: str, burst_mib: int) -> str:
    # Writes durable state to /workspace and /tmp, and leaves a file in the disposable
    # /scratch tmpfs (declared so in the sandbox config: dropped at teardown) behind.
    return (
        f"echo 'notes of {agent_id}' > /workspace/notes.txt && "
        f"echo 'draft of {agent_id}' > /tmp/draft.txt && "
        f"head -c {burst_mib * MIB} /dev/zero > {SCRATCH}/burst && "
        "python3 -c 'import hashlib; print(hashlib.sha256(open(\"/workspace/notes.txt\","
        "\"rb\").read()).hexdigest())'"
    )


async def run_demo(*, backend: str, budget_bytes: int, num_agents: int, state_dir: Path,
                   image: str, console: Console, burst_mib: int = 64) -> list[AgentOutcome]:
    """Run the demo; raise on any broken promise (lost workspace, failed rebuild)."""
    try:
        async with open_manager(backend, state_dir=state_dir, budget_bytes=budget_bytes,
                                prefix="tenon-demo", limits=DiskLimits()) as (manager, domain):
            outcomes, resident_bytes, released_bytes, elapsed_s = await _exercise(
                manager, domain, num_agents, image, burst_mib, console)
    except BackendUnavailable as exc:
        raise SandboxError(str(exc)) from exc
    table = Table("agent", "action", "teardown", "rebuilt action", "workspace and /tmp intact",
                  "scratch fresh",
                  title=f"{num_agents} agents on {backend}, budget {format_bytes(budget_bytes)}")
    for o in outcomes:
        table.add_row(o.agent_id, str(o.first_exit), o.teardown, str(o.rebuilt_exit),
                      "yes" if o.workspace_intact else "[red]NO[/red]",
                      "yes" if o.scratch_cleared else "[red]NO[/red]")
    console.print(table)
    console.print(f"domain memory with all sandboxes resident: {format_bytes(resident_bytes)}; "
                  f"after teardown: {format_bytes(released_bytes)}; total {elapsed_s:.2f} s")
    if not all(o.workspace_intact and o.scratch_cleared and o.teardown == "torn_down"
               for o in outcomes):
        raise SandboxError("demo failed: a workspace was lost or a teardown was refused")
    return outcomes


def _ensure(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


async def _exercise(manager: ResidencyManager, domain: WorkloadDomain, num_agents: int,
                    image: str, burst_mib: int, console: Console
                    ) -> tuple[list[AgentOutcome], int, int, float]:
    """Run, tear down, rebuild and check every agent; always finish them all."""
    agents = [f"agent{i}" for i in range(num_agents)]
    outcomes: list[AgentOutcome] = []
    try:
        t0 = time.perf_counter()
        first = {}
        for agent in agents:
            await manager.start(agent, image, {"disposable": [SCRATCH]})
            first[agent] = await manager.exec(agent, _action(agent, burst_mib),
                                              timeout_s=ACTION_TIMEOUT_S)
        resident_bytes = domain.reading().usage_bytes
        teardowns = {a: await manager.teardown(a) for a in agents}
        released_bytes = domain.reading().usage_bytes
        for agent in agents:
            again = await manager.exec(
                agent, f"sha256sum /workspace/notes.txt; cat /tmp/draft.txt; ls {SCRATCH}",
                timeout_s=ACTION_TIMEOUT_S)
            expected = hashlib.sha256(f"notes of {agent}\n".encode()).hexdigest()
            lines = again.output.splitlines()
            intact = (bool(lines) and lines[0].split()[0] == expected
                      == first[agent].output.strip() and f"draft of {agent}" in lines[1:2])
            outcomes.append(AgentOutcome(agent, first[agent].exit_code,
                                         teardowns[agent].outcome, again.exit_code, intact,
                                         "burst" not in again.output))
        return outcomes, resident_bytes, released_bytes, time.perf_counter() - t0
    finally:
        for agent in agents:
            try:
                await manager.finish(agent)
            except Exception as exc:  # keep cleaning up the rest
                console.print(f"[yellow]cleanup of {agent}: {exc}[/yellow]")
