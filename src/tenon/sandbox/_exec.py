"""Helpers for running actions: the action's process tree (via host.procs), bounded output."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from tenon.errors import SandboxError
from tenon.host import procs
from tenon.sandbox.base import ProcessInfo

logger = logging.getLogger(__name__)

EXEC_ID_VAR = "TENON_EXEC_ID"
_READ_CHUNK_BYTES = 65536
# Puts itself into every cgroup.procs given (count first), then execs the rest of argv.
# The process is inside the cgroup before it can start anything, so every descendant is too.
ENTER_CGROUP_SH = (
    'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; shift; n=$((n-1)); done; '
    'exec "$@"'
)


def enter_cgroup_argv(procs_files: Iterable[Path], argv: list[str]) -> list[str]:
    files = [str(f) for f in procs_files]
    return ["/bin/sh", "-c", ENTER_CGROUP_SH, "tenon-enter", str(len(files)), *files, *argv]


def describe(pids: Iterable[int]) -> list[ProcessInfo]:
    """The live ones among `pids`, as the Protocol reports them."""
    infos = (procs.process_info(pid) for pid in pids)
    return [ProcessInfo(host_pid=i.pid, ppid=i.ppid, command=i.command) for i in infos if i]


def action_pids(root_pid: int, candidates: Iterable[int], exec_id: str) -> set[int]:
    """The action's processes among `candidates`: `root_pid`, its descendants by ppid chain,
    and any process carrying the action's exec id (daemons reparented to the sandbox init)."""
    parents: dict[int, int] = {}
    for pid in candidates:
        if (info := procs.process_info(pid)) is not None:
            parents[pid] = info.ppid
    found = {root_pid} if root_pid in parents or procs.exists(root_pid) else set()
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    stack = [root_pid]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    found.update(
        pid for pid in parents
        if pid not in found and procs.read_environ_token(pid, EXEC_ID_VAR) == exec_id
    )
    return found


async def kill_action(
    root_pid: int,
    candidates: Callable[[], Iterable[int]],
    exec_id: str,
    *,
    exclude: set[int],
    timeout_s: float = 5.0,
) -> None:
    """SIGKILL the action's whole tree until none of it is left, not even a zombie.

    `root_pid` (nsenter, outside the sandbox's pid namespace) goes last: it reaps the action's
    shell. Killed first, it would hand that shell to the *host's* reaper, which may never reap
    it. No SIGSTOP: nsenter stops itself when its child stops, and would then never reap it.
    A fork loop cannot outrun the repeated kills for long: the pids limit bounds it.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    seen: set[int] = set()
    while True:
        pids = action_pids(root_pid, candidates(), exec_id) - exclude
        inside = pids - {root_pid}
        seen |= inside
        # Orphans reparented to the sandbox's pid 1 leave the ppid chain, and as zombies lose
        # their environ: wait for every pid ever seen to be reaped, not just the visible ones.
        if not inside and not any(map(procs.exists, seen)):
            break
        # parents first: a shell killed after its children could exit normally in between
        procs.kill_pids(parents_first(p for p in inside if procs.is_alive(p)), signal.SIGKILL)
        if loop.time() > deadline:
            logger.warning("action %s: pids %s survived SIGKILL", exec_id, sorted(pids))
            break
        await asyncio.sleep(0.002)
    procs.kill_pids([root_pid], signal.SIGKILL)


class OutputBuffer:
    """An action's output as `ExecResult` reports it: every stream's chunks in arrival
    order, keeping at most `max_bytes` (the rest is counted as truncated, never stored)."""

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max(max_bytes, 0)
        self._buf = bytearray()
        self.truncated = False

    def add(self, data: bytes) -> None:
        room = self._max_bytes - len(self._buf)
        if len(data) > room:
            self.truncated = True
        if room > 0:
            self._buf += data[:room]

    def text(self) -> str:
        return self._buf.decode(errors="replace")


class OutputCapture:
    """Drains a pipe's read end into `sink`, handing each chunk to `on_chunk` (in the event
    loop, as it arrives); never stops reading, so the writer never blocks on a full pipe.
    An exception from `on_chunk` is logged and the draining goes on."""

    def __init__(self, read_fd: int, sink: OutputBuffer,
                 on_chunk: Callable[[bytes], None] | None = None) -> None:
        self._fd = read_fd
        self._sink = sink
        self._on_chunk = on_chunk
        self._loop = asyncio.get_running_loop()
        self._eof: asyncio.Future[None] = self._loop.create_future()
        os.set_blocking(read_fd, False)
        self._loop.add_reader(read_fd, self._on_readable)

    def _on_readable(self) -> None:
        self._read_once()

    def _read_once(self) -> bool:
        """Read one chunk; False when nothing was ready (or the pipe hit EOF and is closed)."""
        try:
            data = os.read(self._fd, _READ_CHUNK_BYTES)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if not data:
            self._release()
            return False
        self._sink.add(data)
        if self._on_chunk is not None:
            try:
                self._on_chunk(data)
            except Exception:
                logger.exception("an output callback failed; the output is still captured")
        return True

    async def wait_eof(self, timeout_s: float) -> bool:
        """Wait for every writer to close; False when some (a background process) still holds it."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._eof), timeout_s)
        return self._eof.done()

    def close(self) -> None:
        """Stop reading, after taking what is already buffered in the pipe."""
        for _ in range(256):
            if self._fd < 0 or not self._read_once():
                break
        self._release()

    def _release(self) -> None:
        if self._fd < 0:
            return
        self._loop.remove_reader(self._fd)
        os.close(self._fd)
        self._fd = -1
        if not self._eof.done():
            self._eof.set_result(None)


