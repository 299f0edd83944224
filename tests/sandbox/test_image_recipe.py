"""The base image's recipe key: a changed package list rebuilds, swapping the rootfs in one step."""

import json
import os
import shutil

import pytest

from tenon.sandbox.image import PACKAGES, build_image, image_dir, image_key, image_rootfs

IMAGE = "tenon-base:bookworm"


def test_key_changes_with_the_package_list_only():
    assert image_key() == image_key(packages=tuple(reversed(PACKAGES)))
    assert image_key() != image_key(packages=(*PACKAGES, "strace"))
    assert image_key() != image_key(suite="trixie")


@pytest.mark.sandbox
@pytest.mark.slow
def test_an_image_built_from_another_recipe_is_rebuilt_and_swapped(tmp_path):
    if os.geteuid() != 0 or shutil.which("mmdebstrap") is None:
        pytest.skip("building the base image needs root and mmdebstrap")
    target = image_dir(IMAGE, tmp_path)
    old_rootfs = target / "rootfs"
    (old_rootfs / "usr" / "bin").mkdir(parents=True)
    (old_rootfs / "usr" / "bin" / "python3").write_text("an older image\n")
    old_inode = old_rootfs.stat().st_ino
    (target / "image.json").write_text(json.dumps({
        "name": IMAGE, "rootfs": str(old_rootfs), "tar_sha256": "0" * 64, "created_s": 0.0,
        "docker_imported": False}))  # written before images recorded a key

    info = build_image(IMAGE, state_dir=tmp_path, docker=False)

    assert info.key == image_key()
    assert json.loads((target / "image.json").read_text())["key"] == image_key()
    rootfs = image_rootfs(IMAGE, tmp_path)
    assert rootfs.stat().st_ino != old_inode
    for tool in ("git", "sqlite3", "pip3"):
        assert (rootfs / "usr" / "bin" / tool).exists(), tool
    assert (rootfs / "usr/lib/python3.11/ensurepip/__init__.py").exists()  # python3-venv
    # The replaced tree is kept (running sandboxes may have it bind-mounted), not merged.
    superseded = target / "superseded" / "rootfs"
    assert superseded.stat().st_ino == old_inode
    assert (superseded / "usr/bin/python3").read_text() == "an older image\n"
    assert sorted(p.name for p in target.iterdir()) == [
        "image.json", "rootfs", "rootfs.tar", "superseded"]
    assert build_image(IMAGE, state_dir=tmp_path, docker=False) == info  # now up to date


def _tiny_tar(path, content: bytes):
    import io
    import tarfile

    with tarfile.open(path, "w") as tar:
        info = tarfile.TarInfo("marker")
        info.size = len(content)
        tar.addfile(info, io.BytesIO(content))
    return path


@pytest.mark.docker
def test_reimport_moves_the_tag_and_drops_the_old_image_unless_a_container_uses_it(tmp_path):
    import contextlib
    import uuid

    from tenon.sandbox.docker import connect
    from tenon.sandbox.image import _docker_import

    name = f"tenon-imagetest-{uuid.uuid4().hex[:8]}:t"
    client = connect(timeout_s=30)
    image_ids: list[str] = []
    container_ids: list[str] = []
    try:
        assert _docker_import(_tiny_tar(tmp_path / "a.tar", b"a"), name)
        image_ids.append(client.images.get(name).id)
        assert _docker_import(_tiny_tar(tmp_path / "b.tar", b"b"), name)
        image_ids.append(client.images.get(name).id)
        first, second = image_ids
        assert second != first
        with pytest.raises(Exception, match="No such image"):
            client.images.get(first)
        container_ids.append(client.containers.create(second, command=["/marker"]).id)
        assert _docker_import(_tiny_tar(tmp_path / "c.tar", b"c"), name)
        image_ids.append(client.images.get(name).id)
        assert image_ids[2] not in (first, second)
        assert client.images.get(second).id == second  # kept: a container uses it
    finally:
        for container_id in container_ids:
            client.containers.get(container_id).remove(force=True)
        for image_id in reversed(image_ids):
            with contextlib.suppress(Exception):  # the first is already gone
                client.images.remove(image_id, force=True)
        client.close()
