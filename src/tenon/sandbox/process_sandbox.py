"""A live process-backend sandbox (`sandbox.process`): its commands, state and teardown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
import uuid
from pathlib import Path

from tenon.errors import SandboxDied, SandboxError, SandboxFrozen
from tenon.host import nsinspect, procfs, procs
from tenon.host.domain import SandboxCgroup
from tenon.sandbox import launcher
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
    signal_action,
)
from tenon.sandbox.base import (
    PERSISTENT_MOUNTS,
    ExecIO,
    ExecResult,
    ProcessInfo,
    SandboxSpec,
)
from tenon.sandbox.uids import IdRangeAllocator
from tenon.sandbox.usernet import UserNet
from tenon.sandbox.users import (
    UNKNOWN_USER_EXIT_CODE,
    ImageConfig,
    SandboxUser,
    UnknownUser,
    resolve_user,
)

logger = logging.getLogger(__name__)

SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
OUTPUT_GRACE_S = 0.05  # after an action exits, how long background holders may keep the pipe
_HELD_POLL_S = 0.02  # how often a SIGKILL asked for while the gate holds the sandbox looks again
# Mounts an action may write through besides the spec's disposable paths: the overlay root
# (its writes land in the persistent upper layer), the persistent directories, the two
# `nsinspect` lists (/dev/shm, /dev/mqueue), and two that hold no state of their own
# (/dev/pts: ptys of live processes; /proc). Anything else writable makes the
# leftover-state answer unknown.
_WRITABLE_MOUNTS = ("/", *PERSISTENT_MOUNTS.values(), nsinspect.SHM_DIR, nsinspect.MQUEUE_DIR,
                    "/dev/pts", "/proc")


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


def has_processes(cgroup: SandboxCgroup) -> bool:
    """Whether anything may still run in `cgroup` (True when that cannot be read)."""
    if not any(d.is_dir() for d in cgroup.dirs.values()):
        return False  # removed, so empty
    try:
        return bool(cgroup.pids())
    except OSError:
        return True


def enter_argv(pid: int, user: SandboxUser, cwd: str, inner: list[str]) -> list[str]:
    """The launcher's `enter` running `inner` as `user` in `cwd` inside the sandbox whose
    pid 1 is host pid `pid`."""
    return [str(launcher.LAUNCHER), "enter", "--pid", str(pid), "--uid", str(user.uid),
            "--gid", str(user.gid), "--groups", ",".join(map(str, user.groups)),
            *(("--root",) if user.is_root else ()), "--cwd", cwd, "--", *inner]
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
        """Signal the action's processes inside the sandbox (the launcher, outside it, is spared:
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
    """A live launcher sandbox."""

    def __init__(self, spec: SandboxSpec, cgroup: SandboxCgroup,
                 proc: asyncio.subprocess.Process, child_pid: int, out_fd: int,
                 id_base: int, ids: IdRangeAllocator, layers: tuple[Path, ...],
                 config: ImageConfig, usernet: UserNet | None = None) -> None:
        self._spec = spec
        self.cgroup = cgroup
        self._proc = proc  # the launcher's parent (host pid ns)
        self.child_pid = child_pid  # pid 1 of the sandbox pid namespace (the reaper)
        self._out_fd = out_fd  # launcher's stdout/stderr; kept open so late writes never SIGPIPE it
        self.id_base = id_base  # host ids id_base.. (held from `ids` until destroy is done)
        self._ids = ids
        self._layers = layers  # the overlay's upper and lower directories, topmost first
        self._config = config
        self._usernet = usernet  # slirp4netns, when the network is allowed
        self._destroyed = False

    @property
    def spec(self) -> SandboxSpec:
        return self._spec

    @property
    def cgroup_name(self) -> str:
        return self._spec.sandbox_id

    @property
    def root_pid(self) -> int:
        """A host pid whose /proc/<pid>/root is the sandbox's root (its pid 1)."""
        return self.child_pid

    @property
    def _own_pids(self) -> set[int]:
        own = {self._proc.pid, self.child_pid}
        return own if self._usernet is None else {*own, self._usernet.pid}

    def _ensure_usable(self) -> None:
        if self._destroyed:
            raise SandboxError(f"sandbox {self._spec.sandbox_id} was destroyed")
        if self._proc.returncode is not None or not procs.is_alive(self.child_pid):
            raise SandboxDied(f"sandbox {self._spec.sandbox_id}: its init exited "
                              f"(launcher exit code {self._proc.returncode}); "
                              f"rematerialize it")
        if self._usernet is not None and (code := self._usernet.exited()) is not None:
            raise SandboxDied(f"sandbox {self._spec.sandbox_id}: its network (slirp4netns) "
                              f"exited with code {code}: {self._usernet.log_tail()}; "
                              f"rematerialize it")
        if self.cgroup.is_frozen():
            raise SandboxFrozen(f"sandbox {self._spec.sandbox_id} is frozen by the gate")

    def _command(self, command: str, io: ExecIO | None) -> tuple[list[str], dict[str, str]]:
        """argv and environment of the launcher running `command` (as `io.user`)."""
        user = resolve_user(self._layers, io.user if io is not None else None)
        env = {"PATH": SANDBOX_PATH, "LANG": "C.UTF-8", **self._config.env,
               "HOME": user.home, **self._spec.env, EXEC_ID_VAR: uuid.uuid4().hex}
        workdir = self._config.workdir or PERSISTENT_MOUNTS["workspace"]
        # The client's cwd and variables apply inside the sandbox only: the host-side
        # launcher (and the cgroup entry before it) runs as root with `env` alone.
        inner = (["/bin/sh", "-c", command] if io is None
                 else cwd_env_argv(io.cwd or workdir, exec_env(io.env), command))
        argv = enter_cgroup_argv(self.cgroup.procs_files(),
                                 enter_argv(self.child_pid, user, workdir, inner))
        return argv, env

    async def exec(self, command: str, *, timeout_s: float,
                   max_output_bytes: int = 65536, io: ExecIO | None = None) -> ExecResult:
        self._ensure_usable()
        try:
            argv, env = self._command(command, io)
        except UnknownUser as exc:  # as `docker exec -u`: the command fails, the sandbox is fine
            message = f"{exc}\n".encode()
            if io is not None and io.on_stderr is not None:
                io.on_stderr(message)
            return ExecResult(exit_code=UNKNOWN_USER_EXIT_CODE, output=message.decode(),
                              truncated=False, duration_s=0.0)
        exec_id = env[EXEC_ID_VAR]
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
        """No file outside the writable mounts by construction (the root's writes land in
        the persistent upper layer; checked in the mount table: any other writable mount
        makes the answer None); /dev/shm files,
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
            # pid 1 first: the kernel then kills the whole pid namespace while every launcher
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
            self._ids.release(self.id_base)  # nothing runs in the range any more
        finally:
            if self._out_fd >= 0:
                os.close(self._out_fd)
                self._out_fd = -1
        logger.debug("sandbox %s destroyed", self._spec.sandbox_id)
