"""Residency: tear idle sandboxes down safely and rebuild them from committed records.

Teardown runs, in this order: block dispatch, validate (the fail-closed restart-safe
check, skipped when the boundary's own check said restartable and nothing ran in the
sandbox since: `check_token`), capture (durable workspace + manifest, reading only what
changed), commit the recovery record, destroy. The invariant is that at every instant an
agent has a live sandbox or a committed record describing how to rebuild it, never neither:

- a failure before the commit leaves the sandbox resident, usable and unblocked;
- once the record is committed the sandbox is no longer dispatched to; destroy is
  retried, and a sandbox that still refuses to die is kept on a pending list that
  `reap()` (and the next rematerialize) retry, so it is never silently forgotten.

Rematerialize verifies the workspace against the record's digest, provisions a fresh
sandbox from the record and only then marks the new generation resident. Any failure
destroys the partial sandbox, marks the agent blocked and raises RecoveryError; a later
call starts again from the record, never from the partial state.

Dispatch blocking is a per-agent asyncio lock: `exec()` takes it, teardown and
rematerialize hold it for their whole duration, and teardown refuses (kept resident)
rather than wait when an action holds it.

Two things pin a live sandbox without the lock: a command run alongside the action in
flight (`exec_alongside`, which needs the sandbox live and dispatch not blocked) and a
workspace edit (`hold`). Teardown refuses (kept resident, step "held") while either runs.
An edit also excludes every lifecycle step (start, teardown, rematerialize): `hold` waits
for one in flight, and a lifecycle step waits for the edits in flight before it begins, so
a rebuild always verifies against the record as the edit left it.

Fault points: `faults(step, agent_id)` is called just before each step ("validate",
"capture", "commit", "destroy", "verify", "materialize"); raising from it injects a
failure at that step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from tenon.clock import Clock
from tenon.errors import RecoveryError, SandboxError
from tenon.host.diskfs import DiskLimits
from tenon.runtime.eligibility import check_restartable
from tenon.sandbox.base import ExecIO, ExecResult, Sandbox, SandboxBackend, SandboxSpec
from tenon.state.capture import CaptureRefused
from tenon.state.recovery import RecoveryRecord, RecoveryStore
from tenon.state.workspace import WorkspaceStore

logger = logging.getLogger(__name__)

TEARDOWN_STEPS = ("validate", "capture", "commit", "destroy")
REMATERIALIZE_STEPS = ("verify", "materialize")
# (sandbox id, actions and commands started in it): taken when the boundary's restart-safe
# check said restartable; equal at teardown, nothing ran since and the check stands.
CheckToken = tuple[str, int]
# SandboxSpec fields a backend config may set; anything else is rejected.
SPEC_CONFIG_KEYS = frozenset({"network", "max_pids", "tmp_size_bytes", "disposable", "env"})

# Runs blocking workspace I/O: a worker thread by default; `run_inline` under a simulated
# clock, where a real thread would let time jump while it works.
BlockingRunner = Callable[..., Awaitable[Any]]
FaultHook = Callable[[str, str], None]  # (step, agent_id); raise to inject a failure
TeardownOutcome = Literal["torn_down", "kept_resident", "destroy_pending"]


@dataclass(frozen=True)
class TeardownResult:
    """What a teardown did. `step` names the step that stopped it, if any."""

    agent_id: str
    outcome: TeardownOutcome
    reason: str
    step: str | None = None
    record: RecoveryRecord | None = None  # set once the record is committed


@dataclass
class _Slot:
    """The controller's in-memory view of one agent's physical sandbox."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    sandbox: Sandbox | None = None
    generation: int = 0
    image: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    dispatch_blocked: bool = False
    pending_destroy: list[Sandbox] = field(default_factory=list)
    holds: int = 0  # workspace edits in flight (`hold`)
    alongside: int = 0  # commands running next to the action in flight (`exec_alongside`)
    in_lifecycle: bool = False  # a start, teardown or rematerialize is past its wait for edits
    num_runs: int = 0  # actions and commands started in the live sandbox
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def notify(self) -> None:
        """Wake every waiter on this slot's holds and lifecycle steps."""
        self.changed.set()
        self.changed = asyncio.Event()

    async def unheld(self) -> None:
        """Return once no workspace edit is in flight."""
        while self.holds:
            await self.changed.wait()

    @contextlib.asynccontextmanager
    async def lifecycle_step(self) -> AsyncIterator[None]:
        """Mark a start, teardown or rematerialize in flight, once no edit runs."""
        await self.unheld()
        self.in_lifecycle = True
        try:
            yield
        finally:
            self.in_lifecycle = False
            self.notify()


