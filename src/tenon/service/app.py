"""One ASGI application for the whole E2B-compatible surface of a host.

The SDK sends control-plane and sandbox-side calls to the same address: a request is routed
by its path: the Connect services (`/process.Process/...`, `/filesystem.Filesystem/...`)
and envd's `/files` and `/health` are sandbox-side (they name their sandbox in the
`E2b-Sandbox-Id` header and carry its access token); everything else is the control plane
(authenticated by `X-API-Key`) or the server's own pages (`/metrics`, `/live`, open to
whoever can reach the listen address, loopback by default).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

from tenon.service.api import control_plane
from tenon.service.envd_filesystem import filesystem_app
from tenon.service.envd_process import SANDBOX_HEADER, TOKEN_HEADER, process_app
from tenon.service.errors import ServiceError, Unauthorized
from tenon.service.files_http import files_routes
from tenon.service.sessions import FilesResolverAdapter, SessionManager

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

API_KEY_HEADER = "x-api-key"
OPEN_PATHS = ("/metrics", "/live", "/docs", "/openapi.json")
_CONNECT_STATUS = {401: "unauthenticated", 404: "not_found", 502: "unavailable",
                   400: "invalid_argument"}


def error_response(exc: ServiceError) -> JSONResponse:
    """The control plane's error body, which the SDK reads (`code`, `message`)."""
    return JSONResponse({"code": exc.http_status, "message": str(exc)},
                        status_code=exc.http_status)


class TenonApp:
    """Routes each request to the control plane, an envd service or a page."""

    def __init__(self, sessions: SessionManager, api_keys: Iterable[str], *,
                 extra_routes: Iterable[Route] = (), max_write_bytes: int) -> None:
        self.sessions = sessions
        self._keys = [k.encode() for k in api_keys]
        if not self._keys:
            raise ValueError("the server needs at least one API key")
        resolver = FilesResolverAdapter(sessions)
        self._process = process_app(sessions)
        self._filesystem = filesystem_app(resolver)
        self._envd_http = Starlette(routes=[
            *files_routes(resolver, max_write_bytes=max_write_bytes),
            Route("/health", lambda _: Response(status_code=204), methods=["GET"]),
        ])
        api = FastAPI(title="Tenon", docs_url="/docs", redoc_url=None)
        api.include_router(control_plane(sessions))
        for route in extra_routes:
            api.router.routes.append(route)

        @api.exception_handler(ServiceError)
        async def _service_error(_: Request, exc: ServiceError) -> JSONResponse:
            return error_response(exc)

        @api.middleware("http")
        async def _authenticate(request: Request,
                                call_next: Callable[[Request], Awaitable[Response]]
                                ) -> Response:
            if request.url.path.startswith(OPEN_PATHS) or self.key_ok(
                    request.headers.get(API_KEY_HEADER)):
                return await call_next(request)
            return error_response(Unauthorized("invalid or missing API key (X-API-Key)"))

        self._api = api

    def key_ok(self, key: str | None) -> bool:
        if not key:
            return False
        given = key.encode()
        return any(hmac.compare_digest(given, k) for k in self._keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._api(scope, receive, send)
            return
        path: str = scope["path"]
        target: ASGIApp | None = None
        if path.startswith("/process.Process/"):
            target = self._process
        elif path.startswith("/filesystem.Filesystem/"):
            target = self._filesystem
        elif path in ("/files", "/health"):
            target = self._envd_http
        if target is None:
            await self._api(scope, receive, send)
            return
        problem = self._check_sandbox_call(scope, connect=path != "/files"
                                           and path != "/health")
        if problem is not None:
            await problem(scope, receive, send)
            return
        await target(scope, receive, send)

    def _check_sandbox_call(self, scope: Scope, *, connect: bool) -> Response | None:
        """A refusal for a sandbox-side call naming an unknown sandbox or carrying the
        wrong access token; None when it may proceed."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        try:
            self.sessions.for_sandbox_call(headers.get(SANDBOX_HEADER),
                                           headers.get(TOKEN_HEADER))
        except ServiceError as exc:
            # As E2B's proxy: an unknown sandbox is a 502 saying it "was not found", which
            # the SDK reports as a sandbox no longer running.
            status = 502 if exc.http_status == 404 else exc.http_status
            body: dict[str, object]
            if connect:
                body = {"code": _CONNECT_STATUS.get(status, "unknown"), "message": str(exc)}
            else:
                body = {"code": status, "message": str(exc)}
            return Response(json.dumps(body), status_code=status,
                            media_type="application/json")
        return None
