"""Suite-wide rules: in CI, a test that needs the real kernel or Docker may not skip."""

from __future__ import annotations

import os

import pytest

REAL_MARKERS = ("docker", "cgroups", "sandbox")


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
