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
from typing import TYPE_CHECKING, Any

from tenon.errors import RecoveryError
from tenon.policy.admission import (
    ActionRequest,
    AdmitDecision,
    is_heavy,
    past_peak_charge,
)
from tenon.policy.pressure import Pressure, PressureState
from tenon.policy.residency import (
    IdleSandbox,
    Rebuild,
    Residency,
    ResidencySnapshot,
    choose_reclaim,
    rebuild_decision,
    residency_decision,
)
from tenon.runtime.agents import AgentState
from tenon.runtime.eligibility import check_restartable
from tenon.runtime.execution import RunningAction
from tenon.runtime.residency import BlockingRunner, TeardownResult
from tenon.runtime.results import AgentClosed, WorkflowFailed
from tenon.sandbox.base import Sandbox

if TYPE_CHECKING:
    from tenon.runtime.controller import Runtime

logger = logging.getLogger(__name__)


@dataclass
class BoundaryTally:
    """Action boundaries the restart-safe check judged, and how many were restartable."""

    num_checked: int = 0
    num_restartable: int = 0

    def add(self, restartable: bool) -> None:
        self.num_checked += 1
        self.num_restartable += restartable

    @property
    def share(self) -> float | None:
        """The restartable fraction; None before any boundary."""
        return self.num_restartable / self.num_checked if self.num_checked else None


