"""mini-swe-agent's execution environment on Tenon.

`TenonEnvironment` runs each mini-swe-agent action as one command in an E2B sandbox, through
the official e2b SDK (sync `e2b.Sandbox`), against a `tenon serve` or any E2B-compatible
endpoint. On Tenon each command is one action (predicted, admitted, gated), and the sandbox
behind it may have been torn down and rebuilt from its workspace since the previous one;
the agent cannot tell.

A mini-swe-agent configuration names it by its import path (mini-swe-agent 2.4.6 resolves
short names from a fixed table of its own, with no hook to add one):

    environment:
      environment_class: tenon.integrations.minisweagent.TenonEnvironment
      force_teardown: true

The result of `execute` is what mini-swe-agent's own environments return: `output` (stdout
and stderr merged in arrival order), `returncode`, `exception_info`, and for a failure an
`extra` naming the exception. A command that exceeds its timeout is reported as
`LocalEnvironment` reports one: returncode -1 and a `subprocess.TimeoutExpired`.
"""

from __future__ import annotations

import logging
import os
import subprocess
from typing import Any

from e2b import CommandExitException, CommandHandle, Sandbox, TimeoutException
from e2b.exceptions import SandboxNotRunningException, SandboxUnreachableException
from minisweagent.exceptions import Submitted
from minisweagent.utils.serialize import recursive_merge
from pydantic import BaseModel, ConfigDict, Field

from tenon.errors import ConfigError

logger = logging.getLogger(__name__)

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
"""First line of output by which a mini-swe-agent agent submits (as its environments check)."""

# TimeoutException subclasses that mean the sandbox is gone, not that the command ran long.
_SANDBOX_GONE = (SandboxNotRunningException, SandboxUnreachableException)
_UNAME_COMMAND = "uname -s; uname -r; uname -v; uname -m"
_UNAME_KEYS = ("system", "release", "version", "machine")


class TenonEnvironmentConfig(BaseModel):
    """How to reach the server and what sandbox to run in. Unknown fields are rejected."""

    model_config = ConfigDict(extra="forbid")

    api_url: str = ""
    """The server's control-plane URL (e.g. http://127.0.0.1:49982); empty: $E2B_API_URL."""
    sandbox_url: str = ""
    """Where sandbox-side calls go; empty: $E2B_SANDBOX_URL, else `api_url`."""
    api_key: str = Field(default="", repr=False)
    """The server's API key; empty: $E2B_API_KEY. Never serialized or templated."""
    template: str = "base"
    """The sandbox template (the e2b SDK's default name, `base`, unless set)."""
    sandbox_timeout_s: int = Field(default=3600, gt=0)
    """The sandbox's lifetime in seconds, as E2B counts it from creation."""
    metadata: dict[str, str] = {}
    """E2B sandbox metadata. On Tenon `tenon.task` and `tenon.family` reach the predictor:
    attempts at one task (retries, rollouts) learn from each other's measured actions."""
    cwd: str = "/workspace"
    """Working directory of every command unless `execute` is given one."""
    env: dict[str, str] = {}
    """Environment variables set for every command."""
    forward_env: list[str] = []
    """Variables copied from this process's environment into every command when set there;
    `env` wins on a conflict."""
    timeout: int = Field(default=30, ge=0)
    """Seconds a command may take (0: no limit), the same key as mini-swe-agent's other
    environments. Like any E2B command stream it covers the whole call, so on Tenon a wait
    for admission or for a rebuild counts."""
    force_teardown: bool = False
    """Pause the sandbox after every command. On Tenon that asks the runtime to tear it down
    now if its boundary is restartable (it stays resident otherwise) and the next command
    rebuilds it from its workspace. On E2B itself a paused sandbox needs `Sandbox.connect`
    before it runs again, which this environment does not do."""


