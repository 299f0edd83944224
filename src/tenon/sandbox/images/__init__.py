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

# The E2B template id a client gets when it names none.
DEFAULT_TEMPLATE = "base"


def template_image(template: str) -> str:
    """The image an E2B template id or alias names: `base` is tenon-base:bookworm, any other
    id is an image name."""
    return BASE_IMAGE if template == DEFAULT_TEMPLATE else template


__all__ = [
    "BASE_IMAGE",
    "BUILTINS",
    "DEFAULT_TEMPLATE",
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
    "template_image",
]
