"""Open a runtime on a real backend: a fresh workload domain, the backend, cleanup on exit."""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from tenon.host.diskfs import DiskLimits
from tenon.host.domain import WorkloadDomain
from tenon.runtime.controller import Runtime
from tenon.sandbox.registry import make_backend

logger = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def open_runtime(
    *,
    budget_bytes: int,
    backend: str = "process",
    state_dir: Path = Path("/var/lib/tenon"),
    run_dir: Path | None = None,
    domain_name: str | None = None,
    **runtime_kwargs: Any,
) -> AsyncIterator[Runtime]:
    """A started `Runtime` in its own domain `tenon-<id>` with `budget_bytes` as its limit.

    `run_dir` holds the run's records, workspaces and event log (`events.jsonl`); by default a
    fresh directory under `state_dir/runs`. On exit every sandbox is destroyed and the domain
    (and, for Docker, the parent cgroups its driver made) removed, also on error or Ctrl-C.
    """
    name = domain_name or f"tenon-{uuid.uuid4().hex[:8]}"
    run_dir = run_dir or state_dir / "runs" / name
    domain = WorkloadDomain.open(name, budget_bytes=budget_bytes)
    try:
        impl = make_backend(backend, domain, state_dir)
        runtime_kwargs.setdefault("event_log", run_dir / "events.jsonl")
        # each agent's persistent root is its own size-limited filesystem
        runtime_kwargs.setdefault("workspace_limits", DiskLimits())
        runtime = Runtime(domain=domain, backend=impl, state_dir=run_dir, **runtime_kwargs)
        try:
            await runtime.start()
            yield runtime
        finally:
            await runtime.close()
    finally:
        try:
            if backend == "docker":
                from tenon.sandbox.docker import cleanup_domain_containers, connect

                with contextlib.suppress(Exception):
                    cleanup_domain_containers(connect(), name)
            domain.remove()
        finally:
            if backend == "docker":
                from tenon.sandbox.docker import remove_parent_cgroups

                remove_parent_cgroups(name)
