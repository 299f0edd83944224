"""Moving an agent between runtimes: one per node of a cluster, each over its own state
directory, all on storage every node can reach.

Two moves need it. A dispatcher re-places a torn-down agent from a saturated node to
another: the first runtime releases it (`release_agent`: it leaves that runtime, its root
unmounted, its record kept), the second adopts it (`adopt_agent`: root and record move into
its state directory; its next action rebuilds the sandbox there and verifies the manifest
digest), and the first then forgets it (`forget_agent`). And a node whose controller died is
taken over (`take_over`): a surviving runtime locks the dead state directory, reconciles it
as a restarted controller would, and adopts every agent whose record is committed.

What moves is only ever a committed record and the persistent root it describes, never a
live sandbox. The order makes every crash recoverable: the record is written into the
adopting store before the root moves (so the adopting runtime's reconcile never removes a
root that arrived without its record), the root's move leaves it whole on at least one side
(`WorkspaceStore.move_in`), and the releasing store keeps its record until `forget_agent`.
Adopting again after a crash midway finishes the move.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

from tenon.errors import ConfigError, HostError, TenonError, WorkspaceError
from tenon.host.domain import WorkloadDomain
from tenon.runtime.agents import AgentState, Phase
from tenon.runtime.controller import Agent, Runtime
from tenon.runtime.open import leftover_remover
from tenon.runtime.results import AgentClosed
from tenon.sandbox.base import SandboxBackend
from tenon.sandbox.registry import BACKENDS, make_backend
from tenon.state.reconcile import LeftoverRemover, reconcile
from tenon.state.recovery import RecoveryRecord, RecoveryStore
from tenon.state.statedir import DEFAULT_STATE_DIR, DOMAIN_FILE, RECOVERY_DB, locked
from tenon.state.statedir import domain_name as domain_name_of
from tenon.state.workspace import WorkspaceStore

logger = logging.getLogger(__name__)

# How often release waits out a rebuild that started meanwhile before it gives up.
MAX_RELEASE_ATTEMPTS = 3


@dataclass(frozen=True)
class Handoff:
    """An agent released by one runtime for another to adopt; picklable (crosses Ray)."""

    agent_id: str
    source_state_dir: Path
    """The releasing runtime's state directory (its root lies there)."""
    record: dict[str, Any]
    """The agent's recovery record, JSON-safe (`RecoveryRecord.to_dict`), as committed at
    release."""
    workflow: str | None
    """The agent's workflow name."""
    num_actions: int
    """Actions it completed so far (`Agent.num_actions_done` after adoption)."""


@dataclass(frozen=True)
class TakeOver:
    """What `take_over` adopted from a dead runtime's state directory."""

    adopted: dict[str, Agent]
    """Agent id -> the adopted agent (torn down; its next action rebuilds it)."""
    failed: dict[str, str]
    """Agent id -> why it could not continue (resident-only, ...); its record stays there."""
    interrupted: dict[str, str]
    """Agent id -> the action id that was in flight when the controller died."""


# -- release ---------------------------------------------------------------------------------


async def release_agent(runtime: Runtime, agent_id: str) -> Handoff | str:
    """Release an idle agent for adoption elsewhere: if it is resident at a restartable
    boundary it is torn down first (through the runtime's teardown path); a torn-down agent
    is released: it leaves this runtime (no longer in `runtime.agents`, its workflow left the
    gate, no event says the workflow ended), its root is unmounted but kept on disk, its record
    stays in this runtime's store until `forget_agent`. Returns a str (why not) and changes
    nothing when it cannot: busy, resident-only, blocked, failed, unknown.

    An agent that never ran gets its root and a generation-0 record first (as a workspace
    edit gives it), and is released as such: its first action materializes it there."""
    for _ in range(MAX_RELEASE_ATTEMPTS):
        state = runtime.agents.get(agent_id)
        if state is None or state.closed:
            return f"unknown: no open agent {agent_id!r}"
        why = await _settle(runtime, state)
        if why is not None:
            return why
        if _idle_committed(state):
            return await _release_committed(runtime, state)
    return f"busy: agent {agent_id} was rebuilt each time it was torn down for release"


