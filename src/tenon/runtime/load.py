"""What a runtime publishes to a cluster's dispatcher: its `NodeLoad` now."""

from __future__ import annotations

from tenon.policy.placement import NodeLoad
from tenon.runtime.controller import Runtime


def node_load(runtime: Runtime, node: str) -> NodeLoad:
    """The runtime's load as node `node`: its budget, usage, committed and queued memory
    (admission's charges and the queued actions' predicted peaks; none without admission),
    live agents and pressure."""
    budget = runtime.domain.budget_bytes or 0
    admission = runtime.admission
    committed = queued = 0
    if admission is not None:
        committed = admission.admitted_total_bytes
        queued = sum(req.prediction.peak_bytes for req in admission.queued)
    level = runtime.pressure_level
    return NodeLoad(
        node=node, budget_bytes=budget, usage_bytes=runtime.domain.reading().usage_bytes,
        committed_bytes=committed, queued_bytes=queued,
        live_agents=sum(not state.closed for state in runtime.agents.values()),
        max_live_agents=runtime.capacity.max_live_workflows,
        pressure=0 if level is None else int(level))
