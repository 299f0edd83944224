"""`ExecIO` on the fake and simulated backends, which the service layer's tests run on."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from tenon.clock import FakeClock, run_simulated
from tenon.errors import SandboxError
from tenon.sandbox.base import ExecControl, ExecIO, ExecResult, SandboxSpec
from tenon.sandbox.fake import FakeBackend, FakeSandbox
from tenon.sandbox.sim import SimBackend, SimDomain, sim_load_command


def make_spec(workspace: Path) -> SandboxSpec:
    return SandboxSpec(sandbox_id="s1", image="img", workspace=workspace)


def recording_io(*, stdin: bool = False) -> tuple[ExecIO, list[bytes], list[ExecControl]]:
    chunks: list[bytes] = []
    starts: list[ExecControl] = []
    io = ExecIO(on_stdout=chunks.append, stdin=stdin, on_start=starts.append)
    return io, chunks, starts


async def test_fake_hands_the_scripted_output_to_on_stdout(tmp_path: Path) -> None:
    sandbox = await FakeBackend(script=lambda sb, cmd: f"ran {cmd}\n").materialize(
        make_spec(tmp_path))
    io, chunks, starts = recording_io()
    result = await sandbox.exec("ls", timeout_s=1, io=io)
    assert result.output == "ran ls\n"
    assert chunks == [b"ran ls\n"]
    assert len(starts) == 1
    with pytest.raises(SandboxError):
        await starts[0].write_stdin(b"x")  # no stdin was asked for


async def test_fake_feeds_stdin_to_the_step_once_closed(tmp_path: Path) -> None:
    def echo(sandbox: FakeSandbox, command: str) -> str:
        return sandbox.last_stdin.decode()

    sandbox = await FakeBackend(script=echo).materialize(make_spec(tmp_path))
    io, chunks, starts = recording_io(stdin=True)
    task = asyncio.ensure_future(sandbox.exec("cat", timeout_s=5, io=io))
    await asyncio.sleep(0)  # the command starts, then waits for stdin
    await starts[0].write_stdin(b"hello ")
    await starts[0].write_stdin(b"world")
    assert not task.done()  # the command waits for EOF
    await starts[0].close_stdin()
    assert (await task).output == "hello world"
    assert chunks == [b"hello world"]
    with pytest.raises(SandboxError):
        await starts[0].write_stdin(b"late")


async def test_fake_signal_ends_a_command_waiting_for_stdin(tmp_path: Path) -> None:
    step = ExecResult(exit_code=0, output="unused", truncated=False, duration_s=0.0)
    sandbox = await FakeBackend(script=[step]).materialize(make_spec(tmp_path))
    io, chunks, starts = recording_io(stdin=True)
    task = asyncio.ensure_future(sandbox.exec("cat", timeout_s=5, io=io))
    await asyncio.sleep(0)  # the command starts, then waits for stdin
    await starts[0].signal(signal.SIGWINCH)  # ignored by default: still running
    assert not task.done()
    await starts[0].signal(signal.SIGTERM)
    assert (await task).exit_code == -signal.SIGTERM
    assert chunks == []
    assert (await sandbox.exec("next", timeout_s=1)) == step  # the step was not consumed


async def test_fake_stdin_never_closed_times_out(tmp_path: Path) -> None:
    sandbox = await FakeBackend(script=lambda sb, cmd: "x").materialize(make_spec(tmp_path))
    io, _, _ = recording_io(stdin=True)
    result = await sandbox.exec("cat", timeout_s=0.01, io=io)
    assert result.timed_out
    assert result.exit_code == -9


def test_sim_calls_on_start_once_and_a_signal_ends_the_load(tmp_path: Path) -> None:
    clock = FakeClock()
    backend = SimBackend(SimDomain(None), clock)

    async def main() -> tuple[ExecResult, ExecResult, int]:
        box = await backend.materialize(make_spec(tmp_path))
        io, chunks, starts = recording_io()
        full = await box.exec(sim_load_command(0, 0, 1.0, 0), timeout_s=60, io=io)
        assert len(starts) == 1
        io, _, starts = recording_io()
        task = asyncio.ensure_future(
            box.exec(sim_load_command(0, 0, 100.0, 0), timeout_s=600, io=io))
        await clock.sleep(1.0)
        await starts[0].signal(signal.SIGKILL)
        return full, await task, len(chunks)

    full, killed, num_chunks = asyncio.run(run_simulated(main(), clock))
    assert full.exit_code == 0
    assert num_chunks == 0  # the simulator ignores streams
    assert killed.exit_code == -signal.SIGKILL
    assert killed.duration_s < 100.0
