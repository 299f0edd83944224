"""The runtime: logical agents, their actions, and the two control loops around them.

    async with Runtime(domain=..., backend=..., state_dir=..., policy="tenon") as rt:
        agent = await rt.create_agent(image="tenon-base:bookworm")
        result = await agent.run("pytest -x", timeout=600)

The boundary loop runs at action boundaries, inside `Agent.run`: at action-ready it predicts
the action's demand and waits for admission (Tenon's water level, or nothing for the
baselines), rebuilds a torn-down sandbox when allowed (never under red, at most
`lifecycle_limit` lifecycle operations at once), then runs the action. At action-done it
releases the charge exactly once, checks restart safety (fail closed) and decides residency.
The execution loop (`ExecutionLoop`) runs every control period: it samples every running
sandbox, decides the gate, reclaims idle sandboxes under pressure, starts predictive
rebuilds under green, and re-runs admission as memory frees up.

An OOM kill or a lost sandbox fails the agent's workflow attempt: the result says so, and
the agent refuses further actions (`WorkflowFailed`); the caller decides on a retry.

For a service in front of the runtime (one sandbox per agent, commands as actions): an
action may be interactive (`ExecIO`); `Agent.run_alongside` runs a command next to the
action in flight; `edit_workspace` changes an agent's files from the host, resident or torn
down; `teardown_now` and `prewarm` tear down and rebuild on request; `residency_of` reads
an agent's state for observers; and `keep_agents` makes `close` leave every agent for the
next runtime on the same state directory instead of ending its workflow.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, Literal

from tenon.clock import Clock, SystemClock
from tenon.errors import (
    ConfigError,
    NotBusy,
    RecoveryError,
    SandboxDied,
    SandboxError,
    SandboxFrozen,
    UnknownAgent,
    WorkspaceError,
)
from tenon.host import diskfs
from tenon.host.actuator import GateActuator
from tenon.host.diskfs import DiskLimits
from tenon.host.types import CgroupVersion
from tenon.policy.admission import ActionRequest, AdmissionController, AdmitDecision
from tenon.policy.baselines import (
    AgentCgroupDomainObs,
    AgentCgroupSandbox,
    AgentCgroupState,
    PolicyKind,
    PolicySpec,
    WorkflowRequest,
    agentcgroup_class,
    agentcgroup_v2_step,
    parse_policy,
)
from tenon.policy.config import PolicyConfig
from tenon.policy.control import ControlPolicy
from tenon.policy.pressure import Pressure
from tenon.predict.base import ActionContext, MeasuredAction, Predictor
from tenon.predict.classify import classify_action
from tenon.predict.static import StaticPredictor
from tenon.runtime.agents import AgentState, Lifecycle, Phase, Waker
from tenon.runtime.boundary import Boundary
from tenon.runtime.events import EventLog
from tenon.runtime.execution import ExecutionLoop, RunningAction
from tenon.runtime.residency import BlockingRunner, ResidencyManager
from tenon.runtime.results import (
    ActionResult,
    ActionStats,
    AgentClosed,
    Outcome,
    WorkflowFailed,
)
from tenon.runtime.workflows import WorkflowGate
from tenon.sandbox.base import (
    DomainMeter,
    ExecIO,
    ExecResult,
    Sandbox,
    SandboxBackend,
    SandboxMeter,
)
from tenon.sandbox.netpolicy import NetworkPolicy
from tenon.state.reconcile import LeftoverRemover, ReconcileReport, reconcile
from tenon.state.recovery import RecoveryRecord, RecoveryStore
from tenon.state.workspace import WorkspaceStore

logger = logging.getLogger(__name__)

DEFAULT_IMAGE = "tenon-base:bookworm"

AgentResidency = Literal["new", "resident", "busy", "frozen", "torn_down", "resident_only",
                    "failed", "blocked"]



def with_user(io: ExecIO | None, user: str | None) -> ExecIO | None:
    """`io` set to run as `user` (a new `ExecIO` when there is none); `io` as it is when no
    user is named."""
    if user is None:
        return io
    return ExecIO(user=user) if io is None else dataclasses.replace(io, user=user)


class Agent:
    """A logical agent: its workspace and trajectory outlive any one physical sandbox."""

    def __init__(self, runtime: Runtime, state: AgentState, *,
                 interrupted: ActionResult | None = None) -> None:
        self._runtime = runtime
        self._state = state
        self.interrupted = interrupted
        """After a controller restart: the action the crash cut short (`Outcome.INTERRUPTED`),
        which the caller may run again; None otherwise."""

    @property
    def id(self) -> str:
        return self._state.agent_id

    @property
    def failed(self) -> bool:
        return self._state.failed_reason is not None

    @property
    def history(self) -> tuple[MeasuredAction, ...]:
        return tuple(self._state.history)

    @property
    def workflow(self) -> str | None:
        return self._state.workflow

    @property
    def num_actions_done(self) -> int:
        """Actions run to their end, over every controller this agent lived under."""
        return self._runtime.num_actions_before(self.id) + len(self._state.history)

    async def run(
        self,
        command: str,
        *,
        timeout: float,  # noqa: ASYNC109 - the action's timeout, enforced by the backend
        action_class: str | None = None,
        max_output_bytes: int = 65536,
        issued_command: str | None = None,
        io: ExecIO | None = None,
        user: str | None = None,
    ) -> ActionResult:
        """Run one action; returns its output, exit code, outcome and memory figures.

        `issued_command` is the command the agent issued when `command` is a stand-in for
        it (the replay's load program reproduces a recorded action's memory): predictors
        and the workflow's history see the issued command, never the stand-in, whose
        arguments are the very figures being predicted. `io` makes it an interactive
        command (streams, stdin, signals: `ExecIO`); it is still one predicted, admitted
        and gated action. `user` runs it as that user of the sandbox ("root": root inside
        the sandbox only; None: the default unprivileged user), as `ExecIO.user` does.
        """
        return await self._runtime.run_action(
            self._state, command, timeout_s=timeout, action_class=action_class,
            max_output_bytes=max_output_bytes, issued_command=issued_command,
            io=with_user(io, user),
        )

    async def run_alongside(
        self,
        command: str,
        *,
        timeout: float,  # noqa: ASYNC109 - enforced by the backend
        io: ExecIO | None = None,
        max_output_bytes: int = 65536,
        user: str | None = None,
    ) -> ExecResult:
        """Run `command` in the agent's live sandbox next to the action in flight, with no
        admission of its own: its memory is in the sandbox's cgroup, which the action's
        charge and the gate already cover (a gate hold holds it too). Waits for the action
        to have started in a live sandbox; raises `NotBusy` when the agent has no action in
        flight (or it ends first): run the command as an action then. The sandbox is not
        torn down while it runs, and a boundary it outlives is resident-only.
        """
        return await self._runtime.run_alongside(
            self._state, command, timeout_s=timeout, io=with_user(io, user),
            max_output_bytes=max_output_bytes)

    async def close(self, *, delete_workspace: bool = True) -> None:
        """End the workflow: destroy the sandbox, drop the record, free the workflow's place."""
        await self._runtime.close_agent(self._state, delete_workspace=delete_workspace)


