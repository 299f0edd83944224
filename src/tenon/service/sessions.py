"""E2B sandboxes as Tenon agents: create, connect, pause, resume, kill, timeouts, and the
commands and files of each.

A sandbox is one logical agent of the runtime (the agent id is the sandbox id); its
commands are the agent's actions; the time between them is its model wait. Residency stays
invisible: a torn-down sandbox is rebuilt by its next command. `pause` asks the runtime to
tear the sandbox down now (when its boundary is restartable); connect, resume or the next
command wakes it. At its timeout a sandbox is killed, or paused when it was created with
auto-pause. What a client set (template, metadata, environment, timeout, paused) is kept in
the service's store, so a restarted server answers for every sandbox it had.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tenon.errors import NotBusy, RecoveryError, SandboxError, TenonError
from tenon.runtime.controller import Agent, Runtime
from tenon.runtime.results import Outcome, WorkflowFailed
from tenon.sandbox.base import ExecIO
from tenon.sandbox.netpolicy import NetworkPolicy
from tenon.service.commands import Command, CommandTable, Ended, ended_from
from tenon.service.errors import BadRequest, SandboxNotFound, SandboxUnavailable, Unauthorized
from tenon.service.files import SandboxFiles, is_persistent
from tenon.service.liveroot import open_live_root
from tenon.service.store import SandboxRecord, SandboxStore

logger = logging.getLogger(__name__)

DEFAULT_TEMPLATE = "base"
DEFAULT_TIMEOUT_S = 300
MAX_TIMEOUT_S = 30 * 24 * 3600
TIMER_PERIOD_S = 0.5
# Metadata keys a client sets to inform Tenon's predictor (E2B carries them unchanged).
TASK_KEY, FAMILY_KEY, WORKFLOW_KEY = "tenon.task", "tenon.family", "tenon.workflow"
PROMPT_KEY = "tenon.task_prompt"  # the task's text, for predictors that read it
PROFILE_PEAK_KEY = "tenon.profile_peak_bytes"  # the peak-reserving baselines need it
# A command's environment may name the command it stands for (a wrapper's real command) and
# its action class; both go to the predictor, neither into the sandbox.
ACTION_ENV, ACTION_CLASS_ENV = "TENON_ACTION", "TENON_ACTION_CLASS"


@dataclass
class Session:
    """One E2B sandbox: its record, its agent (None while it cannot run, with the reason)
    and its live commands."""

    record: SandboxRecord
    agent: Agent | None
    unavailable: str | None = None
    commands: CommandTable = field(default_factory=CommandTable)
    pending: asyncio.Task[Any] | None = None
    """The agent's last action while it runs or finishes its boundary."""
    turn: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def sandbox_id(self) -> str:
        return self.record.sandbox_id

    async def settled(self) -> None:
        """Wait until the agent's last action has finished its boundary."""
        while self.pending is not None and not self.pending.done():
            pending = self.pending
            try:
                await asyncio.shield(pending)
            except asyncio.CancelledError:
                if not pending.done():
                    raise  # this caller was cancelled, not the action
            except Exception:  # noqa: BLE001,S110 - the action's own caller reports its failure
                pass

    def forget_pending(self, task: asyncio.Task[Any]) -> None:
        if self.pending is task:
            self.pending = None
        if not task.cancelled() and task.exception() is not None:
            logger.debug("action of sandbox %s: %s", self.sandbox_id, task.exception())


