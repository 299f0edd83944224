"""The `process` backend: a bubblewrap namespace tree in its own cgroup, no daemon.

Each sandbox is one `bwrap` tree (new user, pid, mount, uts, ipc, cgroup and net
namespaces; outbound networking, when the spec allows it, through slirp4netns:
`sandbox.usernet`) over the base image's rootfs mounted read-only, with the agent's
persistent directories bound read-write at /workspace, HOME (/home/user) and /tmp, and
size-capped tmpfs at /dev/shm and at each path declared disposable.

bwrap runs as an unprivileged *host* uid of its own (`sandbox.uids`: one per live sandbox,
so per-user kernel limits such as inotify instances are per sandbox), so no sandbox process
is host root even inside its user namespace (a kuid-0 process could still write root-owned
sysctls or read /proc/kpage*); inside it appears as uid/gid 1000. The persistent root is
owned by that uid and 0700; an agent gets its previous uid back when it is free, so a
rebuild changes no owner.

Actions enter the namespaces with `nsenter`, as fresh processes placed in the sandbox
cgroup before they exec anything. Every sandbox process (the init and each action, right
after nsenter joined the namespaces) starts through the seccomp helper (`sandbox.seccomp`),
which loads the default filter and execs the command. Without an `ExecIO` an action's
stdout and stderr share one pipe and its stdin is /dev/null; with one, each stream has its
own pipe, stdin is a pipe when asked for, and the action's cwd and variables are applied
by a shell inside the sandbox (`_exec.CWD_ENV_SH`), never in the host-side helpers' root
environment.

`--die-with-parent` is set on purpose: a controller restart recovers agents from their
committed records and rematerializes sandboxes, so a sandbox outliving the controller
would only hold budget nobody accounts for. The kernel kills the whole pid namespace
(including exec'd actions) when bwrap's pid 1 dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import time
import uuid
from pathlib import Path

from tenon.errors import (
    BackendUnavailable,
    SandboxDied,
    SandboxError,
    SandboxFrozen,
    TenonError,
)
from tenon.host import nsinspect, procfs, procs
from tenon.host.domain import SandboxCgroup, WorkloadDomain
from tenon.sandbox import seccomp
from tenon.sandbox._exec import (
    EXEC_ID_VAR,
    ActionPipes,
    OutputBuffer,
    OutputCapture,
    StdinPipe,
    cwd_env_argv,
    describe,
    enter_cgroup_argv,
    exec_env,
    kill_action,
    read_child_pid,
    signal_action,
    wait_ready,
)
from tenon.sandbox.base import (
    DEFAULT_STATE_DIR,
    HOME_DIR,
    PERSISTENT_MOUNTS,
    BackendCapacity,
    ExecIO,
    ExecResult,
    ProcessInfo,
    SandboxSpec,
)
from tenon.sandbox.image import image_rootfs
from tenon.sandbox.ownership import hide_persistent_root, own_persistent_root
from tenon.sandbox.uids import UidAllocator, shared_allocator
from tenon.sandbox.usernet import NAMESERVER, UserNet, host_binds
from tenon.sandbox.usernet import connect as connect_network

logger = logging.getLogger(__name__)

DEFAULT_IMAGE = "tenon-base:bookworm"
SANDBOX_UID = 1000  # uid/gid inside the sandbox
SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# How long a new sandbox may take to answer before it counts as failed to start (which
# blocks a rebuilding agent): generous, since a loaded host (or an emulated one) can take
# seconds to set up namespaces and mounts, and a false failure costs an agent.
READY_TIMEOUT_S = 30.0
OUTPUT_GRACE_S = 0.05  # after an action exits, how long background holders may keep the pipe
_HELD_POLL_S = 0.02  # how often a SIGKILL asked for while the gate holds the sandbox looks again
_READY = b"tenon-ready\n"
# The sandbox's network namespace is made here, by root, so that the host's user namespace owns
# it and nothing in the sandbox can change its rules (`sandbox.netfilter`).
_STAGE_SH = ('ip link set lo up && mount --bind "$1" "$3" && mount --bind "$2" "$4" && shift 4 '
             '&& exec "$@"')
_INIT_SH = f"echo {_READY.decode().strip()}; exec sleep infinity </dev/null >/dev/null 2>&1"
# Mounts an action may write through besides the spec's disposable paths: the persistent
# directories, the two `nsinspect` lists (/dev/shm, /dev/mqueue), and two that hold no state
# of their own (/dev/pts: ptys of live processes; /proc). Anything else writable makes the
# leftover-state answer unknown.
_WRITABLE_MOUNTS = (*PERSISTENT_MOUNTS.values(), nsinspect.SHM_DIR, nsinspect.MQUEUE_DIR,
                    "/dev/pts", "/proc")


def _tools() -> dict[str, str | None]:
    return {name: shutil.which(name) for name in ("bwrap", "nsenter", "setpriv", "unshare")}


class ProcessBackend:
    """Materializes bubblewrap sandboxes under a workload domain."""

    name = "process"
    simulated = False

    def __init__(
        self,
        domain: WorkloadDomain,
        state_dir: Path = DEFAULT_STATE_DIR,
        *,
        uids: UidAllocator | None = None,
    ) -> None:
        self.domain = domain
        self.state_dir = state_dir
        self.uids = uids or shared_allocator()
        self._tools = _tools()
        self._slirp4netns = shutil.which("slirp4netns")
        self._stage = state_dir / "mnt"
        # Bound over /etc/resolv.conf when the network is allowed (slirp4netns's forwarder).
        self._resolv_conf = state_dir / "net" / "resolv.conf"

    def _ensure_stage(self) -> None:
        for point in ("root", "workspace"):
            (self._stage / point).mkdir(parents=True, exist_ok=True)
        if not self._resolv_conf.exists():
            self._resolv_conf.parent.mkdir(mode=0o755, exist_ok=True)
            self._resolv_conf.write_text(f"nameserver {NAMESERVER}\n")
            self._resolv_conf.chmod(0o644)
        for d in (self._stage, *self._stage.parents):
            if not d.stat().st_mode & 0o001:
                raise BackendUnavailable(
                    f"{d} is not searchable by the sandbox uids; "
                    f"run: chmod o+x {d}")

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
        problems = []
        packages = {"bwrap": "bubblewrap", "nsenter": "util-linux", "setpriv": "util-linux",
                    "unshare": "util-linux"}
        for tool, path in self._tools.items():
            if path is None:
                problems.append(f"{tool} is missing; run: apt-get install {packages[tool]}")
        try:
            image_rootfs(DEFAULT_IMAGE, self.state_dir)
            self._ensure_stage()
        except (TenonError, OSError) as exc:
            problems.append(str(exc))
        problems.extend(self.uids.check())
        problems.extend(seccomp.check())
        if self._slirp4netns is None:
            problems.append("slirp4netns is missing (sandboxes with network=True need it); "
                            "run: apt-get install slirp4netns")
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

    def _require_tools(self) -> dict[str, str]:
        missing = [t for t, p in self._tools.items() if p is None]
        if missing:
            raise BackendUnavailable(
                f"{', '.join(missing)} missing; run: apt-get install bubblewrap util-linux"
            )
        return {t: p for t, p in self._tools.items() if p is not None}

    def _bwrap_argv(self, tools: dict[str, str], rootfs: Path, spec: SandboxSpec,
                    info_fd: int, host_uid: int) -> list[str]:
        """bwrap runs as `host_uid`, which may not traverse the workspace's ancestors (e.g. a
        0700 parent): root first binds rootfs and workspace onto fixed staging points inside a
        private mount namespace (invisible to the host, gone with the sandbox)."""
        size = str(spec.tmp_size_bytes)
        staged = self._stage / "workspace"
        persistent = [arg for sub, target in PERSISTENT_MOUNTS.items()
                      for arg in ("--bind", str(staged / sub), target)]
        disposable = [arg for path in spec.disposable for arg in ("--size", size, "--tmpfs", path)]
        return [
            tools["unshare"], "--mount", "--net", "--propagation", "private", "--",
            "/bin/sh", "-c", _STAGE_SH, "tenon-stage", str(rootfs), str(spec.workspace),
            str(self._stage / "root"), str(self._stage / "workspace"),
            tools["setpriv"], f"--reuid={host_uid}", f"--regid={host_uid}",
            "--clear-groups", "--", tools["bwrap"],
            "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup",
            "--disable-userns", "--die-with-parent", "--new-session",
            "--hostname", "sandbox", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
            "--cap-drop", "ALL",
            "--ro-bind", str(self._stage / "root"), "/",
            "--ro-bind", str(seccomp.HELPER_DIR), seccomp.SANDBOX_HELPER_DIR,
            *(arg for host, target in host_binds(spec.network, self._resolv_conf)
              for arg in ("--ro-bind", host, target)),
            *persistent,
            "--proc", "/proc", "--dev", "/dev",
            "--size", size, "--tmpfs", nsinspect.SHM_DIR, "--mqueue", nsinspect.MQUEUE_DIR,
            "--remount-ro", "/dev",
            *disposable,
            "--chdir", "/workspace", "--clearenv",
            "--setenv", "PATH", SANDBOX_PATH, "--setenv", "HOME", HOME_DIR,
            "--info-fd", str(info_fd),
            "--", seccomp.SANDBOX_HELPER, "/bin/sh", "-c", _INIT_SH,
        ]

    async def materialize(self, spec: SandboxSpec) -> ProcessSandbox:
        tools = self._require_tools()
        seccomp.require()
        if spec.network and self._slirp4netns is None:
            raise BackendUnavailable("slirp4netns is missing (network=True needs it); "
                                     "run: apt-get install slirp4netns")
        rootfs = image_rootfs(spec.image, self.state_dir)
        # bwrap's mount points (the rootfs is bound read-only, so they must exist in it)
        for point in (*PERSISTENT_MOUNTS.values(), *spec.disposable,
                      seccomp.SANDBOX_HELPER_DIR,
                      *(t for h, t in host_binds(spec.network, self._resolv_conf)
                        if os.path.isdir(h))):
            (rootfs / point.lstrip("/")).mkdir(parents=True, exist_ok=True)
        self._ensure_stage()
        workspace = spec.workspace.resolve()
        try:
            # The root itself is root's between sandboxes (see destroy); its workspace/ keeps
            # the previous owner.
            previous_uid: int | None = (workspace / "workspace").lstat().st_uid
        except OSError:
            previous_uid = None
        host_uid = self.uids.acquire(previous_uid)
        try:
            await asyncio.to_thread(own_persistent_root, workspace, host_uid)
            spec_ws = dataclasses.replace(spec, workspace=workspace)
            cgroup = self.domain.sandbox(spec.sandbox_id)
        except BaseException:
            with contextlib.suppress(SandboxError):
                give_back_uid(self.uids, host_uid, workspace)
            raise
        try:
            if cgroup.pids():
                raise SandboxError(f"cgroup of {spec.sandbox_id} already has processes "
                                   f"{cgroup.pids()}; destroy the old sandbox first")
            cgroup.set_max_pids(spec.max_pids)
            return await self._start(tools, rootfs, spec, spec_ws, cgroup, host_uid)
        except BaseException:
            with contextlib.suppress(Exception):
                cgroup.remove()
            if not _has_processes(cgroup):  # else something may still run as the uid
                with contextlib.suppress(SandboxError):
                    give_back_uid(self.uids, host_uid, workspace)
            raise

    async def _start(self, tools: dict[str, str], rootfs: Path, spec: SandboxSpec,
                     spec_ws: SandboxSpec, cgroup: SandboxCgroup,
                     host_uid: int) -> ProcessSandbox:
        out_r, out_w = os.pipe()
        info_r, info_w = os.pipe()
        argv = enter_cgroup_argv(cgroup.procs_files(),
                                 self._bwrap_argv(tools, rootfs, spec_ws, info_w, host_uid))
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
            init_pid = _init_pid(cgroup, child_pid)
            for ns in ("mnt", "net"):
                if procfs.shares_namespace(child_pid, ns):
                    raise SandboxError(f"sandbox {spec.sandbox_id} did not get its own "
                                       f"{ns} namespace")
            usernet = None
            if spec.network and self._slirp4netns is not None:
                usernet = await connect_network(spec.network, self._slirp4netns,
                                                tools["nsenter"], child_pid, cgroup.procs_files())
        except BaseException:
            os.close(out_r)
            cgroup.kill_all()
            await proc.wait()
            raise
        finally:
            os.close(info_r)
        logger.debug("sandbox %s ready: bwrap %d, pid1 %d, init %d",
                     spec.sandbox_id, proc.pid, child_pid, init_pid)
        return ProcessSandbox(spec, cgroup, proc, child_pid, init_pid, out_r, tools,
                              host_uid, self.uids, usernet)


async def _wait_running(proc: asyncio.subprocess.Process, cgroup: SandboxCgroup,
                        start: float, timeout_s: float) -> bool:
    """Wait for `proc` until `timeout_s` of running time (held time excluded); False on
    timeout."""
    waiter = asyncio.ensure_future(proc.wait())
    held_at_start = cgroup.held_s()
    try:
        while True:
            running_s = time.perf_counter() - start - (cgroup.held_s() - held_at_start)
            remaining = timeout_s - running_s
            if remaining <= 0:
                return False
            done, _ = await asyncio.wait({waiter}, timeout=remaining)
            if done:
                return True
    finally:
        if not waiter.done():
            waiter.cancel()


def give_back_uid(uids: UidAllocator, uid: int, root: Path) -> None:
    """Release `uid` once nothing runs as it. It may go to another agent next, so the
    persistent root first goes back to root (0700); if that fails the uid is kept
    (SandboxError), since nobody else may hold it while it owns a way in."""
    try:
        hide_persistent_root(root)
    except FileNotFoundError:
        pass  # the workspace is gone already
    except OSError as exc:
        raise SandboxError(f"cannot take {root} back from uid {uid}: {exc}") from exc
    uids.release(uid)


def _has_processes(cgroup: SandboxCgroup) -> bool:
    """Whether anything may still run in `cgroup` (True when that cannot be read)."""
    if not any(d.is_dir() for d in cgroup.dirs.values()):
        return False  # removed, so empty
    try:
        return bool(cgroup.pids())
    except OSError:
        return True


def _init_pid(cgroup: SandboxCgroup, child_pid: int) -> int:
    """The init (`sleep infinity`): pid 1's only child right after readiness."""
    for pid in cgroup.pids():
        info = procs.process_info(pid)
        if info is not None and info.ppid == child_pid:
            return pid
    raise SandboxDied(f"sandbox init under pid {child_pid} is gone")


