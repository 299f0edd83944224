"""TenonEnvironment: mini-swe-agent's actions as E2B commands on Tenon.

The fast tests drive the environment over a scripted fake of the e2b SDK's Sandbox
object (the SDK is not this project's code); the demonstration runs mini-swe-agent's own
agent loop against a real `tenon serve`, tearing the sandbox down after every step.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")  # mini-swe-agent prints a banner on import

from e2b import CommandExitException, CommandResult, TimeoutException  # noqa: E402
from e2b.exceptions import SandboxNotRunningException  # noqa: E402
from minisweagent import package_dir  # noqa: E402
from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.environments import get_environment, get_environment_class  # noqa: E402
from minisweagent.environments.local import LocalEnvironment  # noqa: E402
from minisweagent.exceptions import Submitted  # noqa: E402
from minisweagent.models.test_models import DeterministicModel, make_output  # noqa: E402
from pydantic import ValidationError  # noqa: E402

from tenon.errors import ConfigError  # noqa: E402
from tenon.integrations.minisweagent import (  # noqa: E402
    SUBMIT_MARKER,
    TenonEnvironment,
    TenonEnvironmentConfig,
)
from tenon.sandbox import launcher  # noqa: E402

FULL_PATH = "tenon.integrations.minisweagent.TenonEnvironment"


# -- a scripted fake of e2b.Sandbox (the SDK, not this project) -------------------------


@dataclass
class Reply:
    """What one command does: output chunks, then an exit code or an exception."""

    chunks: list[tuple[str, str]] = field(default_factory=list)  # ("stdout"|"stderr", text)
    exit_code: int = 0
    error: str | None = None
    raises: Exception | None = None


class FakeHandle:
    def __init__(self, sandbox: FakeSandbox, pid: int, reply: Reply) -> None:
        self._sandbox, self.pid, self._reply = sandbox, pid, reply

    def wait(self, on_stdout: Callable[[str], None] | None = None,
             on_stderr: Callable[[str], None] | None = None) -> CommandResult[str]:
        out = {"stdout": "", "stderr": ""}
        for stream, text in self._reply.chunks:
            out[stream] += text
            callback = on_stdout if stream == "stdout" else on_stderr
            if callback is not None:
                callback(text)
        if self._reply.raises is not None:
            raise self._reply.raises
        if self._reply.exit_code != 0:
            raise CommandExitException(stdout=out["stdout"], stderr=out["stderr"],
                                       exit_code=self._reply.exit_code, error=self._reply.error)
        return CommandResult(stdout=out["stdout"], stderr=out["stderr"], exit_code=0,
                             error=self._reply.error)

    def kill(self) -> bool:
        self._sandbox.calls.append(("kill_command", self.pid))
        return True


class FakeCommands:
    def __init__(self, sandbox: FakeSandbox) -> None:
        self._sandbox = sandbox

    def run(self, cmd: str, background: bool | None = None, envs: dict[str, str] | None = None,
            cwd: str | None = None, timeout: float | None = 60) -> FakeHandle:
        assert background is True
        if not self._sandbox.replies:
            raise AssertionError(f"unscripted command: {cmd}")
        self._sandbox.calls.append(("run", {"cmd": cmd, "envs": envs, "cwd": cwd,
                                            "timeout": timeout}))
        return FakeHandle(self._sandbox, 1000 + len(self._sandbox.calls),
                          self._sandbox.replies.pop(0))


class FakeSandbox:
    """Records every call in order; raises when a command is not scripted."""

    sandbox_id = "sbx-fake"

    def __init__(self, *replies: Reply) -> None:
        self.replies = list(replies)
        self.calls: list[tuple[str, Any]] = []
        self.commands = FakeCommands(self)

    def pause(self) -> bool:
        self.calls.append(("pause", None))
        return True

    def kill(self) -> bool:
        self.calls.append(("kill", None))
        return True

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.calls]

    def runs(self) -> list[dict[str, Any]]:
        return [args for kind, args in self.calls if kind == "run"]


def make_env(*replies: Reply, **config: Any) -> tuple[TenonEnvironment, FakeSandbox]:
    sandbox = FakeSandbox(*replies)
    return TenonEnvironment(sandbox=sandbox, **config), sandbox  # type: ignore[arg-type]


def out(text: str, exit_code: int = 0) -> Reply:
    return Reply(chunks=[("stdout", text)], exit_code=exit_code)


# -- execute -------------------------------------------------------------------------------


def test_output_merges_both_streams_in_arrival_order_with_the_exit_code() -> None:
    env, sandbox = make_env(Reply(chunks=[("stdout", "a\n"), ("stderr", "b\n"),
                                          ("stdout", "c\n")], exit_code=3))
    assert env.execute({"command": "make"}) == {"output": "a\nb\nc\n", "returncode": 3,
                                                 "exception_info": ""}
    assert sandbox.runs() == [{"cmd": "make", "envs": {}, "cwd": "/workspace", "timeout": 30}]


def test_cwd_timeout_and_environment_reach_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FWD", "from-host")
    monkeypatch.setenv("BOTH", "from-host")
    monkeypatch.delenv("ABSENT", raising=False)
    env, sandbox = make_env(out("x"), out("y"), cwd="/workspace/repo", timeout=7,
                            env={"PAGER": "cat", "BOTH": "from-config"},
                            forward_env=["FWD", "BOTH", "ABSENT"])
    env.execute({"command": "one"})
    env.execute({"command": "two"}, cwd="/tmp", timeout=90)
    first, second = sandbox.runs()
    assert first == {"cmd": "one", "cwd": "/workspace/repo", "timeout": 7,
                     "envs": {"FWD": "from-host", "BOTH": "from-config", "PAGER": "cat"}}
    assert (second["cwd"], second["timeout"]) == ("/tmp", 90)


def test_a_sandbox_error_reaches_exception_info() -> None:
    env, _ = make_env(Reply(exit_code=137, error="out of memory"))
    result = env.execute({"command": "python3 big.py"})
    assert result["returncode"] == 137
    assert "out of memory" in result["exception_info"]


def test_submission_raises_submitted_with_the_text_after_the_marker() -> None:
    env, sandbox = make_env(out(f"{SUBMIT_MARKER}\ndiff --git a/x b/x\n"), force_teardown=True)
    with pytest.raises(Submitted) as caught:
        env.execute({"command": f"echo {SUBMIT_MARKER} && git diff"})
    (message,) = caught.value.messages
    assert message["extra"] == {"exit_status": "Submitted", "submission": "diff --git a/x b/x\n"}
    assert "pause" not in sandbox.kinds()  # nothing left to tear down for


def test_the_marker_is_no_submission_when_the_command_failed() -> None:
    env, _ = make_env(out(f"{SUBMIT_MARKER}\n", exit_code=1))
    assert env.execute({"command": "false"})["returncode"] == 1


def test_force_teardown_pauses_after_every_command() -> None:
    env, sandbox = make_env(out("1"), out("2", exit_code=2), force_teardown=True)
    env.execute({"command": "one"})
    env.execute({"command": "two"})
    assert sandbox.kinds() == ["run", "pause", "run", "pause"]
    assert env.serialize()["info"]["tenon"] == {"sandbox_id": "sbx-fake", "num_commands": 2,
                                                "num_pauses": 2}


def test_without_force_teardown_nothing_is_paused() -> None:
    env, sandbox = make_env(out("1"), out("2"))
    env.execute({"command": "one"})
    env.execute({"command": "two"})
    assert sandbox.kinds() == ["run", "run"]


def test_a_timeout_is_reported_as_the_local_environment_reports_it() -> None:
    env, sandbox = make_env(Reply(chunks=[("stdout", "partial\n")],
                                  raises=TimeoutException("deadline_exceeded")), timeout=1)
    result = env.execute({"command": "echo partial; sleep 10"})
    local = LocalEnvironment(timeout=1).execute({"command": "echo partial; sleep 10"})
    assert result == local
    assert result["extra"]["exception_type"] == "TimeoutExpired"
    assert sandbox.kinds() == ["run", "kill_command"]  # the command may still run: killed


def test_a_vanished_sandbox_is_an_error_not_a_timeout() -> None:
    env, sandbox = make_env(Reply(raises=SandboxNotRunningException("sandbox was killed")))
    result = env.execute({"command": "ls"})
    assert result["returncode"] == -1
    assert result["extra"]["exception_type"] == "SandboxNotRunningException"
    assert "kill_command" not in sandbox.kinds()


# -- template vars, serialization, lifetime ------------------------------------------------


def test_template_vars_carry_the_sandbox_uname_learned_once() -> None:
    env, sandbox = make_env(out("Linux\n6.1.0-test\n#1 SMP Debian\nx86_64\n"),
                            force_teardown=True, api_key="k-secret")
    first = env.get_template_vars(task="fix it")
    assert env.get_template_vars() | {"task": "fix it"} == first
    assert {k: first[k] for k in ("system", "release", "version", "machine", "task")} == {
        "system": "Linux", "release": "6.1.0-test", "version": "#1 SMP Debian",
        "machine": "x86_64", "task": "fix it"}
    assert first["cwd"] == "/workspace"
    assert "api_key" not in first
    assert sandbox.kinds() == ["run", "pause"]
    assert sandbox.runs()[0]["cwd"] == "/"


def test_template_vars_fall_back_to_linux_when_uname_fails() -> None:
    env, _ = make_env(out("", exit_code=127))
    assert env.get_template_vars()["system"] == "Linux"


def test_serialize_names_the_class_and_never_holds_the_api_key() -> None:
    env, _ = make_env(api_key="k-secret", metadata={"tenon.task": "calc__add"})
    data = env.serialize()
    assert "k-secret" not in json.dumps(data)
    assert data["info"]["config"]["environment_type"] == FULL_PATH
    assert data["info"]["config"]["environment"]["metadata"] == {"tenon.task": "calc__add"}
    assert "k-secret" not in repr(env.config)


def test_mini_swe_agent_finds_the_class_by_its_import_path() -> None:
    assert get_environment_class(FULL_PATH) is TenonEnvironment


def test_cleanup_kills_the_sandbox_once() -> None:
    env, sandbox = make_env()
    with env:
        pass
    env.cleanup()
    env.close()
    del env
    assert sandbox.kinds() == ["kill"]


def test_unknown_config_fields_are_rejected() -> None:
    with pytest.raises(ValidationError, match="image"):
        TenonEnvironmentConfig(image="python:3.11")  # type: ignore[call-arg]


def test_without_a_server_url_construction_says_what_to_set(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("E2B_API_URL", raising=False)
    with pytest.raises(ConfigError, match="E2B_API_URL"):
        TenonEnvironment()


# -- the demonstration: mini-swe-agent fixes a bug on a sandbox rebuilt before every step ---

STATE_DIR_IMAGES = Path("/var/lib/tenon/images")
REPO = "/workspace"
CALC = '''"""Small arithmetic helpers."""


def add(a, b):
    """The sum of a and b."""
    return a - b


def mul(a, b):
    """The product of a and b."""
    return a * b
'''
TEST_CALC = '''import unittest

from calc import add, mul


class TestCalc(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)

    def test_mul(self):
        self.assertEqual(mul(2, 3), 6)


if __name__ == "__main__":
    unittest.main()
'''
TASK = "The tests in test_calc.py fail: add(2, 3) does not return 5. Fix calc.py."
# (thought, command): what the scripted model does, in order; the last one submits.
SCRIPT = [
    ("Run the tests to see what fails.", "python3 -m unittest -v 2>&1 | tail -n 20"),
    ("test_add fails; look at the code.", "nl -ba calc.py"),
    ("add subtracts; make it add.", "sed -i 's/return a - b/return a + b/' calc.py"),
    ("Run the tests again.", "python3 -m unittest -v"),
    ("The tests pass: submit the diff.", f"echo {SUBMIT_MARKER} && git diff"),
]


def _need_real_sandboxes() -> None:
    if os.geteuid() != 0:
        pytest.skip("real sandboxes need root")
    if problems := launcher.check():
        pytest.skip(problems[0])
    if not STATE_DIR_IMAGES.exists():
        pytest.skip("base image missing: run `tenon image build`")


def scripted_model() -> DeterministicModel:
    config = yaml.safe_load((package_dir / "config" / "default.yaml").read_text())
    outputs = [make_output(f"THOUGHT: {thought}\n\n```mswea_bash_command\n{command}\n```",
                           [{"command": command}]) for thought, command in SCRIPT]
    return DeterministicModel(outputs=outputs,
                              observation_template=config["model"]["observation_template"])


def make_repo(env: TenonEnvironment) -> None:
    """A git repository with the bug, written through the SDK as any E2B user would."""
    env.sandbox.files.write(f"{REPO}/calc.py", CALC)
    env.sandbox.files.write(f"{REPO}/test_calc.py", TEST_CALC)
    env.sandbox.commands.run("git init -q && git add -A && git -c user.name=tenon "
                             "-c user.email=tenon@example.invalid commit -qm 'calc'", cwd=REPO)


def run_agent(env: TenonEnvironment, trajectory: Path) -> dict[str, Any]:
    """mini-swe-agent's own loop with its default prompts, the scripted model and `env`."""
    config = yaml.safe_load((package_dir / "config" / "default.yaml").read_text())
    agent = DefaultAgent(scripted_model(), env,
                         **config["agent"] | {"step_limit": 10, "output_path": trajectory})
    return agent.run(TASK)


