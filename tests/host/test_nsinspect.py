"""Namespace inspection: IPC objects, /dev/shm files and sockets of another process's
namespaces, against a namespace tree made with unshare (real kernel) and against canned
/proc text."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tenon.errors import HostError
from tenon.host import nsinspect

# Creates one object of each kind in its own namespaces, says "ready", then waits.
_HOLDER = r"""
import ctypes, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
rt = ctypes.CDLL("librt.so.1", use_errno=True)
assert libc.shmget(0, 4096, 0o1600) >= 0          # IPC_PRIVATE, IPC_CREAT | 0600
assert libc.msgget(0, 0o1600) >= 0
assert libc.semget(0, 3, 0o1600) >= 0
assert rt.mq_open(b"/tenon-q", 0o100 | 2, 0o600, None) >= 0   # O_CREAT | O_RDWR
open("/dev/shm/tenon-seg", "w").write("x")
tcp = socket.socket(); tcp.bind(("127.0.0.1", 8765)); tcp.listen()
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); udp.bind(("127.0.0.1", 8766))
unix = socket.socket(socket.AF_UNIX); unix.bind("\0tenon-abstract"); unix.listen()
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def holder() -> Iterator[int]:
    """A python in private IPC, network and mount namespaces holding one of everything."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs root, unshare (util-linux) and ip (iproute2)")
    # A /dev of its own (a tmpfs in the private mount namespace) to hold /dev/shm and
    # /dev/mqueue, so nothing is made in the host's /dev.
    setup = ('ip link set lo up && mount -t tmpfs tmpfs /dev && mkdir /dev/shm /dev/mqueue && '
             'mount -t tmpfs tmpfs /dev/shm && mount -t mqueue mqueue /dev/mqueue && '
             'exec "$0" -c "$1"')
    argv = ["unshare", "--ipc", "--net", "--mount", "--propagation", "private", "--fork",
            "sh", "-c", setup, sys.executable, _HOLDER]
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as proc:
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready"
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            yield int(children[0])
        finally:
            proc.kill()


@pytest.mark.sandbox
def test_finds_every_kind_of_object_in_the_namespaces(holder: int) -> None:
    state = nsinspect.namespace_state(holder)
    assert "/dev/shm/tenon-seg" in state
    assert "POSIX mqueue /dev/mqueue/tenon-q" in state
    sysv = [s for s in state if s.startswith("SysV")]
    assert sorted(s.split()[1] for s in sysv) == ["msg", "sem", "shm"]
    assert any("(4096 bytes)" in s for s in sysv)
    assert any("(3 semaphores)" in s for s in sysv)
    assert "tcp listener 127.0.0.1:8765" in state
    assert "udp socket 127.0.0.1:8766" in state
    assert "unix listener @tenon-abstract" in state
    sockets = nsinspect.listening_sockets(holder)
    assert sockets == nsinspect.proc_sockets(holder)  # sock_diag and /proc agree
    assert sockets == [s for s in state if "socket" in s or "listener" in s]


@pytest.mark.sandbox
def test_the_host_namespaces_are_not_confused_with_the_sandbox(holder: int) -> None:
    """The objects are the holder's: this process's own namespaces hold none of them."""
    mine = nsinspect.sysv_ipc_objects(os.getpid())
    assert not any("(3 semaphores)" in s for s in mine)
    assert "tcp listener 127.0.0.1:8765" not in nsinspect.listening_sockets(os.getpid())
    assert nsinspect.sysv_ipc_objects(holder) != mine


def test_a_gone_process_is_an_error_not_an_empty_answer(tmp_path: Path) -> None:
    with pytest.raises(HostError, match="pid 4242"):
        nsinspect.namespace_state(4242, proc_root=tmp_path)


def make_proc(tmp_path: Path, *, tcp: str = "", udp: str = "", unix: str = "") -> Path:
    net = tmp_path / "7" / "net"
    net.mkdir(parents=True)
    header = "  sl  local_address rem_address   st tx_queue rx_queue\n"
    (net / "tcp").write_text(header + tcp)
    (net / "udp").write_text(header + udp)
    (net / "unix").write_text("Num       RefCount Protocol Flags    Type St Inode Path\n" + unix)
    return tmp_path


def test_socket_lines_are_parsed(tmp_path: Path) -> None:
    proc_root = make_proc(
        tmp_path,
        tcp="   0: 0100007F:1F90 00000000:0000 0A 0 0\n"   # listening on 127.0.0.1:8080
            "   1: 0100007F:1F91 0100007F:9C40 01 0 0\n",  # established: not listed
        udp="   0: 00000000:0035 00000000:0000 07 0 0\n"   # bound to 0.0.0.0:53
            "   1: 00000000:0000 00000000:0000 07 0 0\n",  # unbound: not listed
        unix="0000: 00000002 00000000 00010000 0001 01 100 /workspace/s.sock\n"
             "0000: 00000002 00000000 00000000 0001 03 101\n"  # connected, unnamed: not listed
             "0000: 00000002 00000000 00000000 0002 01 102 @dgram\n",
    )
    assert nsinspect.proc_sockets(7, proc_root) == [
        "tcp listener 127.0.0.1:8080",
        "udp socket 0.0.0.0:53",
        "unix datagram socket @dgram",
        "unix listener /workspace/s.sock",
    ]


def test_ipv6_addresses_are_decoded(tmp_path: Path) -> None:
    proc_root = make_proc(tmp_path)
    (proc_root / "7" / "net" / "tcp6").write_text(
        "header\n   0: 00000000000000000000000001000000:0050 "
        "00000000000000000000000000000000:0000 0A 0 0\n")
    assert nsinspect.proc_sockets(7, proc_root) == ["tcp6 listener [::1]:80"]
