"""Makes a started container's root the writable tree Docker bound at `NEW_ROOT`.

Run by the Docker backend as host root, as its own single-threaded process (setns into a
mount namespace refuses a threaded caller), with nothing but the standard library:

    python -S docker_enter.py <init pid> [--limit <name>=<value>]... <move>... -- <read-only>...

Each --limit first sets one of the per-user limits of the container's user namespace
(/proc/sys/user/<name>, from a child that joined that namespace: the file shows the values of
the reader's namespace). Under Docker's user-namespace remapping every container's namespace is
owned by host root, so what its users hold of a limit counted per user (inotify instances and
watches) is also counted against host root's limit on the host: the cap here keeps one
container from taking all of it. Then it joins the container's mount namespace, moves
Docker's mounts named in <move> (/proc, /dev, /sys, the persistent binds...) from the
placeholder root into the new root, pivots onto it (every process of the namespace whose
root was the old one follows: docker-init and its idle child), detaches the old root, and
remounts each <read-only> path read-only, keeping its other flags. A `docker exec` then
joins a namespace whose root is the tree. Exit 0, or 1 with one line naming the step that failed.
"""

from __future__ import annotations

import ctypes
import os
import sys

NEW_ROOT = "/.tenon-root"
_CLONE_NEWNS = 0x20000
_MS_RDONLY = 1
_MS_REMOUNT = 32
_MS_BIND = 4096
_MS_MOVE = 8192
_MS_REC = 16384
_MS_PRIVATE = 1 << 18
_MNT_DETACH = 2
# statvfs f_flag bit -> the mount flag that keeps it (a locked flag must be kept).
_KEPT_FLAGS = ((2, 2), (4, 4), (8, 8), (1024, 1024), (2048, 2048), (4096, 1 << 21))

_libc = ctypes.CDLL(None, use_errno=True)


class EnterError(Exception):
    pass


def _check(ret: int, what: str) -> None:
    if ret != 0:
        raise EnterError(f"{what}: {os.strerror(ctypes.get_errno())}")


def _mount(source: str | None, target: str, flags: int) -> None:
    src = None if source is None else source.encode()
    ret = _libc.mount(src, target.encode(), None, ctypes.c_ulong(flags), None)
    _check(ret, f"mount {source or ''} {target}")


def set_user_limits(init_pid: int, limits: dict[str, int]) -> None:
    """Write `limits` into the container's user namespace, from a child joined to it."""
    if not limits:
        return
    fd = os.open(f"/proc/{init_pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports by its exit code
        code = 1
        try:
            _check(_libc.setns(fd, 0x10000000), "setns into the user namespace")  # CLONE_NEWUSER
            for name, value in limits.items():
                with open(f"/proc/sys/user/{name}", "w") as limit:
                    limit.write(str(value))
            code = 0
        except (EnterError, OSError) as exc:
            print(f"docker_enter: user limit: {exc}", file=sys.stderr)
        os._exit(code)
    os.close(fd)
    _, status = os.waitpid(child, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise EnterError(f"setting the user limits {sorted(limits)} of {init_pid} failed")


def enter(init_pid: int, moves: list[str], readonly: list[str]) -> None:
    fd = os.open(f"/proc/{init_pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    _check(_libc.setns(fd, _CLONE_NEWNS), f"setns into the mount namespace of {init_pid}")
    os.close(fd)
    os.chdir("/")
    _mount(None, "/", _MS_REC | _MS_PRIVATE)
    for path in moves:
        _mount(path, NEW_ROOT + path, _MS_MOVE)
    os.chdir(NEW_ROOT)
    _check(_libc.pivot_root(b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", _MNT_DETACH), "detach the placeholder root")
    os.chdir("/")
    for path in readonly:
        have = os.statvfs(path).f_flag
        flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY
        flags |= sum(ms for st, ms in _KEPT_FLAGS if have & st)
        _mount(None, path, flags)


def main(argv: list[str]) -> int:
    try:
        split = argv.index("--")
        init_pid, rest = int(argv[0]), argv[1:split]
        limits: dict[str, int] = {}
        while rest[:1] == ["--limit"]:
            name, value = rest[1].split("=", 1)
            limits[name] = int(value)
            rest = rest[2:]
        set_user_limits(init_pid, limits)
        enter(init_pid, rest, argv[split + 1:])
    except (EnterError, OSError, ValueError, IndexError) as exc:
        print(f"docker_enter: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
