"""Images of your own, through the local Docker daemon: a Dockerfile built FROM the built-in
base (a file added, a file deleted, a directory made opaque), imported from Docker, from its
`docker save` tarball and from an OCI layout converted from that tarball, then run by a
process sandbox."""

import contextlib
import gzip
import hashlib
import json
import os
import tarfile
import uuid
from pathlib import Path

import pytest

from tenon.errors import ImageNotFound
from tenon.sandbox import launcher
from tenon.sandbox.base import SandboxSpec
from tenon.sandbox.images import BASE_IMAGE, ImageStore, image_rootfs
from tenon.sandbox.images.build import build_dockerfile, dockerfile_bases
from tenon.sandbox.images.importer import import_image
from tenon.units import MIB

pytestmark = pytest.mark.docker

DOCKERFILE = """\
FROM tenon-base:bookworm AS base
COPY hello /usr/local/bin/hello
RUN rm /etc/debian_version \\
 && rm -rf /usr/share/doc && mkdir /usr/share/doc && echo only > /usr/share/doc/only
ENV GREETING=imported
WORKDIR /srv
"""
HELLO = '#!/bin/sh\necho "hello from the image: $GREETING"\n'


def test_dockerfile_bases_skip_scratch_stages_and_arguments():
    text = ("ARG V=1\nFROM --platform=linux/amd64 a:1 AS build\nFROM scratch\n"
            "FROM build\nFROM b:$V\nFROM \\\n  c:2\n")
    assert dockerfile_bases(text) == ["a:1", "c:2"]


@pytest.fixture(scope="module")
def docker_client():
    docker = pytest.importorskip("docker")
    from tenon.sandbox.dockerd import connect

    if os.geteuid() != 0:
        pytest.skip("extracting images with their owners needs root")
    try:
        image_rootfs(BASE_IMAGE)
    except ImageNotFound as exc:
        pytest.skip(str(exc))
    client = connect(timeout_s=60)
    yield client
    client.close()
    del docker


@pytest.fixture(scope="module")
def built(docker_client, tmp_path_factory):
    """The Dockerfile's image, built as a unique name into a store of its own."""
    work = tmp_path_factory.mktemp("build")
    (work / "Dockerfile").write_text(DOCKERFILE)
    (work / "hello").write_text(HELLO)
    (work / "hello").chmod(0o755)
    name = f"tenon-imagetest-{uuid.uuid4().hex[:8]}:1"
    store = ImageStore(tmp_path_factory.mktemp("store"))
    try:
        yield build_dockerfile(work / "Dockerfile", name=name, store=store), store, work
    finally:
        with contextlib.suppress(Exception):
            docker_client.images.remove(name, force=True)


def test_a_dockerfile_build_is_imported_with_its_layers_and_config(built):
    image, store, _ = built
    rootfs = image.rootfs
    assert (rootfs / "usr/local/bin/hello").read_text() == HELLO
    assert os.access(rootfs / "usr/local/bin/hello", os.X_OK)
    assert not (rootfs / "etc/debian_version").exists()  # a whiteout of the RUN layer
    assert sorted(p.name for p in (rootfs / "usr/share/doc").iterdir()) == ["only"]  # opaque
    assert (rootfs / "usr/bin/python3").exists()  # the base's layer below
    assert (rootfs / "usr/bin/su").stat().st_mode & 0o4000  # setuid kept
    assert "GREETING=imported" in image.meta.env
    assert image.meta.workdir == "/srv"
    assert image.meta.source == f"docker image {image.name}"
    assert store.names() == [image.name]
    assert not list(rootfs.rglob(".wh.*"))


def _docker_save(client, name: str, path: Path) -> Path:
    with path.open("wb") as out:
        for chunk in client.images.get(name).save(named=True):
            out.write(chunk)
    return path


def _oci_from_docker_save(archive: Path, layout: Path) -> None:
    """Convert a docker save tarball into an OCI image layout (gzip layers)."""
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def blob(data: bytes) -> dict:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return {"digest": f"sha256:{digest}", "size": len(data)}

    with tarfile.open(archive) as tar:
        entry = json.loads(tar.extractfile("manifest.json").read())[0]
        config = blob(tar.extractfile(entry["Config"]).read())
        layers = [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                   **blob(gzip.compress(tar.extractfile(name).read(), compresslevel=1))}
                  for name in entry["Layers"]]
    manifest = blob(json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **config},
        "layers": layers}).encode())
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", **manifest,
         "annotations": {"org.opencontainers.image.ref.name": "from-oci:1"}}]}))