class SessionManager:
    """Every E2B sandbox of one runtime."""

    def __init__(self, runtime: Runtime, state_dir: Path, *, templates: Mapping[str, str],
                 images: Callable[[], list[str]] | None = None,
                 image_root: Callable[[str], Path | None] | None = None,
                 max_write_bytes: int = 100 * 1024 * 1024,
                 wall_clock: Callable[[], float] = time.time) -> None:
        """`templates` maps E2B template names (aliases, e.g. `base`) to images; any other
        template id a client asks for is an image name, offered when `images()` (the
        image store's names) lists it; `image_root(image)` is the host directory of an
        image's root filesystem (the process backend's), for reading paths outside the
        persistent directories."""
        self.runtime = runtime
        self.templates = dict(templates)
        self._images = images
        self._image_root = image_root
        self._max_write_bytes = max_write_bytes
        self.wall_clock = wall_clock
        self._store = SandboxStore(state_dir)
        self.sessions: dict[str, Session] = {}
        self._timer: asyncio.Task[None] | None = None
        self._prewarms: set[asyncio.Task[None]] = set()

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        """Restore every sandbox of the store (after a restart: as the runtime recovered
        its agent), then start enforcing timeouts."""
        for record in self._store.all():
            agent, reason = await self._agent_for(record)
            self.sessions[record.sandbox_id] = Session(record, agent, reason)
        self._timer = asyncio.ensure_future(self._enforce_timeouts())

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._timer
        for task in list(self._prewarms):
            task.cancel()
        await asyncio.gather(*self._prewarms, return_exceptions=True)
        for session in self.sessions.values():
            await session.commands.kill_all()
            await session.settled()
        self._store.close()

    async def _agent_for(self, record: SandboxRecord) -> tuple[Agent | None, str | None]:
        recovered = self.runtime.recovered.get(record.sandbox_id)
        if recovered is not None:  # a blocked one refuses commands, saying why
            return recovered, None
        try:  # never ran a command before the restart: nothing on disk to lose
            return await self._new_agent(record), None
        except TenonError as exc:
            return None, f"sandbox {record.sandbox_id} could not be restored: {exc}"

    async def _new_agent(self, record: SandboxRecord) -> Agent:
        meta = record.metadata
        peak = meta.get(PROFILE_PEAK_KEY)
        return await self.runtime.create_agent(
            image=self.image_of(record.template), agent_id=record.sandbox_id,
            family=meta.get(FAMILY_KEY), task=meta.get(TASK_KEY),
            workflow=meta.get(WORKFLOW_KEY), task_prompt=meta.get(PROMPT_KEY),
            profile_peak_bytes=int(peak) if peak and peak.isdigit() else None,
            network=record.network)

    def image_of(self, template: str) -> str:
        """The image an E2B template id or alias names."""
        return self.templates.get(template, template)

    def offered(self) -> list[str]:
        """Every template id a client may ask for: the aliases and the images."""
        return sorted({*self.templates, *(self._images() if self._images else ())})

    def _check_template(self, template: str) -> None:
        if template in self.templates:
            return
        names = self._images() if self._images is not None else []
        if template in names or (":" not in template and f"{template}:latest" in names):
            return
        raise BadRequest(f"unknown template {template!r}; this server offers "
                         f"{', '.join(self.offered())}")

    # -- the control plane -----------------------------------------------------------

    def get(self, sandbox_id: str) -> Session:
        session = self.sessions.get(sandbox_id)
        if session is None:
            raise SandboxNotFound(f"sandbox {sandbox_id} was not found")
        return session

    async def create(self, *, template: str | None, timeout_s: int | None,
                     metadata: Mapping[str, str] | None, env_vars: Mapping[str, str] | None,
                     auto_pause: bool = False,
                     network: NetworkPolicy | None = None) -> Session:
        template = template or DEFAULT_TEMPLATE
        self._check_template(template)
        timeout = _check_timeout(DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
        meta = {str(k): str(v) for k, v in (metadata or {}).items()}
        now = self.wall_clock()
        record = SandboxRecord(secrets.token_hex(10), template, now, now + timeout,
                               secrets.token_urlsafe(24), meta,
                               {str(k): str(v) for k, v in (env_vars or {}).items()},
                               auto_pause, False, float(timeout),
                               None if network is None else network.to_dict())
        self._store.put(record)  # before the agent: a crash now leaves a sandbox to restore
        try:
            agent = await self._new_agent(record)
        except BaseException:
            self._store.delete(record.sandbox_id)
            raise
        session = Session(record, agent)
        self.sessions[record.sandbox_id] = session
        return session

    async def kill(self, sandbox_id: str) -> None:
        session = self.get(sandbox_id)
        del self.sessions[sandbox_id]
        await session.commands.kill_all()
        await session.settled()
        if session.agent is not None:
            await session.agent.close()
        self._store.delete(sandbox_id)

    def set_timeout(self, sandbox_id: str, timeout_s: int) -> None:
        session = self.get(sandbox_id)
        session.record.end_at = self.wall_clock() + _check_timeout(timeout_s)
        self._store.put(session.record)

    async def pause(self, sandbox_id: str) -> bool:
        """E2B pause: the sandbox stops counting against its timeout and is torn down now
        when its boundary is restartable (else it stays resident, the reason logged). False
        when it was paused already."""
        session = self.get(sandbox_id)
        if session.record.paused:
            return False
        session.record.paused = True
        self._store.put(session.record)
        await session.settled()
        if session.agent is not None and not session.commands.busy:
            reason = await self.runtime.teardown_now(sandbox_id)
            if reason is not None:
                logger.info("sandbox %s paused but kept resident: %s", sandbox_id, reason)
        return True

    async def resume(self, sandbox_id: str, timeout_s: int | None) -> Session:
        """E2B connect/resume: running again, its timeout at least `timeout_s` from now,
        and its sandbox rebuilt now if it was torn down (a client pre-warms it while its
        model generates)."""
        session = self.get(sandbox_id)
        timeout = _check_timeout(session.record.timeout_s if timeout_s is None else timeout_s)
        session.record.end_at = max(session.record.end_at if not session.record.paused else 0.0,
                                    self.wall_clock() + timeout)
        session.record.paused = False
        self._store.put(session.record)
        if session.agent is not None and not session.agent.failed:
            # rebuilt in the background: the client's model generates meanwhile, and its
            # next command finds the sandbox resident (or waits for this rebuild)
            task = asyncio.ensure_future(self._prewarm(sandbox_id))
            self._prewarms.add(task)
            task.add_done_callback(self._prewarms.discard)
        return session

    async def _prewarm(self, sandbox_id: str) -> None:
        try:
            await self.runtime.prewarm(sandbox_id)
        except TenonError as exc:  # the next command rebuilds it, or says why not
            logger.warning("pre-warming sandbox %s: %s", sandbox_id, exc)

    def list(self) -> list[Session]:
        return list(self.sessions.values())

    def memory_bytes(self, sandbox_id: str) -> int:
        """What the sandbox holds now (0 while torn down)."""
        sandbox = self.runtime.residency.sandbox_for(sandbox_id)
        if sandbox is None:
            return 0
        try:
            return sandbox.cgroup.reading().usage_bytes
        except (OSError, SandboxError):
            return 0

    async def _enforce_timeouts(self) -> None:
        while True:
            await asyncio.sleep(TIMER_PERIOD_S)
            now = self.wall_clock()
            for session in list(self.sessions.values()):
                if session.record.paused or session.record.end_at > now:
                    continue
                try:
                    if session.record.auto_pause:
                        await self.pause(session.sandbox_id)
                    else:
                        await self.kill(session.sandbox_id)
                except Exception:  # noqa: BLE001 - one sandbox never stops the others' timers
                    logger.exception("timeout of sandbox %s", session.sandbox_id)

    # -- the sandbox side: commands and files ----------------------------------------

    def for_sandbox_call(self, sandbox_id: str | None, access_token: str | None) -> Session:
        """The session a sandbox-side call (envd) names; a paused sandbox wakes up."""
        if not sandbox_id:
            raise SandboxNotFound("the request names no sandbox (E2b-Sandbox-Id header)")
        session = self.sessions.get(sandbox_id)
        if session is None:
            raise SandboxNotFound(f"sandbox {sandbox_id} was not found")
        if access_token is None or not secrets.compare_digest(access_token,
                                                              session.record.access_token):
            raise Unauthorized(f"wrong or missing access token for sandbox {sandbox_id}")
        if session.record.paused:  # the next call resumes it, as E2B's auto-resume
            session.record.paused = False
            session.record.end_at = max(session.record.end_at,
                                        self.wall_clock() + session.record.timeout_s)
            self._store.put(session.record)
        return session

    async def run_command(self, session: Session, command: Command, io: ExecIO,
                          timeout_s: float) -> Ended:
        """Run one client command: alongside the action in flight when another command of
        the sandbox still runs, else the agent's next action.

        The client has its answer once the action's outcome is known; Tenon finishes the
        boundary (the restart-safe check, the records) meanwhile, and the sandbox's next
        action, pause or kill waits for that (`Session.pending`)."""
        if session.agent is None:
            raise SandboxUnavailable(session.unavailable or f"{session.sandbox_id} is lost")
        agent = session.agent
        env = {**session.record.env_vars, **io.env}
        # A client may name what a wrapped command really is, for the predictor.
        issued = env.pop(ACTION_ENV, None) or shell_words(command)
        action_class = env.pop(ACTION_CLASS_ENV, None)
        io.env = env
        line = command.spec.shell_line()
        no_action = False  # other commands run, but none of them is an action in flight
        while True:
            async with session.turn:  # one command at a time decides who is the action
                alongside = not no_action and any(
                    c is not command for c in session.commands.running.values())
                if not alongside:
                    await session.settled()
                    outcome: asyncio.Future[Ended] = asyncio.get_running_loop().create_future()

                    def answer(kind: str, exit_code: int,
                               outcome: asyncio.Future[Ended] = outcome) -> None:
                        if not outcome.done():
                            outcome.set_result(_ended_of_action(Outcome(kind), exit_code, ""))

                    io.on_outcome = answer
                    task = asyncio.ensure_future(agent.run(
                        line, timeout=timeout_s, io=io, max_output_bytes=4096,
                        issued_command=issued, action_class=action_class))
                    session.pending = task
                    task.add_done_callback(session.forget_pending)
            if alongside:
                try:
                    result = await agent.run_alongside(line, timeout=timeout_s, io=io,
                                                       max_output_bytes=4096)
                    return ended_from(result.exit_code, timed_out=result.timed_out)
                except NotBusy:  # the action has not started yet, or just ended: look again
                    no_action = session.pending is None or session.pending.done()
                    await asyncio.sleep(0)
                    continue
            try:
                either: set[asyncio.Future[Any]] = {task, outcome}
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                task.cancel()  # the client's command is killed: so is the action
                raise
            if outcome.done():
                return outcome.result()
            try:
                action = task.result()
            except WorkflowFailed as exc:
                raise SandboxUnavailable(str(exc)) from exc
            return _ended_of_action(action.outcome, action.exit_code, action.output)

    @contextlib.asynccontextmanager
    async def files(self, sandbox_id: str, *, write: bool, paths: Sequence[str] = (),
                    user: str | None = None) -> AsyncIterator[SandboxFiles]:
        """The sandbox's files for one request on `paths` (`FilesResolver`): through its
        live root (rebuilt first if torn down) as `user` when a path lies outside the
        persistent directories, else the persistent root alone (held off teardown and
        rebuild when writing)."""
        session = self.sessions.get(sandbox_id)
        if session is None:
            raise SandboxNotFound(f"sandbox {sandbox_id} was not found")
        if not all(is_persistent(path) for path in paths):
            async with self._live_files(session, user) as files:
                yield files
            return
        image = self.image_of(session.record.template)
        image_root = self._image_root(image) if self._image_root is not None else None
        workspaces = self.runtime.workspaces
        if write or not workspaces.exists(sandbox_id):
            # held off teardown and rebuild; a torn-down agent's record follows the edit
            async with self.runtime.edit_workspace(sandbox_id) as root:
                yield SandboxFiles(root, image_root=image_root,
                                   max_write_bytes=self._max_write_bytes)
        else:  # reading never changes what a rebuild verifies
            root = await asyncio.to_thread(workspaces.attach, sandbox_id)
            yield SandboxFiles(root, image_root=image_root,
                               max_write_bytes=self._max_write_bytes)


    @contextlib.asynccontextmanager
    async def _live_files(self, session: Session, user: str | None,
                          ) -> AsyncIterator[SandboxFiles]:
        sandbox_id = session.sandbox_id
        if session.agent is None:
            raise SandboxUnavailable(session.unavailable or f"{sandbox_id} is lost")
        try:
            async with self.runtime.live_sandbox(sandbox_id) as sandbox:
                live = await asyncio.to_thread(open_live_root, sandbox, user)
                try:
                    root = await asyncio.to_thread(self.runtime.workspaces.attach, sandbox_id)
                    image = self.image_of(session.record.template)
                    image_root = (None if live is not None or self._image_root is None
                                  else self._image_root(image))
                    yield SandboxFiles(root, image_root=image_root, live=live,
                                       max_write_bytes=self._max_write_bytes)
                finally:
                    if live is not None:
                        os.close(live.top_fd)
        except (WorkflowFailed, RecoveryError) as exc:
            raise SandboxUnavailable(f"sandbox {sandbox_id}: {exc}") from exc


class FilesResolverAdapter:
    """The files services' resolver (reading/writing by sandbox id) over the sessions."""

    def __init__(self, sessions: SessionManager) -> None:
        self._sessions = sessions

    def reading(self, sandbox_id: str, paths: Sequence[str] = (), user: str | None = None,
                ) -> contextlib.AbstractAsyncContextManager[SandboxFiles]:
        return self._sessions.files(sandbox_id, write=False, paths=paths, user=user)

    def writing(self, sandbox_id: str, paths: Sequence[str] = (), user: str | None = None,
                ) -> contextlib.AbstractAsyncContextManager[SandboxFiles]:
        return self._sessions.files(sandbox_id, write=True, paths=paths, user=user)


def shell_words(command: Command) -> str:
    """The command as the client wrote it (a shell's `-c` script when it ran one): what the
    predictor learns from."""
    args = command.spec.args
    if len(args) >= 2 and args[-2] == "-c":
        return args[-1]
    return " ".join((command.spec.cmd, *args))


def _ended_of_action(outcome: Outcome, exit_code: int, output: str) -> Ended:
    if outcome is Outcome.TIMEOUT:
        return ended_from(-9, timed_out=True)
    if outcome is Outcome.OOM_KILLED:
        return ended_from(-9, error="OOM kill: the sandbox ran out of memory")
    if outcome is Outcome.SANDBOX_DIED:
        return Ended(-1, False, "error", output.splitlines()[0] if output else "sandbox died")
    return ended_from(exit_code)


def _check_timeout(timeout_s: int | float) -> int:
    if not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise BadRequest(f"timeout must be between 1 and {MAX_TIMEOUT_S} seconds, "
                         f"got {timeout_s}")
    return int(timeout_s)
