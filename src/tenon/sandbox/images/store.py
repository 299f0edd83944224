"""The image store: every image's root filesystem once, by content id, under names.

Layout of an image directory (default /var/lib/tenon/images, $TENON_IMAGE_DIR):

    content/<id>/rootfs      the extracted root filesystem, read-only to sandboxes
    content/<id>/image.json  what the image is (ImageMeta, and its settings under Docker's
                             names in "config": Env, WorkingDir, User, Entrypoint, Cmd)
    names/<name>             a pointer file holding the id `name` (e.g. tenon-base:bookworm) is
    tmp/                     staging: an image is extracted here, then renamed into content/
    trash/                   content whose last name was removed, until `prune`
    .lock                    held (flock) while names or content change

An install is atomic (a complete content directory appears by one rename, a name moves by
one rename of its pointer file) and concurrent installs serialize on the lock. The store does
not depend on any runtime's state directory: every runtime and both backends share it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tenon.errors import ImageNotFound

IMAGE_DIR_ENV = "TENON_IMAGE_DIR"
DEFAULT_IMAGE_DIR = Path("/var/lib/tenon/images")
DEFAULT_TAG = "latest"
_NAME = re.compile(r"[a-z0-9][a-z0-9._/-]*(:[A-Za-z0-9._-]+)?")
_ID = re.compile(r"[0-9a-f]{64}")


def default_image_dir() -> Path:
    """$TENON_IMAGE_DIR, else /var/lib/tenon/images."""
    return Path(os.environ.get(IMAGE_DIR_ENV) or DEFAULT_IMAGE_DIR)


def normalize_name(name: str) -> str:
    """`name` with its tag (`:latest` when none); ImageNotFound when it cannot be a name."""
    if not _NAME.fullmatch(name) or ".." in name or "//" in name or name.endswith("/"):
        raise ImageNotFound(f"invalid image name {name!r} (expected e.g. tenon-base:bookworm)")
    return name if ":" in name else f"{name}:{DEFAULT_TAG}"


def _pointer_name(name: str) -> str:
    return normalize_name(name).replace("/", "~").replace(":", "@")


@dataclass(frozen=True)
class ImageMeta:
    """image.json: what an image is and where it came from."""

    id: str
    name: str  # the name it was first installed under
    created_s: float
    source: str  # e.g. "mmdebstrap bookworm", "docker save app.tar", "docker image app:1"
    size_bytes: int
    env: list[str] = field(default_factory=list)
    workdir: str = ""
    user: str = ""
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    key: str = ""  # the recipe key of a built-in image ("" for others)


@dataclass(frozen=True)
class StoredImage:
    name: str
    meta: ImageMeta
    rootfs: Path


def docker_config(meta: ImageMeta) -> dict[str, object]:
    """The image's settings under Docker's names (image.json "config")."""
    return {"Env": meta.env, "WorkingDir": meta.workdir, "User": meta.user,
            "Entrypoint": meta.entrypoint, "Cmd": meta.cmd}


def _write_meta(path: Path, meta: ImageMeta) -> None:
    path.write_text(json.dumps({**asdict(meta), "config": docker_config(meta)}, indent=2))


def _read_meta(path: Path) -> ImageMeta:
    data = json.loads(path.read_text())
    return ImageMeta(**{k: v for k, v in data.items() if k in ImageMeta.__dataclass_fields__})


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


class ImageStore:
    """The images under one directory."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root if root is not None else default_image_dir()

    # -- reading ---------------------------------------------------------------------

    def names(self) -> list[str]:
        directory = self.root / "names"
        if not directory.is_dir():
            return []
        return sorted(p.name.replace("@", ":").replace("~", "/")
                      for p in directory.iterdir() if not p.name.startswith("."))

    def id_of(self, name: str) -> str | None:
        try:
            image_id = (self.root / "names" / _pointer_name(name)).read_text().strip()
        except FileNotFoundError:
            return None
        return image_id if _ID.fullmatch(image_id) else None

    def get(self, name: str) -> StoredImage:
        """The image `name` names; ImageNotFound naming the images there are."""
        full = normalize_name(name)
        image_id = self.id_of(full)
        meta_path = self.root / "content" / str(image_id) / "image.json"
        if image_id is None or not meta_path.exists():
            raise ImageNotFound(self._unknown(full))
        meta = _read_meta(meta_path)
        return StoredImage(full, meta, meta_path.parent / "rootfs")

    def _unknown(self, name: str) -> str:
        there = ", ".join(self.names()) or "none"
        return (f"unknown image {name!r}; images in {self.root}: {there} "
                f"(run: tenon image build, or tenon image import)")

    def rootfs(self, name: str) -> Path:
        return self.get(name).rootfs

    def images(self) -> list[StoredImage]:
        out = []
        for name in self.names():
            with contextlib.suppress(ImageNotFound):
                out.append(self.get(name))
        return out

    def has_content(self, image_id: str) -> bool:
        return (self.root / "content" / image_id / "image.json").exists()

    # -- changing --------------------------------------------------------------------

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(self.root.stat().st_mode | 0o055)  # sandboxes' uids search it
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def staging(self) -> Iterator[Path]:
        """A fresh directory inside the store (same filesystem as content/), removed after."""
        tmp = self.root / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix="stage-", dir=tmp))
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def install(self, name: str, image_id: str, populate: Callable[[Path], ImageMeta]) -> (
            StoredImage):
        """Point `name` at content `image_id`, first extracting it with `populate(rootfs)`
        (which returns its metadata) unless the store already has that content."""
        full = normalize_name(name)
        if not _ID.fullmatch(image_id):
            raise ValueError(f"image id {image_id!r} is not a sha256 hex digest")
        if not self.has_content(image_id):
            with self.staging() as stage:
                rootfs = stage / "rootfs"
                rootfs.mkdir(mode=0o755)
                meta = populate(rootfs)
                meta = ImageMeta(**{**asdict(meta), "id": image_id, "name": full,
                                    "size_bytes": _tree_bytes(rootfs)})
                _write_meta(stage / "image.json", meta)
                stage.chmod(0o755)
                with self.locked():
                    self._adopt(stage, image_id)
        with self.locked():
            self._point(full, image_id)
        return self.get(full)

    def _adopt(self, stage: Path, image_id: str) -> None:
        content = self.root / "content"
        content.mkdir(mode=0o755, exist_ok=True)
        if not self.has_content(image_id):  # a concurrent install may have won
            stage.rename(content / image_id)

    def _point(self, name: str, image_id: str) -> None:
        names = self.root / "names"
        names.mkdir(mode=0o755, exist_ok=True)
        previous = self.id_of(name)
        tmp = names / f".{_pointer_name(name)}.{os.getpid()}"
        tmp.write_text(image_id + "\n")
        os.replace(tmp, names / _pointer_name(name))
        if previous is not None and previous != image_id:
            self._trash_if_unnamed(previous)

    def _trash_if_unnamed(self, image_id: str) -> bool:
        """Move content no name points to any more into trash/ (not deleted: a running
        sandbox may still have it mounted)."""
        if any(self.id_of(other) == image_id for other in self.names()):
            return False
        content = self.root / "content" / image_id
        if not content.exists():
            return False
        trash = self.root / "trash"
        trash.mkdir(mode=0o755, exist_ok=True)
        content.rename(trash / f"{image_id}.{time.time_ns()}")
        return True

    def tag(self, name: str, source: str) -> StoredImage:
        """Give the image `source` names a second name."""
        return self.install(name, self.get(source).meta.id, _never)

    def remove(self, name: str) -> list[str]:
        """Remove `name`; content no other name points to moves to trash/ (a running
        sandbox keeps its mount of it) until `prune`. Returns the ids moved to trash."""
        full = normalize_name(name)
        with self.locked():
            image_id = self.id_of(full)
            if image_id is None:
                raise ImageNotFound(self._unknown(full))
            (self.root / "names" / _pointer_name(full)).unlink()
            return [image_id] if self._trash_if_unnamed(image_id) else []

    def prune(self) -> list[str]:
        """Delete the content in trash/ that no process on this host has as its root and no
        mount table names; returns what was deleted."""
        trash = self.root / "trash"
        if not trash.is_dir():
            return []
        roots, mounts = _in_use()
        deleted = []
        with self.locked():
            for entry in sorted(trash.iterdir()):
                image_id = entry.name.split(".", 1)[0]
                if image_id in mounts:
                    continue
                with contextlib.suppress(OSError):
                    st = (entry / "rootfs").stat()
                    if (st.st_dev, st.st_ino) in roots:
                        continue
                shutil.rmtree(entry)
                deleted.append(entry.name.split(".", 1)[0])
        return deleted