def _spec_for(
    agent_id: str, generation: int, image: str, workspace: Any, config: Mapping[str, Any]
) -> SandboxSpec:
    unknown = set(config) - SPEC_CONFIG_KEYS - set(DiskLimits.CONFIG_KEYS)
    if unknown:
        raise RecoveryError(
            f"agent {agent_id}: unknown backend config keys {sorted(unknown)}; "
            f"known: {sorted(SPEC_CONFIG_KEYS | set(DiskLimits.CONFIG_KEYS))}"
        )
    # A fresh suffix per attempt: a half-removed earlier attempt must not collide by name.
    sandbox_id = f"{agent_id}-g{generation}-{uuid.uuid4().hex[:8]}"
    # disk_bytes / max_inodes size the agent's workspace filesystem (WorkspaceStore.create).
    fields = {k: v for k, v in config.items() if k not in DiskLimits.CONFIG_KEYS}
    if "disposable" in fields:  # JSON (the recovery record) carries it as a list
        fields["disposable"] = tuple(fields["disposable"])
    try:
        return SandboxSpec(sandbox_id=sandbox_id, image=image, workspace=workspace, **fields)
    except (TypeError, ValueError) as exc:
        raise RecoveryError(f"agent {agent_id}: bad backend config: {exc}") from exc


async def _exec(sandbox: Sandbox, command: str, timeout_s: float, max_output_bytes: int,
                io: ExecIO | None) -> ExecResult:
    """`sandbox.exec`, passing `io` only when there is one (so a backend without
    interactive commands still runs every plain one)."""
    if io is None:
        return await sandbox.exec(command, timeout_s=timeout_s,
                                  max_output_bytes=max_output_bytes)
    return await sandbox.exec(command, timeout_s=timeout_s, max_output_bytes=max_output_bytes,
                              io=io)


async def run_inline(fn: Callable[..., Any], *args: Any) -> Any:
    """A `BlockingRunner` that runs `fn` on the event loop's thread (simulations)."""
    return fn(*args)