class TenonEnvironment:
    """Runs mini-swe-agent's actions in one E2B sandbox created at construction and killed
    by `cleanup` (also `close`, leaving a `with` block, or garbage collection).

    Invariants: every `execute` sends exactly one command; with `force_teardown` every
    command that did not submit is followed by exactly one pause request; the sandbox is
    killed at most once.
    """

    def __init__(self, *, config_class: type[TenonEnvironmentConfig] = TenonEnvironmentConfig,
                 sandbox: Sandbox | None = None, **kwargs: Any) -> None:
        """Takes `TenonEnvironmentConfig`'s fields as keywords. `sandbox`, for callers in
        Python only: an already-open sandbox to run in instead of creating one (this
        environment then owns it and kills it at cleanup)."""
        self._closed = False
        self.config = config_class(**kwargs)
        self.num_commands = 0
        self.num_pauses = 0
        self._platform: dict[str, str] | None = None
        self.sandbox = sandbox if sandbox is not None else self._create_sandbox()

    # -- the Environment protocol --------------------------------------------------------

    def execute(self, action: dict[str, Any], cwd: str = "", *,
                timeout: int | None = None) -> dict[str, Any]:
        """Run `action["command"]` in the sandbox; raises `Submitted` when its output starts
        with the submit marker and it exited 0."""
        command = str(action.get("command", ""))
        output = self._run(command, cwd or self.config.cwd, timeout or self.config.timeout)
        submission = _submission(output)
        if submission is not None:
            raise Submitted({"role": "exit", "content": submission,
                             "extra": {"exit_status": "Submitted", "submission": submission}})
        self._after_command()
        return output

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        """The config (without the API key), the sandbox's `uname` fields (`system`,
        `release`, `version`, `machine`: mini-swe-agent's templates branch on `system`), and
        `kwargs`. The first call learns the `uname` fields by running one command."""
        return recursive_merge(self._public_config(), self._sandbox_platform(), kwargs)

    def serialize(self) -> dict[str, Any]:
        """The trajectory's record of this environment: its config (without the API key) and
        the sandbox id and counts."""
        cls = type(self)
        return {"info": {
            "config": {"environment": self._public_config(),
                       "environment_type": f"{cls.__module__}.{cls.__qualname__}"},
            "tenon": {"sandbox_id": self.sandbox.sandbox_id, "num_commands": self.num_commands,
                      "num_pauses": self.num_pauses},
        }}

    def cleanup(self) -> None:
        """Kill the sandbox (once; a failure is logged, not raised)."""
        sandbox: Sandbox | None = getattr(self, "sandbox", None)
        if sandbox is None or getattr(self, "_closed", True):
            return
        self._closed = True
        try:
            sandbox.kill()
        except Exception as exc:
            logger.warning("could not kill sandbox %s: %s", sandbox.sandbox_id, exc)

    close = cleanup

    def __enter__(self) -> TenonEnvironment:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cleanup()

    def __del__(self) -> None:
        self.cleanup()

    # -- internals -----------------------------------------------------------------------

    def _create_sandbox(self) -> Sandbox:
        api_url = self.config.api_url or os.environ.get("E2B_API_URL", "")
        if not api_url:
            raise ConfigError("TenonEnvironment needs the server's URL: set api_url or "
                              "E2B_API_URL (and E2B_API_KEY)")
        sandbox_url = self.config.sandbox_url or os.environ.get("E2B_SANDBOX_URL", "") or api_url
        api_key = self.config.api_key or os.environ.get("E2B_API_KEY", "")
        self.config = self.config.model_copy(update={"api_url": api_url,
                                                     "sandbox_url": sandbox_url})
        sandbox = Sandbox.create(template=self.config.template,
                                 timeout=self.config.sandbox_timeout_s,
                                 metadata=dict(self.config.metadata) or None,
                                 api_url=api_url, sandbox_url=sandbox_url,
                                 api_key=api_key or None)
        logger.info("sandbox %s created at %s", sandbox.sandbox_id, api_url)
        return sandbox

    def _envs(self) -> dict[str, str]:
        forwarded = {k: v for k in self.config.forward_env if (v := os.environ.get(k)) is not None}
        return forwarded | self.config.env

    def _run(self, command: str, cwd: str, timeout_s: int) -> dict[str, Any]:
        """One command; its output as mini-swe-agent's environments return it."""
        self.num_commands += 1
        chunks: list[str] = []  # stdout and stderr in the order they arrived
        handle: CommandHandle | None = None
        try:
            handle = self.sandbox.commands.run(command, background=True, envs=self._envs(),
                                               cwd=cwd, timeout=timeout_s)
            try:
                result = handle.wait(on_stdout=chunks.append, on_stderr=chunks.append)
                exit_code, error = result.exit_code, result.error
            except CommandExitException as exc:
                exit_code, error = exc.exit_code, exc.error
        except TimeoutException as exc:
            if isinstance(exc, _SANDBOX_GONE):
                return _failure(exc, "".join(chunks))
            if handle is not None:
                _kill_quietly(handle)
            return _failure(subprocess.TimeoutExpired(command, timeout_s), "".join(chunks))
        except Exception as exc:
            return _failure(exc, "".join(chunks))
        output: dict[str, Any] = {"output": "".join(chunks), "returncode": exit_code,
                                  "exception_info": ""}
        if error:
            output["exception_info"] = f"The sandbox reported: {error}"
        return output

    def _after_command(self) -> None:
        if not self.config.force_teardown:
            return
        try:
            self.sandbox.pause()
            self.num_pauses += 1
        except Exception as exc:  # the command's result stands; residency is the server's
            logger.warning("pause of sandbox %s failed: %s", self.sandbox.sandbox_id, exc)

    def _sandbox_platform(self) -> dict[str, str]:
        if self._platform is None:
            output = self._run(_UNAME_COMMAND, "/", self.config.timeout)
            lines = output["output"].splitlines()
            if output["returncode"] == 0 and len(lines) == len(_UNAME_KEYS):
                self._platform = dict(zip(_UNAME_KEYS, lines, strict=True))
            else:
                logger.warning("uname in sandbox %s failed: %s", self.sandbox.sandbox_id,
                               output["exception_info"] or output["output"])
                self._platform = dict.fromkeys(_UNAME_KEYS, "") | {"system": "Linux"}
            self._after_command()
        return self._platform

    def _public_config(self) -> dict[str, Any]:
        return self.config.model_dump(mode="json", exclude={"api_key"})


def _submission(output: dict[str, Any]) -> str | None:
    """The submitted text if `output` is a submission (mini-swe-agent's rule), else None."""
    lines = output.get("output", "").lstrip().splitlines(keepends=True)
    if lines and lines[0].strip() == SUBMIT_MARKER and output["returncode"] == 0:
        return "".join(lines[1:])
    return None


def _failure(exc: BaseException, partial_output: str) -> dict[str, Any]:
    """A command that did not complete, reported as mini-swe-agent's environments do."""
    return {"output": partial_output, "returncode": -1,
            "exception_info": f"An error occurred while executing the command: {exc}",
            "extra": {"exception_type": type(exc).__name__, "exception": str(exc)}}


def _kill_quietly(handle: CommandHandle) -> None:
    """SIGKILL a command whose stream timed out (it may still run in the sandbox)."""
    try:
        handle.kill()
    except Exception as exc:
        logger.warning("could not kill timed-out command %s: %s", handle.pid, exc)
