"""Fixtures for escape attempts from process-backend sandboxes (real kernel, root)."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from tenon.host.domain import WorkloadDomain
from tenon.sandbox import launcher
from tenon.sandbox.base import SandboxSpec
from tenon.sandbox.images import image_rootfs
from tenon.sandbox.process import ProcessBackend, ProcessSandbox
from tenon.units import MIB

IMAGE = "tenon-base:bookworm"
STATE_DIR = Path("/var/lib/tenon")


@pytest.fixture
def process_backend() -> Iterator[ProcessBackend]:
    if os.geteuid() != 0:
        pytest.skip("the process backend needs root (cgroups, nsenter)")
    if problems := launcher.check():
        pytest.skip(problems[0])
    image_rootfs(IMAGE, STATE_DIR)  # ImageNotFound names the fix: tenon image build
    domain = WorkloadDomain.open(f"tenon-test-{uuid.uuid4().hex[:8]}")
    yield ProcessBackend(domain, state_dir=STATE_DIR)
    domain.remove()


def make_spec(workspace: Path, **overrides: object) -> SandboxSpec:
    fields: dict[str, object] = {"sandbox_id": f"sb-{uuid.uuid4().hex[:8]}", "image": IMAGE,
                                 "workspace": workspace, "max_pids": 64,
                                 "tmp_size_bytes": 64 * MIB}
    return SandboxSpec(**{**fields, **overrides})  # type: ignore[arg-type]


@pytest.fixture
def roots() -> Iterator[Path]:
    """A store-like directory for persistent roots: root-owned, 0711 (traversable by any
    uid, not listable), as `WorkspaceStore` makes its root; so only each root's own mode
    keeps one sandbox uid out of another's files."""
    base = STATE_DIR / f"test-roots-{uuid.uuid4().hex[:8]}"
    base.mkdir(mode=0o711)
    base.chmod(0o711)
    yield base
    shutil.rmtree(base)


@pytest.fixture
async def sandboxes(process_backend: ProcessBackend,
                    roots: Path) -> AsyncIterator[Callable[..., Awaitable[ProcessSandbox]]]:
    """`await make(name, **spec_fields)`: a live sandbox over its own persistent root
    `roots/name`, destroyed at the end of the test."""
    live: list[ProcessSandbox] = []

    async def make(name: str, **overrides: object) -> ProcessSandbox:
        root = roots / name
        root.mkdir()
        sandbox = await process_backend.materialize(make_spec(root, **overrides))
        live.append(sandbox)
        return sandbox

    yield make
    for sandbox in live:
        await sandbox.destroy()
