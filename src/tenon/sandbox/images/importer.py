"""Import an image into the store from the local Docker daemon, a `docker save` tarball or an
OCI layout directory; its layers are applied in order (whiteouts included) into one rootfs.

The content id is the sha256 of the image's config blob (what Docker calls the image id): it
names the layers' content (their diff ids) and the settings, so one image imported twice, or
once from Docker and once from an OCI layout, is stored once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

from tenon.errors import BackendUnavailable, ConfigError, ImageNotFound
from tenon.sandbox.images.layers import apply_layer
from tenon.sandbox.images.store import ImageMeta, ImageStore, StoredImage, normalize_name

REF_NAME = "org.opencontainers.image.ref.name"
_INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
                "application/vnd.docker.distribution.manifest.list.v2+json")


class ImageImportError(ConfigError):
    """The source is not an image this importer reads (with what is wrong)."""


class _Source:
    """Files of a docker save or OCI layout, in a directory or a tar."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tar: tarfile.TarFile | None = None
        if path.is_file():
            try:
                self._tar = tarfile.open(path, mode="r:*")  # noqa: SIM115 - closed by close()
            except tarfile.TarError as exc:
                raise ImageImportError(f"{path} is not a tar archive ({exc})") from exc

    def close(self) -> None:
        if self._tar is not None:
            self._tar.close()

    def exists(self, name: str) -> bool:
        if self._tar is None:
            return (self.path / name).is_file()
        with contextlib.suppress(KeyError):
            self._tar.getmember(name)
            return True
        with contextlib.suppress(KeyError):
            self._tar.getmember(f"./{name}")
            return True
        return False

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[IO[bytes]]:
        if ".." in Path(name).parts or name.startswith("/"):
            raise ImageImportError(f"{self.path}: entry {name!r} points outside the image")
        if self._tar is None:
            with (self.path / name).open("rb") as f:
                yield f
            return
        for candidate in (name, f"./{name}"):
            with contextlib.suppress(KeyError):
                member = self._tar.getmember(candidate)
                while member.issym() or member.islnk():  # docker save links equal layers
                    member = self._tar.getmember(_link_target(member))
                member_file = self._tar.extractfile(member)
                if member_file is not None:
                    with member_file:
                        yield member_file
                    return
        raise ImageImportError(f"{self.path}: {name} is missing")

    def read(self, name: str) -> bytes:
        with self.open(name) as f:
            return f.read()

    def json(self, name: str) -> Any:
        try:
            return json.loads(self.read(name))
        except ValueError as exc:
            raise ImageImportError(f"{self.path}: {name} is not JSON ({exc})") from exc


def _link_target(member: tarfile.TarInfo) -> str:
    if member.islnk():
        return member.linkname
    return str(Path(member.name).parent / member.linkname)


@dataclass(frozen=True)
class _Plan:
    """What to apply: the config blob, the layers in order and the name the source gives."""

    config: bytes
    layers: list[str]
    name: str | None
    source: str


def _docker_save_plan(src: _Source) -> _Plan:
    manifest = src.json("manifest.json")
    if not isinstance(manifest, list) or not manifest:
        raise ImageImportError(f"{src.path}: manifest.json lists no image")
    entry = manifest[0]
    tags = entry.get("RepoTags") or []
    return _Plan(src.read(entry["Config"]), list(entry["Layers"]),
                 tags[0] if tags else None, f"docker save {src.path}")


def _blob(digest: str) -> str:
    algorithm, _, hexdigest = digest.partition(":")
    if not algorithm or not hexdigest.isalnum():
        raise ImageImportError(f"invalid digest {digest!r}")
    return f"blobs/{algorithm}/{hexdigest}"


def _oci_plan(src: _Source) -> _Plan:
    index = src.json("index.json")
    descriptors = index.get("manifests") or []
    if not descriptors:
        raise ImageImportError(f"{src.path}: index.json lists no manifest")
    descriptor = descriptors[0]
    ref = (descriptor.get("annotations") or {}).get(REF_NAME)
    manifest = src.json(_blob(descriptor["digest"]))
    while manifest.get("mediaType") in _INDEX_TYPES or "manifests" in manifest:
        manifest = src.json(_blob(_pick_platform(manifest["manifests"])["digest"]))
    layers = []
    for layer in manifest.get("layers", []):
        if "zstd" in layer.get("mediaType", ""):
            raise ImageImportError(f"{src.path}: layer {layer['digest']} is zstd-compressed; "
                               "only tar, gzip, bzip2 and xz layers are read")
        layers.append(_blob(layer["digest"]))
    config = src.read(_blob(manifest["config"]["digest"]))
    name = ref if ref and (":" in ref or "/" in ref) else None  # not a bare tag
    return _Plan(config, layers, name, f"OCI layout {src.path}")


