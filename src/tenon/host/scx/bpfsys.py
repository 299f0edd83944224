"""The few bpf(2) commands the gate needs, through ctypes: open a pinned map, and look up,
update and delete one element. Errors are OSError with the kernel's errno."""

from __future__ import annotations

import ctypes
import os
import platform
import struct

SYS_BPF = {"x86_64": 321, "aarch64": 280}
BPF_MAP_LOOKUP_ELEM = 1
BPF_MAP_UPDATE_ELEM = 2
BPF_MAP_DELETE_ELEM = 3
BPF_OBJ_GET = 7
BPF_ANY = 0
ATTR_SIZE = 128  # larger than every command's part of union bpf_attr; the rest stays zero

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _bpf(cmd: int, attr: ctypes.Array[ctypes.c_char]) -> int:
    number = SYS_BPF.get(platform.machine())
    if number is None:
        raise OSError(38, f"bpf(2) number unknown for {platform.machine()}")  # ENOSYS
    result = int(_libc.syscall(ctypes.c_long(number), ctypes.c_int(cmd), attr,
                               ctypes.c_uint(ATTR_SIZE)))
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"bpf(cmd={cmd}): {os.strerror(err)}")
    return result


def _address(buffer: ctypes.Array[ctypes.c_char]) -> int:
    return ctypes.addressof(buffer)


def obj_get(path: str) -> int:
    """A file descriptor for the BPF object pinned at `path` (the caller closes it)."""
    name = ctypes.create_string_buffer(os.fsencode(path))
    attr = ctypes.create_string_buffer(ATTR_SIZE)
    struct.pack_into("=QII", attr, 0, _address(name), 0, 0)
    return _bpf(BPF_OBJ_GET, attr)


def _elem_attr(map_fd: int, key: ctypes.Array[ctypes.c_char], value_address: int,
               flags: int) -> ctypes.Array[ctypes.c_char]:
    attr = ctypes.create_string_buffer(ATTR_SIZE)
    struct.pack_into("=IIQQQ", attr, 0, map_fd, 0, _address(key), value_address, flags)
    return attr


def update(map_fd: int, key: bytes, value: bytes) -> None:
    """Insert or replace one element."""
    key_buf = ctypes.create_string_buffer(key, len(key))
    value_buf = ctypes.create_string_buffer(value, len(value))
    _bpf(BPF_MAP_UPDATE_ELEM, _elem_attr(map_fd, key_buf, _address(value_buf), BPF_ANY))


def delete(map_fd: int, key: bytes) -> bool:
    """Remove one element: True if it was there."""
    key_buf = ctypes.create_string_buffer(key, len(key))
    try:
        _bpf(BPF_MAP_DELETE_ELEM, _elem_attr(map_fd, key_buf, 0, 0))
    except FileNotFoundError:
        return False
    return True


def lookup(map_fd: int, key: bytes, value_size: int) -> bytes | None:
    """One element's value, or None when the key is absent."""
    key_buf = ctypes.create_string_buffer(key, len(key))
    value_buf = ctypes.create_string_buffer(value_size)
    try:
        _bpf(BPF_MAP_LOOKUP_ELEM, _elem_attr(map_fd, key_buf, _address(value_buf), 0))
    except FileNotFoundError:
        return None
    return value_buf.raw[:value_size]
