"""Who owns an agent's persistent root on the host.

Without a user namespace (the Docker backend) the live sandbox's host uid owns it, and
between sandboxes only root may enter it. With one (the process backend) files keep their
canonical ids (as the sandbox sees them) and the root stays root's.
"""

from __future__ import annotations

import os
from pathlib import Path

from tenon.errors import WorkspaceError
from tenon.sandbox.base import OVERLAY_UPPER_DIR, OVERLAY_WORK_DIR, PERSISTENT_MOUNTS

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


# Owner and mode, in canonical ids (as the sandbox sees them), of each subdirectory of a
# persistent root that a sandbox with a user namespace (the process backend) mounts.
_CANONICAL_DIRS: dict[str, tuple[int, int]] = {
    "workspace": (1000, 0o755), "home": (1000, 0o700), "tmp": (1000, 0o1777),
    OVERLAY_UPPER_DIR: (0, 0o755), OVERLAY_WORK_DIR: (0, 0o700),
}
_MAX_CANONICAL_ID = 65535


def prepare_canonical_root(root: Path) -> None:
    """Make `root` ready for a sandbox that sees it through an idmapped mount: the root is
    host root's (0700: no host uid but root enters it), its subdirectories exist with their
    canonical owners, and files left by a sandbox that ran as one host uid of its own
    (ids above 65535, which an idmapped mount cannot show) become the default user's."""
    if not root.is_dir():
        raise WorkspaceError(f"workspace {root} is not a directory")
    hide_persistent_root(root)
    for sub, (owner, mode) in _CANONICAL_DIRS.items():
        path = root / sub
        path.mkdir(mode=mode, exist_ok=True)
        st = path.lstat()
        if st.st_uid > _MAX_CANONICAL_ID or st.st_gid > _MAX_CANONICAL_ID:
            _own_default_user(path)
        if (st.st_mode & 0o7777) != mode or (st.st_uid, st.st_gid) != (owner, owner):
            os.lchown(path, owner, owner)
            path.chmod(mode)


def _own_default_user(top: Path) -> None:
    for directory, dirs, files in os.walk(top):
        for name in (directory, *(os.path.join(directory, n) for n in (*dirs, *files))):
            st = os.lstat(name)
            if st.st_uid > _MAX_CANONICAL_ID or st.st_gid > _MAX_CANONICAL_ID:
                os.lchown(name, 1000, 1000)