class _ProcessControl:
    """`ExecControl` of one running action; inert once the action's exec has returned."""

    def __init__(self, sandbox: ProcessSandbox, proc: asyncio.subprocess.Process,
                 exec_id: str, stdin: StdinPipe | None) -> None:
        self._sandbox = sandbox
        self._proc = proc
        self._exec_id = exec_id
        self._stdin = stdin
        self._done = False

    async def write_stdin(self, data: bytes) -> None:
        if self._stdin is None:
            raise SandboxError("the command was started without stdin")
        await self._stdin.write(data)

    async def close_stdin(self) -> None:
        if self._stdin is not None:
            self._stdin.close()

    async def signal(self, signum: int) -> None:
        """Signal the action's processes inside the sandbox (nsenter, outside it, is spared:
        it reaps the action's shell). For SIGKILL, then wait until the whole tree is gone
        (`kill_action`), after the gate lets the sandbox go if it holds it (a frozen
        process only dies once thawed)."""
        if self._done:
            return
        sandbox, root_pid = self._sandbox, self._proc.pid
        try:
            signal_action(root_pid, sandbox.cgroup.pids(), self._exec_id, signum,
                          exclude={*sandbox._own_pids, root_pid})
            if signum != signal.SIGKILL:
                return
            while not self._done and sandbox.cgroup.is_frozen():  # noqa: ASYNC110 - the freezer
                await asyncio.sleep(_HELD_POLL_S)
        except OSError:  # the cgroup is gone, and the action with the sandbox
            return
        if not self._done:
            await kill_action(root_pid, sandbox.cgroup.pids, self._exec_id,
                              exclude=sandbox._own_pids)

    def finish(self) -> None:
        """The action is over: stdin gets EOF, writes fail, signals are ignored."""
        self._done = True
        if self._stdin is not None:
            self._stdin.close()


