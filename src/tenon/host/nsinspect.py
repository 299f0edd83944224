"""State a sandbox's namespaces hold outside files: IPC objects, /dev/shm, listening sockets.

Every function takes the host pid of a process inside the sandbox's namespaces (the process
backend's init, a container's init) and names each object in one string, sorted. An error
reading the namespace raises `HostError`; the restart-safe check turns that into an
unknown answer (resident_only), never into "nothing there".

- SysV IPC: /proc/sysvipc/{shm,msg,sem} list the IPC namespace of the process that opens
  them, so they are opened from a short-lived thread that first joins the sandbox's IPC
  and network namespaces with setns(2) (a thread may change its own IPC and network
  namespaces; it exits right after, so no other code ever runs in the sandbox's namespaces).
- POSIX message queues: the files of the mqueue filesystem the sandbox mounts at
  /dev/mqueue, read through /proc/<pid>/root.
- /dev/shm: POSIX shared memory and any other file there, through /proc/<pid>/root.
- Sockets: a sock_diag dump (`host.sockdiag`) from that same thread; /proc/<pid>/net/*
  (which describe the pid's network namespace, but cost ~4 ms a read) when it fails.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from tenon.errors import HostError
from tenon.host import procfs, sockdiag

PROC_ROOT = Path("/proc")
MQUEUE_DIR = "/dev/mqueue"
SHM_DIR = "/dev/shm"
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWNET = 0x40000000
_NAMESPACES = {"ipc": _CLONE_NEWIPC, "net": _CLONE_NEWNET}
_TCP_LISTEN = "0A"
_SO_ACCEPTCON = 0x10000  # __SO_ACCEPTCON in /proc/net/unix flags: a listening socket
_UNIX_DGRAM = 2
_SYSV_KINDS = ("shm", "msg", "sem")

_T = TypeVar("_T")


_LIBC = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int, nstype: int) -> None:
    if _LIBC.setns(fd, nstype) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _in_namespaces(pid: int, kinds: tuple[str, ...], read: Callable[[], _T],
                   proc_root: Path = PROC_ROOT) -> _T:
    """`read()` run in a fresh thread that has joined `pid`'s namespaces of those kinds."""
    outcome: list[_T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            for kind in kinds:
                fd = procfs.open_namespace(pid, kind, proc_root)
                try:
                    _setns(fd, _NAMESPACES[kind])
                finally:
                    os.close(fd)
            outcome.append(read())
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=run, name=f"tenon-ipcns-{pid}", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise HostError(f"cannot read the namespaces of pid {pid}: {failure[0]}")
    return outcome[0]


def _read_sysvipc() -> dict[str, str]:
    return {kind: Path(f"/proc/sysvipc/{kind}").read_text() for kind in _SYSV_KINDS}


def sysv_ipc_objects(pid: int, proc_root: Path = PROC_ROOT) -> list[str]:
    """SysV shared-memory segments, message queues and semaphore sets of `pid`'s IPC
    namespace, e.g. "SysV shm key 0x00000000 id 3 (4096 bytes)"."""
    return _sysv_names(_in_namespaces(pid, ("ipc",), _read_sysvipc, proc_root))


def _sysv_names(tables: dict[str, str]) -> list[str]:
    found = []
    for kind in _SYSV_KINDS:
        for line in tables[kind].splitlines()[1:]:  # the first line is the header
            fields = line.split()
            if len(fields) < 4:
                continue
            key, ident = int(fields[0]), fields[1]
            detail = {"shm": f"{fields[3]} bytes", "msg": f"{fields[4]} messages",
                      "sem": f"{fields[3]} semaphores"}[kind]
            found.append(f"SysV {kind} key 0x{key & 0xFFFFFFFF:08x} id {ident} ({detail})")
    return sorted(found)


def _files_under(pid: int, directory: str, proc_root: Path) -> list[str]:
    top = proc_root / str(pid) / "root" / directory.lstrip("/")
    if not top.is_dir():
        raise HostError(f"{directory} is not a directory in the namespaces of pid {pid}")
    return sorted(f"{directory}/{path.relative_to(top)}" for path in top.rglob("*"))


def posix_mqueues(pid: int, proc_root: Path = PROC_ROOT) -> list[str]:
    """POSIX message queues, as files of the mqueue filesystem the sandbox mounts at
    /dev/mqueue (HostError when it has none there: the answer would be unknown)."""
    return [f"POSIX mqueue {path}" for path in _files_under(pid, MQUEUE_DIR, proc_root)]


def shm_files(pid: int, proc_root: Path = PROC_ROOT) -> list[str]:
    """Files and directories under the sandbox's /dev/shm (POSIX shared memory among them)."""
    return _files_under(pid, SHM_DIR, proc_root)


def _inet_address(hex_address: str) -> str:
    host_hex, port_hex = hex_address.split(":")
    raw = bytes.fromhex(host_hex)
    # /proc/net/tcp{,6} prints each 32-bit word in host (little-endian) byte order.
    packed = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(packed)
    host = f"[{address}]" if address.version == 6 else str(address)
    return f"{host}:{int(port_hex, 16)}"


def _inet_sockets(net: Path, proto: str) -> list[str]:
    found = []
    for family in ("", "6"):
        path = net / f"{proto}{family}"
        if not path.exists():  # no IPv6 in this kernel
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local, state = fields[1], fields[3]
            if proto == "tcp" and state != _TCP_LISTEN:
                continue
            if proto == "udp" and local.endswith(":0000"):
                continue
            role = "listener" if proto == "tcp" else "socket"
            found.append(f"{proto}{family} {role} {_inet_address(local)}")
    return found


def _unix_sockets(net: Path) -> list[str]:
    found = []
    for line in (net / "unix").read_text().splitlines()[1:]:
        fields = line.split()
        flags, sock_type = int(fields[3], 16), int(fields[4], 16)
        name = fields[7] if len(fields) > 7 else ""
        if flags & _SO_ACCEPTCON:
            found.append(f"unix listener {name or '(unnamed)'}")
        elif sock_type == _UNIX_DGRAM and name:
            found.append(f"unix datagram socket {name}")
    return found


def _diag_sockets() -> list[str] | None:
    """The calling thread's network namespace's sockets; None when sock_diag fails."""
    try:
        return sorted({*sockdiag.inet_sockets(), *sockdiag.unix_sockets()})
    except OSError:
        return None


def listening_sockets(pid: int, proc_root: Path = PROC_ROOT) -> list[str]:
    """Listening TCP, bound UDP and listening or bound-datagram unix sockets of `pid`'s
    network namespace, e.g. "tcp listener 127.0.0.1:8080", "unix listener @name"."""
    found = _in_namespaces(pid, ("net",), _diag_sockets, proc_root)
    return found if found is not None else proc_sockets(pid, proc_root)


def proc_sockets(pid: int, proc_root: Path = PROC_ROOT) -> list[str]:
    """`listening_sockets` read from /proc/<pid>/net (the slower fallback)."""
    net = proc_root / str(pid) / "net"
    try:
        return sorted({*_inet_sockets(net, "tcp"), *_inet_sockets(net, "udp"),
                       *_unix_sockets(net)})
    except (OSError, ValueError, IndexError) as exc:
        raise HostError(f"cannot read the sockets of pid {pid}'s network namespace: "
                        f"{exc}") from exc


def namespace_state(pid: int, proc_root: Path = PROC_ROOT) -> list[str]:
    """Everything above: /dev/shm files, POSIX and SysV IPC objects, sockets."""
    try:
        files = [*shm_files(pid, proc_root), *posix_mqueues(pid, proc_root)]
        tables, sockets = _in_namespaces(pid, ("ipc", "net"),
                                         lambda: (_read_sysvipc(), _diag_sockets()), proc_root)
        if sockets is None:
            sockets = proc_sockets(pid, proc_root)
        return [*files, *_sysv_names(tables), *sockets]
    except OSError as exc:
        if isinstance(exc, HostError):
            raise
        raise HostError(f"cannot inspect the namespaces of pid {pid}: {exc}") from exc
