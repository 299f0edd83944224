"""The base image: Debian minbase + python3, built locally with mmdebstrap.

One build feeds both backends: the tarball is extracted as the process backend's
read-only root and `docker import`ed under the same name for the Docker backend.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tenon.errors import BackendUnavailable, ImageNotFound

logger = logging.getLogger(__name__)

SUITE = "bookworm"
BUILD_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class ImageInfo:
    name: str
    rootfs: str
    tar_sha256: str
    created_s: float
    docker_imported: bool


def _safe_name(name: str) -> str:
    if not re.fullmatch(r"[a-z0-9][a-z0-9._-]*(:[A-Za-z0-9._-]+)?", name):
        raise ImageNotFound(f"invalid image name {name!r} (expected e.g. tenon-base:bookworm)")
    return name.replace(":", "_")


def image_dir(name: str, state_dir: Path) -> Path:
    return state_dir / "images" / _safe_name(name)


def image_rootfs(name: str, state_dir: Path) -> Path:
    """The extracted root filesystem of `name`; ImageNotFound (with the fix) when absent."""
    rootfs = image_dir(name, state_dir) / "rootfs"
    if not (rootfs / "usr" / "bin" / "python3").exists():
        raise ImageNotFound(
            f"base image {name!r} has no rootfs at {rootfs}; run: tenon image build"
        )
    return rootfs


def _sanitize(rootfs: Path) -> None:
    """mmdebstrap copies the build host's /etc/hostname; a sandbox must not learn it."""
    hostname = rootfs / "etc" / "hostname"
    if not hostname.exists() or hostname.read_text() != "sandbox\n":
        hostname.write_text("sandbox\n")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _docker_import(tar_path: Path, name: str) -> bool:
    """Import the tarball into a local Docker Engine; False when none answers."""
    from tenon.sandbox.docker import connect

    try:
        client = connect(timeout_s=300)
    except BackendUnavailable as exc:
        logger.warning("no Docker Engine answers (%s); skipping docker import", exc)
        return False
    repository, _, tag = name.partition(":")
    try:
        with tar_path.open("rb") as f:
            client.api.import_image_from_data(f, repository=repository, tag=tag or "latest")
        client.images.get(name)
    finally:
        client.close()
    return True


def _docker_has(name: str) -> bool:
    from tenon.sandbox.docker import connect

    try:
        client = connect(timeout_s=10)
    except BackendUnavailable:
        return False
    try:
        client.images.get(name)
    except Exception:
        return False
    finally:
        client.close()
    return True


def build_image(
    name: str = "tenon-base:bookworm",
    *,
    state_dir: Path = Path("/var/lib/tenon"),
    force: bool = False,
    docker: bool | None = None,
) -> ImageInfo:
    """Build `name` (idempotent: skips what is already present unless `force`).

    `docker`: True requires importing into a Docker Engine, False skips it, None (default)
    imports when an engine answers.
    """
    target = image_dir(name, state_dir)
    meta_path = target / "image.json"
    if not force and meta_path.exists():
        info = ImageInfo(**json.loads(meta_path.read_text()))
        _sanitize(image_rootfs(name, state_dir))
        # The rootfs is there; re-import into Docker when the engine lost the image.
        tar_path = target / "rootfs.tar"
        if docker is False:
            return info
        if not _docker_has(name) and tar_path.exists() and _docker_import(tar_path, name):
            info = replace(info, docker_imported=True)
            meta_path.write_text(json.dumps(asdict(info), indent=2))
        return info
    if shutil.which("mmdebstrap") is None:
        raise BackendUnavailable("mmdebstrap is missing; run: apt-get install mmdebstrap")
    target.mkdir(parents=True, exist_ok=True)
    tar_path = target / "rootfs.tar"
    logger.info("building %s with mmdebstrap", name)
    cmd = ["mmdebstrap", "--variant=minbase", "--include=python3", SUITE, str(tar_path)]
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.CalledProcessError as exc:
        tail = exc.stderr.decode(errors="replace")[-2000:]
        raise BackendUnavailable(f"mmdebstrap failed ({exc.returncode}): {tail}") from exc
    except subprocess.TimeoutExpired as exc:
        raise BackendUnavailable(f"mmdebstrap took longer than {BUILD_TIMEOUT_S} s") from exc
    # Extract next to the final place, then swap in atomically.
    staging = Path(tempfile.mkdtemp(prefix="rootfs-", dir=target))
    with tarfile.open(tar_path) as tar:
        tar.extractall(staging, filter="fully_trusted")
    rootfs = target / "rootfs"
    if rootfs.exists():
        shutil.rmtree(rootfs)
    _sanitize(staging)
    staging.rename(rootfs)
    info = ImageInfo(
        name=name,
        rootfs=str(rootfs),
        tar_sha256=_sha256(tar_path),
        created_s=time.time(),
        docker_imported=docker is not False and _docker_import(tar_path, name),
    )
    if docker and not info.docker_imported:
        raise BackendUnavailable(f"no Docker Engine answered to import {name}; start dockerd")
    meta_path.write_text(json.dumps(asdict(info), indent=2))
    return info
