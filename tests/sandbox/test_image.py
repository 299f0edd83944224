"""The built-in images: built from Debian packages, kept while their recipe holds, rebuilt and
swapped in one step when it changes, loaded into Docker with their content id."""

import contextlib
import hashlib
import io
import json
import os
import shutil
import tarfile
import uuid
from pathlib import Path

import pytest

from tenon.errors import ConfigError, ImageNotFound
from tenon.sandbox.images import (
    BASE_IMAGE,
    PACKAGES,
    PYTHON_IMAGE,
    ImageMeta,
    ImageStore,
    build_builtin,
    ensure_in_docker,
    image_key,
)
from tenon.sandbox.images.docker_sync import ID_LABEL


def _need_builder() -> None:
    if os.geteuid() != 0:
        pytest.skip("building the built-in images needs root")
    if shutil.which("mmdebstrap") is None:
        pytest.skip("mmdebstrap is missing (apt-get install mmdebstrap)")


def _tar(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _previous_layout(store: ImageStore, marker: bytes) -> Path:
    """An image directory as the previous layout kept it (name dir, rootfs.tar, image.json
    with the current recipe's key), whose tarball a build extracts instead of rebuilding."""
    legacy = store.root / BASE_IMAGE.replace(":", "_")
    legacy.mkdir(parents=True)
    _tar(legacy / "rootfs.tar", {"etc/hostname": b"buildhost\n", "marker": marker})
    (legacy / "image.json").write_text(json.dumps({"name": BASE_IMAGE, "key": image_key()}))
    return legacy


def test_key_changes_with_the_package_list_only():
    assert image_key() == image_key(packages=tuple(reversed(PACKAGES)))
    assert image_key() != image_key(packages=(*PACKAGES, "strace"))
    assert image_key() != image_key(suite="trixie")


def test_missing_image_names_the_fix(tmp_path):
    with pytest.raises(ImageNotFound, match="run: tenon image build"):
        ImageStore(tmp_path).get(BASE_IMAGE)


def test_an_unknown_builtin_lists_the_builtins(tmp_path):
    with pytest.raises(ConfigError, match="built-ins: tenon-base:bookworm, tenon-python"):
        build_builtin("tenon-go:bookworm", store=ImageStore(tmp_path), docker=False)


def test_a_changed_recipe_rebuilds_and_the_superseded_content_goes_to_trash(tmp_path):
    store = ImageStore(tmp_path / "images")
    legacy = _previous_layout(store, b"first")
    first = build_builtin(BASE_IMAGE, store=store, docker=False)
    assert (first.rootfs / "marker").read_bytes() == b"first"
    assert (first.rootfs / "etc/hostname").read_text() == "sandbox\n"  # not the build host's
    assert not legacy.exists()  # the previous layout's copy went to trash
    moved = next((store.root / "trash").glob("tenon-base_bookworm.*"))
    assert first.meta.id == hashlib.sha256((moved / "rootfs.tar").read_bytes()).hexdigest()
    assert build_builtin(BASE_IMAGE, store=store, docker=False) == first  # current: kept

    meta_path = first.rootfs.parent / "image.json"
    stale = json.loads(meta_path.read_text()) | {"key": "an-older-recipe"}
    meta_path.write_text(json.dumps(stale))
    _previous_layout(store, b"second")
    second = build_builtin(BASE_IMAGE, store=store, docker=False)
    assert second.meta.id != first.meta.id
    assert (store.get(BASE_IMAGE).rootfs / "marker").read_bytes() == b"second"
    trashed = [p for p in (store.root / "trash").iterdir() if p.name.startswith(first.meta.id)]
    assert len(trashed) == 1  # kept for sandboxes that mounted it, until prune
    assert (trashed[0] / "rootfs/marker").read_bytes() == b"first"


@pytest.mark.sandbox
def test_build_is_idempotent():
    _need_builder()
    first = build_builtin(BASE_IMAGE, docker=False)
    meta = first.rootfs.parent / "image.json"
    rootfs_inode = first.rootfs.stat().st_ino
    meta_mtime = meta.stat().st_mtime_ns
    again = build_builtin(BASE_IMAGE, docker=False)
    assert again == first
    assert again.rootfs.stat().st_ino == rootfs_inode
    assert meta.stat().st_mtime_ns == meta_mtime
    assert (first.rootfs / "usr/bin/python3").exists()
    assert (first.rootfs / "etc/hostname").read_text() == "sandbox\n"
    for tool in ("git", "sqlite3", "pip3"):
        assert (first.rootfs / "usr/bin" / tool).exists(), tool
    assert (first.rootfs / "usr/lib/python3.11/ensurepip/__init__.py").exists()  # venv


@pytest.mark.sandbox
def test_the_python_image_has_pytest_from_debian_and_no_compiler():
    _need_builder()
    image = build_builtin(PYTHON_IMAGE, docker=False)
    assert (image.rootfs / "usr/lib/python3/dist-packages/pytest").is_dir()
    for tool in ("python3", "pip3", "git", "pytest-3"):
        assert (image.rootfs / "usr/bin" / tool).exists(), tool
    assert not (image.rootfs / "usr/bin/gcc").exists()
    assert image.meta.key == image_key(packages=(
        "python3", "python3-venv", "python3-pip", "git", "python3-pytest"))


@pytest.mark.docker
def test_docker_gets_the_builtin_with_its_content_id():
    _need_builder()
    docker = pytest.importorskip("docker")
    image = build_builtin(BASE_IMAGE)
    client = docker.from_env(timeout=30)
    try:
        found = client.images.get(BASE_IMAGE)
        assert found.labels[ID_LABEL] == image.meta.id
    finally:
        client.close()


@pytest.mark.docker
def test_reloading_moves_the_tag_and_drops_the_old_image_unless_a_container_uses_it(tmp_path):
    from tenon.sandbox.dockerd import connect

    store = ImageStore(tmp_path / "images")
    name = f"tenon-imagetest-{uuid.uuid4().hex[:8]}:t"

    def install(marker: bytes) -> str:
        image_id = hashlib.sha256(marker).hexdigest()

        def populate(rootfs: Path) -> ImageMeta:
            (rootfs / "marker").write_bytes(marker)
            return ImageMeta(id=image_id, name=name, created_s=0.0, source="test",
                             size_bytes=0)

        store.install(name, image_id, populate)
        assert ensure_in_docker(name, store=store)
        return image_id

    client = connect(timeout_s=30)
    docker_ids: list[str] = []
    container_ids: list[str] = []
    try:
        install(b"a")
        docker_ids.append(client.images.get(name).id)
        assert ensure_in_docker(name, store=store)  # already there: nothing reloaded
        assert client.images.get(name).id == docker_ids[0]
        install(b"b")
        docker_ids.append(client.images.get(name).id)
        first, second = docker_ids
        assert second != first
        with pytest.raises(Exception, match="No such image"):
            client.images.get(first)
        container_ids.append(client.containers.create(second, command=["/marker"]).id)
        install(b"c")
        docker_ids.append(client.images.get(name).id)
        assert docker_ids[2] not in (first, second)
        assert client.images.get(second).id == second  # kept: a container uses it
    finally:
        for container_id in container_ids:
            client.containers.get(container_id).remove(force=True)
        for image_id in reversed(docker_ids):
            with contextlib.suppress(Exception):  # the first is already gone
                client.images.remove(image_id, force=True)
        client.close()