def _pick_platform(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    for m in manifests:
        platform = m.get("platform") or {}
        if platform.get("os") == "linux" and platform.get("architecture") == "amd64":
            return m
    return manifests[0]


def _meta_of(plan: _Plan, image_id: str, name: str) -> ImageMeta:
    try:
        config = json.loads(plan.config).get("config") or {}
    except ValueError as exc:
        raise ImageImportError(f"{plan.source}: the image config is not JSON ({exc})") from exc
    return ImageMeta(id=image_id, name=name, created_s=0.0, source=plan.source, size_bytes=0,
                     env=list(config.get("Env") or []), workdir=config.get("WorkingDir") or "",
                     user=config.get("User") or "",
                     entrypoint=list(config.get("Entrypoint") or []),
                     cmd=list(config.get("Cmd") or []))


def import_path(path: Path, *, name: str | None, store: ImageStore,
                source: str | None = None) -> StoredImage:
    """Import a `docker save` tarball or an OCI layout (a directory or a tar of one);
    `source` (default: the kind and path) is recorded in image.json."""
    if not path.exists():
        raise ImageImportError(f"{path} does not exist")
    src = _Source(path)
    try:
        if src.exists("manifest.json"):
            plan = _docker_save_plan(src)
        elif src.exists("index.json"):
            plan = _oci_plan(src)
        else:
            raise ImageImportError(f"{path} is neither a docker save archive (manifest.json) nor "
                               "an OCI layout (index.json)")
        target = name or plan.name
        if target is None:
            raise ImageImportError(f"{path} names no image; give one with --name")
        target = normalize_name(target)
        image_id = hashlib.sha256(plan.config).hexdigest()

        def populate(rootfs: Path) -> ImageMeta:
            for layer in plan.layers:
                with src.open(layer) as f:
                    try:
                        apply_layer(f, rootfs)
                    except tarfile.TarError as exc:
                        raise ImageImportError(f"{plan.source}: layer {layer}: {exc}") from exc
            meta = _meta_of(plan, image_id, target)
            return replace(meta, created_s=time.time(), source=source or plan.source)

        return store.install(target, image_id, populate)
    finally:
        src.close()


def import_from_docker(image: str, *, name: str | None, store: ImageStore) -> StoredImage:
    """Import an image of the local Docker daemon (`docker save` through the SDK)."""
    import docker

    from tenon.sandbox.dockerd import connect

    client = connect(timeout_s=300)
    try:
        try:
            found = client.images.get(image)
        except docker.errors.ImageNotFound as exc:
            raise ImageNotFound(f"the Docker daemon has no image {image!r} and {image!r} is "
                                "not a file or directory") from exc
        except docker.errors.APIError as exc:
            raise BackendUnavailable(f"Docker could not look up {image!r}: {exc}") from exc
        known = (found.id or "").removeprefix("sha256:")
        if store.has_content(known):  # Docker's id is the config digest: stored already
            return store.install(normalize_name(name or image), known, _unreachable)
        with store.staging() as stage:
            tar_path = stage / "image.tar"
            with tar_path.open("wb") as out:
                for chunk in found.save(named=False):
                    out.write(chunk)
            return import_path(tar_path, name=name or image, store=store,
                               source=f"docker image {image}")
    finally:
        client.close()


def _unreachable(rootfs: Path) -> ImageMeta:
    raise ImageImportError(f"no content to extract into {rootfs}")


def import_image(source: str, *, name: str | None = None,
                 store: ImageStore | None = None) -> StoredImage:
    """Import `source`: a path (docker save tarball, OCI layout directory or tar), else the
    name of an image of the local Docker daemon. `name` (default: the one the source gives)
    is what sandboxes ask for."""
    store = store or ImageStore()
    path = Path(source)
    if path.exists():
        return import_path(path, name=name, store=store)
    if "/" in source and (source.startswith((".", "/")) or source.endswith(".tar")):
        raise ImageImportError(f"{source} does not exist")
    return import_from_docker(source, name=name, store=store)