class Runtime:
    """One workload domain, one backend, one policy; see the module docstring."""

    def __init__(
        self,
        *,
        domain: DomainMeter,
        backend: SandboxBackend,
        state_dir: Path,
        policy: str | PolicySpec = "tenon",
        config: PolicyConfig | None = None,
        clock: Clock | None = None,
        predictor: Predictor | None = None,
        event_log: Path | None = None,
        keep_events: bool = False,
        blocking: BlockingRunner = asyncio.to_thread,
        backend_config: Mapping[str, Any] | None = None,
        lifecycle_events: bool = False,
        workspace_limits: DiskLimits | None = None,
        keep_agents: bool = False,
        gate_actuator: GateActuator | None = None,
    ) -> None:
        """`keep_agents`: `close()` keeps every agent for the next runtime on the same state
        directory (see `close`). `gate_actuator` holds sandboxes for the gate (default: the
        cgroup freezer); the runtime closes it."""
        self._keep_agents = keep_agents
        self._gate_actuator = gate_actuator
        self.spec = parse_policy(policy) if isinstance(policy, str) else policy
        self.config = config or PolicyConfig()
        self.capacity = backend.capacity()
        self.clock = clock or SystemClock()
        self.domain = domain
        self.backend = backend
        if predictor is None or self.spec.static_predictor:  # the ablation forces static
            predictor = StaticPredictor(heavy_peak_bytes=self.config.heavy_peak_bytes)
        self.predictor = predictor
        self.events = EventLog(event_log, self.clock.now, keep_in_memory=keep_events)
        self._blocking = blocking
        self._backend_config = dict(backend_config or {})
        state_dir.mkdir(parents=True, exist_ok=True)
        self._recovery = RecoveryStore(state_dir / "recovery.sqlite")
        # With limits, each agent's persistent root is its own ext4 image (host.diskfs).
        self.workspaces = WorkspaceStore(state_dir, limits=workspace_limits)
        self.residency = ResidencyManager(
            backend, self.workspaces, self._recovery, self.clock, blocking=blocking,
            faults=self._lifecycle_step if lifecycle_events else None,
        )
        self.recovered: dict[str, Agent] = {}  # agents restored by `recover()`, by id
        self.last_reconcile: ReconcileReport | None = None
        self._actions_before: dict[str, int] = {}  # recovered agents' completed actions
        self._blocked: set[str] = set()  # recovered blocked agents: close() keeps their records
        self._make_policy(domain)
        self.lifecycle = Lifecycle(self.config.lifecycle_limit)
        self.waker = Waker()
        self.agents: dict[str, AgentState] = {}
        self.actions: dict[str, RunningAction] = {}
        # AgentCgroup on v2: the policy's state; the memory.high written per sandbox id
        self._agentcgroup = AgentCgroupState()
        self._agentcgroup_marks: dict[str, int | None] = {}
        self.boundary = Boundary(self, blocking)
        self._ids = itertools.count(1)
        self._loop_task: asyncio.Task[None] | None = None
        self._closed = False

    def _make_policy(self, domain: DomainMeter) -> None:
        """The policy objects for this runtime's spec: admission's window, the execution
        loop and its policy, the control step, the workflow gate."""
        budget = domain.budget_bytes
        self.admission = (
            AdmissionController(self.config, self.config.window_bytes(budget or (1 << 40)),
                                max_admitted_actions=self.capacity.max_admitted_actions)
            if self.spec.use_admission else None
        )
        self.execution = ExecutionLoop(
            domain=domain, config=self.config, events=self.events, use_gate=self.spec.use_gate,
            agentcgroup=self.spec.kind is PolicyKind.AGENTCGROUP, now=self.clock.now,
            actuator=self._gate_actuator,
        )
        self.control = ControlPolicy(self.config, self.execution.policy, self.admission,
                                     use_gate=self.spec.use_gate,
                                     use_residency=self.spec.use_residency)
        self.workflows = WorkflowGate(
            self.spec, budget, max_live=self.capacity.max_live_workflows
            if self.spec.kind is PolicyKind.TENON else None)

    # -- lifecycle of the runtime ------------------------------------------------

    async def __aenter__(self) -> Runtime:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        if self._loop_task is not None:
            return
        problems = self.backend.check()
        if self.workspaces.limits is not None:
            problems += diskfs.check()
        if problems:
            raise SandboxError(f"backend {self.backend.name} not ready: {'; '.join(problems)}")
        self.events.emit("runtime_start", policy=self.spec.name, backend=self.backend.name,
                         budget_bytes=self.domain.budget_bytes, predictor=self.predictor.name,
                         config=self.config.model_dump())
        self._loop_task = asyncio.ensure_future(self._execution_loop())

    async def close(self) -> None:
        """Stop the loops, end every open workflow, leave nothing running.

        With `keep_agents`, no workflow ends: each idle agent whose last boundary was
        restartable is torn down (its root committed), every other live sandbox is
        destroyed (an action in it fails), an agent that never ran gets its root and a
        generation-0 record, and every record and root is kept. The next runtime on the
        state directory restores them all through `recover()`, as after a crash: torn-down
        ones rebuild at their next action, resident-only ones are blocked with the reason.
        """
        if self._closed:
            return
        self._closed = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        self.execution.release_all(self.actions.values())
        self.execution.close()
        if self._keep_agents:
            await self._keep_all()
        for state in list(self.agents.values()):
            if self._keep_agents:
                break
            if state.agent_id in self._blocked and not state.busy:
                continue  # its record waits for `tenon agents unblock` or `discard`
            with contextlib.suppress(Exception):
                await self.close_agent(state)
        await self.residency.reap()
        try:  # a root kept past close_agent stays on its image, not mounted
            await self._blocking(self.workspaces.unmount_all)
        except WorkspaceError as exc:
            logger.error("workspaces left mounted: %s", exc)
        tally = self.boundary.tally
        self.events.emit("runtime_stop", boundaries=tally.num_checked,
                         restartable_boundaries=tally.num_restartable,
                         restartable_share=None if tally.share is None else round(tally.share, 4))
        self.events.close()
        self._recovery.close()

    # -- agents --------------------------------------------------------------------

    async def create_agent(
        self,
        *,
        image: str = DEFAULT_IMAGE,
        agent_id: str | None = None,
        family: str | None = None,
        task_prompt: str | None = None,
        profile_peak_bytes: int | None = None,
        workflow: str | None = None,
        task: str | None = None,
        network: NetworkPolicy | bool | Mapping[str, Any] | None = None,
    ) -> Agent:
        """A new logical agent (one workflow). Baselines that admit per workflow wait here;
        the sandbox itself is materialized when the first action is admitted. `workflow`
        names the workflow for the predictor (default: the agent id); `task` names what it
        attempts, so predictors learn from other attempts at the same task (default: none,
        they fall back to the family). `network` is what its sandbox may reach
        (`NetworkPolicy`; default: the runtime's backend config, no network unless it says)."""
        if self._closed:
            raise AgentClosed("the runtime is closed")
        if agent_id is None:  # skip ids of agents recovered from an earlier controller
            agent_id = f"agent-{next(self._ids):05d}"
            while agent_id in self.agents or self._recovery.get(agent_id) is not None:
                agent_id = f"agent-{next(self._ids):05d}"
        if agent_id in self.agents:
            raise ConfigError(f"agent {agent_id!r} already exists")
        self.workflows.check(profile_peak_bytes)
        state = AgentState(agent_id, image, family, task_prompt, profile_peak_bytes,
                           created_at=self.clock.now(), workflow=workflow, task=task)
        if network is not None:  # kept in its records, so every rebuild applies it again
            policy = NetworkPolicy.from_value(network)
            state.backend_config = {**self._backend_config, "network": policy.to_dict()}
        if self.spec.kind is PolicyKind.AGENTCGROUP:
            if profile_peak_bytes is None:
                raise ConfigError("the agentcgroup policy needs each workflow's profiled peak")
            state.agentcgroup_class = agentcgroup_class(
                profile_peak_bytes, self.domain.budget_bytes or 0, self.config)
        self.agents[agent_id] = state
        try:
            await self.workflows.enter(
                WorkflowRequest(agent_id, profile_peak_bytes or 0, state.created_at))
        except BaseException:
            self.agents.pop(agent_id, None)
            raise
        self.events.emit("workflow_start", agent_id=agent_id, workflow=state.workflow,
                         family=family, task=task, profile_peak_bytes=profile_peak_bytes,
                         waited_s=round(self.clock.now() - state.created_at, 4))
        return Agent(self, state)

    def _config_of(self, state: AgentState) -> Mapping[str, Any]:
        return self._backend_config if state.backend_config is None else state.backend_config

    async def _keep_all(self) -> None:
        """Leave every agent for the next runtime, `lifecycle_limit` of them at a time."""
        # restartable and idle, or with the next action only queued: torn down cleanly
        clean = self.boundary.teardown_candidates() if self.spec.use_residency else set()
        slots = asyncio.Semaphore(max(self.config.lifecycle_limit, 1))

        async def keep(state: AgentState) -> None:
            async with slots:
                try:
                    await self._keep(state, tear_down=state.agent_id in clean)
                except Exception:
                    logger.exception("agent %s: not kept cleanly", state.agent_id)

        await asyncio.gather(*(keep(state) for state in list(self.agents.values())))

    async def _keep(self, state: AgentState, *, tear_down: bool) -> None:
        """Leave the agent for the next runtime (`close` with `keep_agents`)."""
        agent_id = state.agent_id
        if state.lifecycle is not None:
            with contextlib.suppress(Exception):
                await state.lifecycle
            tear_down = self.spec.use_residency and state.idle and state.restartable
        how = "as_recorded"  # torn down or blocked: its record already describes it
        if self._recovery.get(agent_id) is None:
            async with self.residency.hold(agent_id):  # after a first materialize in flight
                if self._recovery.get(agent_id) is None:
                    await self._blocking(self.workspaces.create, agent_id, self._config_of(state))
                    await self._commit_root(state)
                    how = "recorded"
        if self.residency.sandbox_for(agent_id) is not None:
            how = "dropped"
            if tear_down:
                result = await self.residency.teardown(agent_id)
                if result.outcome != "kept_resident":
                    how = "torn_down"
                elif result.step == "validate":
                    self._recovery.mark_blocked(
                        agent_id, f"resident-only when the runtime stopped: {result.reason}")
            if how == "dropped":
                await self.residency.drop(agent_id)
        state.phase = Phase.CLOSED
        self.events.emit("agent_kept", agent_id=agent_id, how=how)

    async def close_agent(self, state: AgentState, *, delete_workspace: bool = True) -> None:
        if state.closed:
            return
        state.phase = Phase.CLOSED
        if state.lifecycle is not None:
            with contextlib.suppress(Exception):
                await state.lifecycle
        try:
            if state.root_made:
                await self.residency.finish(state.agent_id, delete_workspace=delete_workspace)
        finally:
            self.agents.pop(state.agent_id, None)
            self.workflows.leave(state.agent_id)
            self.events.emit("workflow_end", agent_id=state.agent_id,
                             failed=state.failed_reason, num_actions=len(state.history))
            self.waker.notify()

    def _agent(self, agent_id: str) -> AgentState:
        state = self.agents.get(agent_id)
        if state is None or state.closed:
            raise UnknownAgent(f"no open agent {agent_id!r}")
        return state

    def residency_of(self, agent_id: str) -> AgentResidency:
        """Where the agent's sandbox is now, read off memory (no I/O): "new" (never
        materialized), "busy" (an action or a command alongside it in flight), "frozen"
        (that action held by the gate), "resident", "resident_only" (idle, but its last
        boundary was not restartable), "torn_down", "failed" (an OOM kill or a lost sandbox
        ended its attempt) or "blocked" (its rebuild failed or a restart blocked it)."""
        state = self._agent(agent_id)
        if state.blocked_reason is not None or (
                agent_id in self._blocked and state.failed_reason is not None):
            return "blocked"
        if state.failed_reason is not None:
            return "failed"
        action = state.action
        if action is not None and action.started and not action.allowed:
            return "frozen"
        if state.busy or state.alongside:
            return "busy"
        if not state.materialized:
            return "new"
        if state.torn_down:
            return "torn_down"
        if self.spec.use_residency and not state.restartable:
            return "resident_only"
        return "resident"

    async def run_alongside(self, state: AgentState, command: str, *, timeout_s: float,
                            io: ExecIO | None = None,
                            max_output_bytes: int = 65536) -> ExecResult:
        """See `Agent.run_alongside`."""
        if timeout_s <= 0:
            raise ConfigError(f"timeout must be positive, got {timeout_s}")
        while True:
            if state.closed or self._closed:
                raise AgentClosed(f"agent {state.agent_id} is closed")
            action = state.action
            if action is None:
                raise NotBusy(f"agent {state.agent_id} has no action in flight")
            if (action.launched and not action.done
                    and self.residency.sandbox_for(state.agent_id) is not None):
                state.alongside += 1
                try:
                    return await self.residency.exec_alongside(
                        state.agent_id, command, timeout_s=timeout_s,
                        max_output_bytes=max_output_bytes, io=io)
                except SandboxFrozen:  # a gate hold: wait for it, as the action does
                    await self.clock.sleep(self.config.control_period_s)
                    continue
                finally:
                    state.alongside -= 1
                    self.waker.notify()
            # a launch does not always notify: look again each control period at the latest
            await self._wait_for_change(self.config.control_period_s)

    async def _wait_for_change(self, at_most_s: float) -> None:
        """Until the waker fires or `at_most_s` passes on the runtime's clock."""
        woken = asyncio.ensure_future(self.waker.wait())
        slept = asyncio.ensure_future(self.clock.sleep(at_most_s))
        try:
            await asyncio.wait({woken, slept}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
            slept.cancel()

    @contextlib.asynccontextmanager
    async def edit_workspace(self, agent_id: str) -> AsyncIterator[Path]:
        """The agent's persistent root, mounted, for the host to change its files.

        An agent that never materialized gets its root now (as its first sandbox would
        make it, with the runtime's backend config). While the body runs no teardown,
        rebuild or first materialization of the agent starts (one in flight is waited
        for). Afterwards, when the agent has no live sandbox, its root is captured and the
        record committed again (generation unchanged; a new agent's as generation 0), so
        the next rebuild verifies, and sees, the edited content. A blocked agent's record is
        left as it is. The live sandbox, if any, sees every change at once.

        The body must not wait for an action of the same agent: a rebuild that action
        needs waits for the edit to end.
        """
        state = self._agent(agent_id)
        if state.lifecycle is not None:
            with contextlib.suppress(Exception):
                await state.lifecycle
        async with self.residency.hold(agent_id):
            if state.closed:
                raise AgentClosed(f"agent {agent_id} was closed")
            if self._recovery.get(agent_id) is None:
                root = await self._blocking(self.workspaces.create, agent_id,
                                            self._config_of(state))
                state.root_made = True
            else:
                root = await self._blocking(self.workspaces.attach, agent_id)
            try:
                yield root
            finally:
                if self.residency.sandbox_for(agent_id) is None:
                    await self._commit_root(state)

    @contextlib.asynccontextmanager
    async def live_sandbox(self, agent_id: str) -> AsyncIterator[Sandbox]:
        """The agent's live sandbox, held for the body as `edit_workspace` holds its root
        (no teardown or rebuild starts meanwhile; what the body writes, the next teardown
        captures). A torn-down agent is rebuilt first (as `prewarm`), a new one
        materialized (as its first action would, without waiting for admission). The body
        must not wait for an action of the same agent. WorkflowFailed when the agent
        failed, RecoveryError when its rebuild does."""
        state = self._agent(agent_id)
        while True:
            if state.closed:
                raise AgentClosed(f"agent {agent_id} is closed")
            if state.failed_reason is not None:
                raise WorkflowFailed(f"agent {agent_id}: {state.failed_reason}")
            if not state.materialized and not state.busy:
                await self.boundary.ensure_sandbox(state, self._config_of(state))
            else:
                await self.boundary.prewarm(state)
            async with self.residency.hold(agent_id):
                sandbox = self.residency.sandbox_for(agent_id)
                if sandbox is not None:
                    yield sandbox
                    return
            # an action's own rebuild in flight, or a teardown came first: look again
            await self._wait_for_change(self.config.control_period_s)

    async def _commit_root(self, state: AgentState) -> None:
        """Capture the root of an agent without a live sandbox and commit its record again
        (a new agent's as generation 0, which its first materialization rebuilds from)."""
        agent_id = state.agent_id
        record = self._recovery.get(agent_id)
        if record is not None and record.state != "torn_down":
            return  # blocked: its reason stands; resident: its next teardown captures
        manifest = await self._blocking(self.workspaces.capture, agent_id)
        if record is None:
            self._recovery.commit_teardown(agent_id, 0, manifest.digest, state.image,
                                           self.backend.name, self._config_of(state),
                                           manifest=manifest)
            self._recovery.note_agent_meta(agent_id, _agent_meta(state))
        else:
            self._recovery.commit_teardown(agent_id, record.generation, manifest.digest,
                                           record.base_image, record.backend,
                                           record.backend_config, manifest=manifest)
        state.root_made = True
        self.events.emit("workspace_committed", agent_id=agent_id,
                         generation=0 if record is None else record.generation,
                         digest=manifest.digest)

    async def teardown_now(self, agent_id: str) -> str | None:
        """Tear the agent's sandbox down now if it is idle and its last boundary was
        restartable (through the lifecycle limit, as any teardown). None when it is torn
        down, already was, or never had a sandbox; otherwise why it stays resident."""
        state = self._agent(agent_id)
        while True:
            task = state.lifecycle
            if task is not None and not task.done():  # a teardown or rebuild: its outcome
                with contextlib.suppress(Exception):
                    await task
                continue
            if state.closed or not state.materialized or state.torn_down:
                return None
            if state.failed_reason is not None:
                return f"failed: {state.failed_reason}"
            if state.busy or state.alongside:
                return "busy: an action is in flight"
            if not self.spec.use_residency:
                return f"resident_only: policy {self.spec.name} keeps every sandbox resident"
            if not state.restartable:
                return f"resident_only: {state.restart_reason or 'never checked'}"
            if self.lifecycle.try_acquire():
                break
            await self.waker.wait()
        result = await self.boundary.teardown_acquired(state, why="asked")
        if state.torn_down:
            return None
        return "kept_resident: " + (result.reason if result is not None else "teardown failed")

    async def prewarm(self, agent_id: str) -> None:
        """Rebuild a torn-down agent's sandbox now, as its next action would (under the
        lifecycle limit, never under red); returns once it is resident. A no-op when it is
        resident, busy (its action rebuilds) or new (an action materializes it).
        RecoveryError when the rebuild fails (the agent is blocked)."""
        state = self._agent(agent_id)
        await self.boundary.prewarm(state)

    # -- the boundary loop: one action -------------------------------------------

    async def run_action(
        self,
        state: AgentState,
        command: str,
        *,
        timeout_s: float,
        action_class: str | None,
        max_output_bytes: int,
        issued_command: str | None = None,
        io: ExecIO | None = None,
        user: str | None = None,
    ) -> ActionResult:
        if state.closed or self._closed:
            raise AgentClosed(f"agent {state.agent_id} is closed")
        if state.failed_reason is not None:
            raise WorkflowFailed(f"agent {state.agent_id}: {state.failed_reason}")
        if state.busy:
            raise SandboxError(f"agent {state.agent_id} already runs an action")
        if timeout_s <= 0:
            raise ConfigError(f"timeout must be positive, got {timeout_s}")
        state.busy = True
        try:
            return await self._run_action(state, command, timeout_s, action_class,
                                          max_output_bytes, issued_command or command, io)
        finally:
            state.busy = False

    async def _run_action(self, state: AgentState, command: str, timeout_s: float,
                          action_class: str | None, max_output_bytes: int,
                          issued_command: str, io: ExecIO | None) -> ActionResult:
        ready_at = self.clock.now()
        state.note_ready(ready_at)
        self._rank(state, ready_at)
        klass = action_class or classify_action("Bash", issued_command)
        context = ActionContext(state.workflow or state.agent_id, issued_command, klass,
                                len(state.history), state.family, state.task_prompt,
                                tuple(state.history), state.task)
        prediction = self.predictor.predict(context)
        number = self.num_actions_before(state.agent_id) + len(state.history) + 1
        action_id = f"{state.agent_id}-a{number:04d}"
        action = RunningAction(action_id, state.agent_id, prediction, 0, ready_at,
                               profiled_peak_bytes=(state.profile_peak_bytes
                                                    if state.agentcgroup_class is not None
                                                    else None),
                               context=context)
        self.events.emit("action_ready", action_id=action_id, agent_id=state.agent_id,
                         action_class=klass, predicted_avg_bytes=prediction.avg_bytes,
                         predicted_peak_bytes=prediction.peak_bytes,
                         heavy=prediction.heavy_risk, rank_at=round(state.rank, 3))
        admitted = False
        state.action = action
        try:
            decision = await self.boundary.admit(action, ActionRequest(
                action_id, state.agent_id, prediction, ready_at, state.rank))
            admitted = True
            action.charge_bytes = decision.charge_bytes if decision else 0
            if state.lifecycle is not None:  # a teardown or predictive rebuild in flight
                with contextlib.suppress(Exception):
                    await state.lifecycle
            sandbox = await self.boundary.ensure_sandbox(state, self._config_of(state))
            self._recovery.note_action_start(state.agent_id, action_id,
                                             agent_meta=_agent_meta(state))
            return await self._execute(state, action, sandbox, command, context, timeout_s,
                                       max_output_bytes, io)
        finally:
            state.action = None
            self.actions.pop(action_id, None)
            if admitted:
                self.boundary.release(action)
            self.waker.notify()

    @staticmethod
    def _rank(state: AgentState, ready_at: float) -> None:
        """Place the agent in line for its next action: when it would be ready had Tenon
        never made it wait (the most delayed first). The delay is then spread over every
        workflow instead of piling up on one: a long workflow behind every younger one's
        actions, one wait per action, finishes last by the sum of its waits."""
        state.rank_at = ready_at - state.delayed_s

    async def _execute(self, state: AgentState, action: RunningAction, sandbox: Sandbox,
                       command: str, context: ActionContext, timeout_s: float,
                       max_output_bytes: int, io: ExecIO | None = None) -> ActionResult:
        """Launch the admitted action when the gate lets it, run it, measure it, learn from
        it, and close its boundary."""
        meter = sandbox.cgroup
        await self._launch_when_let_go(state, action, sandbox)
        start = await self._begin(state, action, meter)
        assert action.stats is not None
        result: ExecResult | None = None
        died: str | None = None
        try:
            result = await self._exec_when_let_go(state.agent_id, command, timeout_s,
                                                  max_output_bytes, io)
        except SandboxDied as exc:
            died = str(exc)
        finally:
            self.execution.end_action(action)
            self.execution.release_all([action])
        end = self.clock.now()
        try:
            last = meter.reading()
            oom_kills = meter.new_oom_kills()
            avg, peak = action.stats.finish(end, last.usage_bytes, last.peak_bytes)
            idle_bytes = last.usage_bytes
        except OSError:  # the cgroup went with the sandbox
            oom_kills, avg, peak = 0, action.stats.peak_bytes, action.stats.peak_bytes
            idle_bytes = action.last_usage_bytes
        outcome = _outcome(result, died, oom_kills)
        if outcome.fails_attempt:
            state.failed_reason = died or f"OOM kill during {action.action_id}"
        measured = MeasuredAction(context.action_class, avg, peak, end - start,
                                  context.command, oom_killed=outcome is Outcome.OOM_KILLED)
        self._learn(state, context, measured, outcome)
        state.note_done(end)
        workspace_full = self._report_done(state, action, outcome, result, measured, oom_kills,
                                           io)
        await self._close_boundary(state, sandbox, outcome, idle_bytes)
        return ActionResult(
            action.action_id, state.agent_id, outcome,
            -9 if result is None else result.exit_code,
            died or ("" if result is None else result.output),
            False if result is None else result.truncated,
            end - start, start - action.ready_at, avg, peak,
            action.prediction.avg_bytes, action.prediction.peak_bytes, action.charge_bytes,
            context.action_class, workspace_full=workspace_full,
        )

    async def _launch_when_let_go(self, state: AgentState, action: RunningAction,
                                  sandbox: Sandbox) -> None:
        """Enter the gate's view; wait while it holds the start."""
        meter = sandbox.cgroup
        first = meter.reading()
        action.meter, action.gate_id = meter, sandbox.spec.sandbox_id
        action.last_usage_bytes = first.usage_bytes
        if self.execution.start_action(action):
            return
        self.events.emit("start_held", action_id=action.action_id, agent_id=state.agent_id)
        assert action.launch is not None
        try:
            await action.launch
        except BaseException:
            self.execution.end_action(action)
            raise
        if self._closed:
            self.execution.end_action(action)
            raise AgentClosed(f"agent {state.agent_id}: the runtime closed")

    async def _begin(self, state: AgentState, action: RunningAction,
                     meter: SandboxMeter) -> float:
        """The action starts: baselines for its OOM kills and peak, then its stats."""
        start = self.clock.now()
        state.delayed_s += max(start - action.ready_at, 0.0)
        meter.new_oom_kills()  # the baseline: only kills during this action count
        # a mark left by an earlier, larger action would hide this one's peak between samples
        await self._blocking(meter.reset_peak)
        first = meter.reading()
        action.stats = ActionStats(start, first.usage_bytes, first.peak_bytes)
        await self._apply_agentcgroup_mark(state, action)
        self.events.emit("action_start", action_id=action.action_id, agent_id=state.agent_id,
                         sandbox_id=action.gate_id, charge_bytes=action.charge_bytes,
                         queued_s=round(start - action.ready_at, 4))
        return start

    def _learn(self, state: AgentState, context: ActionContext, measured: MeasuredAction,
               outcome: Outcome) -> None:
        """The predictor learns from the measured action."""
        state.history.append(measured)
        if outcome is not Outcome.SANDBOX_DIED:
            self.predictor.observe(context, measured)
            if measured.oom_killed or measured.peak_bytes > self.config.heavy_peak_bytes:
                self.boundary.repredict_queued()

    def _report_done(self, state: AgentState, action: RunningAction, outcome: Outcome,
                     result: ExecResult | None, measured: MeasuredAction, oom_kills: int,
                     io: ExecIO | None) -> str | None:
        """Record the action's end and tell the caller its outcome; why the workspace
        refuses writes now, if it does."""
        self.events.emit("action_done", action_id=action.action_id, agent_id=state.agent_id,
                         outcome=outcome.value, exit_code=None if result is None
                         else result.exit_code, duration_s=round(measured.duration_s, 4),
                         avg_bytes=measured.avg_bytes, peak_bytes=measured.peak_bytes,
                         oom_kills=oom_kills)
        if io is not None and io.on_outcome is not None:
            try:
                io.on_outcome(outcome.value, -9 if result is None else result.exit_code)
            except Exception:  # a caller's callback never breaks the boundary
                logger.exception("on_outcome of %s", action.action_id)
        workspace_full = self._workspace_full(state.agent_id) if result is not None else None
        if workspace_full is not None:
            self.events.emit("workspace_full", action_id=action.action_id,
                             agent_id=state.agent_id, reason=workspace_full)
        if outcome is Outcome.OOM_KILLED:
            self.events.emit("oom_kill", action_id=action.action_id, agent_id=state.agent_id,
                             sandbox_id=action.gate_id, num_kills=oom_kills)
        return workspace_full

    async def _close_boundary(self, state: AgentState, sandbox: Sandbox, outcome: Outcome,
                              idle_bytes: int) -> None:
        """Action-done: the restart-safe check and residency, then the boundary's record."""
        # A runtime stopping and keeping its agents may have destroyed the sandbox under
        # the action: its marks stay as a crash leaves them (in flight, previous boundary).
        kept = self._closed and self._keep_agents
        if not outcome.fails_attempt and self.spec.use_residency and not kept:
            await self.boundary.after_action(state, sandbox, last_usage=idle_bytes)
        if not outcome.fails_attempt and not state.closed and not kept:  # closed: no record
            # before any teardown of this boundary runs: a crash later restores by it
            checked = self.spec.use_residency
            self._recovery.note_action_done(
                state.agent_id,
                boundary=("unchecked" if not checked else
                          "restartable" if state.restartable else "resident_only"),
                reason=state.restart_reason if checked else None)

    def _workspace_full(self, agent_id: str) -> str | None:
        """Why the agent's persistent root refuses writes after an action, if it does (one
        statvfs; a plain-directory store has no limit to reach). Never fails the action."""
        try:
            return self.workspaces.full_reason(agent_id)
        except WorkspaceError as exc:
            logger.warning("usage of %s's workspace: %s", agent_id, exc)
            return None

    async def _apply_agentcgroup_mark(self, state: AgentState, action: RunningAction) -> None:
        """AgentCgroup sets a tool call's memory.high as it starts (v2), from the policy's
        current plan. On v1 the execution loop throttles CPU over the mark instead."""
        if state.agentcgroup_class is not None and self.domain.version is CgroupVersion.V2:
            await self._agentcgroup_period(start=action)

    async def _agentcgroup_period(self, start: RunningAction | None = None) -> None:
        """AgentCgroup on v2, once per control period and at each tool call's start: observe
        the domain (usage, limit, memory PSI) and its running sandboxes, step the pure policy
        (`agentcgroup_v2_step`), and write the memory.high marks that moved (and `start`'s:
        each tool call sets its own)."""
        running = {a.gate_id: a for a in self.actions.values()
                   if a.started and a.profiled_peak_bytes is not None}
        if start is not None:
            running[start.gate_id] = start
        reading = self.domain.reading()
        plan = agentcgroup_v2_step(
            [AgentCgroupSandbox(gate_id, a.profiled_peak_bytes or 0, a.usage_bytes)
             for gate_id, a in running.items()],
            AgentCgroupDomainObs(reading.usage_bytes, reading.limit_bytes,
                                 self._domain_psi_some_total_us()),
            self._agentcgroup, self.domain.budget_bytes or 0, self.clock.now(), self.config)
        if (plan.state.protected_since is None) != (self._agentcgroup.protected_since is None):
            self.events.emit("agentcgroup", protected=plan.state.protected_since is not None,
                             trigger=plan.trigger)
        self._agentcgroup = plan.state
        marks = {}
        for mark in plan.marks:
            action, high = running[mark.sandbox_id], mark.high_mark_bytes
            marks[mark.sandbox_id] = high
            if action.meter is None or (action is not start and
                                        self._agentcgroup_marks.get(mark.sandbox_id) == high):
                continue
            try:
                await self._blocking(action.meter.set_memory_high, high)
            except OSError as exc:  # the sandbox went between observing and acting
                logger.debug("memory.high of %s: %s", mark.sandbox_id, exc)
        self._agentcgroup_marks = marks

    def _domain_psi_some_total_us(self) -> int | None:
        pressure = self.domain.pressure()
        return None if pressure is None else int(pressure.some_total_us)

    # -- the execution loop ---------------------------------------------------------

    async def _exec_when_let_go(self, agent_id: str, command: str, timeout_s: float,
                                max_output_bytes: int, io: ExecIO | None = None) -> ExecResult:
        """Exec the action, waiting while the gate holds its sandbox frozen.

        A tick can run between the launch and the exec (the peak mark is reset in a thread
        meanwhile) and freeze the sandbox, or a thaw may not have settled yet. The backends
        refuse an exec into a frozen sandbox (Docker cannot exec into a paused container),
        and failing the attempt for it threw away the workflow's progress. The action waits
        for the gate instead, as a hold mid-run would; the wait is not part of its timeout.
        """
        while True:
            try:
                return await self.residency.exec(agent_id, command, timeout_s=timeout_s,
                                                 max_output_bytes=max_output_bytes, io=io)
            except SandboxFrozen:
                if self._closed:
                    raise AgentClosed(f"agent {agent_id}: the runtime closed") from None
                logger.debug("agent %s: sandbox frozen at exec; waiting for the gate", agent_id)
                await self.clock.sleep(self.config.control_period_s)

    async def _execution_loop(self) -> None:
        period = self.config.control_period_s
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad tick must not stop the controller
                logger.exception("execution loop tick failed")
            await self.clock.sleep(period)

    def _report_heavy_growth(self) -> None:
        """Tell the predictor, mid-run, of an action that crossed the heavy line (and each
        time it grows a tenth more), and predict the queued ones again. Otherwise it hears
        of actions only when they end, and while a long heavy run lasts another attempt's
        same step is admitted as a light action; both then spike together and are held in
        turn, each taking several times its own length."""
        crossed = False
        for action in self.actions.values():
            if action.stats is None or action.context is None:
                continue
            peak = action.stats.peak_bytes
            # once over the line, again each time it grew by a tenth
            if peak <= max(self.config.heavy_peak_bytes, 1.1 * action.heavy_reported_bytes):
                continue
            action.heavy_reported_bytes, crossed = peak, True
            self.predictor.observe_running(action.context, peak)
        if crossed:
            self.boundary.repredict_queued()

    async def tick(self) -> None:
        now = self.clock.now()
        budget = self.domain.budget_bytes
        if self.admission is not None and budget is not None:
            window = self.config.window_bytes(budget)
            if window != self.admission.window_bytes:  # the budget moved; W follows it
                self.admission.set_window(window)
                self.events.emit("window", window_bytes=window, budget_bytes=budget)
        seen = self.execution.observe(now, list(self.actions.values()))
        snapshot = self.boundary.control_snapshot(seen.snapshot)
        plan = self.control.step(snapshot)
        self.execution.act(plan.tick, seen)
        if self.spec.kind is PolicyKind.AGENTCGROUP and self.domain.version is CgroupVersion.V2:
            await self._agentcgroup_period()
        self.boundary.act(plan)
        self._report_heavy_growth()
        self.boundary.pump()
        self.waker.notify()

    # -- restart ---------------------------------------------------------------------

    def recover(self, remove_leftovers: LeftoverRemover | None = None) -> list[Agent]:
        """After a controller restart: reconcile the state directory with what exists (see
        `runtime.reconcile`; `remove_leftovers` removes the dead controller's sandboxes),
        then an `Agent` for every record, also kept in `recovered`.

        Nothing is rebuilt eagerly; each agent's next action rebuilds its sandbox from the
        committed record (or blocks with RecoveryError if the workspace no longer matches).
        A blocked agent refuses actions (`WorkflowFailed`) until `tenon agents unblock`. An
        action in flight at the crash is on the agent's `interrupted` and in the event log.
        """
        report = reconcile(self._recovery, self.workspaces, remove_leftovers=remove_leftovers)
        self.last_reconcile = report
        self.events.emit("reconcile", **report.as_event())
        agents = []
        for record in self.residency.recover_all():
            if record.agent_id in self.agents:
                continue
            state = self._restored_state(record)
            interrupted = None
            if record.interrupted is not None:
                interrupted = _interrupted_result(record.agent_id, record.interrupted)
                self.events.emit("action_interrupted", action_id=record.interrupted,
                                 agent_id=record.agent_id, outcome=Outcome.INTERRUPTED.value)
            agent = Agent(self, state, interrupted=interrupted)
            self.recovered[agent.id] = agent
            agents.append(agent)
            self.events.emit("agent_recovered", agent_id=record.agent_id,
                             generation=record.generation, state=record.state,
                             workflow=state.workflow, num_actions=record.num_actions,
                             reason=record.reason)
        return agents

    def _restored_state(self, record: RecoveryRecord) -> AgentState:
        meta = record.agent_meta
        peak = meta.get("profile_peak_bytes")
        state = AgentState(record.agent_id, record.base_image, meta.get("family"), None,
                           peak if isinstance(peak, int) else None,
                           created_at=self.clock.now(), workflow=meta.get("workflow"),
                           task=meta.get("task"))
        state.phase, state.root_made = Phase.TORN_DOWN, True
        if record.generation == 0 and record.state == "torn_down":
            # never ran (`edit_workspace`, or kept at close): its first action materializes
            state.phase = Phase.NEW
        if record.state == "blocked":
            state.failed_reason = f"blocked: {record.reason}"
            self._blocked.add(record.agent_id)
        if self.spec.kind is PolicyKind.AGENTCGROUP and state.profile_peak_bytes is not None:
            state.agentcgroup_class = agentcgroup_class(
                state.profile_peak_bytes, self.domain.budget_bytes or 0, self.config)
        self._actions_before[record.agent_id] = record.num_actions
        self.agents[record.agent_id] = state
        self.workflows.adopt(record.agent_id, state.profile_peak_bytes or 0)
        return state

    def num_actions_before(self, agent_id: str) -> int:
        """Actions a recovered agent completed under earlier controllers (0 for new ones)."""
        return self._actions_before.get(agent_id, 0)

    def _lifecycle_step(self, step: str, agent_id: str) -> None:
        """Each teardown and rebuild step as it starts (`lifecycle_events`): where a crash
        landed can be read off the event log."""
        self.events.emit("lifecycle_step", step=step, agent_id=agent_id)

    @property
    def pressure_level(self) -> Pressure | None:
        last = self.execution.last_pressure
        return None if last is None else last.level


def _outcome(result: ExecResult | None, died: str | None, oom_kills: int) -> Outcome:
    if died is not None:
        return Outcome.SANDBOX_DIED
    if oom_kills > 0:
        return Outcome.OOM_KILLED
    if result is not None and result.timed_out:
        return Outcome.TIMEOUT
    return Outcome.OK if result is not None and result.exit_code == 0 else Outcome.ERROR


def _agent_meta(state: AgentState) -> dict[str, Any]:
    """What a restarted controller needs to know about the agent besides its sandbox."""
    return {"workflow": state.workflow, "family": state.family, "task": state.task,
            "profile_peak_bytes": state.profile_peak_bytes}


def _interrupted_result(agent_id: str, action_id: str) -> ActionResult:
    return ActionResult(action_id, agent_id, Outcome.INTERRUPTED, -9,
                        "interrupted: the controller stopped during this action", False,
                        0.0, 0.0, 0, 0, 0, 0, 0, "")


__all__ = ["Agent", "AgentResidency", "AdmitDecision", "RecoveryError", "Runtime"]