def _listing(root: Path) -> list[tuple[str, int, int, int]]:
    out = []
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        out.append((str(path.relative_to(root)), st.st_mode, st.st_uid, st.st_size))
    return out


@pytest.mark.slow
def test_docker_save_and_oci_layout_give_the_same_content_id_and_tree(built, docker_client,
                                                                      tmp_path):
    image, _, _ = built
    archive = _docker_save(docker_client, image.name, tmp_path / "image.tar")
    saved_store = ImageStore(tmp_path / "saved")
    saved = import_image(str(archive), store=saved_store)
    assert (saved.name, saved.meta.id) == (image.name, image.meta.id)
    assert saved.meta.source == f"docker save {archive}"

    _oci_from_docker_save(archive, tmp_path / "oci")
    from_oci = import_image(str(tmp_path / "oci"), store=saved_store)
    assert from_oci.name == "from-oci:1"
    assert from_oci.meta.id == image.meta.id  # the config's digest: stored once
    assert from_oci.rootfs == saved.rootfs
    oci_only = import_image(str(tmp_path / "oci"), store=ImageStore(tmp_path / "oci-store"))
    assert _listing(oci_only.rootfs) == _listing(image.rootfs)


def test_a_base_that_is_not_present_locally_is_a_clear_error(docker_client, tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM tenon-nonexistent/base:9\nRUN true\n")
    with pytest.raises(ImageNotFound) as info:
        build_dockerfile(tmp_path / "Dockerfile", name="never:1",
                         store=ImageStore(tmp_path / "store"))
    message = str(info.value)
    assert "'tenon-nonexistent/base:9'" in message
    assert "not present locally" in message
    assert "tenon image import" in message
    assert "tenon image build" in message
    assert "\n" not in message


def test_a_failing_step_is_a_one_line_error(docker_client, tmp_path):
    from tenon.sandbox.images.build import BuildFailed

    (tmp_path / "Dockerfile").write_text(f"FROM {BASE_IMAGE}\nRUN exit 3\n")
    with pytest.raises(BuildFailed, match="returned a non-zero code: 3"):
        build_dockerfile(tmp_path / "Dockerfile", name="tenon-imagetest-fails:1",
                         store=ImageStore(tmp_path / "store"))


@pytest.mark.sandbox
async def test_a_process_sandbox_runs_what_the_image_added(built, tmp_path, monkeypatch):
    import asyncio

    from tenon.host.domain import WorkloadDomain
    from tenon.sandbox.process import ProcessBackend

    if problems := launcher.check():
        pytest.skip(problems[0])
    image, store, _ = built
    # the backend's state directory has no images: it finds them in $TENON_IMAGE_DIR
    monkeypatch.setenv("TENON_IMAGE_DIR", str(store.root))
    domain = WorkloadDomain.open(f"tenon-test-{uuid.uuid4().hex[:8]}")
    try:
        backend = ProcessBackend(domain, state_dir=Path("/var/lib/tenon"))
        workspace = tmp_path / "ws"
        workspace.mkdir()
        spec = SandboxSpec(sandbox_id=f"sb-{uuid.uuid4().hex[:8]}", image=image.name,
                           workspace=workspace, max_pids=64, tmp_size_bytes=64 * MIB)
        sandbox = await backend.materialize(spec)
        try:
            result = await sandbox.exec(
                "hello; cat /usr/share/doc/only; test ! -e /etc/debian_version && echo gone",
                timeout_s=30)
        finally:
            await sandbox.destroy()
        await asyncio.sleep(0)
    finally:
        domain.remove()
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == ["hello from the image: imported", "only", "gone"]
    with pytest.raises(ImageNotFound, match=r"unknown image 'tenon-nope:1'.*" +
                       image.name.replace(".", r"\.")):
        store.get("tenon-nope:1")
