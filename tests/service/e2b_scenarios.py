"""Scenarios written against the official e2b SDK, run against `tenon serve` (the tests in
test_e2b_sdk.py run them on each backend and across a server restart). Each creates its own
sandboxes and kills them."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import (
    AsyncSandbox,
    AuthenticationException,
    CommandExitException,
    NotFoundException,
    Sandbox,
    SandboxException,
    SandboxQuery,
    TimeoutException,
)


@contextlib.contextmanager
def sandbox(**kwargs: object) -> Iterator[Sandbox]:
    sbx = Sandbox.create(**kwargs)  # type: ignore[arg-type]
    try:
        yield sbx
    finally:
        with contextlib.suppress(Exception):
            sbx.kill()


def metadata_reaches_the_predictor(events_path: Path) -> None:
    """`tenon.*` metadata names the agent's workflow, family and task for the predictor."""
    import json

    meta = {"tenon.task": "repo__issue-1", "tenon.family": "repo", "tenon.workflow": "wf-1"}
    with sandbox(metadata=meta) as sbx:
        sbx.commands.run("true", envs={"TENON_ACTION": "pytest -x", "SEEN": "1"})
        assert sbx.commands.run("echo ${TENON_ACTION:-unset}").stdout == "unset\n"
        events = [json.loads(line) for line in events_path.read_text().splitlines()]
        start = next(e for e in events if e["kind"] == "workflow_start"
                     and e["agent_id"] == sbx.sandbox_id)
        assert (start["workflow"], start["family"], start["task"]) == ("wf-1", "repo",
                                                                        "repo__issue-1")
        ready = [e for e in events if e["kind"] == "action_ready"
                 and e["agent_id"] == sbx.sandbox_id]
        assert ready[0]["action_class"] == "test_runner", "classified by TENON_ACTION, not `true`"


def lifecycle_and_metadata() -> None:
    with sandbox(template="base", timeout=120, metadata={"tenon.task": "t1", "who": "x"},
                 envs={"GREETING": "hello"}) as sbx:
        info = sbx.get_info()
        assert info.sandbox_id == sbx.sandbox_id
        assert info.metadata == {"tenon.task": "t1", "who": "x"}
        assert info.state.value == "running"
        assert 100 < (info.end_at - info.started_at).total_seconds() <= 121
        listed = Sandbox.list(query=SandboxQuery(metadata={"who": "x"})).next_items()
        assert [s.sandbox_id for s in listed] == [sbx.sandbox_id]
        assert Sandbox.list(query=SandboxQuery(metadata={"who": "nobody"})).next_items() == []
        # sandbox-level environment reaches commands
        assert sbx.commands.run("echo $GREETING").stdout == "hello\n"
        sbx.set_timeout(600)
        assert (sbx.get_info().end_at - info.started_at).total_seconds() > 500
        metrics = sbx.get_metrics()
        assert metrics
        assert metrics[0].mem_total > 0
        same = Sandbox.connect(sbx.sandbox_id)
        assert same.commands.run("echo again").stdout == "again\n"
        sid = sbx.sandbox_id
    assert sid not in [s.sandbox_id for s in Sandbox.list().next_items()]
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sid)
    assert Sandbox.kill(sid) is False


def foreground_commands() -> None:
    with sandbox() as sbx:
        result = sbx.commands.run("echo out; echo err >&2; exit 0")
        assert (result.stdout, result.stderr, result.exit_code) == ("out\n", "err\n", 0)
        with pytest.raises(CommandExitException) as failed:
            sbx.commands.run("echo no >&2; exit 3")
        assert failed.value.exit_code == 3
        assert failed.value.stderr == "no\n"
        sbx.commands.run("mkdir -p /workspace/sub")
        here = sbx.commands.run("pwd; echo $A$B", cwd="/workspace/sub", envs={"A": "1", "B": "2"})
        assert here.stdout == "/workspace/sub\n12\n"
        chunks: list[str] = []
        sbx.commands.run("for i in 1 2 3; do echo line$i; sleep 0.2; done",
                         on_stdout=chunks.append)
        assert "".join(chunks) == "line1\nline2\nline3\n"
        with pytest.raises(TimeoutException):
            sbx.commands.run("sleep 30", timeout=2)
        # the server ends the command at its timeout too (on running time, a moment later)
        deadline = time.monotonic() + 20
        while sbx.commands.list() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sbx.commands.list() == []
        # the sandbox still works after a timed-out command
        assert sbx.commands.run("echo alive").stdout == "alive\n"


