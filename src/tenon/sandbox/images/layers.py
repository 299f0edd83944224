"""Apply image layers (tar streams) onto a root filesystem directory, as a container engine
would, without trusting the layers.

Every path of a layer is resolved inside the root (a symlink, absolute or relative, is
followed as the sandbox would see it, never onto the host), an existing non-directory is
removed before its replacement is written (a file never opens through a lower layer's
symlink), and whiteouts are applied: `.wh.NAME` deletes NAME, `.wh..wh..opq` empties its
directory, both only of what lower layers put there. Ownership is kept as the numeric ids of
the tar, permission bits as they are (setuid included), extended attributes from the PAX
headers; device nodes are skipped (each backend gives a sandbox its own /dev).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tarfile
from pathlib import Path
from typing import IO

from tenon.errors import ConfigError

WHITEOUT_PREFIX = ".wh."
OPAQUE_WHITEOUT = ".wh..wh..opq"
_MAX_SYMLINK_HOPS = 40
_XATTR_PREFIX = "SCHILY.xattr."


class LayerError(ConfigError):
    """A layer names a path that no root filesystem can hold (e.g. '..' above the root)."""


def _parts(name: str) -> list[str]:
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise LayerError(f"layer entry {name!r} climbs above the root")
    return parts


def resolve_in_root(root: Path, parts: list[str], hops: int = 0) -> Path:
    """The host path of directory `parts` inside `root`, every symlink on the way followed
    as if `root` were '/'. Components that do not exist are returned as they are."""
    current = root
    for i, part in enumerate(parts):
        candidate = current / part
        try:
            mode = candidate.lstat().st_mode
        except FileNotFoundError:
            return candidate.joinpath(*parts[i + 1:])
        if not stat.S_ISLNK(mode):
            current = candidate
            continue
        if hops >= _MAX_SYMLINK_HOPS:
            raise LayerError(f"too many symlinks resolving {'/'.join(parts)}")
        target = os.readlink(candidate)
        base = [] if target.startswith("/") else _relative_parts(root, current)
        resolved = _normalize([*base, *target.split("/")])
        current = resolve_in_root(root, resolved, hops + 1)
    return current


def _relative_parts(root: Path, path: Path) -> list[str]:
    return list(path.relative_to(root).parts)


def _normalize(parts: list[str]) -> list[str]:
    """'..' of the root stays at the root, as in the kernel's path walk."""
    out: list[str] = []
    for part in parts:
        if part in ("", "."):
            continue
        if part == "..":
            if out:
                out.pop()
            continue
        out.append(part)
    return out


def _target(root: Path, name: str) -> tuple[Path, str]:
    """(the resolved parent directory, the entry's own name) of layer entry `name`."""
    parts = _parts(name)
    if not parts:
        return root, ""
    return resolve_in_root(root, parts[:-1]), parts[-1]


def _remove(path: Path) -> None:
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)
    else:
        path.unlink()


def _empty(directory: Path) -> None:
    if not directory.is_dir() or directory.is_symlink():
        return
    for child in directory.iterdir():
        _remove(child)


def _whiteouts(members: list[tarfile.TarInfo], root: Path) -> None:
    for member in members:
        parent, base = _target(root, member.name)
        if base == OPAQUE_WHITEOUT:
            _empty(parent)
        elif base.startswith(WHITEOUT_PREFIX):
            _remove(parent / base.removeprefix(WHITEOUT_PREFIX))


def _set_xattrs(path: Path, member: tarfile.TarInfo) -> None:
    for key, value in member.pax_headers.items():
        if key.startswith(_XATTR_PREFIX):
            with contextlib.suppress(OSError):  # a filesystem without that namespace
                os.setxattr(path, key.removeprefix(_XATTR_PREFIX),
                            value.encode("utf-8", "surrogateescape"), follow_symlinks=False)


def _extract(tar: tarfile.TarFile, member: tarfile.TarInfo, root: Path) -> None:
    parent, base = _target(root, member.name)
    if not base:
        return
    parent.mkdir(parents=True, exist_ok=True)
    dest = parent / base
    existing_dir = dest.is_dir() and not dest.is_symlink()
    if not (member.isdir() and existing_dir):
        _remove(dest)
    copy = member.replace(name=str(dest.relative_to(root)), deep=False)
    if member.islnk():
        link_parent, link_base = _target(root, member.linkname)
        copy = copy.replace(linkname=str((link_parent / link_base).relative_to(root)),
                            deep=False)
    tar.extract(copy, root, set_attrs=True, numeric_owner=True, filter="fully_trusted")
    _set_xattrs(dest, member)


def apply_layer(layer: IO[bytes], root: Path) -> int:
    """Apply one layer (an uncompressed or gzip/bzip2/xz tar stream) onto `root`; returns
    the number of entries written."""
    with tarfile.open(fileobj=layer, mode="r:*") as tar:
        members = tar.getmembers()
        _whiteouts([m for m in members if _basename(m.name).startswith(WHITEOUT_PREFIX)], root)
        written = 0
        for member in members:
            if _basename(member.name).startswith(WHITEOUT_PREFIX) or _skipped(member):
                continue
            _extract(tar, member, root)
            written += 1
    _restore_dir_modes(root, members)
    return written


def _restore_dir_modes(root: Path, members: list[tarfile.TarInfo]) -> None:
    """A directory's entries were written after its mode and mtime were set: set them again."""
    for member in reversed(members):
        if member.isdir() and _parts(member.name):
            parent, base = _target(root, member.name)
            path = parent / base
            with contextlib.suppress(OSError):
                os.chmod(path, member.mode)
                os.utime(path, (member.mtime, member.mtime), follow_symlinks=False)


def _basename(name: str) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1]


def _skipped(member: tarfile.TarInfo) -> bool:
    return member.ischr() or member.isblk()
