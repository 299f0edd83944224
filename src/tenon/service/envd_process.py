"""envd's Process service (Connect RPC), served by the SDK's generated ASGI application:
start, attach to, list, feed and signal a sandbox's commands."""

from __future__ import annotations

import base64
import signal
from collections.abc import AsyncIterator

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from e2b.envd.process import process_pb as pb
from e2b.envd.process.process_connect import ProcessASGIApplication
from protobuf import Oneof

from tenon.service.commands import NO_TIMEOUT_S, Command, CommandSpec, Ended, Event
from tenon.service.errors import ServiceError
from tenon.service.sessions import Session, SessionManager

SANDBOX_HEADER = "e2b-sandbox-id"
# The SDK names the user a command runs as in "Authorization: Basic base64(user:)".
AUTH_HEADER = "authorization"
TOKEN_HEADER = "x-access-token"
KEEPALIVE_HEADER = "keepalive-ping-interval"
DEFAULT_KEEPALIVE_S = 50.0


class ProcessService:
    """The generated `Process` protocol over a `SessionManager`."""

    def __init__(self, sessions: SessionManager) -> None:
        self._sessions = sessions

    def _session(self, ctx: RequestContext[object, object]) -> Session:
        headers = ctx.request_headers
        try:
            return self._sessions.for_sandbox_call(headers.get(SANDBOX_HEADER),
                                                   headers.get(TOKEN_HEADER))
        except ServiceError as exc:
            raise ConnectError(exc.connect_code, str(exc)) from exc

    @staticmethod
    def _command(session: Session, selector: pb.ProcessSelector | None) -> Command:
        which = selector.selector if selector is not None else None
        command = None
        if which is not None and which.field == "pid":
            command = session.commands.find(pid=int(which.value))
        elif which is not None and which.field == "tag":
            command = session.commands.find(tag=str(which.value))
        if command is None:
            what = "no process named" if which is None else f"{which.field} {which.value}"
            raise ConnectError(Code.NOT_FOUND, f"process with {what} not found")
        return command

    async def list(self, request: pb.ListRequest,
                   ctx: RequestContext[pb.ListRequest, pb.ListResponse]) -> pb.ListResponse:
        session = self._session(ctx)  # type: ignore[arg-type]
        return pb.ListResponse(processes=[
            pb.ProcessInfo(config=pb.ProcessConfig(cmd=c.spec.cmd, args=list(c.spec.args),
                                                   envs=dict(c.spec.envs), cwd=c.spec.cwd),
                           pid=c.pid, tag=c.spec.tag)
            for c in session.commands.running.values()])

    async def start(self, request: pb.StartRequest,
                    ctx: RequestContext[pb.StartRequest, pb.StartResponse]
                    ) -> AsyncIterator[pb.StartResponse]:
        session = self._session(ctx)  # type: ignore[arg-type]
        if request.pty is not None:
            raise ConnectError(Code.UNIMPLEMENTED, "pseudo-terminals are not offered")
        config = request.process or pb.ProcessConfig()
        if not config.cmd:
            raise ConnectError(Code.INVALID_ARGUMENT, "the process has no cmd")
        spec = CommandSpec(config.cmd, tuple(config.args), dict(config.envs), config.cwd or None,
                           request.tag or None, bool(request.stdin),
                           basic_auth_user(ctx.request_headers.get(AUTH_HEADER)))
        timeout_ms = ctx.timeout_ms
        timeout_s = timeout_ms / 1000 if timeout_ms else NO_TIMEOUT_S
        sessions = self._sessions

        async def run(command: Command, io: object, limit_s: float) -> Ended:
            return await sessions.run_command(session, command, io, limit_s)  # type: ignore[arg-type]

        command = session.commands.start(spec, run, timeout_s)
        async for event in _stream(command, _keepalive_s(ctx)):  # type: ignore[arg-type]
            yield pb.StartResponse(event=event)

    async def connect(self, request: pb.ConnectRequest,
                      ctx: RequestContext[pb.ConnectRequest, pb.ConnectResponse]
                      ) -> AsyncIterator[pb.ConnectResponse]:
        session = self._session(ctx)  # type: ignore[arg-type]
        command = self._command(session, request.process)
        async for event in _stream(command, _keepalive_s(ctx)):  # type: ignore[arg-type]
            yield pb.ConnectResponse(event=event)

    async def update(self, request: pb.UpdateRequest,
                     ctx: RequestContext[pb.UpdateRequest, pb.UpdateResponse]
                     ) -> pb.UpdateResponse:
        raise ConnectError(Code.UNIMPLEMENTED, "pseudo-terminals are not offered")

    async def stream_input(self, request: AsyncIterator[pb.StreamInputRequest],
                           ctx: RequestContext[pb.StreamInputRequest, pb.StreamInputResponse]
                           ) -> pb.StreamInputResponse:
        session = self._session(ctx)  # type: ignore[arg-type]
        command: Command | None = None
        async for message in request:
            event = message.event
            if event is None:
                continue
            if event.field == "start":
                command = self._command(session, event.value.process)
            elif event.field == "data":
                if command is None:
                    raise ConnectError(Code.INVALID_ARGUMENT, "input before its start event")
                await _write(command, event.value.input)
        return pb.StreamInputResponse()

    async def send_input(self, request: pb.SendInputRequest,
                         ctx: RequestContext[pb.SendInputRequest, pb.SendInputResponse]
                         ) -> pb.SendInputResponse:
        command = self._command(self._session(ctx), request.process)  # type: ignore[arg-type]
        await _write(command, request.input)
        return pb.SendInputResponse()

    async def send_signal(self, request: pb.SendSignalRequest,
                          ctx: RequestContext[pb.SendSignalRequest, pb.SendSignalResponse]
                          ) -> pb.SendSignalResponse:
        command = self._command(self._session(ctx), request.process)  # type: ignore[arg-type]
        signum = {pb.Signal.SIGKILL: signal.SIGKILL,
                  pb.Signal.SIGTERM: signal.SIGTERM}.get(request.signal)
        if signum is None:
            raise ConnectError(Code.INVALID_ARGUMENT, f"unsupported signal {request.signal}")
        await command.signal(signum)
        return pb.SendSignalResponse()

    async def close_stdin(self, request: pb.CloseStdinRequest,
                          ctx: RequestContext[pb.CloseStdinRequest, pb.CloseStdinResponse]
                          ) -> pb.CloseStdinResponse:
        command = self._command(self._session(ctx), request.process)  # type: ignore[arg-type]
        await command.close_stdin()
        return pb.CloseStdinResponse()