class ProcessSandbox:
    """A live bubblewrap sandbox."""

    def __init__(self, spec: SandboxSpec, cgroup: SandboxCgroup,
                 proc: asyncio.subprocess.Process, child_pid: int, init_pid: int,
                 out_fd: int, tools: dict[str, str], host_uid: int,
                 uids: UidAllocator, usernet: UserNet | None = None) -> None:
        self._spec = spec
        self.cgroup = cgroup
        self._proc = proc  # outer bwrap (host pid ns)
        self.child_pid = child_pid  # bwrap's pid 1 of the sandbox pid namespace (reaper)
        self.init_pid = init_pid
        self._out_fd = out_fd  # bwrap's stdout/stderr; kept open so late writes never SIGPIPE it
        self._tools = tools
        self.host_uid = host_uid  # held from `uids` until destroy has killed every process
        self._uids = uids
        self._usernet = usernet  # slirp4netns, when the network is allowed
        self._destroyed = False

    @property
    def spec(self) -> SandboxSpec:
        return self._spec

    @property
    def cgroup_name(self) -> str:
        return self._spec.sandbox_id

    @property
    def _own_pids(self) -> set[int]:
        own = {self._proc.pid, self.child_pid, self.init_pid}
        return own if self._usernet is None else {*own, self._usernet.pid}

    def _ensure_usable(self) -> None:
        if self._destroyed:
            raise SandboxError(f"sandbox {self._spec.sandbox_id} was destroyed")
        if self._proc.returncode is not None or not procs.is_alive(self.init_pid):
            raise SandboxDied(f"sandbox {self._spec.sandbox_id}: its init exited "
                              f"(bwrap exit code {self._proc.returncode}); rematerialize it")
        if self._usernet is not None and (code := self._usernet.exited()) is not None:
            raise SandboxDied(f"sandbox {self._spec.sandbox_id}: its network (slirp4netns) "
                              f"exited with code {code}: {self._usernet.log_tail()}; "
                              f"rematerialize it")
        if self.cgroup.is_frozen():
            raise SandboxFrozen(f"sandbox {self._spec.sandbox_id} is frozen by the gate")

    async def exec(self, command: str, *, timeout_s: float,
                   max_output_bytes: int = 65536, io: ExecIO | None = None) -> ExecResult:
        self._ensure_usable()
        exec_id = uuid.uuid4().hex
        env = {"PATH": SANDBOX_PATH, "HOME": HOME_DIR, "LANG": "C.UTF-8",
               **self._spec.env, EXEC_ID_VAR: exec_id}
        # The client's cwd and variables apply inside the sandbox only: the host-side
        # helpers (the cgroup entry, setpriv, nsenter) run as root with `env` alone.
        inner = (["/bin/sh", "-c", command] if io is None
                 else cwd_env_argv(io.cwd or PERSISTENT_MOUNTS["workspace"], exec_env(io.env),
                                   command))
        argv = enter_cgroup_argv(self.cgroup.procs_files(), [
            self._tools["setpriv"], "--no-new-privs", "--", self._tools["nsenter"],
            "-t", str(self.child_pid), "-U", "-m", "-p", "-n", "-u", "-i", "-C",
            "-r", "--wdns=/workspace", "-S", str(SANDBOX_UID), "-G", str(SANDBOX_UID),
            "--", seccomp.SANDBOX_HELPER, *inner,
        ])
        start = time.perf_counter()
        output = OutputBuffer(max_output_bytes)
        with ActionPipes(separate=io is not None, stdin=io is not None and io.stdin) as pipes:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=pipes.child_stdin, stdout=pipes.child_out, stderr=pipes.child_err,
                env=env, start_new_session=True,
            )
            captures = [OutputCapture(pipes.take_out(), output, io.on_stdout if io else None)]
            if io is not None:
                captures.append(OutputCapture(pipes.take_err(), output, io.on_stderr))
            stdin = pipes.take_stdin()
        control = _ProcessControl(self, proc, exec_id, stdin)
        timed_out = False
        try:
            if io is not None and io.on_start is not None:
                io.on_start(control)
            timed_out = not await _wait_running(proc, self.cgroup, start, timeout_s)
            if timed_out:
                await kill_action(proc.pid, self.cgroup.pids, exec_id, exclude=self._own_pids)
                await proc.wait()
            await asyncio.gather(*(c.wait_eof(OUTPUT_GRACE_S) for c in captures))
        except BaseException:  # cancelled: leave nothing of the action behind
            with contextlib.suppress(OSError):
                self.cgroup.thaw()  # a held action cannot die of SIGKILL until thawed
            await asyncio.shield(kill_action(proc.pid, self.cgroup.pids, exec_id,
                                             exclude=self._own_pids))
            raise
        finally:
            control.finish()
            for capture in captures:
                capture.close()
        code = proc.returncode if proc.returncode is not None else -9
        if code == 125 and not timed_out and self._proc.returncode is not None:
            raise SandboxDied(f"sandbox {self._spec.sandbox_id} died during the action")
        return ExecResult(exit_code=code, output=output.text(), truncated=output.truncated,
                          duration_s=time.perf_counter() - start, timed_out=timed_out)

    def processes(self) -> list[ProcessInfo]:
        if self._destroyed:
            return []
        return describe(pid for pid in self.cgroup.pids() if pid not in self._own_pids)

    def leftover_state(self) -> list[str] | None:
        """No file outside the writable mounts by construction (read-only root, checked in
        the mount table: any other writable mount makes the answer None); /dev/shm files,
        POSIX and SysV IPC objects and sockets of the sandbox's namespaces are listed."""
        if self._destroyed:
            return None
        writable = (*_WRITABLE_MOUNTS, *self._spec.disposable)
        try:
            for mount in procfs.mount_table(self.child_pid):
                if not mount.writable:
                    continue
                point = mount.mount_point
                allowed = any(point == m or point.startswith(m + "/") for m in writable)
                device_node = point.startswith("/dev/") and mount.fs_type == "devtmpfs"
                if not (allowed or device_node):
                    logger.warning("sandbox %s: unexpected writable mount %s",
                                   self._spec.sandbox_id, point)
                    return None
            return nsinspect.namespace_state(self.child_pid)
        except (OSError, IndexError) as exc:
            logger.warning("sandbox %s: cannot list leftover state: %s",
                           self._spec.sandbox_id, exc)
            return None

    async def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        try:
            # pid 1 first: the kernel then kills the whole pid namespace while every nsenter
            # is still alive to reap its child (see _exec.kill_action).
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.child_pid, signal.SIGKILL)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._proc.wait(), 2.0)
            if self._usernet is not None:
                await self._usernet.stop()
                self._usernet.close()
            await asyncio.to_thread(self.cgroup.kill_all)
            await self._proc.wait()
            await asyncio.to_thread(self.cgroup.remove)
            give_back_uid(self._uids, self.host_uid, self._spec.workspace)
        finally:
            if self._out_fd >= 0:
                os.close(self._out_fd)
                self._out_fd = -1
        logger.debug("sandbox %s destroyed", self._spec.sandbox_id)
