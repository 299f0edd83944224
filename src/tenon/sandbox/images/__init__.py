"""Images: a content-addressed store of root filesystems shared read-only by every sandbox of
both backends, filled by importing (Docker, docker save, OCI layout), by building a
Dockerfile on the local Docker daemon, or from the built-in Debian recipes (docs/IMAGES.md).
"""

from __future__ import annotations

from tenon.sandbox.images.builtins import (
    BASE_IMAGE,
    BUILTINS,
    PACKAGES,
    PYTHON_IMAGE,
    build_builtin,
    image_key,
)
from tenon.sandbox.images.docker_sync import ensure_in_docker
from tenon.sandbox.images.store import (
    IMAGE_DIR_ENV,
    ImageMeta,
    ImageStore,
    StoredImage,
    default_image_dir,
    image_rootfs,
    image_store,
    normalize_name,
)

__all__ = [
    "BASE_IMAGE",
    "BUILTINS",
    "IMAGE_DIR_ENV",
    "PACKAGES",
    "PYTHON_IMAGE",
    "ImageMeta",
    "ImageStore",
    "StoredImage",
    "build_builtin",
    "default_image_dir",
    "ensure_in_docker",
    "image_key",
    "image_rootfs",
    "image_store",
    "normalize_name",
]
