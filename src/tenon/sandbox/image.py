"""The base image: Debian minbase + the tools agents' commands use, built locally with mmdebstrap.

One build feeds both backends: the tarball is extracted as the process backend's
read-only root and `docker import`ed under the same name for the Docker backend.
An image records the key of what it was built from (suite, variant, package list);
a build whose key differs from the recorded one rebuilds. A rebuild never leaves a
half-written image in place: the tarball and image.json are replaced by rename, the
rootfs directory is swapped with the new one in one renameat2(RENAME_EXCHANGE), and
`docker import` moves the tag in one step. The superseded rootfs is kept until the
next rebuild, because running process sandboxes still have it bind-mounted.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tenon.errors import BackendUnavailable, ImageNotFound
from tenon.sandbox.base import DEFAULT_STATE_DIR

logger = logging.getLogger(__name__)

SUITE = "bookworm"
VARIANT = "minbase"
# What agents' commands need beyond minbase (util-linux, with ipcmk/ipcrm, is essential).
PACKAGES = ("python3", "python3-venv", "python3-pip", "git", "sqlite3")
BUILD_TIMEOUT_S = 900.0
_RENAME_EXCHANGE = 2  # linux/fs.h


@dataclass(frozen=True)
class ImageInfo:
    name: str
    rootfs: str
    tar_sha256: str
    created_s: float
    docker_imported: bool
    key: str = ""  # image_key() of the build; "" for an image built before keys existed


def image_key(suite: str = SUITE, variant: str = VARIANT,
              packages: tuple[str, ...] = PACKAGES) -> str:
    """A digest of everything the build depends on: a different key means rebuild."""
    recipe = json.dumps({"suite": suite, "variant": variant, "packages": sorted(packages)})
    return hashlib.sha256(recipe.encode()).hexdigest()[:16]


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


def _exchange(a: Path, b: Path) -> None:
    """Atomically swap two existing paths (renameat2 RENAME_EXCHANGE)."""
    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd = -100
    if libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE):
        err = ctypes.get_errno()
        raise OSError(err, f"renameat2 RENAME_EXCHANGE {a} <-> {b}: {os.strerror(err)}")


def _write_meta(meta_path: Path, info: ImageInfo) -> None:
    tmp = meta_path.with_name(meta_path.name + ".tmp")
    tmp.write_text(json.dumps(asdict(info), indent=2))
    os.replace(tmp, meta_path)


def _install_rootfs(staging: Path, rootfs: Path) -> None:
    """Put `staging` at `rootfs` in one step; the previous tree moves to superseded/.

    Only the tree superseded by the previous rebuild is deleted: a running sandbox may
    still have the one just replaced bind-mounted as its root.
    """
    if not rootfs.exists():
        staging.rename(rootfs)
        return
    _exchange(staging, rootfs)
    superseded = rootfs.parent / "superseded"
    if superseded.exists():
        shutil.rmtree(superseded)
    superseded.mkdir()
    staging.rename(superseded / "rootfs")


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
        try:
            previous_id: str | None = client.images.get(name).id
        except Exception:
            previous_id = None
        with tar_path.open("rb") as f:
            client.api.import_image_from_data(f, repository=repository, tag=tag or "latest")
        current_id = client.images.get(name).id
        if previous_id is not None and previous_id != current_id:
            # The tag has moved; the engine refuses (and we leave) an image a container uses.
            try:
                client.images.remove(previous_id)
            except Exception as exc:
                logger.info("kept the superseded image %s of %s: %s", previous_id, name, exc)
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
    state_dir: Path = DEFAULT_STATE_DIR,
    force: bool = False,
    docker: bool | None = None,
) -> ImageInfo:
    """Build `name` (idempotent: skips an image built from the current image_key() unless
    `force`).

    `docker`: True requires importing into a Docker Engine, False skips it, None (default)
    imports when an engine answers.
    """
    target = image_dir(name, state_dir)
    meta_path = target / "image.json"
    key = image_key()
    if not force and meta_path.exists():
        info = ImageInfo(**json.loads(meta_path.read_text()))
        if info.key == key:
            return _reuse(info, name, state_dir, docker)
        logger.info("image %s was built from %s, the recipe is now %s: rebuilding",
                    name, info.key or "an unkeyed recipe", key)
    if shutil.which("mmdebstrap") is None:
        raise BackendUnavailable("mmdebstrap is missing; run: apt-get install mmdebstrap")
    target.mkdir(parents=True, exist_ok=True)
    tar_path = target / "rootfs.tar"
    logger.info("building %s (%s) with mmdebstrap", name, ",".join(PACKAGES))
    with tempfile.TemporaryDirectory(prefix="build-", dir=target) as build_dir:
        new_tar = Path(build_dir) / "rootfs.tar"
        _mmdebstrap(new_tar)
        # Extract next to the final place, then swap in atomically.
        staging = Path(build_dir) / "rootfs"
        staging.mkdir()
        with tarfile.open(new_tar) as tar:
            tar.extractall(staging, filter="fully_trusted")
        _sanitize(staging)
        imported = docker is not False and _docker_import(new_tar, name)
        if docker and not imported:
            raise BackendUnavailable(f"no Docker Engine answered to import {name}; start dockerd")
        rootfs = target / "rootfs"
        _install_rootfs(staging, rootfs)
        os.replace(new_tar, tar_path)
    info = ImageInfo(name=name, rootfs=str(rootfs), tar_sha256=_sha256(tar_path),
                     created_s=time.time(), docker_imported=imported, key=key)
    _write_meta(meta_path, info)
    return info


def _reuse(info: ImageInfo, name: str, state_dir: Path, docker: bool | None) -> ImageInfo:
    _sanitize(image_rootfs(name, state_dir))
    # The rootfs is there; re-import into Docker when the engine lost the image.
    tar_path = image_dir(name, state_dir) / "rootfs.tar"
    if docker is False:
        return info
    if not _docker_has(name) and tar_path.exists() and _docker_import(tar_path, name):
        info = replace(info, docker_imported=True)
        _write_meta(image_dir(name, state_dir) / "image.json", info)
    return info


def _mmdebstrap(tar_path: Path) -> None:
    cmd = ["mmdebstrap", f"--variant={VARIANT}", f"--include={','.join(PACKAGES)}",
           SUITE, str(tar_path)]
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.CalledProcessError as exc:
        tail = exc.stderr.decode(errors="replace")[-2000:]
        raise BackendUnavailable(f"mmdebstrap failed ({exc.returncode}): {tail}") from exc
    except subprocess.TimeoutExpired as exc:
        raise BackendUnavailable(f"mmdebstrap took longer than {BUILD_TIMEOUT_S} s") from exc
