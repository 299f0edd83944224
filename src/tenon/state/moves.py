"""Moving a persistent root between state directories, durably, across filesystems."""

from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path

from tenon.state.capture import fsync_path, scan
from tenon.state.filehash import data_chunks


def move_file(src: Path, dst: Path) -> None:
    """Move `src` over `dst`: a rename, or across filesystems a sparse copy renamed into
    place (durably) before `src` is removed."""
    try:
        os.rename(src, dst)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        partial = dst.with_name(dst.name + ".partial")
        copy_sparse(src, partial)
        os.replace(partial, dst)
        fsync_path(dst.parent, directory=True)
        src.unlink()
    fsync_path(dst.parent, directory=True)
    fsync_path(src.parent, directory=True)


def copy_sparse(src: Path, dst: Path) -> None:
    """Copy `src` to `dst` (mode 0600) and fsync it, writing only the data extents: a
    sparse image stays sparse (and its size is what the agent wrote, not its limit)."""
    fd_in = os.open(src, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        fd_out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            size = os.fstat(fd_in).st_size
            for offset, chunk in data_chunks(fd_in, src, size):
                written = 0
                while written < len(chunk):
                    written += os.pwrite(fd_out, chunk[written:], offset + written)
            os.ftruncate(fd_out, size)
            os.fsync(fd_out)
        finally:
            os.close(fd_out)
    finally:
        os.close(fd_in)


def _copy_entry(src: str, dst: str) -> None:
    """copytree's copy function: overlay whiteouts (character devices) are made again."""
    st = os.lstat(src)
    if stat.S_ISCHR(st.st_mode):
        os.mknod(dst, st.st_mode, st.st_rdev)
        return
    shutil.copy2(src, dst, follow_symlinks=False)


def move_tree(src: Path, dst: Path) -> None:
    """Move the directory `src` over `dst`: a rename, or across filesystems a copy (owners,
    modes, xattrs and whiteouts kept, every file and directory fsynced) renamed into place
    before `src` goes."""
    if dst.exists():
        shutil.rmtree(dst)
    try:
        os.rename(src, dst)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        partial = dst.with_name(dst.name + ".partial")
        if partial.exists():
            shutil.rmtree(partial)
        shutil.copytree(src, partial, symlinks=True, copy_function=_copy_entry)
        for top, dirs, files in os.walk(src):
            for name in (top, *(os.path.join(top, n) for n in (*dirs, *files))):
                st = os.lstat(name)
                os.lchown(partial / os.path.relpath(name, src), st.st_uid, st.st_gid)
        scan(partial, fsync=True)
        os.rename(partial, dst)
        fsync_path(dst.parent, directory=True)
        shutil.rmtree(src)
    fsync_path(dst.parent, directory=True)
    fsync_path(src.parent, directory=True)
