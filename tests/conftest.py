"""Suite-wide rules: in CI, a test that needs the real kernel or Docker may not skip."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REAL_MARKERS = ("docker", "cgroups", "sandbox", "disk", "vm", "ray")
IN_VM = os.environ.get("TENON_IN_VM") == "1"  # set by the test VM's init (scripts/vm/guest-init.sh)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked vm run only inside the cgroup v2 test VM (scripts/vm/test.sh boots it and
    runs them there); on the host they are deselected, not skipped. Inside the VM only they run."""
    keep = [item for item in items if (item.get_closest_marker("vm") is not None) == IN_VM]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # noqa: ARG001
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") != "true" or not report.skipped:
        return
    needs = [m for m in REAL_MARKERS if item.get_closest_marker(m)]
    if needs:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} needs {', '.join(needs)} and was skipped while CI=true: "
            f"{report.longrepr}"
        )


_docker_problem: list[str | None] = []


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked docker skips, naming why, when no Docker Engine answers (in CI that
    skip is a failure, see above)."""
    if item.get_closest_marker("docker") is None:
        return
    if not _docker_problem:
        from tenon.errors import BackendUnavailable
        from tenon.sandbox.dockerd import connect

        try:
            connect(timeout_s=5).close()
            _docker_problem.append(None)
        except BackendUnavailable as exc:
            _docker_problem.append(str(exc))
    if _docker_problem[0] is not None:
        pytest.skip(_docker_problem[0])


@pytest.fixture
def docker_backend() -> Iterator[Any]:
    """A DockerBackend in a fresh 1 GiB workload domain (skips, naming why, without root,
    a Docker Engine or the base image); afterwards its containers, domain and parent
    cgroups are gone."""
    import docker.errors

    from tenon.errors import BackendUnavailable
    from tenon.host.domain import WorkloadDomain
    from tenon.sandbox.docker import (
        DockerBackend,
        cleanup_domain_containers,
        connect,
        remove_parent_cgroups,
    )

    image = "tenon-base:bookworm"
    if os.geteuid() != 0:
        pytest.skip("the docker backend needs root (cgroup domain, workspace owners)")
    try:
        client = connect(timeout_s=30)
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        client.close()
        pytest.skip(f"{image} missing; run: tenon image build")
    domain = WorkloadDomain.open(f"tenon-test-{uuid.uuid4().hex[:8]}", budget_bytes=1 << 30)
    yield DockerBackend(domain, client=client)
    cleanup_domain_containers(client, domain.name)
    domain.remove()
    remove_parent_cgroups(domain.name)
    assert list(Path("/sys/fs/cgroup").glob(f"*/{domain.name}")) == []
    client.close()