class ResidencyManager:
    """Owns each agent's physical sandbox: start, exec, teardown, rematerialize, recover."""

    def __init__(
        self,
        backend: SandboxBackend,
        workspaces: WorkspaceStore,
        recovery: RecoveryStore,
        clock: Clock,
        *,
        faults: FaultHook | None = None,
        max_destroy_attempts: int = 3,
        destroy_retry_s: float = 0.1,
        blocking: BlockingRunner = asyncio.to_thread,
    ) -> None:
        if max_destroy_attempts < 1:
            raise ValueError(f"max_destroy_attempts must be >= 1, got {max_destroy_attempts}")
        self._backend = backend
        self._workspaces = workspaces
        self._recovery = recovery
        self._clock = clock
        self._faults = faults
        self._max_destroy_attempts = max_destroy_attempts
        self._destroy_retry_s = destroy_retry_s
        self._slots: dict[str, _Slot] = {}
        self._blocking = blocking

    # -- queries ---------------------------------------------------------------

    def sandbox_for(self, agent_id: str) -> Sandbox | None:
        slot = self._slots.get(agent_id)
        return None if slot is None else slot.sandbox

    def is_dispatch_blocked(self, agent_id: str) -> bool:
        slot = self._slots.get(agent_id)
        return slot is not None and slot.dispatch_blocked

    def check_token(self, agent_id: str) -> CheckToken | None:
        """What a restart-safe check of the agent's live sandbox made now stands for."""
        slot = self._slots.get(agent_id)
        if slot is None or slot.sandbox is None:
            return None
        return slot.sandbox.spec.sandbox_id, slot.num_runs

    def pending_destroys(self, agent_id: str | None = None) -> list[Sandbox]:
        """Sandboxes whose record is committed but whose destroy has not yet succeeded."""
        slots = self._slots.values() if agent_id is None else [self._slot(agent_id)]
        return [s for slot in slots for s in slot.pending_destroy]

    # -- lifecycle -------------------------------------------------------------

    async def start(
        self, agent_id: str, image: str, config: Mapping[str, Any] | None = None
    ) -> Sandbox:
        """Materialize a new agent's first sandbox, or return/rebuild an existing agent's."""
        slot = self._slot(agent_id)
        async with slot.lock:
            if slot.sandbox is not None:
                return slot.sandbox
            config = dict(config or {})
            async with slot.lifecycle_step():
                # after the wait: an edit of a new agent commits a record to rebuild from
                if self._recovery.get(agent_id) is not None:
                    return await self._rematerialize_stepped(agent_id, slot)
                workspace = await self._blocking(self._workspaces.create, agent_id, config)
                sandbox = await self._backend.materialize(
                    _spec_for(agent_id, 1, image, workspace, config)
                )
                try:
                    self._recovery.register(agent_id, image, self._backend.name, config)
                except BaseException:
                    await self._destroy_or_park(agent_id, slot, sandbox)
                    raise
                slot.sandbox, slot.generation, slot.image, slot.config = (
                    sandbox, 1, image, config)
            logger.info("agent %s: generation 1 materialized", agent_id)
            return sandbox

    async def exec(
        self, agent_id: str, command: str, *, timeout_s: float, max_output_bytes: int = 65536,
        io: ExecIO | None = None,
    ) -> ExecResult:
        """Run an action, rebuilding the sandbox first if it was torn down."""
        slot = self._slot(agent_id)
        async with slot.lock:
            if slot.dispatch_blocked:  # defensive: the lock already excludes teardown
                raise SandboxError(f"agent {agent_id}: dispatch is blocked")
            sandbox = slot.sandbox or await self._rematerialize_locked(agent_id, slot)
            slot.num_runs += 1
            return await _exec(sandbox, command, timeout_s, max_output_bytes, io)

    async def exec_alongside(
        self, agent_id: str, command: str, *, timeout_s: float, max_output_bytes: int = 65536,
        io: ExecIO | None = None,
    ) -> ExecResult:
        """Run `command` in the agent's live sandbox without the dispatch lock (the action
        in flight holds it). The sandbox stays pinned while it runs: teardown refuses.
        SandboxError when there is no live sandbox or a lifecycle step holds dispatch."""
        slot = self._slots.get(agent_id)
        sandbox = None if slot is None else slot.sandbox
        if slot is None or sandbox is None or slot.dispatch_blocked or slot.in_lifecycle:
            raise SandboxError(f"agent {agent_id}: no live sandbox to run a command alongside")
        slot.alongside += 1  # no await since the check: a teardown cannot have begun
        slot.num_runs += 1
        try:
            return await _exec(sandbox, command, timeout_s, max_output_bytes, io)
        finally:
            slot.alongside -= 1
            slot.notify()

    @contextlib.asynccontextmanager
    async def hold(self, agent_id: str) -> AsyncIterator[None]:
        """Hold off every lifecycle step of the agent while the body runs (a workspace
        edit): waits for one in flight first; teardown refuses and rebuilds wait meanwhile."""
        slot = self._slot(agent_id)
        while slot.in_lifecycle:
            await slot.changed.wait()
        slot.holds += 1  # no await since the check: no lifecycle step runs
        try:
            yield
        finally:
            slot.holds -= 1
            slot.notify()

    async def teardown(
        self, agent_id: str, *, agent_has_logical_state: bool = True,
        checked: CheckToken | None = None,
    ) -> TeardownResult:
        """Tear the agent's sandbox down if restart-safe; otherwise keep it resident.
        `checked`: the token of a restart-safe check that said restartable (`check_token`);
        when nothing ran in the sandbox since, that check stands and is not made again."""
        slot = self._slots.get(agent_id)
        if slot is None or slot.sandbox is None:
            raise RecoveryError(f"agent {agent_id} has no resident sandbox to tear down")
        if slot.lock.locked():
            return TeardownResult(
                agent_id, "kept_resident", "an action or lifecycle step is in flight", step="block"
            )
        async with slot.lock:
            if slot.sandbox is None:  # another lifecycle step took it meanwhile
                raise RecoveryError(f"agent {agent_id} has no resident sandbox to tear down")
            if slot.holds or slot.alongside:
                return TeardownResult(
                    agent_id, "kept_resident",
                    "a workspace edit or a command alongside the action is in flight",
                    step="held")
            slot.dispatch_blocked = True
            slot.in_lifecycle = True  # no await since the check: no edit or command began
            try:
                fresh = checked is not None and checked == self.check_token(agent_id)
                return await self._teardown_locked(agent_id, slot,
                                                   agent_has_logical_state, fresh)
            finally:
                slot.dispatch_blocked = False
                slot.in_lifecycle = False
                slot.notify()

    async def _teardown_locked(
        self, agent_id: str, slot: _Slot, agent_has_logical_state: bool, checked: bool
    ) -> TeardownResult:
        sandbox = slot.sandbox
        assert sandbox is not None  # checked by teardown() under the same lock
        step = "validate"
        try:
            self._fault(step, agent_id)
            if not (checked and agent_has_logical_state):
                eligibility = await self._blocking(check_restartable, sandbox,
                                                   agent_has_logical_state)
                if not eligibility.restartable:
                    return TeardownResult(agent_id, "kept_resident", eligibility.reason,
                                          step=step)
            step = "capture"
            self._fault(step, agent_id)
            record = self._recovery.get(agent_id)
            manifest = await self._blocking(self._workspaces.capture, agent_id,
                                            None if record is None else record.manifest)
            step = "commit"
            self._fault(step, agent_id)
            record = self._recovery.commit_teardown(
                agent_id,
                slot.generation,
                manifest.digest,
                slot.image,
                self._backend.name,
                slot.config,
                manifest=manifest,
            )
        except CaptureRefused as exc:  # what the root holds makes the boundary resident_only
            return TeardownResult(agent_id, "kept_resident", f"resident_only: {exc}", step=step)
        except Exception as exc:
            logger.warning(
                "agent %s: teardown stopped at %s, kept resident: %r", agent_id, step, exc
            )
            return TeardownResult(agent_id, "kept_resident", f"{step} failed: {exc!r}", step=step)
        # Committed: from here the agent is torn down; dispatch will rematerialize.
        slot.sandbox = None
        try:
            error = await self._destroy_with_retries(agent_id, sandbox)
        except BaseException:
            slot.pending_destroy.append(sandbox)
            raise
        if error is not None:
            slot.pending_destroy.append(sandbox)
            return TeardownResult(
                agent_id,
                "destroy_pending",
                f"record committed; destroy failed {self._max_destroy_attempts} time(s): "
                f"{error!r}; kept for reap()",
                step="destroy",
                record=record,
            )
        logger.info("agent %s: generation %d torn down", agent_id, slot.generation)
        return TeardownResult(
            agent_id, "torn_down", "record committed and sandbox destroyed", record=record
        )

    async def rematerialize(self, agent_id: str) -> Sandbox:
        """Rebuild the agent's sandbox from its committed record (see module docstring)."""
        slot = self._slot(agent_id)
        async with slot.lock:
            return await self._rematerialize_locked(agent_id, slot)

    async def _rematerialize_locked(self, agent_id: str, slot: _Slot) -> Sandbox:
        if slot.sandbox is not None:
            return slot.sandbox
        async with slot.lifecycle_step():
            return await self._rematerialize_stepped(agent_id, slot)

    async def _rematerialize_stepped(self, agent_id: str, slot: _Slot) -> Sandbox:
        record = self._recovery.get(agent_id)
        if record is None:
            raise RecoveryError(f"agent {agent_id} has no recovery record")
        generation = record.generation + 1
        sandbox: Sandbox | None = None
        step = "reap"
        try:
            if await self._reap_slot(agent_id, slot):
                raise RecoveryError("an earlier sandbox of this agent is not yet destroyed")
            step = "record"
            if record.manifest_digest is None:
                raise RecoveryError(
                    f"generation {record.generation} was lost while resident "
                    "and no workspace manifest was ever committed"
                )
            if record.backend != self._backend.name:
                raise RecoveryError(
                    f"record names backend {record.backend!r}, "
                    f"this controller runs {self._backend.name!r}"
                )
            workspace = await self._blocking(self._workspaces.attach, agent_id)
            spec = _spec_for(
                agent_id, generation, record.base_image, workspace, record.backend_config
            )
            step = "verify"  # before the sandbox exists: a mismatch never runs anything
            self._fault(step, agent_id)
            await self._blocking(
                self._workspaces.verify, agent_id, record.manifest_digest, record.manifest
            )
            step = "materialize"
            self._fault(step, agent_id)
            sandbox = await self._backend.materialize(spec)
            step = "mark_resident"
            self._recovery.mark_resident(agent_id, generation)
        except Exception as exc:
            reason = f"rematerializing generation {generation} failed at {step}: {exc}"
            if sandbox is not None:
                await self._destroy_or_park(agent_id, slot, sandbox)
            try:
                self._recovery.mark_blocked(agent_id, reason)
            except RecoveryError as block_exc:
                logger.error("agent %s: could not record the block: %s", agent_id, block_exc)
            raise RecoveryError(f"agent {agent_id} blocked: {reason}") from exc
        except BaseException:
            if sandbox is not None:
                slot.pending_destroy.append(sandbox)
            raise
        slot.sandbox, slot.generation = sandbox, generation
        slot.image, slot.config = record.base_image, dict(record.backend_config)
        logger.info("agent %s: generation %d rematerialized and verified", agent_id, generation)
        return sandbox

    def recover_all(self) -> list[RecoveryRecord]:
        """After a controller restart: every agent the store knows, loaded for dispatch.

        Nothing is rebuilt eagerly; an agent's next exec (or `rematerialize`) rebuilds it
        from its record. A record still marked resident means its sandbox died with the
        previous controller; it rebuilds only if the workspace still matches the last
        committed manifest, and blocks otherwise.
        """
        records = self._recovery.all()
        for record in records:
            slot = self._slot(record.agent_id)
            if slot.sandbox is None:
                slot.generation = record.generation
                slot.image, slot.config = record.base_image, dict(record.backend_config)
        logger.info("recovered %d agent record(s)", len(records))
        return records

    async def reap(self) -> int:
        """Retry destroying every pending sandbox; return how many are still pending."""
        remaining = 0
        for agent_id, slot in list(self._slots.items()):
            if slot.lock.locked():
                remaining += len(slot.pending_destroy)
                continue
            async with slot.lock:
                remaining += await self._reap_slot(agent_id, slot)
        return remaining

    async def finish(self, agent_id: str, *, delete_workspace: bool = True) -> None:
        """The agent's workflow is over: destroy its sandbox, forget its record."""
        slot = self._slot(agent_id)
        async with slot.lock:
            if slot.sandbox is not None:
                slot.pending_destroy.append(slot.sandbox)
                slot.sandbox = None
            if await self._reap_slot(agent_id, slot):
                raise SandboxError(f"agent {agent_id}: sandbox could not be destroyed")
            await slot.unheld()  # an edit in flight finishes before its root goes
            self._recovery.delete(agent_id)
            if delete_workspace:  # unmounting and removing it is disk work: off the loop
                await self._blocking(self._workspaces.delete, agent_id)
        self._slots.pop(agent_id, None)

    async def drop(self, agent_id: str) -> None:
        """Destroy the agent's live sandbox (without waiting for an action holding dispatch:
        its exec fails) and keep its record and workspace as they are: what a restart that
        keeps agents does to a sandbox it cannot tear down. A restart then restores the
        record as it would after a crash."""
        slot = self._slots.get(agent_id)
        if slot is None:
            return
        if slot.sandbox is not None:
            slot.pending_destroy.append(slot.sandbox)
            slot.sandbox = None
        if await self._reap_slot(agent_id, slot):
            raise SandboxError(f"agent {agent_id}: sandbox could not be destroyed")

    # -- helpers ---------------------------------------------------------------

    def _slot(self, agent_id: str) -> _Slot:
        self._workspaces.path_for(agent_id)  # validates the id before any state exists
        return self._slots.setdefault(agent_id, _Slot())

    def _fault(self, step: str, agent_id: str) -> None:
        if self._faults is not None:
            self._faults(step, agent_id)

    async def _destroy_with_retries(self, agent_id: str, sandbox: Sandbox) -> Exception | None:
        """Destroy `sandbox`; the last error if every attempt failed."""
        last: Exception | None = None
        for attempt in range(1, self._max_destroy_attempts + 1):
            try:
                self._fault("destroy", agent_id)
                await sandbox.destroy()
                return None
            except Exception as exc:
                last = exc
                logger.warning(
                    "agent %s: destroy of %s failed (attempt %d/%d): %r",
                    agent_id,
                    sandbox.spec.sandbox_id,
                    attempt,
                    self._max_destroy_attempts,
                    exc,
                )
                if attempt < self._max_destroy_attempts:
                    await self._clock.sleep(self._destroy_retry_s)
        return last

    async def _destroy_or_park(self, agent_id: str, slot: _Slot, sandbox: Sandbox) -> None:
        if await self._destroy_with_retries(agent_id, sandbox) is not None:
            slot.pending_destroy.append(sandbox)

    async def _reap_slot(self, agent_id: str, slot: _Slot) -> int:
        still: list[Sandbox] = []
        for sandbox in slot.pending_destroy:
            if await self._destroy_with_retries(agent_id, sandbox) is not None:
                still.append(sandbox)
        slot.pending_destroy = still
        return len(still)