async def _settle(runtime: Runtime, state: AgentState) -> str | None:
    """Bring an idle agent to torn down with a committed record; why not, if it cannot."""
    agent_id = state.agent_id
    where = runtime.residency_of(agent_id)
    if where in ("busy", "frozen"):
        return "busy: an action is in flight"
    if where == "failed":
        return f"failed: {state.failed_reason}"
    if where == "blocked":
        return f"blocked: {state.blocked_reason or state.failed_reason}"
    if where == "resident_only":
        return f"resident-only: {state.restart_reason or 'its last boundary was never checked'}"
    if where == "new":
        async with runtime.edit_workspace(agent_id):
            pass  # commits its root as generation 0: released as any torn-down agent
        return None
    if where == "resident":
        reason = await runtime.teardown_now(agent_id)
        if reason is not None:
            return reason.replace("resident_only", "resident-only", 1)
        return None
    if state.lifecycle is not None:  # a rebuild in flight: release the agent once it ends
        with contextlib.suppress(Exception):
            await state.lifecycle
    return None


def _idle_committed(state: AgentState) -> bool:
    """Torn down (or never run, its root committed), and nothing in flight."""
    return ((state.torn_down or (state.phase is Phase.NEW and state.root_made))
            and state.lifecycle is None and not (state.busy or state.alongside))


async def _release_committed(runtime: Runtime, state: AgentState) -> Handoff | str:
    """The agent leaves the runtime; its record and unmounted root stay for adoption."""
    agent_id = state.agent_id
    record = runtime._recovery.get(agent_id)
    if record is None or record.state != "torn_down" or record.manifest_digest is None:
        return f"not committed: agent {agent_id} has no torn-down record with a manifest"
    if runtime.residency.sandbox_for(agent_id) is not None:
        return f"resident: agent {agent_id} has a live sandbox"
    if runtime.residency.pending_destroys(agent_id):
        return f"destroy pending: an earlier sandbox of agent {agent_id} is not yet destroyed"
    num_actions = runtime.num_actions_before(agent_id) + len(state.history)
    # From here on nothing drives the agent: an action asked for now is refused (closed).
    state.phase = Phase.CLOSED
    runtime.agents.pop(agent_id, None)
    runtime.recovered.pop(agent_id, None)
    runtime.workflows.leave(agent_id)
    runtime.waker.notify()
    try:
        await runtime._blocking(runtime.workspaces.unmount, agent_id)
    except WorkspaceError as exc:  # adoption unmounts it again before moving it
        logger.warning("agent %s: root left mounted at release: %s", agent_id, exc)
    doc = record.to_dict()
    doc["num_actions"] = num_actions
    runtime.events.emit("agent_released", agent_id=agent_id, generation=record.generation,
                        workflow=state.workflow, num_actions=num_actions)
    return Handoff(agent_id, runtime.workspaces.root.parent, doc, state.workflow, num_actions)


def forget_agent(runtime: Runtime, agent_id: str) -> None:
    """After adoption elsewhere: delete the released agent's record from this runtime's store
    (its root already moved). Idempotent. ConfigError for an agent this runtime still runs,
    WorkspaceError while its root is still here (not adopted yet: the record describes it)."""
    if agent_id in runtime.agents:
        raise ConfigError(f"agent {agent_id!r} is open in this runtime; release it first")
    if runtime._recovery.get(agent_id) is None:
        return
    workspaces = runtime.workspaces
    if workspaces.path_for(agent_id).is_dir() or workspaces.image_for(agent_id).exists():
        raise WorkspaceError(f"agent {agent_id}: its root is still in {workspaces.root}; "
                             f"forget it only once another runtime adopted it")
    runtime._recovery.delete(agent_id)
    runtime.events.emit("agent_forgotten", agent_id=agent_id)


# -- adopt -------------------------------------------------------------------------------------


