"""`tenon image import | list | rm | prune | build` on a store of their own: what they print,
and one-line errors for bad input."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tenon.cli.main import app
from tenon.sandbox.images import ImageStore

WIDE = {"COLUMNS": "200"}


def _layout(path: Path) -> str:
    """An OCI layout of one layer holding /greeting; returns its config digest."""
    blobs = path / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def blob(data: bytes) -> dict[str, object]:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return {"digest": f"sha256:{digest}", "size": len(data)}

    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        info = tarfile.TarInfo("greeting")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"hi\n"))
    config = blob(json.dumps({"config": {"Env": ["A=1"]}}).encode())
    manifest = blob(json.dumps({"schemaVersion": 2, "config": config,
                                "layers": [blob(layer.getvalue())]}).encode())
    (path / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [manifest]}))
    return str(config["digest"]).removeprefix("sha256:")


def invoke(*args: str):  # noqa: ANN201 - click's Result
    return CliRunner().invoke(app, ["image", *args], env=WIDE)


def test_import_list_rm_prune(tmp_path: Path) -> None:
    image_id = _layout(tmp_path / "oci")
    store = ["--image-dir", str(tmp_path / "images")]
    result = invoke("import", str(tmp_path / "oci"), "--name", "greet:1", *store)
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"greet:1: {image_id[:12]} ")
    listed = invoke("list", *store)
    assert listed.exit_code == 0, listed.output
    row = next(line for line in listed.output.splitlines() if "greet:1" in line)
    assert image_id[:12] in row
    assert "OCI layout" in row
    assert (ImageStore(tmp_path / "images").rootfs("greet:1") / "greeting").read_text() == "hi\n"
    removed = invoke("rm", "greet:1", *store)
    assert removed.exit_code == 0, removed.output
    assert "moved to trash" in removed.output
    assert "greet:1" not in invoke("list", *store).output
    assert "deleted 1 removed image(s)" in invoke("prune", *store).output


@pytest.mark.parametrize(("args", "expected"), [
    (["rm", "nope:1"], "unknown image 'nope:1'"),
    (["import", "./missing.tar"], "does not exist"),
    (["import", "{tmp}"], "neither a docker save archive"),
    (["build", "-f", "{tmp}/Dockerfile"], "-f needs --name"),
    (["build", "--name", "x:1"], "goes with -f"),
    (["build", "--image", "tenon-go:bookworm"], "not a built-in image"),
    (["rm", "../../etc"], "invalid image name"),
])
def test_bad_input_is_one_line(tmp_path: Path, args: list[str], expected: str) -> None:
    (tmp_path / "Dockerfile").write_text("FROM scratch\n")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    result = invoke(*argv, "--image-dir", str(tmp_path / "images"))
    assert result.exit_code == 2, result.output
    assert expected in result.output
    assert "Traceback" not in result.output
