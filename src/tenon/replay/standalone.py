"""A ResidencyManager on a real backend without a Runtime: the residency demo and the
differential harness drive teardowns and rebuilds directly through it."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from tenon.clock import SystemClock
from tenon.errors import BackendUnavailable
from tenon.host.diskfs import DiskLimits
from tenon.host.domain import WorkloadDomain
from tenon.runtime.residency import ResidencyManager
from tenon.sandbox.base import SandboxBackend
from tenon.sandbox.registry import make_backend
from tenon.state.recovery import RecoveryStore
from tenon.state.statedir import DEFAULT_STATE_DIR
from tenon.state.workspace import WorkspaceStore


@contextlib.asynccontextmanager
async def open_manager(
    backend: str,
    *,
    state_dir: Path = DEFAULT_STATE_DIR,
    budget_bytes: int | None = None,
    prefix: str = "tenon-manager",
    limits: DiskLimits | None = None,
) -> AsyncIterator[tuple[ResidencyManager, WorkloadDomain]]:
    """A ResidencyManager in its own workload domain `<prefix>-<id>` and scratch state
    directory under `state_dir`, with workspaces as the runtime makes them (`limits`:
    each agent's root its own filesystem; None: plain directories). Everything it made,
    mounts included, is removed on exit."""
    domain = WorkloadDomain.open(f"{prefix}-{uuid.uuid4().hex[:8]}", budget_bytes=budget_bytes)
    impl: SandboxBackend | None = None
    try:
        await asyncio.to_thread(state_dir.mkdir, parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f"{prefix}-", dir=state_dir) as tmp:
            impl = make_backend(backend, domain, state_dir)
            if problems := impl.check():
                raise BackendUnavailable(f"backend {backend} not ready: {'; '.join(problems)}")
            workspaces = WorkspaceStore(Path(tmp), limits=limits)
            recovery = RecoveryStore(Path(tmp) / "recovery.sqlite")
            try:
                yield ResidencyManager(impl, workspaces, recovery, SystemClock()), domain
            finally:
                recovery.close()
                await asyncio.to_thread(workspaces.unmount_all)
    finally:
        domain.remove()
        if impl is not None:
            impl.release_domain()