def agent_events(state_dir: Path, agent_id: str) -> list[dict[str, Any]]:
    lines = (state_dir / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("agent_id") == agent_id]


def rebuilt_before_each_action(events: list[dict[str, Any]]) -> list[bool]:
    """For each action in order: whether its sandbox was torn down and rebuilt since the
    previous action."""
    flags: list[bool] = []
    torn = rebuilt = False
    for event in events:
        if event["kind"] == "teardown" and event["outcome"] != "kept_resident":
            torn = True
        elif event["kind"] == "rebuild":
            rebuilt = torn
        elif event["kind"] == "action_start":
            flags.append(torn and rebuilt)
            torn = rebuilt = False
    return flags


@pytest.fixture
def tenon_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A `tenon serve` on the process backend with the e2b SDK's variables pointing at it;
    yields its state directory."""
    _need_real_sandboxes()
    from tenon.service.testing import running_server

    state_dir = tmp_path / "state"
    with running_server(state_dir) as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        yield state_dir


@pytest.mark.sandbox
@pytest.mark.slow
def test_mini_swe_agent_fixes_a_bug_on_a_sandbox_rebuilt_before_every_step(
        tenon_server: Path, tmp_path: Path) -> None:
    defaults = yaml.safe_load((package_dir / "config" / "default.yaml").read_text())
    env = get_environment({
        "environment_class": FULL_PATH, "force_teardown": True, "timeout": 120,
        "metadata": {"tenon.task": "calc__add", "tenon.family": "calc"},
        "env": defaults["environment"]["env"] | {"PYTHONDONTWRITEBYTECODE": "1"},
    })
    assert isinstance(env, TenonEnvironment)
    trajectory = tmp_path / "trajectory.json"
    try:
        make_repo(env)
        info = run_agent(env, trajectory)
        sandbox_id = env.sandbox.sandbox_id

        assert info["exit_status"] == "Submitted"
        assert "+    return a + b" in info["submission"]
        # checked apart from the agent, through the SDK
        assert env.sandbox.commands.run("python3 -m unittest", cwd=REPO).exit_code == 0
        diff = env.sandbox.commands.run("git diff", cwd=REPO).stdout
        assert "-    return a - b" in diff
        assert "+    return a + b" in diff
    finally:
        env.cleanup()

    saved = json.loads(trajectory.read_text())
    assert saved["info"]["exit_status"] == "Submitted"
    # a pause after the uname and after every step but the submitting one
    assert saved["info"]["tenon"]["num_pauses"] == len(SCRIPT)
    observations = [m["extra"] for m in saved["messages"][2:] if m["role"] == "user"]
    assert "FAILED (failures=1)" in observations[0]["raw_output"]
    assert (observations[3]["returncode"], observations[3]["raw_output"].split()[-1]) == (0, "OK")

    events = agent_events(tenon_server, sandbox_id)
    asked = [e for e in events if e["kind"] == "teardown" and e["why"] == "asked"]
    assert [e["outcome"] for e in asked] == ["torn_down"] * len(SCRIPT)
    # actions: git init, uname, the agent's steps, the two checks; every step on a rebuild
    flags = rebuilt_before_each_action(events)
    assert len(flags) == 2 + len(SCRIPT) + 2
    assert flags[2:2 + len(SCRIPT)] == [True] * len(SCRIPT)


@pytest.mark.sandbox
@pytest.mark.slow
def test_on_tenon_a_timed_out_command_is_reported_and_killed(tenon_server: Path) -> None:
    with TenonEnvironment(timeout=1) as env:
        result = env.execute({"command": "echo partial; sleep 37"})
        assert result == LocalEnvironment(timeout=1).execute(
            {"command": "echo partial; sleep 37"})
        # a pattern that does not match its own command line
        count = env.execute({"command": "cat /proc/[0-9]*/cmdline | tr '\\0' ' ' "
                                        "| grep -c 'slee[p] 37'"})
        assert count["output"].strip() == "0"
