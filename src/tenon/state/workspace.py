"""Durable per-agent state directories and their content manifests.

Each logical agent owns `<state_dir>/workspaces/<agent_id>`, its *persistent root*: a host
directory that outlives every physical sandbox bound onto it. It holds one subdirectory per
designated persistent directory of the sandbox (`PERSISTENT_DIRS`): the workspace, HOME and
/tmp, and, for a writable root, the overlay upper layer (`upper/`, captured) and workdir
(`work/`, never captured, emptied before each rebuild). Everything a later action can read
lives there, or in a path the sandbox's configuration explicitly declares disposable, or
the boundary is not restartable.

`capture()` makes the root durable and describes it as a manifest (`state.manifest`) whose
digest goes into the recovery record; `verify()` proves, before a rebuilt sandbox starts,
that the root still holds the same content. Both cost what changed since the store's last
manifest of the agent (`state.capture`): the store keeps each agent's manifest in memory,
and a restarted controller passes the committed one (`previous`) instead.

Limits and privacy: with `DiskLimits`, each persistent root is its own ext4 filesystem of
fixed byte and inode size (`host.diskfs`), so a full root fails the agent's own writes with
ENOSPC and nothing else. Roots and their subdirectories are mode 0700; the backend that runs
the sandbox owns them to its sandbox uid, so no other host user or sandbox uid can read them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tenon.errors import ConfigError, WorkspaceError
from tenon.host import diskfs
from tenon.host.diskfs import DiskLimits, DiskUsage
from tenon.sandbox.base import OVERLAY_WORK_DIR, PERSISTENT_MOUNTS
from tenon.state.capture import CaptureLimits, Hasher, ScanResult
from tenon.state.capture import fsync_path as _fsync_path
from tenon.state.capture import scan as _scan
from tenon.state.filehash import block_digest
from tenon.state.manifest import MANIFEST_VERSION, Manifest, ManifestEntry
from tenon.state.moves import move_file as _move_file
from tenon.state.moves import move_tree as _move_tree

__all__ = ["MANIFEST_VERSION", "CaptureLimits", "Manifest", "ManifestEntry", "WorkspaceStore",
           "scan"]

logger = logging.getLogger(__name__)

# The persistent root's subdirectories (where a sandbox sees each: sandbox.base.PERSISTENT_MOUNTS).
PERSISTENT_DIRS: tuple[str, ...] = tuple(PERSISTENT_MOUNTS)
AGENT_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# Only the sandbox's own uid may enter a persistent root or its subdirectories; the store
# directory itself is traversable (not listable), so a sandbox uid staging its own root
# needs no other permission.
_PRIVATE_MODE = 0o700
_ROOT_MODE = 0o711
# Verification is never cut short: a bound there would block an agent, not keep it resident.
_UNBOUNDED = CaptureLimits(max_files=2**62, max_hash_bytes=2**62, max_seconds=1e12)


def scan(root: Path, *, fsync: bool) -> Manifest:
    """Describe the tree under `root` from scratch (every file read), optionally fsyncing
    every entry."""
    return _scan(root, limits=_UNBOUNDED, fsync=fsync).manifest


@dataclass(frozen=True)
class ReconciledWorkspaces:
    """What `WorkspaceStore.reconcile` found and did, agent ids sorted."""

    mounted: tuple[str, ...]  # kept agents whose image was mounted again
    removed: tuple[str, ...]  # agents not kept: unmounted, root and image removed
    missing: tuple[str, ...]  # kept agents with neither an image nor a root
    detached_loops: int  # loop devices left attached to an image without a mount


class WorkspaceStore:
    """Persistent roots under `<state_dir>/workspaces`, one per agent.

    With `limits`, each root is the mount point of the agent's own ext4 image (see
    `host.diskfs`), kept in `<state_dir>/workspaces/.images/<agent_id>.ext4`; this needs root.
    Without, each root is a plain directory (tests, simulations): no limit applies.
    """

    IMAGES_DIR = ".images"  # agent ids never start with ".", so it names no agent

    def __init__(self, state_dir: Path, *, limits: DiskLimits | None = None,
                 capture_limits: CaptureLimits | None = None,
                 hasher: Hasher = block_digest) -> None:
        self._state_dir = Path(state_dir)
        self._root = self._state_dir / "workspaces"
        self._limits = limits
        self.capture_limits = capture_limits or CaptureLimits()
        self._hasher = hasher
        # Each agent's last manifest (captured or verified): what the next capture and
        # verification compare metadata with. Only the controller's own scans enter it.
        self._manifests: dict[str, Manifest] = {}
        # agent -> (digest, KiB its filesystem had written) right after its last capture: an
        # image-backed root that has written nothing since holds exactly that manifest.
        self._seals: dict[str, tuple[str, int]] = {}
        self.last_scan: ScanResult | None = None  # what the last capture or verify read

    @property
    def root(self) -> Path:
        return self._root

    @property
    def limits(self) -> DiskLimits | None:
        """The default limits of a new agent's filesystem; None for plain directories."""
        return self._limits

    def path_for(self, agent_id: str) -> Path:
        """The agent's workspace path; refuses unsafe ids and anything resolving elsewhere."""
        candidate = self._root / agent_id
        if not AGENT_ID_RE.fullmatch(agent_id):
            raise WorkspaceError(
                f"agent id {agent_id!r} is not safe for a workspace path ({candidate}); "
                f"use letters, digits, '.', '_' and '-', starting with a letter or digit"
            )
        state = self._state_dir.resolve()
        root = self._root.resolve()
        if root != state / "workspaces":
            raise WorkspaceError(
                f"workspace root {self._root} resolves to {root}, "
                f"outside the state directory {state}"
            )
        if candidate.is_symlink():
            raise WorkspaceError(
                f"workspace {candidate} is a symlink (to "
                f"{os.readlink(candidate)}); refusing to follow it"
            )
        resolved = candidate.resolve()
        if resolved.parent != root:
            raise WorkspaceError(
                f"workspace {candidate} resolves to {resolved}, outside the state directory {state}"
            )
        return resolved

    def image_for(self, agent_id: str) -> Path:
        """Where the agent's filesystem image lives (whether or not it exists)."""
        self.path_for(agent_id)
        return self._root / self.IMAGES_DIR / f"{agent_id}.ext4"

    def exists(self, agent_id: str) -> bool:
        return self.path_for(agent_id).is_dir()

    def create(self, agent_id: str, config: Mapping[str, Any] | None = None) -> Path:
        """Create the agent's persistent root and its subdirectories (idempotent), durably.

        `config` is the agent's sandbox config: its `disk_bytes` and `max_inodes`, if set,
        override the store's limits for this agent's new image (an existing image keeps its
        size). A store without limits refuses them rather than silently not enforcing them.
        """
        path = self.path_for(agent_id)
        limits = self._limits_for(agent_id, config or {})
        try:
            self._make_dir(self._root, _ROOT_MODE)
            self._make_dir(path, _PRIVATE_MODE)
            if limits is not None:
                image = self.image_for(agent_id)
                self._make_dir(image.parent, _PRIVATE_MODE)
                if diskfs.mounted_at(path) is None and any(path.iterdir()):
                    raise WorkspaceError(
                        f"{path} holds files but is not its image's mount point; refusing "
                        f"to hide them under a filesystem (remove it or reconcile the store)")
                if not image.exists():
                    diskfs.create_image(image, limits)
                diskfs.mount(image, path)
                # mkfs leaves the root 0755 with a lost+found no agent should see in its tree.
                with contextlib.suppress(FileNotFoundError):
                    (path / "lost+found").rmdir()
                path.chmod(_PRIVATE_MODE)
            for sub in PERSISTENT_DIRS:
                self._make_dir(path / sub, _PRIVATE_MODE)
                _fsync_path(path / sub, directory=True)
            _fsync_path(path, directory=True)
            _fsync_path(self._root, directory=True)
        except WorkspaceError:
            raise
        except OSError as exc:  # HostError is one
            raise WorkspaceError(f"cannot create workspace {path}: {exc}") from exc
        return path

    def attach(self, agent_id: str) -> Path:
        """The agent's persistent root, its image mounted again if it was not (after a host
        or controller restart). The path of a plain-directory root is returned as is."""
        path = self.path_for(agent_id)
        image = self.image_for(agent_id)
        if self._limits is None or not image.exists():
            return path
        if os.path.ismount(path):  # the usual case, at every rebuild: one stat, no mountinfo
            return path
        try:
            path.mkdir(mode=_PRIVATE_MODE, exist_ok=True)
            if diskfs.mounted_at(path) is None:
                diskfs.detach_loops(image)
                diskfs.mount(image, path)
                logger.info("workspace %s: image mounted again", agent_id)
        except OSError as exc:
            raise WorkspaceError(f"cannot mount workspace {path}: {exc}") from exc
        return path

    def is_mounted(self, agent_id: str) -> bool:
        return diskfs.mounted_at(self.path_for(agent_id)) is not None

    def usage(self, agent_id: str) -> DiskUsage | None:
        """Bytes and inodes the agent's filesystem uses and allows; None for a plain
        directory (or an image not mounted)."""
        path = self.path_for(agent_id)
        if self._limits is None or not os.path.ismount(path):
            return None
        try:
            return diskfs.usage(path)
        except OSError as exc:
            raise WorkspaceError(f"cannot read the usage of workspace {path}: {exc}") from exc

    def full_reason(self, agent_id: str) -> str | None:
        """Why the agent's persistent root refuses writes (byte or inode limit reached), or
        None: what an action result that ended with the filesystem full should say."""
        used = self.usage(agent_id)
        reason = None if used is None else used.full_reason()
        return None if reason is None else f"workspace of {agent_id}: {reason}"

    def capture(self, agent_id: str, previous: Manifest | None = None) -> Manifest:
        """Make the workspace durable, then describe it, reading only what changed since
        the store's last manifest of the agent (or `previous`, a committed one, when the
        store has none: after a restart). CaptureRefused past a capture limit or on an
        entry that cannot be kept; nothing is remembered then.

        An image-backed root is its agent's own filesystem: one syncfs makes all of it
        durable (cheaper than an fsync per changed file and directory, which a plain root
        gets). Capture runs only when no process is left in the sandbox.
        """
        path = self._existing(agent_id)
        baseline = self._manifests.get(agent_id, previous)
        synced = self._limits is not None and os.path.ismount(path)
        if synced:
            try:
                diskfs.sync(path)
            except OSError as exc:
                raise WorkspaceError(f"cannot make workspace {path} durable: {exc}") from exc
        result = _scan(path, baseline, limits=self.capture_limits, hasher=self._hasher,
                       fsync=not synced)
        if not synced:
            _fsync_path(path, directory=True)
        self._remember(agent_id, result)
        written = diskfs.written_kib(path) if synced else None  # the scan wrote nothing
        if written is not None and result.manifest.version == MANIFEST_VERSION:
            self._seals[agent_id] = (result.manifest.digest, written)
        logger.debug("captured workspace %s: %d entries, %d hashed, digest %s", path,
                     result.num_entries, result.num_hashed, result.manifest.digest)
        return result.manifest

    def manifest(self, agent_id: str) -> Manifest:
        """Describe the workspace without fsyncing it."""
        path = self._existing(agent_id)
        return _scan(path, self._manifests.get(agent_id), limits=_UNBOUNDED,
                     hasher=self._hasher).manifest

    def verify(self, agent_id: str, digest: str, previous: Manifest | None = None) -> Manifest:
        """Check, before a sandbox is built on it, that the workspace still holds the
        content named by `digest` (`previous`: the committed manifest behind it); raise
        WorkspaceError otherwise. Empties the overlay workdir first.

        Entries whose metadata equal those of the last manifest (the store's, else
        `previous`) are not read; the others are hashed again, and any real difference
        fails. A version 1 manifest is verified by rehashing the whole tree."""
        path = self._existing(agent_id)
        known = self._manifests.get(agent_id)
        if self._sealed(agent_id, path, digest, known) and known is not None:
            self._empty_overlay_work(path)
            return known
        self._empty_overlay_work(path)
        baseline = next((m for m in (known, previous) if m is not None and m.digest == digest),
                        None)
        version = MANIFEST_VERSION if baseline is None else baseline.version
        result = _scan(path, baseline, limits=_UNBOUNDED, hasher=self._hasher,
                       version=version)
        if result.manifest.digest != digest and baseline is None:
            result = _scan(path, limits=_UNBOUNDED, version=1)  # a v1 record without manifest
        if result.manifest.digest == digest:
            self._remember(agent_id, result)
            return result.manifest
        self._manifests.pop(agent_id, None)
        self._seals.pop(agent_id, None)
        detail = ""
        if baseline is not None:
            diff = baseline.first_difference(result.manifest)
            if diff is not None:
                detail = f"; first difference: {diff}"
        raise WorkspaceError(
            f"workspace {path} does not match its manifest: expected digest {digest}, "
            f"found {result.manifest.digest}{detail}"
        )

    def _sealed(self, agent_id: str, path: Path, digest: str, known: Manifest | None) -> bool:
        """Whether the root still holds, unread, what this store captured last: the capture
        had `digest` and the root's filesystem has written nothing since (after a sync that
        flushes any write still in memory). Used once: the next capture seals again."""
        seal = self._seals.pop(agent_id, None)
        if seal is None or known is None or not seal[0] == known.digest == digest:
            return False
        if not os.path.ismount(path):
            return False
        try:
            diskfs.sync(path)
        except OSError:  # HostError is one
            return False
        return diskfs.written_kib(path) == seal[1]

    def forget(self, agent_id: str) -> None:
        """Drop the store's manifest of the agent: its next capture reads every file."""
        self._manifests.pop(agent_id, None)
        self._seals.pop(agent_id, None)

    def _remember(self, agent_id: str, result: ScanResult) -> None:
        self.last_scan = result
        if result.manifest.version == MANIFEST_VERSION:
            self._manifests[agent_id] = result.manifest
        else:
            self._manifests.pop(agent_id, None)
        self._seals.pop(agent_id, None)

    @staticmethod
    def _empty_overlay_work(path: Path) -> None:
        """The overlay workdir holds only overlayfs's own scratch: emptied before a mount."""
        work = path / OVERLAY_WORK_DIR
        if not work.is_dir() or work.is_symlink():
            return
        try:
            for entry in work.iterdir():
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
        except OSError as exc:
            raise WorkspaceError(f"cannot empty the overlay workdir {work}: {exc}") from exc

    def delete(self, agent_id: str) -> None:
        """Remove the agent's workspace: unmount it, remove its root and image (idempotent)."""
        path = self.path_for(agent_id)
        self._manifests.pop(agent_id, None)
        self._seals.pop(agent_id, None)
        try:
            self._remove(path, self.image_for(agent_id))
            if self._root.exists():
                _fsync_path(self._root, directory=True)
        except OSError as exc:
            raise WorkspaceError(f"cannot delete workspace {path}: {exc}") from exc

    def reconcile(self, keep: Iterable[str]) -> ReconciledWorkspaces:
        """Make the store hold exactly the agents in `keep`, as after a crash or restart.

        Kept agents with an image get it mounted again; every other root (mounted or not),
        image, half-made image and stray loop device is removed. A kept agent with a plain
        root and no image is left as it is: its records decide whether it still verifies.
        """
        keep = set(keep)
        for agent_id in keep:
            self.path_for(agent_id)  # refuse a bad id before touching anything
        images = self._root / self.IMAGES_DIR
        removed: set[str] = set()
        mounted_again: list[str] = []
        missing: list[str] = []
        detached = 0
        try:
            # A mount point may be gone or renamed; its mount is still the store's to drop.
            for mounted in diskfs.mounts_under(self._root):
                name = mounted.mount_point.name
                if name not in keep and AGENT_ID_RE.fullmatch(name):
                    diskfs.unmount(mounted.mount_point)
                    removed.add(name)
            for entry in self._root.iterdir() if self._root.is_dir() else ():
                if entry.name not in keep and AGENT_ID_RE.fullmatch(entry.name):
                    self._remove(entry, images / f"{entry.name}.ext4")
                    removed.add(entry.name)
            for image in images.iterdir() if images.is_dir() else ():
                agent_id = image.name.removesuffix(".partial").removesuffix(".ext4")
                if image.name.endswith(".partial") or agent_id not in keep:
                    detached += diskfs.detach_loops(image)
                    image.unlink()
                    if AGENT_ID_RE.fullmatch(agent_id):
                        removed.add(agent_id)
            for agent_id in sorted(keep):
                image, path = self.image_for(agent_id), self.path_for(agent_id)
                if image.exists() and self._limits is not None:
                    if diskfs.mounted_at(path) is None:
                        detached += diskfs.detach_loops(image)
                        self.attach(agent_id)
                        mounted_again.append(agent_id)
                elif not path.is_dir():
                    missing.append(agent_id)
            if self._root.exists():
                _fsync_path(self._root, directory=True)
        except OSError as exc:
            raise WorkspaceError(f"cannot reconcile workspaces under {self._root}: {exc}") from exc
        report = ReconciledWorkspaces(tuple(mounted_again), tuple(sorted(removed - keep)),
                                 tuple(missing), detached)
        logger.info("reconciled workspaces: %s", report)
        return report

    def unmount_all(self) -> int:
        """Unmount every agent's root (images stay, for `attach` or `reconcile` to mount
        again): what a runtime does on exit so no mount outlives it. Returns how many."""
        mounted = [m.mount_point for m in diskfs.mounts_under(self._root)
                   if AGENT_ID_RE.fullmatch(m.mount_point.name)]
        try:
            for point in mounted:
                diskfs.unmount(point)
        except OSError as exc:
            raise WorkspaceError(f"cannot unmount workspaces under {self._root}: {exc}") from exc
        return len(set(mounted))

    def unmount(self, agent_id: str) -> None:
        """Unmount the agent's root (its image stays, for `attach` to mount again); a no-op
        for a plain directory or a root not mounted."""
        path = self.path_for(agent_id)
        try:
            diskfs.unmount(path)
        except OSError as exc:
            raise WorkspaceError(f"cannot unmount workspace {path}: {exc}") from exc

    def move_in(self, agent_id: str, source: WorkspaceStore) -> Path:
        """Move the agent's persistent root (its directory and, when it has one, its image)
        from `source`, another state directory's store, into this one, unmounted; its path
        here. A rename when both lie on one filesystem, else a copy made durable under a
        temporary name and renamed into place before the source goes: a crash leaves the
        root whole on at least one side, and running this again finishes the move. While
        the source holds the root it is the one that counts (it replaces a copy here)."""
        path, src_path = self.path_for(agent_id), source.path_for(agent_id)
        image, src_image = self.image_for(agent_id), source.image_for(agent_id)
        if path == src_path:
            raise WorkspaceError(f"workspace {path}: source and destination are the same")
        self._manifests.pop(agent_id, None)
        self._seals.pop(agent_id, None)
        try:
            if src_image.exists() or src_path.is_dir():
                diskfs.unmount(src_path)
                diskfs.unmount(path)
            self._make_dir(self._root, _ROOT_MODE)
            if src_image.exists() or image.exists():  # the root is an image's mount point
                self._make_dir(image.parent, _PRIVATE_MODE)
                if src_image.exists():
                    _move_file(src_image, image)
                self._make_dir(path, _PRIVATE_MODE)
                if src_path.is_dir():
                    src_path.rmdir()  # an empty mount point; anything in it is not moved
            elif src_path.is_dir():
                _move_tree(src_path, path)
            elif not path.is_dir():
                raise WorkspaceError(
                    f"agent {agent_id} has no persistent root in {source.root} or {self._root}")
            _fsync_path(self._root, directory=True)
            if source.root.is_dir():
                _fsync_path(source.root, directory=True)
        except OSError as exc:  # HostError is one
            raise WorkspaceError(
                f"cannot move workspace {src_path} to {path}: {exc}") from exc
        logger.info("workspace %s moved in from %s", agent_id, source.root)
        return path

    def _limits_for(self, agent_id: str, config: Mapping[str, Any]) -> DiskLimits | None:
        asked = [key for key in DiskLimits.CONFIG_KEYS if key in config]
        if self._limits is None:
            if asked:
                raise WorkspaceError(
                    f"agent {agent_id}: {', '.join(asked)} set, but this store keeps plain "
                    f"directories without disk limits")
            return None
        try:
            return self._limits.with_config(config)
        except ConfigError as exc:
            raise WorkspaceError(f"agent {agent_id}: {exc}") from exc

    @staticmethod
    def _make_dir(path: Path, mode: int) -> None:
        path.mkdir(mode=mode, parents=True, exist_ok=True)
        if stat.S_IMODE(path.stat().st_mode) != mode:  # mkdir's mode is masked by the umask
            path.chmod(mode)

    @staticmethod
    def _remove(path: Path, image: Path) -> None:
        diskfs.unmount(path)
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.exists():
            shutil.rmtree(path)
        if image.exists():
            diskfs.detach_loops(image)
            image.unlink()

    def _existing(self, agent_id: str) -> Path:
        path = self.path_for(agent_id)
        if not path.is_dir():
            raise WorkspaceError(f"workspace {path} does not exist")
        return path