def background_commands() -> None:
    with sandbox() as sbx:
        seen: list[str] = []
        # the sync client streams a background command's output while its handle waits
        handle = sbx.commands.run("echo started; sleep 0.5; echo done", background=True)
        result = handle.wait(on_stdout=seen.append)
        assert result.stdout == "started\ndone\n"
        assert result.exit_code == 0
        assert "".join(seen) == "started\ndone\n"
        # a long-running one is listed, and killed by pid
        server = sbx.commands.run("sleep 300", background=True)
        pids = [p.pid for p in sbx.commands.list()]
        assert server.pid in pids
        # a foreground command runs while the background one holds the sandbox
        assert sbx.commands.run("echo beside").stdout == "beside\n"
        assert sbx.commands.kill(server.pid) is True
        with pytest.raises(CommandExitException):
            server.wait()
        assert server.pid not in [p.pid for p in sbx.commands.list()]
        # stdin reaches a background command
        cat = sbx.commands.run("cat", background=True, stdin=True)
        sbx.commands.send_stdin(cat.pid, "to cat\n")
        sbx.commands.close_stdin(cat.pid)
        assert cat.wait().stdout == "to cat\n"


def files() -> None:
    with sandbox() as sbx:
        sbx.files.write("/workspace/a.txt", "text")
        sbx.files.write("/workspace/b.bin", b"\x00\x01\x02")
        sbx.files.write_files([{"path": "/workspace/many/one.txt", "data": "1"},
                               {"path": "/workspace/many/two.txt", "data": "2"}])
        assert sbx.files.read("/workspace/a.txt") == "text"
        assert sbx.files.read("/workspace/b.bin", format="bytes") == b"\x00\x01\x02"
        assert sorted(e.name for e in sbx.files.list("/workspace/many")) == ["one.txt",
                                                                              "two.txt"]
        assert sbx.files.exists("/workspace/a.txt")
        assert not sbx.files.exists("/workspace/none")
        assert sbx.files.make_dir("/workspace/d") is True
        assert sbx.files.make_dir("/workspace/d") is False
        sbx.files.rename("/workspace/a.txt", "/workspace/d/a.txt")
        info = sbx.files.get_info("/workspace/d/a.txt")
        assert info.size == 4
        assert info.type.value == "file"
        # what the API wrote, a command sees, and the other way round
        assert sbx.commands.run("cat /workspace/d/a.txt").stdout == "text"
        sbx.commands.run("echo from-command > /home/user/c.txt")
        assert sbx.files.read("/home/user/c.txt") == "from-command\n"
        assert sbx.files.read("c.txt") == "from-command\n"  # relative: the user's home
        sbx.files.remove("/workspace/d")
        assert not sbx.files.exists("/workspace/d/a.txt")
        with pytest.raises(NotFoundException):
            sbx.files.read("/workspace/d/a.txt")


def pause_and_resume() -> None:
    with sandbox(timeout=300) as sbx:
        sbx.files.write("/workspace/kept.txt", "kept")
        sbx.commands.run("echo built > /workspace/by-command.txt")
        sbx.pause()
        assert sbx.get_info().state.value == "paused"
        resumed = Sandbox.connect(sbx.sandbox_id)
        assert resumed.get_info().state.value == "running"
        out = resumed.commands.run("cat /workspace/kept.txt /workspace/by-command.txt")
        assert out.stdout == "keptbuilt\n"
        # the next command wakes a paused sandbox by itself
        sbx.pause()
        assert sbx.commands.run("echo awake").stdout == "awake\n"
        assert sbx.get_info().state.value == "running"


