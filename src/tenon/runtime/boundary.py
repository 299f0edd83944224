"""The boundary loop's decisions, wired to the runtime: admission, residency, rebuilds.

Everything here runs at action boundaries (ready / done) or is nudged by the execution
loop's tick; the decisions themselves are the pure functions of `policy/`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

from tenon.clock import Clock
from tenon.errors import RecoveryError
from tenon.policy.admission import (
    ActionRequest,
    AdmissionController,
    AdmitDecision,
    admission_headroom_bytes,
    is_heavy,
)
from tenon.policy.baselines import PolicySpec
from tenon.policy.config import PolicyConfig
from tenon.policy.control import ControlPolicy, ControlSnapshot, Plan
from tenon.policy.execution import TickSnapshot
from tenon.policy.pressure import PressureState
from tenon.policy.reclaim import TeardownOrder, reclaim_candidates
from tenon.policy.residency import (
    IdleSandbox,
    Rebuild,
    rebuild_decision,
)
from tenon.predict.base import Predictor
from tenon.runtime.agents import AgentState, Lifecycle, Waker
from tenon.runtime.eligibility import check_restartable
from tenon.runtime.events import EventLog
from tenon.runtime.execution import ExecutionLoop, RunningAction
from tenon.runtime.residency import BlockingRunner, CheckToken, ResidencyManager, TeardownResult
from tenon.runtime.results import AgentClosed, WorkflowFailed
from tenon.sandbox.base import DomainMeter, Sandbox


class BoundaryHost(Protocol):
    """What the boundary decisions use of the runtime that owns them (`Runtime`)."""

    config: PolicyConfig
    spec: PolicySpec
    clock: Clock
    events: EventLog
    predictor: Predictor
    domain: DomainMeter
    residency: ResidencyManager
    admission: AdmissionController | None
    execution: ExecutionLoop
    control: ControlPolicy
    lifecycle: Lifecycle
    waker: Waker
    agents: dict[str, AgentState]
    actions: dict[str, RunningAction]

logger = logging.getLogger(__name__)


@dataclass
class BoundaryTally:
    """Action boundaries the restart-safe check judged, and how many were restartable;
    teardowns and rebuilds carried out, and the wall time they took."""

    num_checked: int = 0
    num_restartable: int = 0
    num_teardowns: int = 0
    num_rebuilds: int = 0
    lifecycle_s: float = 0.0

    def add(self, restartable: bool) -> None:
        self.num_checked += 1
        self.num_restartable += restartable

    @property
    def share(self) -> float | None:
        """The restartable fraction; None before any boundary."""
        return self.num_restartable / self.num_checked if self.num_checked else None


class Boundary:
    """Admission waiters, teardowns and rebuilds of one runtime."""

    def __init__(self, runtime: BoundaryHost, blocking: BlockingRunner) -> None:
        self._rt = runtime
        self._blocking = blocking
        self.tally = BoundaryTally()
        self._waiting: dict[str, tuple[RunningAction, asyncio.Future[AdmitDecision]]] = {}
        # Each agent's last restart-safe check that said restartable: a teardown before
        # anything else runs in that sandbox need not check again.
        self._checks: dict[str, CheckToken] = {}

    # -- admission ----------------------------------------------------------------

    async def admit(self, action: RunningAction, request: ActionRequest) -> AdmitDecision | None:
        """Wait until the action is admitted (at once without admission control)."""
        rt = self._rt
        if rt.admission is None:
            rt.actions[action.action_id] = action
            return None
        future: asyncio.Future[AdmitDecision] = asyncio.get_running_loop().create_future()
        self._waiting[action.action_id] = (action, future)
        rt.admission.submit(request)
        self.pump()
        try:
            return await future
        except asyncio.CancelledError:
            self._waiting.pop(action.action_id, None)
            if (not rt.admission.withdraw(action.action_id) and future.done()
                    and not future.cancelled()):
                self.release(action)  # admitted just as the caller gave up
            raise

    def repredict_queued(self) -> None:
        """Predict every queued action again: the predictor just learned something large.

        An action is predicted once, when it becomes ready, and under load it may then queue
        for a long time. A peer's heavy run (or OOM kill) observed meanwhile would not reach
        it: copies of a step just killed in another copy would still be admitted at their
        light prediction. Only large observations call
        this, so the admission path does not pay a prediction per queued action per action.
        """
        rt = self._rt
        if rt.admission is None:
            return
        changed = False
        for action_id, (action, future) in list(self._waiting.items()):
            if future.done() or action.context is None:
                continue
            prediction = rt.predictor.predict(action.context)
            if (prediction == action.prediction
                    or not rt.admission.update_prediction(action_id, prediction)):
                continue
            action.prediction = prediction
            rt.events.emit("repredict", action_id=action_id, agent_id=action.agent_id,
                           predicted_avg_bytes=prediction.avg_bytes,
                           predicted_peak_bytes=prediction.peak_bytes,
                           heavy=is_heavy(prediction, rt.config))
            changed = True
        if changed:
            self.pump()

    def release(self, action: RunningAction) -> None:
        """Release the action's charge; called exactly once per admitted action."""
        rt = self._rt
        if rt.admission is None:
            return
        charge = rt.admission.release(action.action_id)
        rt.events.emit("release", action_id=action.action_id, charge_bytes=charge,
                       admitted_total_bytes=rt.admission.admitted_total_bytes)
        self.pump()

    def pump(self) -> None:
        """Admit whatever fits now."""
        rt = self._rt
        if rt.admission is None or not self._waiting:
            return
        # The physical gate after the logical window: H now. Growth still to come is the
        # window's business (charges rise toward peaks) and the execution gate's.
        now = rt.clock.now()
        pressure = rt.execution.pressure(rt.actions.values(), rt.domain.reading())
        starving = 0
        if rt.spec.use_gate:
            starving = rt.execution.starving_demand_bytes(rt.actions.values(), now)
        headroom = admission_headroom_bytes(pressure.headroom_bytes, starving,
                                            rt.domain.budget_bytes,
                                            nothing_can_free=self._nothing_can_free())
        for decision in rt.admission.decide(rt.clock.now(), headroom):
            action, future = self._waiting.pop(decision.action_id)
            if future.cancelled():
                # Its caller was cancelled (shutdown cancels every waiter at once) and has
                # not yet run its handler: hand the charge straight back.
                rt.admission.release(decision.action_id)
                continue
            rt.actions[action.action_id] = action
            future.set_result(decision)
            rt.events.emit("admit", action_id=decision.action_id, agent_id=decision.workflow_id,
                           charge_bytes=decision.charge_bytes, heavy=decision.heavy,
                           reason=decision.reason,
                           admitted_total_bytes=rt.admission.admitted_total_bytes,
                           headroom_bytes=headroom, pressure=pressure.level.name.lower())

    def control_snapshot(self, tick: TickSnapshot) -> ControlSnapshot:
        rt = self._rt
        return ControlSnapshot(tick, tuple(s.observed() for s in rt.agents.values()),
                               frozenset(self._queued()), rt.lifecycle.slots)

    def snapshot_now(self) -> ControlSnapshot:
        """The control snapshot between periods (no new samples)."""
        rt = self._rt
        return self.control_snapshot(rt.execution.snapshot(
            rt.clock.now(), rt.actions.values(), rt.domain.reading()))

    def teardown_candidates(self) -> set[str]:
        """Agents a teardown may take now."""
        snap = self.snapshot_now()
        return {a.agent_id for a in reclaim_candidates(snap.agents, snap.queued)}

    def act(self, plan: Plan) -> None:
        """Carry out the period's boundary-side orders: shrunk charges, teardowns, rebuilds."""
        rt = self._rt
        for release in plan.peak_releases:
            action = rt.actions[release.action.action_id]
            action.charge_bytes, action.peak_passed = release.charge_bytes, True
            rt.events.emit("peak_passed", action_id=action.action_id, agent_id=action.agent_id,
                           peak_bytes=release.action.peak_bytes,
                           usage_bytes=release.action.usage_bytes,
                           charge_bytes=release.charge_bytes, freed_bytes=release.freed_bytes,
                           admitted_total_bytes=release.admitted_total_bytes)
        self._start_teardowns(plan.teardowns)
        for agent_id in plan.rebuilds:
            state = rt.agents[agent_id]
            if rt.lifecycle.try_acquire():
                state.lifecycle = asyncio.ensure_future(self._predictive(state))

    def _nothing_can_free(self) -> bool:
        """Nothing runs, nothing is being torn down and nothing idle can be."""
        rt = self._rt
        if rt.actions or rt.lifecycle.in_flight:
            return False
        if not rt.spec.use_residency:
            return True
        agents = tuple(s.observed() for s in rt.agents.values())
        return not reclaim_candidates(agents, frozenset(self._queued()))

    def _queued(self) -> set[str]:
        """Agents whose next action waits for admission."""
        return {action.agent_id for action, _ in self._waiting.values()}

    # -- sandboxes ------------------------------------------------------------------

    async def ensure_sandbox(self, state: AgentState, config: Mapping[str, Any]) -> Sandbox:
        """The agent's live sandbox: materialized the first time, rebuilt after a teardown."""
        rt = self._rt
        sandbox = rt.residency.sandbox_for(state.agent_id)
        if sandbox is not None:
            return sandbox
        if not state.materialized:
            sandbox = await rt.residency.start(state.agent_id, state.image, config)
            state.phase, state.root_made = state.phase.after_rebuild(), True
            rt.events.emit("materialize", agent_id=state.agent_id,
                           sandbox_id=sandbox.spec.sandbox_id)
            return sandbox
        reported = False
        while True:
            if state.closed:
                raise AgentClosed(f"agent {state.agent_id} was closed while waiting to rebuild")
            waiting = self._take_rebuild_slot(state)
            if waiting is None:
                break
            if not reported:
                rt.events.emit("rebuild_wait", agent_id=state.agent_id, reason=waiting)
                reported = True
            await rt.waker.wait()
        try:
            return await self._rebuild(state, predictive=False)
        finally:
            rt.lifecycle.release()
            rt.waker.notify()

    async def _rebuild(self, state: AgentState, *, predictive: bool) -> Sandbox:
        rt = self._rt
        start = rt.clock.now()
        try:
            sandbox = await rt.residency.rematerialize(state.agent_id)
        except RecoveryError as exc:
            state.blocked_reason = str(exc)
            raise
        state.phase, state.blocked_reason = state.phase.after_rebuild(), None
        took = rt.clock.now() - start
        self.tally.num_rebuilds += 1
        self.tally.lifecycle_s += took
        rt.events.emit("rebuild", agent_id=state.agent_id, sandbox_id=sandbox.spec.sandbox_id,
                       predictive=predictive, duration_s=round(took, 4))
        return sandbox

    def _pressure_without(self, agent_id: str) -> PressureState:
        """Pressure not counting the agent's own admitted action (it cannot wait for itself)."""
        rt = self._rt
        others = [a for a in rt.actions.values() if a.agent_id != agent_id]
        return rt.execution.pressure(others, rt.domain.reading())

    # -- residency ------------------------------------------------------------------

    async def after_action(self, state: AgentState, sandbox: Sandbox, *, last_usage: int) -> None:
        """Action-done: check restart safety (fail closed), then retain or tear down.

        The check reads the sandbox's processes and namespaces off the event loop (the agent
        stays busy meanwhile, so nothing reclaims it on its previous boundary's verdict)."""
        rt = self._rt
        eligibility = await self._blocking(check_restartable, sandbox, True)
        if state.alongside and eligibility.restartable:  # a backend may not list its process
            eligibility = replace(eligibility, restartable=False,
                                  reason="a command run alongside the action is still running")
        state.restartable, state.restart_reason = eligibility.restartable, eligibility.reason
        self._note_check(state.agent_id, eligibility.restartable)
        state.idle_bytes = last_usage
        self.tally.add(eligibility.restartable)
        box = IdleSandbox(state.agent_id, last_usage, eligibility.restartable,
                          state.predicted_wait_s or 0.0, state.rank)
        tick = rt.execution.snapshot(rt.clock.now(), rt.actions.values(), rt.domain.reading())
        plan = rt.control.after_action(tick, rt.lifecycle.slots, box)
        decision = plan.residency
        rt.events.emit("residency", agent_id=state.agent_id, decision=decision.action.value,
                       reason=decision.reason, restartable=eligibility.restartable,
                       eligibility=eligibility.reason, pressure=plan.pressure.level.name.lower(),
                       restartable_share=round(self.tally.share or 0.0, 4))
        self._start_teardowns(plan.teardowns)
        if plan.reclaim:
            self._start_teardowns(rt.control.reclaim(self.control_snapshot(tick), plan.pressure))

    def _note_check(self, agent_id: str, restartable: bool) -> None:
        token = self._rt.residency.check_token(agent_id) if restartable else None
        if token is None:
            self._checks.pop(agent_id, None)
        else:
            self._checks[agent_id] = token

    def _start_teardowns(self, orders: tuple[TeardownOrder, ...]) -> None:
        for order in orders:
            self._start_teardown(self._rt.agents[order.agent_id], why=order.why)

    def _start_teardown(self, state: AgentState, *, why: str) -> None:
        if not self._rt.lifecycle.try_acquire():
            return
        state.lifecycle = asyncio.ensure_future(self._teardown(state, why))

    async def teardown_acquired(self, state: AgentState, *, why: str) -> TeardownResult | None:
        """Tear the agent down on a lifecycle slot the caller acquired (released here);
        the result, None if the teardown failed."""
        task = asyncio.ensure_future(self._teardown(state, why))
        state.lifecycle = task
        return await task

    async def _teardown(self, state: AgentState, why: str) -> TeardownResult | None:
        rt = self._rt
        start = rt.clock.now()
        result: TeardownResult | None = None
        try:
            result = await rt.residency.teardown(state.agent_id,
                                                 checked=self._checks.pop(state.agent_id, None))
            took = rt.clock.now() - start
            self.tally.lifecycle_s += took
            if result.outcome != "kept_resident":
                state.phase = state.phase.after_teardown()
                self.tally.num_teardowns += 1
            elif result.step != "held":  # an edit or a command alongside: not the check's no
                state.restartable = False  # the protocol's own check said no: keep it
                state.restart_reason = result.reason
            rt.events.emit("teardown", agent_id=state.agent_id, outcome=result.outcome,
                           reason=result.reason, why=why, duration_s=round(took, 4))
        except Exception:
            logger.exception("teardown of %s failed", state.agent_id)
        finally:
            rt.lifecycle.release()
            state.lifecycle = None
            rt.waker.notify()
            self.pump()
        return result

    def _take_rebuild_slot(self, state: AgentState) -> str | None:
        """Take a lifecycle slot for rebuilding the agent now (its next action is ready);
        None when taken, else why the rebuild must wait."""
        rt = self._rt
        level = self._pressure_without(state.agent_id).level
        decision = rebuild_decision(state.agent_id, next_action_ready=True, pressure=level,
                                    predicted_ready_in_s=None,
                                    slots=rt.lifecycle.slots, config=rt.config)
        if decision.action is Rebuild.START and rt.lifecycle.try_acquire():
            return None
        return decision.reason

    async def prewarm(self, state: AgentState) -> None:
        """Rebuild a torn-down, idle agent now, as its next action would (`Runtime.prewarm`)."""
        rt = self._rt
        reported = False
        while True:
            if state.closed:
                raise AgentClosed(f"agent {state.agent_id} is closed")
            task = state.lifecycle
            if task is not None and not task.done():  # a teardown or rebuild: then decide
                with contextlib.suppress(Exception):
                    await task
                continue
            if state.failed_reason is not None:
                raise WorkflowFailed(f"agent {state.agent_id}: {state.failed_reason}")
            if not state.materialized or not state.torn_down or state.busy:
                return
            waiting = self._take_rebuild_slot(state)
            if waiting is None:
                break
            if not reported:
                rt.events.emit("rebuild_wait", agent_id=state.agent_id, reason=waiting)
                reported = True
            await rt.waker.wait()
        task = asyncio.ensure_future(self._prewarm(state))
        state.lifecycle = task
        await task

    async def _prewarm(self, state: AgentState) -> None:
        rt = self._rt
        try:
            await self._rebuild(state, predictive=False)
        finally:
            rt.lifecycle.release()
            state.lifecycle = None
            rt.waker.notify()

    async def _predictive(self, state: AgentState) -> None:
        rt = self._rt
        try:
            await self._rebuild(state, predictive=True)
        except RecoveryError as exc:  # the next action retries from the record and reports
            logger.warning("predictive rebuild of %s failed: %s", state.agent_id, exc)
        finally:
            rt.lifecycle.release()
            state.lifecycle = None
            rt.waker.notify()
