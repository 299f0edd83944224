"""Opening a path as if a directory were "/": openat2(2) with RESOLVE_IN_ROOT.

The kernel resolves every component, symlinks included, inside the directory: an absolute
symlink starts again at it, `..` stops at it, magic links (/proc/*/fd/*) are refused. A
component swapped for a symlink during the resolution makes the kernel retry or fail, never
escape; the resolution is atomic with the open, so there is no check-then-use gap.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager

_SYS_OPENAT2 = 437  # the same number on every architecture (added after the table merge)
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_IN_ROOT = 0x10
_RESOLVE = _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS
_MAX_EAGAIN_RETRIES = 16
_LIBC = ctypes.CDLL(None, use_errno=True)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


def openat2(dir_fd: int, rel: str, flags: int, mode: int = 0) -> int:
    """openat2(2) of `rel` with `dir_fd` as the root of every resolution; OSError on failure.
    EAGAIN (a concurrent rename seen during resolution) is retried."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, _RESOLVE)
    path = (rel or ".").encode()
    for _ in range(_MAX_EAGAIN_RETRIES):
        fd = int(_LIBC.syscall(_SYS_OPENAT2, dir_fd, path, ctypes.byref(how),
                               ctypes.sizeof(how)))
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if err != errno.EAGAIN:
            raise OSError(err, os.strerror(err), rel)
    raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN), rel)


@contextmanager
def closing_fd(fd: int) -> Iterator[int]:
    """`fd`, closed when the block ends."""
    try:
        yield fd
    finally:
        os.close(fd)