def basic_auth_user(header: str | None) -> str | None:
    """The user of a "Basic base64(user:)" Authorization header (None without one);
    INVALID_ARGUMENT when it is malformed."""
    if not header:
        return None
    scheme, _, encoded = header.partition(" ")
    try:
        if scheme.lower() != "basic":
            raise ValueError(scheme)
        user = base64.b64decode(encoded.strip(), validate=True).decode().partition(":")[0]
    except ValueError as exc:  # binascii.Error and UnicodeDecodeError are ValueErrors
        raise ConnectError(Code.INVALID_ARGUMENT,
                           "the Authorization header is not Basic base64(user:)") from exc
    return user or None


async def _write(command: Command, data: pb.ProcessInput | None) -> None:
    if data is None or data.input is None:
        return
    if data.input.field != "stdin":
        raise ConnectError(Code.UNIMPLEMENTED, "pseudo-terminals are not offered")
    try:
        await command.write_stdin(bytes(data.input.value))
    except ValueError as exc:
        raise ConnectError(Code.FAILED_PRECONDITION, str(exc)) from exc


async def _stream(command: Command, keepalive_s: float) -> AsyncIterator[pb.ProcessEvent]:
    """A client's view of `command`: its start event, then its output, keepalives and end."""
    queue = command.subscribe()
    try:
        yield _start_event(command.pid)
        async for event in command.events(queue, keepalive_s):
            yield _event(event)
    finally:
        command.unsubscribe(queue)


def _keepalive_s(ctx: RequestContext[object, object]) -> float:
    raw = ctx.request_headers.get(KEEPALIVE_HEADER)
    try:
        return max(float(raw), 1.0) if raw else DEFAULT_KEEPALIVE_S
    except ValueError:
        return DEFAULT_KEEPALIVE_S


def _start_event(pid: int) -> pb.ProcessEvent:
    return pb.ProcessEvent(event=Oneof("start", pb.ProcessEvent.StartEvent(pid=pid)))  # type: ignore[arg-type]


def _event(event: Event | None) -> pb.ProcessEvent:
    if event is None:
        return pb.ProcessEvent(event=Oneof("keepalive", pb.ProcessEvent.KeepAlive()))  # type: ignore[arg-type]
    kind, value = event
    if kind == "end":
        assert isinstance(value, Ended)
        return pb.ProcessEvent(event=Oneof("end", pb.ProcessEvent.EndEvent(  # type: ignore[arg-type]
            exit_code=value.exit_code, exited=value.exited, status=value.status,
            error=value.error)))
    return pb.ProcessEvent(event=Oneof("data", pb.ProcessEvent.DataEvent(  # type: ignore[arg-type]
        output=Oneof(kind, value))))  # type: ignore[arg-type]


def process_app(sessions: SessionManager) -> ProcessASGIApplication:
    return ProcessASGIApplication(ProcessService(sessions))  # type: ignore[arg-type]
