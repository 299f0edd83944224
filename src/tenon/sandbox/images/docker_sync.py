"""Load a stored image into the local Docker daemon under its name, for the Docker backend.

An image imported from Docker is already there (its Docker id is its content id) and only
gets tagged; any other (a built-in, an OCI layout) is `docker import`ed from a tar of its
rootfs, labelled with its content id, with its env, workdir, user, entrypoint and cmd.
Moving a tag removes the image it left unless a container uses it.
"""

from __future__ import annotations

import json
import logging
import tarfile
from typing import TYPE_CHECKING

from tenon.errors import BackendUnavailable
from tenon.sandbox.images.store import ImageStore, StoredImage

if TYPE_CHECKING:
    import docker

logger = logging.getLogger(__name__)

ID_LABEL = "org.tenon.image.id"


def _docker_has(client: docker.DockerClient, image: StoredImage) -> bool:
    try:
        found = client.images.get(image.name)
    except Exception:
        return False
    labels = found.labels or {}
    return labels.get(ID_LABEL) == image.meta.id or found.id == f"sha256:{image.meta.id}"


def _changes(image: StoredImage) -> list[str]:
    meta = image.meta
    changes = [f"LABEL {ID_LABEL}={meta.id}"]
    for item in meta.env:
        key, _, value = item.partition("=")
        changes.append(f"ENV {key}={json.dumps(value)}")
    if meta.workdir:
        changes.append(f"WORKDIR {meta.workdir}")
    if meta.user:
        changes.append(f"USER {meta.user}")
    if meta.entrypoint:
        changes.append(f"ENTRYPOINT {json.dumps(meta.entrypoint)}")
    if meta.cmd:
        changes.append(f"CMD {json.dumps(meta.cmd)}")
    return changes


def _anonymous(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uname = info.gname = ""  # numeric ids only, not the build host's names
    return info


def _import(client: docker.DockerClient, image: StoredImage, store: ImageStore) -> None:
    repository, _, tag = image.name.partition(":")
    try:
        previous_id: str | None = client.images.get(image.name).id
    except Exception:
        previous_id = None
    with store.staging() as stage:
        tar_path = stage / "rootfs.tar"
        with tarfile.open(tar_path, "w") as tar:
            tar.add(image.rootfs, arcname=".", filter=_anonymous)
        with tar_path.open("rb") as f:
            client.api.import_image_from_data(f, repository=repository, tag=tag,
                                              changes=_changes(image))
    current_id = client.images.get(image.name).id
    if previous_id is not None and previous_id != current_id:
        try:  # the engine refuses (and we leave) an image a container uses
            client.images.remove(previous_id)
        except Exception as exc:
            logger.info("kept the superseded image %s of %s: %s", previous_id, image.name, exc)


def ensure_in_docker(name: str, *, store: ImageStore | None = None,
                     required: bool = True) -> bool:
    """Make the Docker daemon hold image `name` of the store with the same content; False
    when no daemon answers and not `required` (BackendUnavailable when it is)."""
    from tenon.sandbox.dockerd import connect

    store = store or ImageStore()
    image = store.get(name)
    try:
        client = connect(timeout_s=300)
    except BackendUnavailable as exc:
        if required:
            raise
        logger.warning("no Docker Engine answers (%s); %s not loaded into Docker", exc, name)
        return False
    try:
        if _docker_has(client, image):
            return True
        try:
            same = client.images.get(f"sha256:{image.meta.id}")
        except Exception:
            same = None
        repository, _, tag = image.name.partition(":")
        if same is not None:
            same.tag(repository, tag)
        else:
            _import(client, image, store)
    finally:
        client.close()
    return True
