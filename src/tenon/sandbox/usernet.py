"""Outbound networking for a sandbox's private network namespace, through slirp4netns.

A sandbox always has its own network namespace. When its spec allows the network,
slirp4netns (user-mode TCP/IP in a host process) gives it a tap device with 10.0.2.100/24,
gateway 10.0.2.2 and DNS 10.0.2.3, and relays its connections from the host's network
namespace as ordinary sockets. `--disable-host-loopback` refuses connections to the host's
127.0.0.1 through 10.0.2.2, so services bound to the host's loopback stay out of reach;
the sandbox's own 127.0.0.1 is its own loopback.

slirp4netns runs as the sandbox's unprivileged host uid where it may open /dev/net/tun (mode
0666, as Debian's udev rules make it; on a host where the node is 0600 it runs as root, and
`--enable-sandbox` drops its capabilities once the tap is set up). That uid owns the user
namespace that
owns the sandbox's network namespace (bwrap's outer one: the sandbox's processes live in a
nested one), so joining that user namespace gives it the capabilities to join the network
namespace and configure the tap. It runs in the sandbox's cgroup (its memory
is the sandbox's), in its own mount namespace with its own seccomp filter
(`--enable-sandbox --enable-seccomp`). It exits when the write end of its exit pipe closes:
at destroy, or when the controller dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import signal
import tempfile
from collections.abc import Iterable
from pathlib import Path

from tenon.errors import SandboxError
from tenon.host import procfs
from tenon.sandbox._exec import enter_cgroup_argv, wait_ready

logger = logging.getLogger(__name__)

NAMESERVER = "10.0.2.3"  # slirp4netns's DNS forwarder, as the sandbox's resolv.conf names it
READY_TIMEOUT_S = 10.0
_MTU = 65520  # slirp4netns's maximum: fewer, larger packets through the user-mode stack
_LOG_TAIL_BYTES = 2000
_NS_GET_USERNS = 0xB701  # ioctl_ns(2): _IO(0xb7, 0x1)
TUN_DEVICE = "/dev/net/tun"


def tun_is_open_to_all() -> bool:
    try:
        return os.stat(TUN_DEVICE).st_mode & 0o006 == 0o006
    except OSError:
        return False


class UserNet:
    """A running slirp4netns serving one sandbox's network namespace."""

    def __init__(self, proc: asyncio.subprocess.Process, exit_w: int, log_fd: int) -> None:
        self._proc = proc
        self._exit_w = exit_w
        self._log_fd = log_fd  # slirp4netns's stdout and stderr: an unnamed file

    @property
    def pid(self) -> int:
        return self._proc.pid

    @classmethod
    async def start(cls, slirp4netns: str, setpriv: str, target_pid: int, host_uid: int,
                    procs_files: Iterable[Path]) -> UserNet:
        """Connect the network namespace of `target_pid`; return once it is configured."""
        net_fd = procfs.open_namespace(target_pid, "net")
        try:
            owner_fd = fcntl.ioctl(net_fd, _NS_GET_USERNS)  # the netns's owning user namespace
        finally:
            os.close(net_fd)
        exit_r, exit_w = os.pipe()
        ready_r, ready_w = os.pipe()
        log = os.open(tempfile.gettempdir(), os.O_TMPFILE | os.O_RDWR, 0o600)
        as_uid = ([setpriv, f"--reuid={host_uid}", f"--regid={host_uid}", "--clear-groups", "--"]
                  if tun_is_open_to_all() else [])
        argv = enter_cgroup_argv(procs_files, [
            *as_uid, slirp4netns, "--configure", f"--mtu={_MTU}", "--disable-host-loopback",
            "--enable-sandbox", "--enable-seccomp", f"--exit-fd={exit_r}",
            f"--ready-fd={ready_w}", f"--userns-path=/proc/self/fd/{owner_fd}",
            str(target_pid), "tap0",
        ])
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
                pass_fds=(exit_r, ready_w, owner_fd), env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                start_new_session=True)
        except BaseException:
            for fd in (exit_w, ready_r, log):
                os.close(fd)
            raise
        finally:
            for fd in (exit_r, ready_w, owner_fd):
                os.close(fd)
        net = cls(proc, exit_w, log)
        try:
            await wait_ready(ready_r, proc, b"1", READY_TIMEOUT_S)
        except SandboxError:
            await net.stop()  # the log outlives it until closed below
            raise SandboxError(f"slirp4netns could not connect the sandbox's network "
                               f"(exit code {proc.returncode}): {net.log_tail()}") from None
        except BaseException:
            await net.stop()
            raise
        finally:
            os.close(ready_r)
            if net.exited() is not None:
                net.close()
        return net

    def exited(self) -> int | None:
        """slirp4netns's exit code once it has exited, else None."""
        return self._proc.returncode

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            size = os.fstat(self._log_fd).st_size
            start = max(0, size - _LOG_TAIL_BYTES)
            text = os.pread(self._log_fd, size - start, start).decode(errors="replace")
            return text.strip() or "no output"
        return "no output"

    async def stop(self) -> None:
        """Kill it (by pid) and reap it; idempotent."""
        if self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._proc.pid, signal.SIGKILL)
        await self._proc.wait()
        if self._exit_w >= 0:
            os.close(self._exit_w)
            self._exit_w = -1

    def close(self) -> None:
        """Release the log (after `stop`)."""
        if self._log_fd >= 0:
            os.close(self._log_fd)
            self._log_fd = -1