class Boundary:
    """Admission waiters, teardowns and rebuilds of one runtime."""

    def __init__(self, runtime: Runtime, blocking: BlockingRunner) -> None:
        self._rt = runtime
        self._blocking = blocking
        self.tally = BoundaryTally()
        self._waiting: dict[str, tuple[RunningAction, asyncio.Future[AdmitDecision]]] = {}

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

        An action is predicted once, when it becomes ready; at 8x one may then queue for a
        minute. A peer's heavy run (or OOM kill) observed meanwhile did not reach it: in a
        real 8x replay with the forest, two copies of a test step that had just been killed
        in another copy were still admitted as 50 MiB actions. Only large observations call
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
        pressure = rt.pressure_now()
        # The physical gate after the logical window: H now. Growth still to come is the
        # window's business (charges rise toward peaks) and the execution gate's.
        headroom = pressure.headroom_bytes
        if rt.spec.use_gate:
            starving = rt.execution.starving_demand_bytes(rt.actions.values(), rt.clock.now())
            headroom = max(headroom - starving, 0)
        if not rt.actions and rt.lifecycle.in_flight == 0 and not self._reclaimable():
            # Liveness: nothing runs, nothing is being torn down and nothing idle can be:
            # waiting cannot free memory, so only the logical window applies.
            headroom = max(headroom, rt.domain.budget_bytes or headroom)
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

    def release_passed_peaks(self) -> None:
        """Shrink the charge of every running action that has passed its peak."""
        rt = self._rt
        if rt.admission is None:
            return
        for action in rt.actions.values():
            stats = action.stats
            if action.peak_passed or stats is None or not action.launched or action.done:
                continue
            charge = past_peak_charge(action.charge_bytes, action.prediction,
                                      start_bytes=stats.start_bytes, peak_bytes=stats.peak_bytes,
                                      usage_bytes=action.last_usage_bytes, config=rt.config)
            if charge is None:
                continue
            freed = rt.admission.shrink(action.action_id, charge)
            action.charge_bytes, action.peak_passed = charge, True
            rt.events.emit("peak_passed", action_id=action.action_id, agent_id=action.agent_id,
                           peak_bytes=stats.peak_bytes, usage_bytes=action.last_usage_bytes,
                           charge_bytes=charge, freed_bytes=freed,
                           admitted_total_bytes=rt.admission.admitted_total_bytes)

    def reclaimable_bytes(self) -> int:
        """Memory that can come back without a held grower running: what reclaim candidates
        hold, and sandboxes whose teardown is in flight (no reads: an idle sandbox holds
        what it held when its last action ended)."""
        rt = self._rt
        if not rt.spec.use_residency:
            return 0
        in_flight = sum(s.idle_bytes for s in rt.agents.values()
                        if s.lifecycle is not None and not s.torn_down)
        return in_flight + sum(s.idle_bytes for s in self._reclaim_candidates(self._queued()))

    def teardown_candidates(self) -> set[str]:
        """Agents a teardown may take now (see `_reclaim_candidates`)."""
        return {s.agent_id for s in self._reclaim_candidates(self._queued())}

    def _reclaimable(self) -> bool:
        return self._rt.spec.use_residency and bool(self._reclaim_candidates(self._queued()))

    def _queued(self) -> set[str]:
        """Agents whose next action waits for admission."""
        return {action.agent_id for action, _ in self._waiting.values()}

    def _reclaim_candidates(self, queued: set[str]) -> list[AgentState]:
        """Agents whose resident sandbox may be torn down now: restartable, between
        actions (in a model wait) or with the next action still queued for admission (its
        sandbox runs nothing until then, and a queued action may wait long)."""
        return [s for s in self._rt.agents.values() if s.restartable and (s.idle or (
            s.agent_id in queued and s.materialized and not s.torn_down and not s.closed
            and s.lifecycle is None and s.failed_reason is None and not s.alongside))]

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
        rt.events.emit("rebuild", agent_id=state.agent_id, sandbox_id=sandbox.spec.sandbox_id,
                       predictive=predictive, duration_s=round(rt.clock.now() - start, 4))
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
        state.idle_bytes = last_usage
        self.tally.add(eligibility.restartable)
        pressure = rt.pressure_now()
        box = IdleSandbox(state.agent_id, last_usage, eligibility.restartable,
                          state.predicted_wait_s or 0.0, state.rank)
        decision = residency_decision(ResidencySnapshot(box, pressure.level, rt.lifecycle.slots),
                                      rt.clock.now(), rt.config)
        rt.events.emit("residency", agent_id=state.agent_id, decision=decision.action.value,
                       reason=decision.reason, restartable=eligibility.restartable,
                       eligibility=eligibility.reason, pressure=pressure.level.name.lower(),
                       restartable_share=round(self.tally.share or 0.0, 4))
        if decision.action is not Residency.TEAR_DOWN:
            return
        if pressure.level is Pressure.GREEN:
            self._start_teardown(state, why=decision.reason)
        else:
            # Under pressure the idle sandboxes compete: the last-ranked workflows' go first
            # (they wait longest for admission), as many as the physical deficit needs,
            # this one included if it is among them.
            self.reclaim(pressure)

    def reclaim(self, pressure: PressureState) -> None:
        """Under yellow or red, or under green while starts or growers are held past overdue,
        tear down restartable idle sandboxes (`_reclaim_candidates`: also those whose next
        action is still queued), last-ranked workflow first, until the physical headroom
        covers the yellow line plus what waiting work needs.

        The deficit is physical: H against the line plus the gate's demand of actions held
        before their start, the demand of growers held past overdue, and the predicted
        averages of actions waiting for admission, up to the room the logical window has.
        Idle memory is given back for work that is ready, not for growth nobody asked for:
        that would only trade memory for rebuilds.
        """
        rt = self._rt
        if rt.lifecycle.slots.num_free == 0:
            return
        now = rt.clock.now()
        held = [a for a in rt.actions.values() if a.pending]
        level = pressure.level
        if level is Pressure.GREEN:
            # Green promises no room above the yellow line: an admitted 1.6 GiB start sat
            # held for 100 s in a green domain half full of idle sandboxes, its charge
            # blocking admission, and nothing was reclaimed for it. Starts held past
            # overdue get room; the brief holds of start rationing do not (reclaiming for
            # those doubled the teardowns of the 8x replay).
            # Growers held past overdue (green keeps one that outgrew its prediction held
            # while its demand exceeds H) get room the same way.
            # So does a queued action past overdue whose charge fits the logical window but
            # not the physical headroom plus what running actions will give back when they
            # end: idle sandboxes would otherwise keep it queued for as long as they stay
            # idle. On the real 8x replay a 1.6 GiB test start waited 27 s in a green domain
            # with 1.3 GiB idle, everything else queued behind its reserved room, while one
            # long action that held little ran to its end. (Where running actions' ends
            # do free the room, reclaiming made 900 teardowns in the simulated 8x replay.)
            overdue = rt.config.overdue_after_s
            held = [a for a in held if a.held_since is not None
                    and now - a.held_since >= overdue]
            stuck = 0 if rt.admission is None else rt.admission.stuck_charge(
                now, pressure.headroom_bytes + self._running_gives_back(), waited_s=overdue)
            if not held and not stuck and not (rt.spec.use_gate and
                                               rt.execution.starving_demand_bytes(
                                                   rt.actions.values(), now)):
                return
            level = Pressure.YELLOW
        else:
            stuck = 0
        budget = rt.domain.budget_bytes or 0
        green_line = (rt.config.red_fraction + rt.config.yellow_fraction) * budget
        # a start predicted heavy launches on bootstrap room (`hold_heavy_starts` off): room
        # for its whole prediction is made only as far as it grows, as for any grower
        held_bytes = sum(rt.execution.launch_demand_bytes(a) for a in held)
        starving = 0
        if rt.spec.use_gate:  # growers held past overdue: the room admission keeps back
            starving = rt.execution.starving_demand_bytes(rt.actions.values(), now)
        waiting = stuck + held_bytes + starving
        if rt.admission is not None and pressure.level is not Pressure.GREEN:
            # Only as much queued work as the logical window lets in can use freed memory:
            # behind a full window a teardown frees room nobody may take, and costs a
            # rebuild later (on a 2-core host, that churn was a third of the CPU).
            queued = sum(r.prediction.avg_bytes for r in rt.admission.queued
                         if r.ready_at <= now)
            room = rt.admission.window_bytes - rt.admission.admitted_total_bytes
            if rt.admission.at_capacity:
                room = 0  # none of it may be admitted before an action ends
            waiting += min(queued, max(room, 0))
        needed = int(green_line + waiting - pressure.headroom_bytes) + 1
        if needed <= 0:
            return
        waiting_agents = self._queued()
        idle = [IdleSandbox(s.agent_id, s.idle_bytes, True, self._idle_for(s, now),
                            rank_at=s.rank, queued=s.agent_id in waiting_agents)
                for s in self._reclaim_candidates(waiting_agents)]
        # Under red, or for work held past overdue, short model waits may go too.
        chosen = choose_reclaim(idle, level, needed, max_count=rt.lifecycle.slots.num_free,
                                min_idle_s=rt.config.reclaim_min_idle_s,
                                spare_short_waits=pressure.level is Pressure.YELLOW)
        why = pressure.level.name.lower()
        if level != pressure.level:
            why += (f": held or stuck work (starts {held_bytes} B, queue {stuck} B, "
                    f"growers {starving} B)")
        for agent_id in chosen:
            self._start_teardown(rt.agents[agent_id], why=f"{why}: reclaim for {needed} B")

    def _running_gives_back(self) -> int:
        """What running actions hold above their sandboxes' level when they started: the
        most their ends can free (what a sandbox held before stays with it, idle)."""
        total = 0
        for action in self._rt.actions.values():
            if action.stats is not None:
                total += max(action.last_usage_bytes - action.stats.start_bytes, 0)
        return total

    @staticmethod
    def _idle_for(state: AgentState, now: float) -> float:
        """How much longer the agent's model wait is predicted to last (0 if unknown)."""
        if state.predicted_wait_s is None or state.last_done_at is None:
            return 0.0
        return state.last_done_at + state.predicted_wait_s - now

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
            result = await rt.residency.teardown(state.agent_id)
            if result.outcome != "kept_resident":
                state.phase = state.phase.after_teardown()
            elif result.step != "held":  # an edit or a command alongside: not the check's no
                state.restartable = False  # the protocol's own check said no: keep it
            rt.events.emit("teardown", agent_id=state.agent_id, outcome=result.outcome,
                           reason=result.reason, why=why,
                           duration_s=round(rt.clock.now() - start, 4))
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

    def predictive_rebuilds(self, pressure: PressureState, now: float) -> None:
        """Under green, rebuild torn-down agents whose next action is predicted soon."""
        rt = self._rt
        if pressure.level is not Pressure.GREEN:
            return
        for state in rt.agents.values():
            if not state.torn_down or state.busy or state.closed or state.lifecycle is not None:
                continue
            if state.predicted_wait_s is None or state.last_done_at is None:
                continue
            ready_in = state.last_done_at + state.predicted_wait_s - now
            decision = rebuild_decision(state.agent_id, next_action_ready=False,
                                        predicted_ready_in_s=ready_in, pressure=pressure.level,
                                        slots=rt.lifecycle.slots, config=rt.config)
            if decision.action is Rebuild.START and rt.lifecycle.try_acquire():
                state.lifecycle = asyncio.ensure_future(self._predictive(state))

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