def timeouts() -> None:
    killed = Sandbox.create(timeout=2)
    paused = Sandbox.create(timeout=2, lifecycle={"on_timeout": "pause"})
    try:
        paused.files.write("/workspace/x", "x")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            ids = {s.sandbox_id: s.state.value for s in Sandbox.list().next_items()}
            if killed.sandbox_id not in ids and ids.get(paused.sandbox_id) == "paused":
                break
            time.sleep(0.5)
        assert killed.sandbox_id not in ids, "killed at its timeout"
        assert ids.get(paused.sandbox_id) == "paused", "paused at its timeout"
        back = Sandbox.connect(paused.sandbox_id)
        assert back.files.read("/workspace/x") == "x"
    finally:
        for sbx in (killed, paused):
            with contextlib.suppress(Exception):
                sbx.kill()


def bad_requests(url: str, api_key: str, *, max_file_bytes: int) -> None:
    import httpx

    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="e2b_wrong")
    with pytest.raises(NotFoundException):
        Sandbox.connect("doesnotexist0000")
    headers = {"X-API-Key": api_key}
    before = len(Sandbox.list().next_items())
    r = httpx.post(f"{url}/v2/sandboxes", content=b"{not json", headers=headers)
    assert r.status_code == 400
    assert "not JSON" in r.json()["message"]
    r = httpx.post(f"{url}/v2/sandboxes", json={"templateID": "nosuch"}, headers=headers)
    assert r.status_code == 400
    assert "unknown template" in r.json()["message"]
    r = httpx.post(f"{url}/v2/sandboxes", json={"templateID": "base", "timeout": -5},
                   headers=headers)
    assert r.status_code == 400
    assert "timeout" in r.json()["message"]
    assert len(Sandbox.list().next_items()) == before, "a refused create leaves nothing"
    with sandbox() as sbx:
        # a path outside the sandbox's writable directories, and one escaping through ..
        with pytest.raises(SandboxException):
            sbx.files.write("/etc/passwd", "owned")
        assert "root:" in sbx.files.read("/etc/passwd")  # read through the sandbox's root
        assert "owned" not in sbx.commands.run("cat /etc/passwd").stdout
        # a file over the server's limit is refused, and nothing of it is written
        with pytest.raises(SandboxException):
            sbx.files.write("/workspace/big.bin", b"x" * (max_file_bytes + 1))
        assert not sbx.files.exists("/workspace/big.bin")
        sbx.files.write("/workspace/fits.bin", b"x" * max_file_bytes)
        # a symlink the sandbox planted resolves inside its own directory, never the host's
        sbx.commands.run("ln -s / /workspace/host")
        sbx.files.write("/workspace/host/etc/tenon-escape", "x")
        assert not Path("/etc/tenon-escape").exists()
        assert sbx.files.read("/workspace/etc/tenon-escape") == "x"
        with pytest.raises(SandboxException):  # `..` cannot climb out of a directory
            sbx.files.write("/workspace/../../../etc/tenon-dotdot", "x")
        assert not Path("/etc/tenon-dotdot").exists()
        # what this server does not offer is refused by name, not a bare 404
        r = httpx.post(f"{url}/sandboxes/{sbx.sandbox_id}/fork", headers=headers)
        assert r.status_code == 501
        assert "forking a sandbox is not offered" in r.json()["message"]
        # the wrong sandbox token
        r = httpx.get(f"{url}/files", params={"path": "/workspace"},
                      headers={"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": "wrong"})
        assert r.status_code == 401


async def async_client() -> None:
    sbx = await AsyncSandbox.create(metadata={"client": "async"})
    try:
        result = await sbx.commands.run("echo async")
        assert result.stdout == "async\n"
        await sbx.files.write("/workspace/async.txt", "a")
        assert await sbx.files.read("/workspace/async.txt") == "a"
        handle = await sbx.commands.run("sleep 0.3; echo bg", background=True)
        assert (await handle.wait()).stdout == "bg\n"
        await sbx.pause()
        again = await AsyncSandbox.connect(sbx.sandbox_id)
        assert (await again.commands.run("cat /workspace/async.txt")).stdout == "a"
    finally:
        await sbx.kill()
