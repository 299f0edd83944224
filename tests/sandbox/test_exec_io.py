"""Interactive commands (`ExecIO`) on the process backend: separate streams as they come,
stdin, cwd, env, signals, on_start, timeouts."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tenon.errors import ImageNotFound, SandboxError
from tenon.host.domain import WorkloadDomain
from tenon.sandbox import launcher
from tenon.sandbox.base import ExecControl, ExecIO, ExecResult, Sandbox, SandboxSpec
from tenon.sandbox.images import image_rootfs
from tenon.sandbox.process import ProcessBackend
from tenon.units import MIB

pytestmark = pytest.mark.sandbox

IMAGE = "tenon-base:bookworm"
STATE_DIR = Path("/var/lib/tenon")
# A detached daemon (reparented to the sandbox's init) and a plain background child, then a
# line on stdout once both run, then a wait that only a signal or the timeout ends.
TREE_COMMAND = "(sleep 1001 &); sleep 1002 & echo started; wait"


@pytest.fixture
def domain() -> Iterator[WorkloadDomain]:
    if os.geteuid() != 0:
        pytest.skip("the process backend needs root (cgroups, nsenter)")
    if problems := launcher.check():
        pytest.skip(problems[0])
    try:
        image_rootfs(IMAGE, STATE_DIR)
    except ImageNotFound as exc:
        pytest.skip(str(exc))
    d = WorkloadDomain.open(f"tenon-test-{uuid.uuid4().hex[:8]}")
    yield d
    d.remove()
    assert list(Path("/sys/fs/cgroup").glob(f"*/{d.name}")) == []


@pytest.fixture
async def sandbox(domain: WorkloadDomain, tmp_path: Path) -> AsyncIterator[Sandbox]:
    spec = SandboxSpec(sandbox_id=f"sb-{uuid.uuid4().hex[:8]}", image=IMAGE,
                       workspace=tmp_path, max_pids=64, tmp_size_bytes=64 * MIB,
                       env={"GREETING": "hi", "SHADOWED": "spec"})
    sb = await ProcessBackend(domain, state_dir=STATE_DIR).materialize(spec)
    yield sb
    await sb.destroy()


class Streams:
    """An `ExecIO` whose callbacks record every chunk and the control they were given."""

    def __init__(self, *, stdin: bool = False, cwd: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.stdout: list[bytes] = []
        self.stderr: list[bytes] = []
        self.arrived = asyncio.Event()  # set at every chunk
        self.starts: list[ExecControl] = []
        self.started: asyncio.Future[ExecControl] = asyncio.get_running_loop().create_future()
        self.task: asyncio.Task[ExecResult] | None = None  # the exec, once `run` started it
        self.io = ExecIO(on_stdout=self._on_stdout, on_stderr=self._on_stderr, stdin=stdin,
                         cwd=cwd, env=env or {}, on_start=self._on_start)

    def _on_stdout(self, data: bytes) -> None:
        self.stdout.append(data)
        self.arrived.set()

    def _on_stderr(self, data: bytes) -> None:
        self.stderr.append(data)
        self.arrived.set()

    def _on_start(self, control: ExecControl) -> None:
        self.starts.append(control)
        if not self.started.done():
            self.started.set_result(control)

    async def until(self, stream: str, text: bytes) -> None:
        """Wait until `stream` has carried `text`; fail if the command ended without it."""
        while text not in b"".join(self.stdout if stream == "stdout" else self.stderr):
            assert self.task is not None
            if self.task.done():
                raise AssertionError(f"the command ended and {stream} never had {text!r}")
            self.arrived.clear()
            chunk = asyncio.ensure_future(self.arrived.wait())
            await asyncio.wait({chunk, self.task}, return_when=asyncio.FIRST_COMPLETED)
            chunk.cancel()


def run(sb: Sandbox, command: str, streams: Streams | None = None,
        timeout_s: float = 30.0) -> asyncio.Task[ExecResult]:
    io = streams.io if streams is not None else None
    task = asyncio.ensure_future(sb.exec(command, timeout_s=timeout_s, io=io))
    if streams is not None:
        streams.task = task
    return task


async def both_sleeps_run(sb: Sandbox) -> None:
    """Until TREE_COMMAND's two sleeps have exec'd ("started" may come a moment before)."""
    for _ in range(500):
        commands = {p.command for p in sb.processes()}
        if {"sleep 1001", "sleep 1002"} <= commands:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the background sleeps never ran: {commands}")


async def no_processes_left(sb: Sandbox) -> None:
    for _ in range(500):  # a signalled process needs a moment to be gone
        if not sb.processes():
            return
        await asyncio.sleep(0.01)
    assert sb.processes() == []


async def test_stdout_and_stderr_arrive_apart_and_while_the_command_runs(sandbox, tmp_path):
    streams = Streams()
    go = tmp_path / "workspace" / "go"
    task = run(sandbox, "echo out1; echo err1 >&2; "
                        "while [ ! -e go ]; do sleep 0.01; done; echo out2; echo err2 >&2",
               streams)
    await streams.until("stdout", b"out1\n")
    await streams.until("stderr", b"err1\n")
    assert not task.done()  # the chunks came while the command still waited
    go.touch()
    result = await task
    assert result.exit_code == 0
    assert b"".join(streams.stdout) == b"out1\nout2\n"
    assert b"".join(streams.stderr) == b"err1\nerr2\n"
    # the result still carries both, interleaved; each stream's own order is kept
    lines = result.output.splitlines()
    assert sorted(lines) == ["err1", "err2", "out1", "out2"]
    assert lines.index("out1") < lines.index("out2")
    assert lines.index("err1") < lines.index("err2")
    assert lines.index("out1") < lines.index("err2")  # err2 only came after go
    assert len(streams.starts) == 1


async def test_result_output_stays_bounded_with_streams(sandbox):
    streams = Streams()
    result = await sandbox.exec("head -c 200000 /dev/zero | tr '\\0' x; echo done >&2",
                                timeout_s=30, max_output_bytes=1000, io=streams.io)
    assert result.truncated
    assert len(result.output) == 1000
    assert len(b"".join(streams.stdout)) == 200000  # the callbacks get everything
    assert b"".join(streams.stderr) == b"done\n"


async def test_stdin_written_then_closed_reaches_cat(sandbox):
    streams = Streams(stdin=True)
    task = run(sandbox, "cat; echo end", streams)
    control = await streams.started
    payload = b"hello\n" + b"y" * 300_000  # more than a pipe holds: writes wait for room
    await control.write_stdin(payload)
    await control.close_stdin()
    result = await task
    assert result.exit_code == 0
    assert b"".join(streams.stdout) == payload + b"end\n"
    assert len(streams.starts) == 1
    with pytest.raises(SandboxError):
        await control.write_stdin(b"late")


async def test_stdin_is_refused_when_not_asked_for(sandbox):
    streams = Streams()
    task = run(sandbox, "cat", streams)  # stdin is /dev/null: cat ends at once
    control = await streams.started
    with pytest.raises(SandboxError):
        await control.write_stdin(b"x")
    assert (await task).exit_code == 0
    assert streams.stdout == []


async def test_cwd_and_env_apply_over_the_sandbox_env(sandbox):
    streams = Streams(cwd="/home/user", env={"FOO": "a b'c", "SHADOWED": "io"})
    result = await run(sandbox, 'pwd; echo "$FOO|$SHADOWED|$GREETING|$HOME"', streams)
    assert result.exit_code == 0
    assert b"".join(streams.stdout) == b"/home/user\na b'c|io|hi|/home/user\n"
    default = await run(sandbox, "pwd; echo $SHADOWED", Streams())
    assert default.output == "/workspace\nspec\n"


async def test_env_cannot_take_the_exec_id_nor_bad_names(sandbox):
    streams = Streams(env={"TENON_EXEC_ID": "mine"})
    result = await run(sandbox, "echo $TENON_EXEC_ID", streams)
    assert result.output.strip() not in ("", "mine")
    with pytest.raises(SandboxError, match="name"):
        await run(sandbox, "true", Streams(env={"A=B": "x"}))


async def test_missing_cwd_fails_like_cd_and_runs_nothing(sandbox, tmp_path):
    streams = Streams(cwd="/no/such/dir")
    result = await run(sandbox, "touch /workspace/ran", streams)
    assert result.exit_code != 0
    err = b"".join(streams.stderr).decode()
    assert "cd" in err
    assert "/no/such/dir" in err
    assert str(tmp_path) not in err
    assert str(STATE_DIR) not in err
    assert not (tmp_path / "workspace" / "ran").exists()
    assert len(streams.starts) == 1


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
async def test_signal_ends_the_command_and_its_background_children(sandbox, signum):
    streams = Streams()
    task = run(sandbox, TREE_COMMAND, streams)
    await streams.until("stdout", b"started\n")
    await both_sleeps_run(sandbox)
    await streams.starts[0].signal(signum)
    result = await task
    assert result.exit_code == -signum
    assert not result.timed_out
    await no_processes_left(sandbox)
    assert len(streams.starts) == 1


async def test_a_signal_the_shell_handles_leaves_it_running(sandbox):
    streams = Streams()
    task = run(sandbox, "trap 'echo got-usr1' USR1; echo ready; "
                        "while [ ! -e go ]; do sleep 0.01; done", streams)
    await streams.until("stdout", b"ready\n")
    await streams.starts[0].signal(signal.SIGUSR1)
    await streams.until("stdout", b"got-usr1\n")
    assert not task.done()
    await streams.starts[0].signal(signal.SIGKILL)
    assert (await task).exit_code == -signal.SIGKILL


async def test_timeout_with_streams_kills_the_tree(sandbox):
    streams = Streams(stdin=True)
    task = run(sandbox, TREE_COMMAND, streams, timeout_s=3.0)
    await streams.until("stdout", b"started\n")
    await both_sleeps_run(sandbox)
    result = await task
    assert result.timed_out
    assert result.exit_code < 0
    assert b"".join(streams.stdout) == b"started\n"
    assert sandbox.processes() == []
    assert len(streams.starts) == 1
    with pytest.raises(SandboxError):
        await streams.starts[0].write_stdin(b"late")


async def test_cancelling_a_streamed_command_leaves_nothing(sandbox):
    streams = Streams(stdin=True)
    task = run(sandbox, TREE_COMMAND, streams)
    await streams.until("stdout", b"started\n")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sandbox.processes() == []


async def test_a_failing_callback_loses_no_output(sandbox):
    def broken(_: bytes) -> None:
        raise RuntimeError("callback bug")

    result = await sandbox.exec("echo out; echo err >&2", timeout_s=30,
                                io=ExecIO(on_stdout=broken, on_stderr=broken))
    assert result.exit_code == 0
    assert sorted(result.output.splitlines()) == ["err", "out"]


async def test_without_io_one_pipe_keeps_the_interleaving(sandbox):
    result = await sandbox.exec("echo out; echo err >&2; echo out2; pwd", timeout_s=30)
    assert result.output.splitlines() == ["out", "err", "out2", "/workspace"]


async def test_sigkill_while_the_gate_holds_the_sandbox_ends_it_once_thawed(sandbox):
    streams = Streams()
    task = run(sandbox, TREE_COMMAND, streams)
    await streams.until("stdout", b"started\n")
    await both_sleeps_run(sandbox)
    sandbox.cgroup.freeze()
    try:
        kill = asyncio.ensure_future(streams.starts[0].signal(signal.SIGKILL))
        await asyncio.sleep(0.05)
        assert not kill.done()  # a frozen process cannot die: the kill waits for the thaw
        assert not task.done()
    finally:
        sandbox.cgroup.thaw()
    await kill
    assert (await task).exit_code == -signal.SIGKILL
    assert sandbox.processes() == []


async def test_a_command_that_ends_with_stdin_still_open_returns(sandbox):
    streams = Streams(stdin=True)
    result = await run(sandbox, "echo hi", streams)
    assert result.exit_code == 0
    assert b"".join(streams.stdout) == b"hi\n"
    with pytest.raises(SandboxError):
        await streams.starts[0].write_stdin(b"late")
