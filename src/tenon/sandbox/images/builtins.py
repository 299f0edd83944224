"""The built-in images, made locally from Debian packages with mmdebstrap (nothing pulled).

Each records the key of its recipe (suite, variant, package list); a build whose key differs
from the recorded one rebuilds. The content id of a built-in is the sha256 of mmdebstrap's
tarball. A rebuild moves the name in one step; the superseded content goes to the store's
trash/, so running sandboxes keep the root they mounted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tenon.errors import BackendUnavailable, ConfigError
from tenon.sandbox.images.layers import apply_layer
from tenon.sandbox.images.store import ImageMeta, ImageStore, StoredImage, normalize_name

logger = logging.getLogger(__name__)

SUITE = "bookworm"
VARIANT = "minbase"
BASE_IMAGE = "tenon-base:bookworm"
PYTHON_IMAGE = "tenon-python:bookworm"
BUILD_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Recipe:
    packages: tuple[str, ...]
    env: tuple[str, ...] = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",)


BUILTINS: dict[str, Recipe] = {
    # What agents' commands need beyond minbase (util-linux, with ipcmk/ipcrm, is essential).
    BASE_IMAGE: Recipe(("python3", "python3-venv", "python3-pip", "git", "sqlite3")),
    # A Python project's tests: pytest from Debian, no compiler.
    PYTHON_IMAGE: Recipe(("python3", "python3-venv", "python3-pip", "git", "python3-pytest")),
}
PACKAGES = BUILTINS[BASE_IMAGE].packages


def image_key(suite: str = SUITE, variant: str = VARIANT,
              packages: tuple[str, ...] = PACKAGES) -> str:
    """A digest of everything a build depends on: a different key means rebuild."""
    recipe = json.dumps({"suite": suite, "variant": variant, "packages": sorted(packages)})
    return hashlib.sha256(recipe.encode()).hexdigest()[:16]


def sanitize(rootfs: Path) -> None:
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


def _mmdebstrap(tar_path: Path, packages: tuple[str, ...]) -> None:
    if shutil.which("mmdebstrap") is None:
        raise BackendUnavailable("mmdebstrap is missing; run: apt-get install mmdebstrap")
    cmd = ["mmdebstrap", f"--variant={VARIANT}", f"--include={','.join(packages)}",
           SUITE, str(tar_path)]
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.CalledProcessError as exc:
        tail = exc.stderr.decode(errors="replace").strip().splitlines()[-1:]
        raise BackendUnavailable(f"mmdebstrap failed ({exc.returncode}): {' '.join(tail)}"
                                 ) from exc
    except subprocess.TimeoutExpired as exc:
        raise BackendUnavailable(f"mmdebstrap took longer than {BUILD_TIMEOUT_S} s") from exc


def _legacy_tar(store: ImageStore, name: str, key: str) -> Path | None:
    """The tarball an image directory of the previous layout (<name>/rootfs.tar and
    image.json side by side) holds for the same recipe, to extract instead of rebuilding."""
    legacy = store.root / name.replace(":", "_")
    try:
        recorded = json.loads((legacy / "image.json").read_text()).get("key")
    except (OSError, ValueError):
        return None
    tar = legacy / "rootfs.tar"
    return tar if recorded == key and tar.is_file() else None


def build_builtin(name: str = BASE_IMAGE, *, store: ImageStore | None = None,
                  force: bool = False, docker: bool | None = None) -> StoredImage:
    """Build the built-in image `name` (idempotent: kept when built from the current recipe
    unless `force`). `docker`: True requires loading it into the Docker daemon, False skips
    that, None (default) loads it when a daemon answers."""
    from tenon.sandbox.images.docker_sync import ensure_in_docker

    store = store or ImageStore()
    full = normalize_name(name)
    recipe = BUILTINS.get(full)
    if recipe is None:
        raise ConfigError(f"{name!r} is not a built-in image; built-ins: {', '.join(BUILTINS)}"
                          " (an image of your own: tenon image build -f Dockerfile --name N)")
    key = image_key(packages=recipe.packages)
    current = store.get(full) if full in store.names() else None
    if force or current is None or current.meta.key != key:
        current = _build(full, recipe, key, store)
    else:
        sanitize(current.rootfs)
    if docker is not False:
        loaded = ensure_in_docker(full, store=store, required=bool(docker))
        if docker and not loaded:
            raise BackendUnavailable(f"no Docker Engine answered to load {full}; start dockerd")
    return current


def _build(name: str, recipe: Recipe, key: str, store: ImageStore) -> StoredImage:
    with store.staging() as stage:
        tar = _legacy_tar(store, name, key)
        source = f"mmdebstrap {SUITE} {VARIANT}"
        if tar is None:
            logger.info("building %s (%s) with mmdebstrap", name, ",".join(recipe.packages))
            tar = stage / "rootfs.tar"
            _mmdebstrap(tar, recipe.packages)
        image_id = _sha256(tar)

        def populate(rootfs: Path) -> ImageMeta:
            with tar.open("rb") as f:
                apply_layer(f, rootfs)
            sanitize(rootfs)
            return ImageMeta(id=image_id, name=name, created_s=time.time(), source=source,
                             size_bytes=0, env=list(recipe.env), key=key)

        stored = store.install(name, image_id, populate)
    if tar.parent != stage:  # extracted from the previous layout: that copy goes to trash
        with store.locked():
            trash = store.root / "trash"
            trash.mkdir(mode=0o755, exist_ok=True)
            tar.parent.rename(trash / f"{tar.parent.name}.{time.time_ns()}")
    return stored
