"""The base image: built with mmdebstrap, extracted atomically, imported into Docker."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from tenon.errors import ImageNotFound
from tenon.sandbox.image import build_image, image_dir, image_rootfs

IMAGE = "tenon-base:bookworm"
STATE_DIR = Path("/var/lib/tenon")


def _need_builder() -> None:
    if os.geteuid() != 0:
        pytest.skip("building the base image needs root")
    if shutil.which("mmdebstrap") is None:
        pytest.skip("mmdebstrap is missing (apt-get install mmdebstrap)")


def test_missing_image_names_the_fix(tmp_path):
    with pytest.raises(ImageNotFound, match="run: tenon image build"):
        image_rootfs(IMAGE, tmp_path)


@pytest.mark.sandbox
def test_build_is_idempotent():
    _need_builder()
    first = build_image(IMAGE, state_dir=STATE_DIR, docker=False)
    meta = image_dir(IMAGE, STATE_DIR) / "image.json"
    rootfs_inode = Path(first.rootfs).stat().st_ino
    meta_mtime = meta.stat().st_mtime_ns
    again = build_image(IMAGE, state_dir=STATE_DIR, docker=False)
    assert again == first
    assert Path(again.rootfs).stat().st_ino == rootfs_inode
    assert meta.stat().st_mtime_ns == meta_mtime
    rootfs = image_rootfs(IMAGE, STATE_DIR)
    assert (rootfs / "usr/bin/python3").exists()
    assert (rootfs / "etc/hostname").read_text() == "sandbox\n"  # not the build host's name


@pytest.mark.sandbox
@pytest.mark.slow
def test_fresh_build_extracts_atomically_and_records_the_tar(tmp_path):
    _need_builder()
    info = build_image(IMAGE, state_dir=tmp_path, docker=False)
    target = image_dir(IMAGE, tmp_path)
    assert Path(info.rootfs) == target / "rootfs"
    assert sorted(p.name for p in target.iterdir()) == ["image.json", "rootfs", "rootfs.tar"]
    meta = json.loads((target / "image.json").read_text())
    assert meta["name"] == IMAGE
    assert meta["tar_sha256"] == hashlib.sha256((target / "rootfs.tar").read_bytes()).hexdigest()
    assert (image_rootfs(IMAGE, tmp_path) / "usr/bin/python3").exists()
    assert not (Path.cwd() / "rootfs.tar").exists()  # nothing written outside the state dir


@pytest.mark.docker
def test_docker_engine_gets_the_same_image():
    _need_builder()
    docker = pytest.importorskip("docker")
    try:
        client = docker.from_env(timeout=10)
        client.ping()
    except Exception as exc:
        pytest.skip(f"no Docker Engine answers: {exc}")
    info = build_image(IMAGE, state_dir=STATE_DIR)
    assert info.docker_imported
    image = client.images.get(IMAGE)
    assert IMAGE in image.tags
