"""The `process` backend: a namespace tree in its own cgroup, started by Tenon's launcher.

Each sandbox is one tree started by the static launcher (`sandbox.launcher`, `launch.c`):
new user, pid, mount, uts, ipc, cgroup and net namespaces (outbound networking, when the
spec allows it, through slirp4netns: `sandbox.usernet`). Its user namespace maps ids
0..65535 onto a host range of its own (`sandbox.uids.IdRangeAllocator`: no other live
sandbox shares it, an agent gets its previous range back when free), so root inside is
never root outside, nor any other sandbox's user.

The root is writable: an overlay whose lower layer is the image's rootfs (read-only,
shared by every sandbox) and whose upper layer is the agent's persistent root's `upper/`
(`base.OVERLAY_UPPER_DIR`), so writes to /etc, /usr, ... stay the agent's and count
against its disk limit. The persistent directories are bound on top (/workspace, HOME,
/tmp), size-capped tmpfs at /dev/shm and at each path declared disposable. Image and
persistent root are attached through idmapped mounts: on disk every file keeps its
canonical id (0..65535, as the sandbox sees it), and a rebuild under another range
changes no owner.

Commands run as the unprivileged default user (uid/gid 1000, HOME /home/user) unless
`ExecIO.user` names another user of the sandbox's /etc/passwd; "root" runs as uid 0 with
Docker's default capabilities (in the sandbox's user namespace only). Every command enters
through the launcher's `enter` mode as a fresh process placed in the sandbox cgroup before
it execs anything; it sets no_new_privs and loads the default seccomp filter
(`sandbox.seccomp`) last. Without an `ExecIO` an action's stdout and stderr share one pipe
and its stdin is /dev/null; with one, each stream has its own pipe, stdin is a pipe when
asked for, and the action's cwd and variables are applied by a shell inside the sandbox
(`_exec.CWD_ENV_SH`), never in the host-side launcher's environment. The image's variables
and working directory (image.json "config") apply to every command.

The sandbox dies with its controller on purpose: a controller restart recovers agents from
their committed records and rematerializes sandboxes, so a sandbox outliving the
controller would only hold budget nobody accounts for. The launcher's pid 1 (a reaper
without capabilities) dies with the launcher, and the kernel then kills the whole pid
namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
from pathlib import Path

from tenon.errors import BackendUnavailable, SandboxError, TenonError
from tenon.host import procfs
from tenon.host.domain import SandboxCgroup, WorkloadDomain
from tenon.sandbox import launcher
from tenon.sandbox._exec import enter_cgroup_argv, read_child_pid, wait_ready
from tenon.sandbox.base import DEFAULT_STATE_DIR, BackendCapacity, SandboxSpec
from tenon.sandbox.images import image_rootfs
from tenon.sandbox.ownership import prepare_canonical_root
from tenon.sandbox.process_sandbox import ProcessSandbox, has_processes
from tenon.sandbox.uids import IdRangeAllocator, shared_range_allocator
from tenon.sandbox.usernet import NAMESERVER, host_binds
from tenon.sandbox.usernet import connect as connect_network
from tenon.sandbox.users import image_config

logger = logging.getLogger(__name__)

DEFAULT_IMAGE = "tenon-base:bookworm"
# How long a new sandbox may take to answer before it counts as failed to start (which
# blocks a rebuilding agent): generous, since a loaded host (or an emulated one) can take
# seconds to set up namespaces and mounts, and a false failure costs an agent.
READY_TIMEOUT_S = 30.0
_READY = b"tenon-ready\n"
# The persistent root's extended attribute naming the id range its last sandbox used.
_ID_BASE_XATTR = "trusted.tenon.id_base"


class ProcessBackend:
    """Materializes launcher sandboxes under a workload domain."""

    name = "process"
    simulated = False

    def __init__(
        self,
        domain: WorkloadDomain,
        state_dir: Path = DEFAULT_STATE_DIR,
        *,
        ids: IdRangeAllocator | None = None,
    ) -> None:
        self.domain = domain
        self.state_dir = state_dir
        self.ids = ids or shared_range_allocator()
        self._slirp4netns = shutil.which("slirp4netns")
        self._nsenter = shutil.which("nsenter")  # loads the network rules (`netfilter`)
        self._stage = state_dir / "mnt"
        # Bound over /etc/resolv.conf when the network is allowed (slirp4netns's forwarder).
        self._resolv_conf = state_dir / "net" / "resolv.conf"

    def _ensure_stage(self) -> None:
        (self._stage / "root").mkdir(parents=True, exist_ok=True)
        if not self._resolv_conf.exists():
            self._resolv_conf.parent.mkdir(mode=0o755, exist_ok=True)
            self._resolv_conf.write_text(f"nameserver {NAMESERVER}\n")
            self._resolv_conf.chmod(0o644)
        for d in (self._stage / "root", *self._stage.parents):
            if not d.stat().st_mode & 0o001:
                raise BackendUnavailable(
                    f"{d} is not searchable by the sandbox ids; run: chmod o+x {d}")

    def capacity(self) -> BackendCapacity:
        """No limit beyond memory: an action is a process the kernel runs, no daemon
        serves it."""
        return BackendCapacity()

    def remove_leftovers(self, sandbox_prefix: str = "") -> list[str]:
        """Nothing: a sandbox is its cgroup's processes, which the domain's removal kills."""
        return []

    def release_domain(self) -> None:
        """Nothing: every sandbox lives inside the domain."""

    def image_root(self, image: str) -> Path | None:
        """The image's unpacked root filesystem under the state directory, if built."""
        try:
            return image_rootfs(image, self.state_dir)
        except Exception:  # noqa: BLE001 - no rootfs: paths outside the mounts read as absent
            return None

    def check(self) -> list[str]:
        problems = list(launcher.check())
        try:
            image_rootfs(DEFAULT_IMAGE, self.state_dir)
            self._ensure_stage()
        except (TenonError, OSError) as exc:
            problems.append(str(exc))
        problems.extend(self.ids.check())
        if self._slirp4netns is None:
            problems.append("slirp4netns is missing (sandboxes with network=True need it); "
                            "run: apt-get install slirp4netns")
        if self._nsenter is None:
            problems.append("nsenter is missing (it loads network rules); "
                            "run: apt-get install util-linux")
        for controller in ("memory", "pids", "freezer"):
            if controller not in self.domain.layout.mounts and not (
                controller == "freezer" and self.domain.layout.version.value == "v2"
            ):
                problems.append(
                    f"cgroup controller {controller} is not available; mount/enable it "
                    f"(see: tenon doctor)"
                )
        max_userns = procfs.max_user_namespaces()
        if max_userns is not None and max_userns < 1:
            problems.append(
                "user namespaces are disabled; run: sysctl user.max_user_namespaces=15000"
            )
        return problems

    def _start_argv(self, rootfs: Path, spec: SandboxSpec, info_fd: int,
                    id_base: int) -> list[str]:
        size = str(spec.tmp_size_bytes)
        return [
            str(launcher.LAUNCHER), "start", "--id-base", str(id_base),
            "--rootfs", str(rootfs), "--persist", str(spec.workspace),
            "--stage", str(self._stage / "root"), "--info-fd", str(info_fd),
            "--shm-bytes", size, "--tmp-bytes", size,
            *(arg for host, target in host_binds(spec.network, self._resolv_conf)
              for arg in ("--ro-bind", host, target)),
            *(arg for path in spec.disposable for arg in ("--disposable", path)),
        ]

    async def materialize(self, spec: SandboxSpec) -> ProcessSandbox:
        launcher.require()
        if spec.network and (self._slirp4netns is None or self._nsenter is None):
            raise BackendUnavailable("slirp4netns or nsenter is missing (networking needs "
                                     "them); run: apt-get install slirp4netns util-linux")
        rootfs = image_rootfs(spec.image, self.state_dir)
        self._ensure_stage()
        workspace = spec.workspace.resolve()
        await asyncio.to_thread(prepare_canonical_root, workspace)
        id_base = self.ids.acquire(_previous_id_base(workspace))
        try:
            _record_id_base(workspace, id_base)
            spec_ws = dataclasses.replace(spec, workspace=workspace)
            cgroup = self.domain.sandbox(spec.sandbox_id)
        except BaseException:
            self.ids.release(id_base)
            raise
        try:
            if cgroup.pids():
                raise SandboxError(f"cgroup of {spec.sandbox_id} already has processes "
                                   f"{cgroup.pids()}; destroy the old sandbox first")
            cgroup.set_max_pids(spec.max_pids)
            return await self._start(rootfs, spec_ws, cgroup, id_base)
        except BaseException:
            with contextlib.suppress(Exception):
                cgroup.remove()
            if not has_processes(cgroup):  # else something may still run in the range
                self.ids.release(id_base)
            raise

    async def _start(self, rootfs: Path, spec: SandboxSpec, cgroup: SandboxCgroup,
                     id_base: int) -> ProcessSandbox:
        out_r, out_w = os.pipe()
        info_r, info_w = os.pipe()
        argv = enter_cgroup_argv(cgroup.procs_files(),
                                 self._start_argv(rootfs, spec, info_w, id_base))
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=out_w, stderr=out_w,
                pass_fds=(info_w,), env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                start_new_session=True,
            )
        except BaseException:
            os.close(out_r)
            os.close(info_r)
            raise
        finally:
            for fd in (out_w, info_w):
                os.close(fd)
        try:
            await wait_ready(out_r, proc, _READY, READY_TIMEOUT_S)
            child_pid = read_child_pid(info_r)
            for ns in ("mnt", "net", "user"):
                if procfs.shares_namespace(child_pid, ns):
                    raise SandboxError(f"sandbox {spec.sandbox_id} did not get its own "
                                       f"{ns} namespace")
            usernet = None
            if spec.network and self._slirp4netns is not None and self._nsenter is not None:
                usernet = await connect_network(spec.network, self._slirp4netns,
                                                self._nsenter, child_pid, cgroup.procs_files())
        except BaseException:
            os.close(out_r)
            cgroup.kill_all()
            await proc.wait()
            raise
        finally:
            os.close(info_r)
        logger.debug("sandbox %s ready: launcher %d, pid1 %d, ids from %d",
                     spec.sandbox_id, proc.pid, child_pid, id_base)
        config = image_config(rootfs.parent / "image.json")
        return ProcessSandbox(spec, cgroup, proc, child_pid, out_r, id_base, self.ids,
                              (spec.workspace / "upper", rootfs), config, usernet)


def _previous_id_base(root: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(os.getxattr(root, _ID_BASE_XATTR))
    return None


def _record_id_base(root: Path, id_base: int) -> None:
    with contextlib.suppress(OSError):  # only a preference for next time
        os.setxattr(root, _ID_BASE_XATTR, str(id_base).encode())