async def adopt_agent(runtime: Runtime, handoff: Handoff) -> Agent:
    """Adopt a released (or taken-over) agent: move its persistent root (directory and disk
    image) from the source state directory's workspace store into this runtime's (a rename
    on the same filesystem, else copy + fsync + remove), write its record into this runtime's
    recovery store (same generation, manifest, metadata, action count), restore it as recovery
    does (torn down; its next action rebuilds the sandbox and verifies the manifest digest),
    emit an `agent_adopted` event; the returned Agent has num_actions_done == handoff.num_actions.
    Re-running it after a crash midway (root already moved) works.

    Raises (changing nothing) for a record that is not a committed torn-down one, names
    another backend, or an agent id this runtime already has with another record."""
    record = _record_of(runtime, handoff)
    agent_id = handoff.agent_id
    source = WorkspaceStore(handoff.source_state_dir, limits=runtime.workspaces.limits)
    present = runtime.agents.get(agent_id)
    if present is not None:  # adopted before (perhaps restored by a restart since)
        return await _finish_adoption(runtime, handoff, record, present, source)
    mine = runtime._recovery.get(agent_id)
    if mine is not None and not _same_commit(mine, record):
        raise ConfigError(f"agent {agent_id!r} already has a record here (generation "
                          f"{mine.generation}), not the one handed off")
    imported = runtime._recovery.import_record(record)
    try:
        await runtime._blocking(runtime.workspaces.move_in, agent_id, source)
    except WorkspaceError:
        if mine is None and _root_in(source, agent_id):  # nothing moved: nothing imported
            runtime._recovery.delete(agent_id)
        raise
    state = runtime._restored_state(imported)
    runtime.events.emit("agent_adopted", agent_id=agent_id, generation=imported.generation,
                        workflow=state.workflow, num_actions=imported.num_actions,
                        source=str(handoff.source_state_dir))
    return Agent(runtime, state)


def _record_of(runtime: Runtime, handoff: Handoff) -> RecoveryRecord:
    """The handed-off record, checked before anything changes."""
    if runtime._closed:
        raise AgentClosed("the runtime is closed")
    record = RecoveryRecord.from_dict(handoff.record)
    if record.agent_id != handoff.agent_id:
        raise ConfigError(f"handoff of {handoff.agent_id!r} carries the record of "
                          f"{record.agent_id!r}")
    if record.state != "torn_down" or record.manifest_digest is None:
        raise ConfigError(f"agent {record.agent_id}: only a torn-down agent with a committed "
                          f"manifest can be adopted (its record is {record.state})")
    if record.backend != runtime.backend.name:
        raise ConfigError(f"agent {record.agent_id}: its record names backend "
                          f"{record.backend!r}, this runtime runs {runtime.backend.name!r}")
    if handoff.source_state_dir.resolve() == runtime.workspaces.root.parent.resolve():
        raise ConfigError(f"agent {record.agent_id} is already in this state directory")
    return replace(record, num_actions=handoff.num_actions)


async def _finish_adoption(runtime: Runtime, handoff: Handoff, record: RecoveryRecord,
                           state: AgentState, source: WorkspaceStore) -> Agent:
    """An agent this runtime already restored from the handed-off record: finish moving its
    root (a crash may have cut the move short) and return it."""
    mine = runtime._recovery.get(state.agent_id)
    if mine is None or not _same_commit(mine, record) or state.closed:
        raise ConfigError(f"agent {state.agent_id!r} already runs here with another record")
    if _root_in(source, state.agent_id):
        if not _idle_committed(state):
            raise ConfigError(f"agent {state.agent_id!r} runs here while its root is still "
                              f"in {handoff.source_state_dir}")
        await runtime._blocking(runtime.workspaces.move_in, state.agent_id, source)
    agent = runtime.recovered.get(state.agent_id)
    return agent if agent is not None else Agent(runtime, state)


def _same_commit(mine: RecoveryRecord, record: RecoveryRecord) -> bool:
    return (mine.generation, mine.manifest_digest) == (record.generation, record.manifest_digest)


def _root_in(store: WorkspaceStore, agent_id: str) -> bool:
    return store.path_for(agent_id).is_dir() or store.image_for(agent_id).exists()


# -- take over ---------------------------------------------------------------------------------


