"""Outbound networking for a sandbox's private network namespace, through slirp4netns.

A sandbox always has its own network namespace, owned by the host's initial user namespace
(created by root before the sandbox starts), so nothing inside the sandbox can reconfigure
it. When its policy lets it reach anything (`netpolicy.NetworkPolicy`), `connect` first loads
the policy's nftables rules into that namespace (`netfilter`), then starts slirp4netns
(user-mode TCP/IP in a host process), which gives it a tap device with 10.0.2.100/24, gateway
10.0.2.2 and DNS 10.0.2.3, and relays its connections from the host's network namespace as
ordinary sockets. `--disable-host-loopback` refuses connections to the host's 127.0.0.1
through 10.0.2.2; the rules deny the host's private networks besides, unless allowed
explicitly. The sandbox's own 127.0.0.1 is its own loopback.

slirp4netns runs as host root and joins the namespace by path (no user namespace to enter),
so opening /dev/net/tun works whatever the node's mode (0666 as Debian's udev makes it, or
0600). `--enable-sandbox` then moves it into a mount namespace of its own on an empty root
and drops every capability; `--enable-seccomp` filters its syscalls. It runs in the sandbox's
cgroup (its memory is the sandbox's) and exits when the write end of its exit pipe closes: at
destroy, or when the controller dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import tempfile
from collections.abc import Iterable
from pathlib import Path

from tenon.errors import SandboxError
from tenon.host import procfs
from tenon.sandbox import netfilter
from tenon.sandbox._exec import enter_cgroup_argv, wait_ready
from tenon.sandbox.netpolicy import NetworkPolicy

logger = logging.getLogger(__name__)

NAMESERVER = "10.0.2.3"  # slirp4netns's DNS forwarder, as the sandbox's resolv.conf names it
READY_TIMEOUT_S = 10.0
_MTU = 65520  # slirp4netns's maximum: fewer, larger packets through the user-mode stack
_LOG_TAIL_BYTES = 2000
TUN_DEVICE = "/dev/net/tun"


async def connect(policy: NetworkPolicy, slirp4netns: str, nsenter: str, target_pid: int,
                  procs_files: Iterable[Path]) -> UserNet | None:
    """Load `policy` into the network namespace of `target_pid`, then connect it to the
    outside when the policy reaches anything (else only the rules: loopback alone)."""
    await asyncio.to_thread(netfilter.enforce, nsenter, target_pid, policy, (NAMESERVER,))
    if not policy:
        return None
    return await UserNet.start(slirp4netns, target_pid, procs_files)


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
    async def start(cls, slirp4netns: str, target_pid: int,
                    procs_files: Iterable[Path]) -> UserNet:
        """Connect the network namespace of `target_pid`; return once it is configured."""
        net_fd = procfs.open_namespace(target_pid, "net")
        exit_r, exit_w = os.pipe()
        ready_r, ready_w = os.pipe()
        log = os.open(tempfile.gettempdir(), os.O_TMPFILE | os.O_RDWR, 0o600)
        argv = enter_cgroup_argv(procs_files, [
            slirp4netns, "--configure", f"--mtu={_MTU}", "--disable-host-loopback",
            "--enable-sandbox", "--enable-seccomp", f"--exit-fd={exit_r}",
            f"--ready-fd={ready_w}", "--netns-type=path", f"/proc/self/fd/{net_fd}", "tap0",
        ])
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
                pass_fds=(exit_r, ready_w, net_fd), env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                start_new_session=True)
        except BaseException:
            for fd in (exit_w, ready_r, log):
                os.close(fd)
            raise
        finally:
            for fd in (exit_r, ready_w, net_fd):
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


# The host's CA bundle, so TLS through an intercepting egress proxy that the host trusts
# verifies inside the sandbox too (the image's own bundle may lack the proxy's CA).
HOST_CERTS = "/etc/ssl/certs"


def host_binds(policy: NetworkPolicy, resolv_conf: Path) -> list[tuple[str, str]]:
    """(host path, sandbox path) pairs bound read-only into a sandbox that has a network:
    the resolver's address and the host's CA certificates."""
    if not policy:
        return []
    binds = [(str(resolv_conf), "/etc/resolv.conf")]
    if os.path.isdir(HOST_CERTS):
        binds.append((HOST_CERTS, HOST_CERTS))
    return binds
