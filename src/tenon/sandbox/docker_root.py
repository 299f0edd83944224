"""The writable root of a Docker sandbox, made on the host side.

Docker runs with user-namespace remapping (`"userns-remap": "default"`): container id `i`
is host id `R + i`, where R is the start of the dockremap user's subordinate range (one
range for every container). A sandbox's root is an overlay mounted by host root under
`<state dir>/docker/roots/<sandbox id>`:

- lower: the image's rootfs from Tenon's image store, shifted once per image and R into
  `<state dir>/docker/lower/<image>.<R>.<rootfs inode>` (every id + R; modes, setuid bits,
  file capabilities and other xattrs kept);
- upper and work: `upper/` and `work/` in the agent's persistent root, holding host ids
  (container ids + R), so what root inside installs or edits survives destroy+materialize.

Docker starts the container from a placeholder image (a static pause program, built
locally with gcc and `docker import`ed, never pulled) with the merged tree bound at
`docker_enter.NEW_ROOT`; `docker_enter` then pivots the container onto it.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import docker
import docker.errors

from tenon.errors import BackendUnavailable, SandboxError, WorkspaceError
from tenon.sandbox.base import PERSISTENT_MOUNTS
from tenon.sandbox.docker_enter import NEW_ROOT
from tenon.sandbox.images import image_rootfs

USER_ID = 1000  # the default user inside (gid the same)
CONTAINER_IDS = 65536  # ids the remapped range covers
UPPER = "upper"
WORK = "work"
_ENTER_SCRIPT = Path(__file__).with_name("docker_enter.py")
_ENTER_TIMEOUT_S = 10.0
_PAUSE_C = b"#include <unistd.h>\nint main(void) { for (;;) pause(); }\n"
_PLACEHOLDER_REPO = "tenon-docker-root"
PLACEHOLDER_COMMAND = ["/pause"]
_PLACEHOLDER_DIRS = ("proc", "dev", "sys", "etc", "tmp", "workspace", "home", "home/user",
                     NEW_ROOT.lstrip("/"))
_MNT_DETACH = 2
_CAPS_XATTR = "security.capability"
_REMAP_FIX = "run: bash scripts/setup.sh (it sets userns-remap in /etc/docker/daemon.json)"

_libc = ctypes.CDLL(None, use_errno=True)


def remap_base(client: docker.DockerClient) -> int:
    """R: the host id of container root; BackendUnavailable when Docker does not remap."""
    info = client.info()
    if not any(o.startswith("name=userns") for o in info.get("SecurityOptions", [])):
        raise BackendUnavailable(f"Docker runs containers without userns-remap; {_REMAP_FIX}")
    # The remapped data root is <data root>/<R>.<G>.
    uid_text = str(info.get("DockerRootDir", "")).rsplit("/", 1)[-1].split(".")[0]
    if not uid_text.isdigit():
        raise BackendUnavailable(f"cannot read the remapped id range from Docker's root dir "
                                 f"{info.get('DockerRootDir')!r}; {_REMAP_FIX}")
    return int(uid_text)


def _shift_one(path: str, base: int) -> None:
    st = os.lstat(path)
    caps = None
    if not os.path.islink(path):
        with contextlib.suppress(OSError):
            caps = os.getxattr(path, _CAPS_XATTR, follow_symlinks=False)
    os.lchown(path, st.st_uid + base, st.st_gid + base)
    if not os.path.islink(path):
        if st.st_mode & 0o6000:  # chown cleared setuid and setgid
            os.chmod(path, st.st_mode & 0o7777)
        if caps is not None:  # and file capabilities
            os.setxattr(path, _CAPS_XATTR, caps, follow_symlinks=False)


def shift_tree(root: Path, base: int) -> None:
    """Add `base` to the owner and group of `root` and everything below it."""
    _shift_one(str(root), base)
    for top, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            _shift_one(os.path.join(top, name), base)


def shifted_lower(image: str, state_dir: Path, base: int) -> Path:
    """The image's rootfs with every id + `base`, copied and shifted on first use (a few
    seconds; concurrent callers wait on a lock); a rebuilt image gets a new copy."""
    rootfs = image_rootfs(image, state_dir)
    ino = rootfs.stat().st_ino
    lower_dir = state_dir / "docker" / "lower"
    lower_dir.mkdir(mode=0o711, parents=True, exist_ok=True)
    target = lower_dir / f"{rootfs.parent.name}.{base}.{ino}"
    if target.is_dir():
        return target
    with open(lower_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_dir():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=lower_dir))
        try:
            copy = tmp / "rootfs"
            subprocess.run(["cp", "-a", "--", str(rootfs), str(copy)], check=True,
                           capture_output=True)
            shift_tree(copy, base)
            copy.rename(target)
        except subprocess.CalledProcessError as exc:
            raise SandboxError(f"cannot copy {rootfs}: {exc.stderr.decode().strip()}") from exc
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def placeholder_image(client: docker.DockerClient, state_dir: Path) -> str:
    """The tag of the placeholder image (a static pause program and empty mount points),
    compiled with gcc and imported on first use."""
    tag = f"{_PLACEHOLDER_REPO}:{hashlib.sha256(_PAUSE_C).hexdigest()[:12]}"
    with contextlib.suppress(docker.errors.ImageNotFound):
        client.images.get(tag)
        return tag
    build_dir = state_dir / "docker"
    build_dir.mkdir(mode=0o711, parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=build_dir) as tmp:
        source, binary = Path(tmp) / "pause.c", Path(tmp) / "pause"
        source.write_bytes(_PAUSE_C)
        try:
            subprocess.run(["gcc", "-static", "-Os", "-s", "-o", str(binary), str(source)],
                           check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            raise BackendUnavailable(f"cannot build the Docker placeholder with gcc ({exc}); "
                                     "run: apt-get install gcc libc6-dev") from exc
        data = io.BytesIO()
        with tarfile.open(fileobj=data, mode="w") as tar:
            for name in _PLACEHOLDER_DIRS:
                entry = tarfile.TarInfo(name)
                entry.type, entry.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(entry)
            tar.add(binary, arcname="pause")
    repository, tag_name = tag.split(":")
    client.api.import_image_from_data(data.getvalue(), repository=repository, tag=tag_name)
    return tag


def own_remapped_root(root: Path, base: int) -> None:
    """The persistent root for a remapped container: the root itself container root's
    (0700), `upper/` made as container root's, `work/` host root's, and anything in the
    persistent directories whose owner is outside the container's range the default
    user's (lchown: never follow a symlink out). Only a directory itself out of the range
    (new, or last owned by something else) is walked: everything a container writes is in
    the range, so a rebuild does not stat the tree."""
    if not root.is_dir():
        raise WorkspaceError(f"workspace {root} is not a directory")
    os.lchown(root, base, base)
    root.chmod(0o700)
    upper, work = root / UPPER, root / WORK
    if not upper.is_dir():
        upper.mkdir(mode=0o755)
        os.lchown(upper, base, base)
    work.mkdir(mode=0o700, exist_ok=True)
    user = base + USER_ID
    for sub in PERSISTENT_MOUNTS:
        directory = root / sub
        directory.mkdir(mode=0o700, exist_ok=True)
        directory.chmod(0o700)
        if base <= directory.lstat().st_uid < base + CONTAINER_IDS:
            continue
        for top, dirs, files in os.walk(directory):
            names = (top,) if top == str(directory) else ()
            for name in (*names, *(os.path.join(top, n) for n in (*dirs, *files))):
                st = os.lstat(name)
                if not base <= st.st_uid < base + CONTAINER_IDS:
                    os.lchown(name, user, user)


def mount_root(lower: Path, persistent_root: Path, merged: Path) -> None:
    """Mount the overlay (lower below, the persistent upper/work above) at `merged`."""
    merged.mkdir(mode=0o755, parents=True, exist_ok=True)
    options = (f"lowerdir={lower},upperdir={persistent_root / UPPER},"
               f"workdir={persistent_root / WORK}")
    result = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options, str(merged)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise SandboxError(f"cannot mount the root of {persistent_root}: "
                           f"{result.stderr.strip()}")


def make_mount_points(merged: Path, paths: list[str], files: list[str], base: int) -> None:
    """Create in the tree (as container root) each directory in `paths` and empty file in
    `files` that a mount moves onto and the image lacks."""
    for path in paths:
        target = merged / path.lstrip("/")
        if not target.is_dir():
            target.mkdir(mode=0o755, parents=True)
            os.lchown(target, base, base)
    for path in files:
        target = merged / path.lstrip("/")
        if not target.exists() and not target.is_symlink():
            target.touch(mode=0o644)
            os.lchown(target, base, base)


def unmount_root(merged: Path) -> None:
    """Detach the overlay at `merged` (if mounted) and remove the directory."""
    if os.path.ismount(merged) and _libc.umount2(str(merged).encode(), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        raise SandboxError(f"cannot unmount {merged}: {os.strerror(err)}")
    with contextlib.suppress(FileNotFoundError):
        merged.rmdir()


# Per-user limits of each container's user namespace (/proc/sys/user): with remapping, what the
# container's users hold is also counted against host root's limit (docker_enter's docstring), so
# each container gets a share; setup raises the host's limit to fit many containers.
CONTAINER_USER_LIMITS = {"max_inotify_instances": 32, "max_inotify_watches": 65536}


def enter_root(init_pid: int, moves: list[str], readonly: list[str]) -> None:
    """Cap the container's per-user limits and pivot it onto its tree (`docker_enter`)."""
    limits = [arg for name, value in CONTAINER_USER_LIMITS.items()
              for arg in ("--limit", f"{name}={value}")]
    argv = [sys.executable, "-S", str(_ENTER_SCRIPT), str(init_pid), *limits, *moves, "--",
            *readonly]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=_ENTER_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise SandboxError(f"entering the root of pid {init_pid} timed out") from exc
    if result.returncode != 0:
        raise SandboxError(result.stderr.strip() or f"docker_enter exited {result.returncode}")
