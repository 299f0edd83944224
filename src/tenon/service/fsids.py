"""The calling thread's filesystem identity: who the kernel checks file access as.

`acting_as` sets the calling thread's filesystem uid and gid (setfsuid(2), setfsgid(2))
and supplementary groups for a block and restores them afterwards. Linux keeps these per
thread, and glibc's setfsuid/setfsgid act on the calling thread only; its setgroups
changes every thread of the process, so the raw system call is made instead. Leaving
filesystem uid 0 clears the thread's file capabilities (CAP_DAC_OVERRIDE, CAP_FOWNER,
CAP_CHOWN, ...) until it returns to 0 (capabilities(7)): access is then decided by owner,
group and mode bits as for that user, and new files and directories get that uid and gid.

Only root (CAP_SETUID, CAP_SETGID) can switch; the server runs as root.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from tenon.errors import TenonError

_LIBC = ctypes.CDLL(None, use_errno=True)
_SYS_SETGROUPS = {"x86_64": 116, "aarch64": 159}.get(platform.machine())
_UNCHANGED = 0xFFFFFFFF  # (uid_t)-1: an invalid id, which setfsuid answers with the current one
_local = threading.local()


class IdentityError(TenonError, PermissionError):
    """The thread's filesystem identity could not be switched."""


def _setfsuid(uid: int) -> int:
    return int(_LIBC.setfsuid(ctypes.c_uint(uid)))


def _setfsgid(gid: int) -> int:
    return int(_LIBC.setfsgid(ctypes.c_uint(gid)))


def _setgroups(groups: Sequence[int]) -> None:
    if _SYS_SETGROUPS is None:
        raise IdentityError(f"setgroups of one thread is not known on {platform.machine()}")
    array = (ctypes.c_uint * max(len(groups), 1))(*groups)
    if _LIBC.syscall(_SYS_SETGROUPS, len(groups), array) != 0:
        err = ctypes.get_errno()
        raise IdentityError(f"cannot set this thread's groups: {os.strerror(err)}")


@contextmanager
def acting_as(uid: int, gid: int, groups: Sequence[int]) -> Iterator[None]:
    """File access in this thread is checked as `uid`, `gid` and `groups` while the block
    runs. Nested blocks for the same identity are free; another identity inside one is an
    error. The block must end in the thread it began in (not across a generator's yield
    handed to another thread)."""
    wanted = (uid, gid, tuple(groups))
    current = getattr(_local, "identity", None)
    if current is not None:
        if current != wanted:
            raise IdentityError(f"this thread already acts as uid {current[0]}")
        yield
        return
    owner = threading.get_ident()
    saved_groups = os.getgroups()  # the calling thread's own list
    _setgroups(wanted[2])
    previous_gid = _setfsgid(gid)
    previous_uid = _setfsuid(uid)
    _local.identity = wanted
    try:
        if _setfsuid(_UNCHANGED) != uid or _setfsgid(_UNCHANGED) != gid:
            raise IdentityError(f"cannot act as uid {uid} gid {gid}: the server is not root")
        yield
    finally:
        if threading.get_ident() != owner:
            raise IdentityError("a filesystem identity was left from another thread")
        _local.identity = None
        _setfsuid(previous_uid)
        _setfsgid(previous_gid)
        _setgroups(saved_groups)