class StdinPipe:
    """The write end of an action's stdin pipe, written without blocking the event loop.

    Writes wait while the pipe is full (the command, or the gate holding it, sets the pace);
    after `close` (EOF for the command) or once nothing reads the pipe any more, a write
    raises SandboxError.
    """

    def __init__(self, write_fd: int) -> None:
        self._fd = write_fd
        self._loop = asyncio.get_running_loop()
        self._lock = asyncio.Lock()
        self._waiter: asyncio.Future[None] | None = None
        os.set_blocking(write_fd, False)

    async def write(self, data: bytes) -> None:
        async with self._lock:  # concurrent writes never interleave their bytes
            view = memoryview(data)
            while view:
                if self._fd < 0:
                    raise SandboxError("the command's stdin is closed")
                try:
                    view = view[os.write(self._fd, view):]
                except BlockingIOError:
                    await self._writable()
                except (BrokenPipeError, ConnectionResetError) as exc:
                    raise SandboxError("the command no longer reads its stdin") from exc

    async def _writable(self) -> None:
        waiter = self._waiter = self._loop.create_future()

        def ready() -> None:
            if not waiter.done():
                waiter.set_result(None)

        self._loop.add_writer(self._fd, ready)
        try:
            await waiter
        finally:
            self._waiter = None
            if self._fd >= 0:
                self._loop.remove_writer(self._fd)

    def close(self) -> None:
        """Close the write end (idempotent); a write waiting for room fails."""
        if self._fd < 0:
            return
        self._loop.remove_writer(self._fd)
        os.close(self._fd)
        self._fd = -1
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(SandboxError("the command's stdin was closed"))


class ActionPipes:
    """An action's pipes: stdout and stderr (one pipe for both unless `separate`), and stdin
    (/dev/null unless `stdin`). Leaving the block closes the child's ends, and the parent's
    ends nobody took (spawning failed)."""

    def __init__(self, *, separate: bool, stdin: bool) -> None:
        self._fds: list[int] = []
        self._out_r, self.child_out = self._pipe()
        self._err_r, self.child_err = self._pipe() if separate else (-1, self.child_out)
        self.child_stdin: int = asyncio.subprocess.DEVNULL
        self._in_w = -1
        if stdin:
            self.child_stdin, self._in_w = self._pipe()

    def _pipe(self) -> tuple[int, int]:
        read_fd, write_fd = os.pipe()
        self._fds += [read_fd, write_fd]
        return read_fd, write_fd

    def _take(self, fd: int) -> int:
        self._fds.remove(fd)
        return fd

    def take_out(self) -> int:
        return self._take(self._out_r)

    def take_err(self) -> int:
        return self._take(self._err_r)

    def take_stdin(self) -> StdinPipe | None:
        return StdinPipe(self._take(self._in_w)) if self._in_w >= 0 else None

    def __enter__(self) -> ActionPipes:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def exec_env(env: Mapping[str, str]) -> dict[str, str]:
    """A command's own variables, checked: POSIX names, no NUL in a value. The action's
    exec id is the runtime's and is dropped (the kill of a timed-out tree relies on it)."""
    for name, value in env.items():
        if not _ENV_NAME.fullmatch(name):
            raise SandboxError(f"invalid environment variable name {name!r}")
        if "\0" in value:
            raise SandboxError(f"environment variable {name} holds a NUL byte")
    return {name: value for name, value in env.items() if name != EXEC_ID_VAR}


