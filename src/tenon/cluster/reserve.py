"""Placement by Ray's own `memory` resource (reservation by peak), the baseline.

Each workflow is a Ray task asking for its profiled peak as `memory`; each node declares
its budget as its `memory` resource, so Ray starts a workflow only where the peaks already
running leave room for its own, and queues it otherwise. The task runs its workflow on the
Tenon of the node Ray chose (an eager policy inside the node's budget: Ray's reservation is
the admission), retrying a failed attempt from scratch as the replay driver does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import ray

from tenon.cluster.ray_nodes import ACTOR_PREFIX, NAMESPACE, RayNode
from tenon.replay.driver import WorkflowRecord, action_command, action_timeout_s
from tenon.replay.schedule import Submission
from tenon.replay.trace import Workflow
from tenon.runtime.results import Outcome


def _run_workflow(instance: str, workflow: Workflow, node_names: dict[str, str],
                  speed: float, max_retries: int) -> dict[str, Any]:
    """The task's body, on the node Ray placed it: every attempt of the workflow."""
    node_id = ray.get_runtime_context().get_node_id()
    actor = ray.get_actor(ACTOR_PREFIX + node_names[node_id], namespace=NAMESPACE)
    tally: dict[str, Any] = {"attempts": 0, "failed_attempts": 0, "oom_events": 0, "timeouts": 0,
             "completed": False, "errors": []}
    while tally["attempts"] <= max_retries and not tally["completed"]:
        tally["attempts"] += 1
        agent_id = f"{instance.replace('/', '_').replace('#', '-')}-{tally['attempts']}"
        outcome = _attempt(actor, agent_id, instance, workflow, speed)
        if outcome is None:
            tally["completed"] = True
            break
        tally["failed_attempts"] += 1
        tally["oom_events"] += outcome is Outcome.OOM_KILLED
        tally["timeouts"] += outcome is Outcome.TIMEOUT
        tally["errors"].append(f"{outcome.value} on node {node_names[node_id]}")
    return tally


def _attempt(actor: Any, agent_id: str, instance: str, workflow: Workflow,
             speed: float) -> Outcome | None:
    ray.get(actor.create_agent.remote(agent_id, {
        "image": workflow.base_image, "family": workflow.family,
        "profile_peak_bytes": workflow.profiled_peak_bytes, "workflow": instance,
        "task": workflow.task}))
    try:
        for step in workflow.steps:
            time.sleep(step.model_wait_s / speed)
            action = step.action
            result = ray.get(actor.run.remote(agent_id, action_command(
                action, speed=speed, sim=False), {
                    "timeout": action_timeout_s(action, speed),
                    "action_class": action.action_class, "issued_command": action.command}))
            if result.outcome.fails_attempt or result.outcome is Outcome.TIMEOUT:
                return result.outcome  # type: ignore[no-any-return]
        return None
    finally:
        ray.get(actor.close_agent.remote(agent_id))


async def run_reserved(subs: Sequence[Submission], nodes: Sequence[RayNode], *,
                       speed: float, max_retries: int) -> list[WorkflowRecord]:
    """Submit each workflow at its time as a Ray task reserving its profiled peak; one
    record each, its end when the task returned."""
    task = ray.remote(num_cpus=0, max_retries=0)(_run_workflow)
    names = {node.node_id: node.name for node in nodes}
    start = time.monotonic()

    async def one(sub: Submission) -> WorkflowRecord:
        record = WorkflowRecord(sub.instance, sub.submit_s)
        await asyncio.sleep(max(sub.submit_s - (time.monotonic() - start), 0.0))
        ref = task.options(memory=sub.workflow.profiled_peak_bytes).remote(
            sub.instance, sub.workflow, names, speed, max_retries)
        try:
            tally = await ref
        except ray.exceptions.RayError as exc:
            record.errors.append(f"ray task failed: {type(exc).__name__}: {exc}"[:300])
        else:
            for key in ("attempts", "failed_attempts", "oom_events", "timeouts", "completed"):
                setattr(record, key, tally[key])
            record.errors.extend(tally["errors"])
        record.end_s = time.monotonic() - start
        return record

    return list(await asyncio.gather(*(one(sub) for sub in subs)))
