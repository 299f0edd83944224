"""Open a runtime on a real backend over a state directory: lock it, reopen its workload
domain, reconcile what a dead controller left, restore its agents; clean up on exit."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from tenon.host.actuator import ActuatorPreference, FreezerActuator, GateActuator, choose_actuator
from tenon.host.diskfs import DiskLimits
from tenon.host.domain import WorkloadDomain
from tenon.policy.baselines import PolicySpec, parse_policy
from tenon.runtime.controller import Runtime
from tenon.sandbox.base import SandboxBackend
from tenon.sandbox.registry import make_backend
from tenon.state.statedir import DEFAULT_STATE_DIR, EVENTS_FILE, locked
from tenon.state.statedir import domain_name as domain_name_of

logger = logging.getLogger(__name__)


def leftover_remover(domain: WorkloadDomain, backend: SandboxBackend) -> list[str]:
    """Kill and remove every sandbox of `domain`: what the backend holds outside the domain
    (Docker's containers), then every cgroup below it. Called before any agent runs, so
    none of them is this controller's."""
    return [*backend.remove_leftovers(),
            *(f"cgroup:{rel}" for rel in domain.remove_children())]


def gate_actuator_for(policy: str | PolicySpec,
                      wanted: GateActuator | ActuatorPreference) -> GateActuator:
    """The actuator a runtime of `policy` gets: `wanted` itself, or the one a preference
    chooses when the policy uses the execution gate (the freezer, unused, when it does not)."""
    if not isinstance(wanted, str):
        return wanted
    spec = parse_policy(policy) if isinstance(policy, str) else policy
    if not spec.use_gate:
        return FreezerActuator()
    actuator, reason = choose_actuator(wanted)
    logger.info("gate actuator: %s", reason)
    return actuator


@contextlib.asynccontextmanager
async def open_runtime(
    *,
    budget_bytes: int | None,
    backend: str = "process",
    state_dir: Path = DEFAULT_STATE_DIR,
    run_dir: Path | None = None,
    domain_name: str | None = None,
    keep_agents: bool = False,
    gate_actuator: GateActuator | ActuatorPreference = "auto",
    **runtime_kwargs: Any,
) -> AsyncIterator[Runtime]:
    """A started, recovered `Runtime` over one state directory, `budget_bytes` its limit
    (None: no limit).

    The runtime's state directory (`runtime.statedir` describes its layout) is `run_dir`
    when given (the bench gives each run its own), else `state_dir`; `state_dir` also holds
    the base images. It is locked for the runtime's lifetime (a second controller gets
    StateDirBusy) and names the workload domain, created on first use; a restart reopens
    that domain, removes what the dead controller left there and restores its agents
    (`Runtime.recovered`). On exit every open workflow ends, its sandbox is destroyed and the
    domain removed, also on error or Ctrl-C; blocked agents keep their records.

    With `keep_agents` (a service restarting) no workflow ends on exit: idle agents at a
    restartable boundary are torn down, every other sandbox is destroyed, and every record
    and workspace is kept for the next `open_runtime` on the same directory to restore
    (`Runtime.close` says how); the domain is removed all the same.

    `gate_actuator`, an actuator or a preference (`gate_actuator_for`), holds sandboxes for
    the execution gate; `runtime.execution.actuator` is the one chosen.
    """
    home = run_dir or state_dir
    with locked(home):
        name = domain_name_of(home, domain_name)
        domain = WorkloadDomain.open(name, budget_bytes=budget_bytes)
        impl: SandboxBackend | None = None
        try:
            impl = make_backend(backend, domain, state_dir)
            runtime_kwargs.setdefault("event_log", home / EVENTS_FILE)
            # each agent's persistent root is its own size-limited filesystem
            runtime_kwargs.setdefault("workspace_limits", DiskLimits())
            actuator = gate_actuator_for(runtime_kwargs.get("policy", "tenon"), gate_actuator)
            runtime = Runtime(domain=domain, backend=impl, state_dir=home,
                              keep_agents=keep_agents, gate_actuator=actuator,
                              **runtime_kwargs)
            try:
                await runtime.start()
                runtime.recover(lambda: leftover_remover(domain, impl))
                yield runtime
            finally:
                await runtime.close()
        finally:
            try:
                if impl is not None:
                    with contextlib.suppress(Exception):
                        impl.remove_leftovers()
                domain.remove()
            finally:
                if impl is not None:
                    impl.release_domain()