# Runs the command in a directory, with variables added, as `sh -c command` (exec'd, so the
# action's tree has the same shape as without): $1 the directory, $2 the count of NAME=VALUE
# pairs that follow, then the command. A missing directory fails as the shell's cd does,
# message on stderr and exit code 2, before anything runs.
CWD_ENV_SH = (
    'cd -- "$1" || exit; n=$2; shift 2; '
    'while [ "$n" -gt 0 ]; do export "$1"; shift; n=$((n-1)); done; '
    'exec /bin/sh -c "$1"'
)


def cwd_env_argv(cwd: str, env: Mapping[str, str], command: str) -> list[str]:
    """argv running `command` in `cwd` (a path inside the sandbox) with `env` exported."""
    pairs = [f"{name}={value}" for name, value in env.items()]
    return ["/bin/sh", "-c", CWD_ENV_SH, "sh", cwd, str(len(pairs)), *pairs, command]


def signal_action(root_pid: int, candidates: Iterable[int], exec_id: str, signum: int, *,
                  exclude: set[int]) -> list[int]:
    """Send `signum` to every live process of the action's tree but `exclude`, parents
    before their children (a shell killed first cannot see its children die and exit
    normally in between); returns the pids hit."""
    pids = {p for p in action_pids(root_pid, candidates, exec_id) - exclude
            if procs.is_alive(p)}
    return procs.kill_pids(parents_first(pids), signum)


def parents_first(pids: Iterable[int]) -> list[int]:
    """`pids` ordered so that each comes after its ancestors among them."""
    parents = {pid: info.ppid for pid in pids if (info := procs.process_info(pid))}

    def depth(pid: int) -> int:
        seen = 0
        while (pid := parents.get(pid, 0)) in parents and seen < len(parents):
            seen += 1
        return seen

    return sorted(parents, key=lambda p: (depth(p), p))


async def wait_ready(fd: int, proc: asyncio.subprocess.Process, marker: bytes,
                     timeout_s: float) -> None:
    """Until the init inside reports it runs (all mounts done); the starter's errors
    otherwise."""
    loop = asyncio.get_running_loop()
    buf = bytearray()
    ready: asyncio.Future[None] = loop.create_future()

    def on_readable() -> None:
        try:
            data = os.read(fd, 4096)
        except BlockingIOError:
            return
        buf.extend(data)
        if (marker in buf or not data) and not ready.done():
            ready.set_result(None)

    os.set_blocking(fd, False)
    loop.add_reader(fd, on_readable)
    exited: asyncio.Future[int] = asyncio.ensure_future(proc.wait())
    waiting: set[asyncio.Future[Any]] = {ready, exited}
    try:
        await asyncio.wait(waiting, timeout=timeout_s,
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        loop.remove_reader(fd)
        if not exited.done():
            exited.cancel()
    if marker not in buf:
        with contextlib.suppress(BlockingIOError):
            buf.extend(os.read(fd, 65536))
        detail = buf.decode(errors="replace").strip() or "no output"
        state = f"exit code {proc.returncode}" if proc.returncode is not None else "no answer"
        raise SandboxError(f"the sandbox failed to start ({state}): {detail}")


def read_child_pid(info_fd: int) -> int:
    """The launcher writes {"child-pid": N} to its info fd right after clone, before the ready
    line."""
    os.set_blocking(info_fd, False)
    raw = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(info_fd, 4096):
            raw += chunk
    try:
        return int(json.loads(raw)["child-pid"])
    except (ValueError, KeyError) as exc:
        raise SandboxError(f"unreadable launcher --info-fd output {raw!r}") from exc
