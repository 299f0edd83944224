import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tenon.cli.main import app
from tenon.errors import ConfigError, ImageNotFound
from tenon.sandbox.images import ImageStore, image_rootfs
from tenon.sandbox.registry import make_backend


def test_missing_image_names_the_fix(tmp_path):
    with pytest.raises(ImageNotFound, match="tenon image build"):
        ImageStore(tmp_path).get("tenon-base:bookworm")


def test_invalid_image_name_is_rejected(tmp_path):
    with pytest.raises(ImageNotFound, match="invalid image name"):
        image_rootfs("../../etc", tmp_path)


def test_unknown_backend_lists_known_ones(tmp_path):
    with pytest.raises(ConfigError, match="unknown backend 'vm'.*docker, process"):
        make_backend("vm", domain=None, state_dir=tmp_path)  # type: ignore[arg-type]


def test_doctor_reports_missing_image_with_fix(tmp_path):
    result = CliRunner().invoke(app, ["doctor", "--state-dir", str(tmp_path)],
                                env={"COLUMNS": "200", "TENON_IMAGE_DIR": str(tmp_path / "i")})
    assert result.exit_code == 1, result.output  # a failed check is a failed doctor
    assert "base rootfs" in result.output
    assert "tenon image build" in result.output


@pytest.mark.sandbox
def test_built_image_rootfs_has_python(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("building the base image needs root")
    from tenon.sandbox.images import build_builtin

    info = build_builtin("tenon-base:bookworm", docker=False)
    rootfs = image_rootfs("tenon-base:bookworm", Path("/var/lib/tenon"))
    assert (rootfs / "usr/bin/python3").exists()
    assert rootfs == info.rootfs
