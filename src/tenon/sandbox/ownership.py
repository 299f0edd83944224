"""Who may enter an agent's persistent root: its live sandbox's host uid, else only root."""

from __future__ import annotations

import os
from pathlib import Path

from tenon.errors import WorkspaceError
from tenon.sandbox.base import PERSISTENT_MOUNTS

PRIVATE_MODE = 0o700


def own_persistent_root(root: Path, uid: int) -> None:
    """`uid` (gid the same) owns the persistent root and everything in it, and only it may
    enter the root and its subdirectories (lchown: never follow a symlink out)."""
    if not root.is_dir():
        raise WorkspaceError(f"workspace {root} is not a directory")
    for sub in PERSISTENT_MOUNTS:
        (root / sub).mkdir(mode=PRIVATE_MODE, exist_ok=True)
    for directory in (root, *(root / sub for sub in PERSISTENT_MOUNTS)):
        directory.chmod(PRIVATE_MODE)
    for top, dirs, files in os.walk(root):
        for name in (top, *(os.path.join(top, n) for n in (*dirs, *files))):
            st = os.lstat(name)
            if st.st_uid != uid or st.st_gid != uid:
                os.lchown(name, uid, uid)


def hide_persistent_root(root: Path) -> None:
    """Between sandboxes the root directory is root's (0700): whoever holds its last uid
    next cannot enter it, while what is inside keeps that owner, so a rebuild under the same
    uid chowns one directory."""
    os.lchown(root, 0, 0)
    root.chmod(PRIVATE_MODE)