def _never(rootfs: Path) -> ImageMeta:
    raise ImageNotFound(f"no content to extract into {rootfs}")


def _in_use() -> tuple[set[tuple[int, int]], str]:
    """(device, inode) of every process's root directory (a sandbox that bind-mounts an
    image's rootfs as its root), and every mount table of the host's processes (an overlay
    names its lower directory in its options)."""
    roots = set()
    tables = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError):
                st = os.stat(f"/proc/{pid}/root")
                roots.add((st.st_dev, st.st_ino))
            with contextlib.suppress(OSError):
                tables.append(Path(f"/proc/{pid}/mountinfo").read_text())
    return roots, "\n".join(tables)


def image_store(where: Path | None = None) -> ImageStore:
    """The store a backend whose state directory (or image directory) is `where` uses:
    `where` itself when it is an image directory, else $TENON_IMAGE_DIR when set, else
    `where`/images when that is an image directory, else /var/lib/tenon/images. A runtime's
    state directory therefore never needs images of its own."""
    if where is not None and (where / "names").is_dir():
        return ImageStore(where)
    if where is not None and not os.environ.get(IMAGE_DIR_ENV) and (
            where / "images" / "names").is_dir():
        return ImageStore(where / "images")
    return ImageStore()


def image_rootfs(name: str, where: Path | None = None) -> Path:
    """The root filesystem of image `name` in the store at `where` (see image_store);
    ImageNotFound naming the images there are and how to add one."""
    return image_store(where).get(name).rootfs
