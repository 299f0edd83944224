"""The image API moved to the `tenon.sandbox.images` package; this name re-exports what
code written against it imports."""

from __future__ import annotations

from tenon.sandbox.images import image_rootfs

__all__ = ["image_rootfs"]
