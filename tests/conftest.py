"""Suite-wide rules: in CI, a test that needs the real kernel or Docker may not skip."""

from __future__ import annotations

import os

import pytest

REAL_MARKERS = ("docker", "cgroups", "sandbox", "disk")


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
        from tenon.sandbox.docker import connect

        try:
            connect(timeout_s=5).close()
            _docker_problem.append(None)
        except BackendUnavailable as exc:
            _docker_problem.append(str(exc))
    if _docker_problem[0] is not None:
        pytest.skip(_docker_problem[0])
