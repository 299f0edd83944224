"""Sockets of the calling thread's network namespace, from the kernel's sock_diag netlink
interface (sock_diag(7)): listening TCP, bound UDP, and listening or named unix sockets.

/proc/net/tcp walks the whole established-connection hash table of the host (about 4 ms
here, even for an empty namespace); a sock_diag dump restricted to listening sockets reads
only those. Three fixed request layouts and replies, so the stdlib `struct` is enough.
The netlink socket belongs to the namespace of the thread that creates it: join the
sandbox's network namespace first (see `host.nsinspect`).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from collections.abc import Iterator

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_NLMSG = struct.Struct("=IHHII")  # len, type, flags, seq, pid
# inet_diag_req_v2: family, protocol, ext, pad, states, then inet_diag_sockid (48 bytes).
_INET_REQ = struct.Struct("=BBBBI48x")
# inet_diag_msg: family, state, timer, retrans, sport (be16), dport (be16), src (16 bytes).
_INET_MSG = struct.Struct("=BBBB2s2s16s")
# unix_diag_req: family, protocol, pad, states, ino, show, cookie (two u32).
_UNIX_REQ = struct.Struct("=BBHIII8x")
_UNIX_MSG = struct.Struct("=BBBBI8x")  # family, type, state, pad, ino, cookie
_RTATTR = struct.Struct("=HH")
_UNIX_DIAG_NAME = 0
_UDIAG_SHOW_NAME = 1
_TCP_LISTEN = 10
_ALL_STATES = 0xFFFFFFFF


def _align(n: int) -> int:
    return (n + 3) & ~3


def _dump(request: bytes) -> Iterator[bytes]:
    """Payloads of a sock_diag dump for `request` (the family-specific request struct)."""
    header = _NLMSG.pack(_NLMSG.size + len(request), _SOCK_DIAG_BY_FAMILY,
                         _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC,
                       _NETLINK_SOCK_DIAG) as sock:
        sock.sendall(header + request)
        while True:
            data = sock.recv(65536)
            offset = 0
            while offset + _NLMSG.size <= len(data):
                length, kind, _, _, _ = _NLMSG.unpack_from(data, offset)
                if kind == _NLMSG_DONE:
                    return
                if kind == _NLMSG_ERROR:
                    errno = -struct.unpack_from("=i", data, offset + _NLMSG.size)[0]
                    raise OSError(errno, f"sock_diag: {os.strerror(errno)}")
                yield data[offset + _NLMSG.size:offset + length]
                offset += _align(length)


def _inet(family: int, protocol: int, states: int) -> list[tuple[str, int, int]]:
    """(address, port, state) of each socket of that family and protocol in `states`."""
    found = []
    for payload in _dump(_INET_REQ.pack(family, protocol, 0, 0, states)):
        msg_family, state, _, _, sport, _, src = _INET_MSG.unpack_from(payload)
        size = 4 if msg_family == socket.AF_INET else 16
        address = str(ipaddress.ip_address(src[:size]))
        found.append((address, int.from_bytes(sport, "big"), state))
    return found


def _address(family: int, address: str, port: int) -> str:
    return f"[{address}]:{port}" if family == socket.AF_INET6 else f"{address}:{port}"


def inet_sockets() -> list[str]:
    """Listening TCP and bound UDP sockets, e.g. "tcp listener 127.0.0.1:8080"."""
    found = []
    for family, suffix in ((socket.AF_INET, ""), (socket.AF_INET6, "6")):
        for address, port, _ in _inet(family, socket.IPPROTO_TCP, 1 << _TCP_LISTEN):
            found.append(f"tcp{suffix} listener {_address(family, address, port)}")
        for address, port, _ in _inet(family, socket.IPPROTO_UDP, _ALL_STATES):
            if port:
                found.append(f"udp{suffix} socket {_address(family, address, port)}")
    return found


def _unix_name(payload: bytes) -> str:
    offset = _UNIX_MSG.size
    while offset + _RTATTR.size <= len(payload):
        length, kind = _RTATTR.unpack_from(payload, offset)
        if length < _RTATTR.size:
            break
        if kind == _UNIX_DIAG_NAME:
            raw = payload[offset + _RTATTR.size:offset + length]
            if raw.startswith(b"\0"):  # an abstract name, shown as ss(8) and /proc show it
                return "@" + raw[1:].decode(errors="replace")
            return raw.rstrip(b"\0").decode(errors="replace")
        offset += _align(length)
    return ""


def unix_sockets() -> list[str]:
    """Listening unix sockets and named datagram ones, e.g. "unix listener @name"."""
    found = []
    request = _UNIX_REQ.pack(socket.AF_UNIX, 0, 0, _ALL_STATES, 0, _UDIAG_SHOW_NAME)
    for payload in _dump(request):
        _, sock_type, state, _, _ = _UNIX_MSG.unpack_from(payload)
        name = _unix_name(payload)
        if state == _TCP_LISTEN:
            found.append(f"unix listener {name or '(unnamed)'}")
        elif sock_type == socket.SOCK_DGRAM and name:
            found.append(f"unix datagram socket {name}")
    return found
