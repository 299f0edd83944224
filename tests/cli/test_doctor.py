"""`tenon doctor` exits 0 only when every check passes, 1 when any fails."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tenon.cli.doctor import run_checks
from tenon.cli.main import DEFAULT_IMAGE, DEFAULT_STATE_DIR, EXIT_CHECK_FAILED, app
from tenon.errors import ImageNotFound
from tenon.sandbox.images import image_rootfs

WIDE = {"COLUMNS": "200"}  # one table row per check, so names are not wrapped


def test_an_image_dir_without_the_image_fails_the_doctor(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["doctor", "--image-dir", str(tmp_path)], env=WIDE)
    assert result.exit_code == EXIT_CHECK_FAILED == 1, result.output
    assert "Traceback" not in result.output
    failed = [c.name for c in run_checks(DEFAULT_STATE_DIR, DEFAULT_IMAGE, tmp_path)
              if not c.ok]
    assert f"base rootfs {DEFAULT_IMAGE}" in failed
    assert f"{len(failed)} of " in result.output
    assert "tenon image build" in result.output


def test_an_unknown_image_fails_the_doctor() -> None:
    result = CliRunner().invoke(app, ["doctor", "--image", "tenon-base:no-such-tag"], env=WIDE)
    assert result.exit_code == 1, result.output
    assert "base rootfs tenon-base:no-such-tag" in result.output


@pytest.mark.cgroups
@pytest.mark.sandbox
@pytest.mark.docker
def test_a_ready_host_passes_the_doctor() -> None:
    if os.geteuid() != 0:
        pytest.skip("the doctor's cgroup checks need root")
    try:
        image_rootfs(DEFAULT_IMAGE, DEFAULT_STATE_DIR)
    except ImageNotFound as exc:
        pytest.skip(str(exc))
    result = CliRunner().invoke(app, ["doctor"], env=WIDE)
    assert result.exit_code == 0, result.output
    assert "checks failed" not in result.output
    assert all(c.ok for c in run_checks(DEFAULT_STATE_DIR, DEFAULT_IMAGE))