async def take_over(runtime: Runtime, dead_state_dir: Path, *,
                    dead_domain_name: str | None = None, same_host: bool = True) -> TakeOver:
    """Adopt what a dead runtime left in `dead_state_dir`: lock it (StateDirBusy if its
    controller still lives), reconcile it (on the same host, first kill and remove what the dead
    controller's sandboxes left: its domain's sandbox cgroups, by the domain name derived as
    open_runtime derives it unless given), then adopt every agent whose record is committed
    (restored or recaptured); blocked (resident-only) agents keep their records there and come
    back in `failed` with the reason. Finally the dead domain's cgroup is removed (same host).

    An adopted agent's record leaves the dead store; the dead directory's lock is held only
    while this runs, and no root of it stays mounted afterwards."""
    if not (dead_state_dir / RECOVERY_DB).is_file():
        raise ConfigError(f"{dead_state_dir} holds no recovery store ({RECOVERY_DB})")
    with locked(dead_state_dir):
        dead = _DeadDomain.open(runtime, dead_state_dir, dead_domain_name) if same_host else None
        store = RecoveryStore(dead_state_dir / RECOVERY_DB)
        workspaces = WorkspaceStore(dead_state_dir, limits=runtime.workspaces.limits)
        try:
            report = reconcile(store, workspaces,
                               remove_leftovers=None if dead is None else dead.remover)
            adopted, failed = await _adopt_all(runtime, store, dead_state_dir)
        finally:
            store.close()
            try:
                await runtime._blocking(workspaces.unmount_all)
            except WorkspaceError as exc:
                logger.error("taking over %s: roots left mounted: %s", dead_state_dir, exc)
            if dead is not None:
                dead.remove()
    runtime.events.emit("take_over", state_dir=str(dead_state_dir), adopted=sorted(adopted),
                        failed=failed, interrupted=dict(report.interrupted),
                        removed_sandboxes=list(report.removed_sandboxes))
    return TakeOver(adopted, failed, dict(report.interrupted))


async def _adopt_all(runtime: Runtime, store: RecoveryStore,
                     dead_state_dir: Path) -> tuple[dict[str, Agent], dict[str, str]]:
    """Adopt every committed agent of a reconciled store; each adopted one leaves it."""
    adopted: dict[str, Agent] = {}
    failed: dict[str, str] = {}
    for record in store.all():
        if record.state != "torn_down":
            failed[record.agent_id] = f"{record.state}: {record.reason or 'no reason recorded'}"
            continue
        workflow = record.agent_meta.get("workflow")
        handoff = Handoff(record.agent_id, dead_state_dir, record.to_dict(),
                          workflow if isinstance(workflow, str) else None, record.num_actions)
        try:
            adopted[record.agent_id] = await adopt_agent(runtime, handoff)
        except TenonError as exc:
            logger.warning("agent %s: not adopted from %s: %s", record.agent_id,
                           dead_state_dir, exc)
            failed[record.agent_id] = f"adoption failed: {exc}"
            continue
        store.delete(record.agent_id)
    return adopted, failed


@dataclass
class _DeadDomain:
    """The dead runtime's workload domain on this host, and a backend bound to it (for what
    it keeps outside the domain, e.g. Docker's containers)."""

    domain: WorkloadDomain
    backend: SandboxBackend | None

    @classmethod
    def open(cls, runtime: Runtime, state_dir: Path, name: str | None) -> _DeadDomain | None:
        if name is None and not (state_dir / DOMAIN_FILE).is_file():
            return None  # no controller of it ever opened a domain
        domain = WorkloadDomain.open(domain_name_of(state_dir, name), budget_bytes=None)
        backend = None
        if runtime.backend.name in BACKENDS:
            images = cast(Path, getattr(runtime.backend, "state_dir", DEFAULT_STATE_DIR))
            backend = make_backend(runtime.backend.name, domain, images)
        return cls(domain, backend)

    @property
    def remover(self) -> LeftoverRemover:
        if self.backend is None:
            return lambda: [f"cgroup:{rel}" for rel in self.domain.remove_children()]
        backend = self.backend
        return lambda: leftover_remover(self.domain, backend)

    def remove(self) -> None:
        try:
            self.domain.remove()
        except (HostError, OSError) as exc:
            logger.error("dead workload domain %s left behind: %s", self.domain.name, exc)
        finally:
            if self.backend is not None:
                self.backend.release_domain()
