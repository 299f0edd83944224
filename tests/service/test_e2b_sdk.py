"""The official e2b SDK, unchanged, against `tenon serve` on each backend (sync and async
clients), and across a server restart in the middle of a scenario."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import e2b_scenarios as scenarios
import pytest
from e2b import Sandbox

from tenon.service.testing import ServerHandle, running_server

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

MAX_FILE_BYTES = 1 << 20
SCENARIOS = ["lifecycle_and_metadata", "foreground_commands", "background_commands",
             "files", "pause_and_resume", "timeouts", "async_client"]


@pytest.fixture(scope="module", params=["process", pytest.param("docker",
                                                                 marks=pytest.mark.docker)])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerHandle]:
    state = tmp_path_factory.mktemp(f"serve-{request.param}") / "state"
    with running_server(state, budget="2GiB", backend=request.param,
                        extra_args=["--max-file-size", str(MAX_FILE_BYTES)]) as handle:
        yield handle
        leftover = _list(handle)
    assert leftover == [], f"scenarios left sandboxes: {leftover}"


def _list(handle: ServerHandle) -> list[str]:
    with _sdk_env(handle):
        return [s.sandbox_id for s in Sandbox.list().next_items()]


class _sdk_env:  # noqa: N801 - a context manager used like a function
    """Point the SDK at `handle` through its documented environment variables."""

    def __init__(self, handle: ServerHandle) -> None:
        self._env = handle.env()
        self._saved: dict[str, str | None] = {}

    def __enter__(self) -> None:
        for key, value in self._env.items():
            self._saved[key] = os.environ.get(key)
            os.environ[key] = value

    def __exit__(self, *exc: object) -> None:
        for key, value in self._saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario(server: ServerHandle, name: str) -> None:
    with _sdk_env(server):
        scenario = getattr(scenarios, name)
        if asyncio.iscoroutinefunction(scenario):
            asyncio.run(scenario())
        else:
            scenario()


def test_metadata_reaches_the_predictor(server: ServerHandle) -> None:
    with _sdk_env(server):
        scenarios.metadata_reaches_the_predictor(server.state_dir / "events.jsonl")


def test_bad_requests(server: ServerHandle) -> None:
    with _sdk_env(server):
        scenarios.bad_requests(server.url, server.api_key, max_file_bytes=MAX_FILE_BYTES)


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["stop", "crash"])
def test_restart_in_the_middle(tmp_path: Path, how: signal.Signals) -> None:
    """A client reconnects by id after the server stopped (cleanly, or killed) and finds its
    files, its metadata and a working sandbox; one killed meanwhile stays gone."""
    with running_server(tmp_path / "state") as handle, _sdk_env(handle):
        sbx = Sandbox.create(metadata={"tenon.task": "restart"}, envs={"KEPT": "yes"})
        gone = Sandbox.create()
        never_ran = Sandbox.create()
        sbx.files.write("/workspace/before.txt", "before")
        sbx.commands.run("echo made-by-command > /home/user/note.txt")
        gone.kill()
        handle.restart(how)
        again = Sandbox.connect(sbx.sandbox_id)
        assert again.get_info().metadata == {"tenon.task": "restart"}
        assert again.files.read("/workspace/before.txt") == "before"
        out = again.commands.run("cat /home/user/note.txt; echo $KEPT").stdout
        assert out == "made-by-command\nyes\n"
        assert Sandbox.connect(never_ran.sandbox_id).commands.run("echo ok").stdout == "ok\n"
        ids = {s.sandbox_id for s in Sandbox.list().next_items()}
        assert ids == {sbx.sandbox_id, never_ran.sandbox_id}
        for sid in ids:
            Sandbox.kill(sid)
