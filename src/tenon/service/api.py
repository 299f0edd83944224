"""E2B's control-plane REST API over the sessions: create, connect, list, inspect, time,
pause, resume and kill sandboxes; and `GET /tenon/load`, the node's load for a cluster's
front door.

Bodies are built and parsed with the SDK's own generated models (`e2b.api.client.models`),
so field names and formats are the ones the official client reads and writes.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import urllib.parse
from typing import Any

from e2b.api.client.models import (
    ConnectSandboxV2,
    ListedSandbox,
    NewSandboxV2,
    SandboxDetail,
    SandboxMetric,
    SandboxState,
    SandboxTimeoutRequest,
)
from e2b.api.client.models import Sandbox as SandboxModel
from e2b.api.client.types import Unset
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from starlette.routing import Route

from tenon.runtime.controller import Runtime
from tenon.runtime.load import node_load
from tenon.service.errors import BadRequest, Conflict
from tenon.service.network import policy_of
from tenon.service.sessions import Session, SessionManager

LOAD_PATH = "/tenon/load"
ENVD_VERSION = "0.6.4"  # the envd API level this server speaks (the SDK gates features on it)
CLIENT_ID = "tenon"
CPU_COUNT = 2


def _unset(value: Any, default: Any = None) -> Any:
    return default if isinstance(value, Unset) else value


def _internet_access(network: dict[str, Any] | None) -> bool:
    return bool(network and network.get("allow_internet_access"))


def _time(seconds: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC)


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not JSON: {exc.msg} at {exc.pos}") from exc
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def _parse(model: Any, body: dict[str, Any]) -> Any:
    try:
        return model.from_dict(body)
    except (KeyError, TypeError, ValueError) as exc:
        raise BadRequest(f"malformed {model.__name__} body: {exc}") from exc


def control_plane(sessions: SessionManager) -> APIRouter:
    """The routes; authentication is the app's middleware."""
    router = APIRouter()
    memory_mb = (sessions.runtime.domain.budget_bytes or 0) // (1024 * 1024)

    def created(session: Session) -> dict[str, Any]:
        record = session.record
        return SandboxModel(template_id=record.template, sandbox_id=record.sandbox_id,
                            client_id=CLIENT_ID, envd_version=ENVD_VERSION,
                            envd_access_token=record.access_token).to_dict()

    def state_of(session: Session) -> SandboxState:
        return SandboxState.PAUSED if session.record.paused else SandboxState.RUNNING

    def listed(session: Session) -> dict[str, Any]:
        r = session.record
        return ListedSandbox(template_id=r.template, sandbox_id=r.sandbox_id,
                             client_id=CLIENT_ID, started_at=_time(r.started_at),
                             end_at=_time(r.end_at), cpu_count=CPU_COUNT, memory_mb=memory_mb,
                             disk_size_mb=_disk_mb(sessions), state=state_of(session),
                             envd_version=ENVD_VERSION, metadata=r.metadata).to_dict()

    @router.post("/sandboxes", status_code=201)
    @router.post("/v2/sandboxes", status_code=201)
    async def create(request: Request) -> dict[str, Any]:
        new = _parse(NewSandboxV2, await _body(request))
        session = await sessions.create(
            template=new.template_id, timeout_s=_unset(new.timeout),
            metadata=_unset(new.metadata, {}), env_vars=_unset(new.env_vars, {}),
            auto_pause=bool(_unset(new.auto_pause, False)),
            network=policy_of(new.allow_internet_access, new.network))
        return created(session)

    @router.get("/sandboxes")
    @router.get("/v2/sandboxes")
    async def list_sandboxes(request: Request, response: Response) -> list[dict[str, Any]]:
        query = request.query_params
        wanted = _metadata_filter(query.get("metadata"))
        states = set(query.get("state", "").split(",")) - {""}
        template = query.get("template")
        found = [s for s in sessions.list()
                 if all(s.record.metadata.get(k) == v for k, v in wanted.items())
                 and (not states or state_of(s).value in states)
                 and (template is None or s.record.template == template)]
        found.sort(key=lambda s: s.record.started_at, reverse=query.get("order") == "desc")
        start = _int_param(query.get("nextToken"), "nextToken", 0)
        limit = _int_param(query.get("limit"), "limit", len(found) or 1)
        page = found[start:start + limit]
        if start + limit < len(found):
            response.headers["x-next-token"] = str(start + limit)
        return [listed(s) for s in page]

    @router.get("/sandboxes/{sandbox_id}")
    async def get_info(sandbox_id: str) -> dict[str, Any]:
        session = sessions.get(sandbox_id)
        r = session.record
        return SandboxDetail(template_id=r.template, sandbox_id=r.sandbox_id,
                             client_id=CLIENT_ID, started_at=_time(r.started_at),
                             end_at=_time(r.end_at), envd_version=ENVD_VERSION,
                             cpu_count=CPU_COUNT, memory_mb=memory_mb,
                             disk_size_mb=_disk_mb(sessions), state=state_of(session),
                             envd_access_token=r.access_token, metadata=r.metadata,
                             allow_internet_access=_internet_access(r.network)).to_dict()

    @router.delete("/sandboxes/{sandbox_id}", status_code=204)
    async def kill(sandbox_id: str) -> Response:
        await sessions.kill(sandbox_id)
        return Response(status_code=204)

    @router.post("/sandboxes/{sandbox_id}/timeout", status_code=204)
    async def set_timeout(sandbox_id: str, request: Request) -> Response:
        body = _parse(SandboxTimeoutRequest, await _body(request))
        sessions.set_timeout(sandbox_id, body.timeout)
        return Response(status_code=204)

    @router.post("/sandboxes/{sandbox_id}/refreshes", status_code=204)
    async def refresh(sandbox_id: str, request: Request) -> Response:
        body = await _body(request)
        sessions.set_timeout(sandbox_id, int(body.get("duration") or 60))
        return Response(status_code=204)

    @router.get("/sandboxes/{sandbox_id}/metrics")
    async def metrics(sandbox_id: str) -> list[dict[str, Any]]:
        session = sessions.get(sandbox_id)
        now = sessions.wall_clock()
        used = sessions.memory_bytes(session.sandbox_id)
        disk = sessions.runtime.workspaces.usage(session.sandbox_id) if \
            sessions.runtime.workspaces.exists(session.sandbox_id) else None
        return [SandboxMetric(timestamp=_time(now), timestamp_unix=int(now),
                              cpu_count=CPU_COUNT, cpu_used_pct=0.0, mem_used=used,
                              mem_total=memory_mb * 1024 * 1024, mem_cache=0,
                              disk_used=disk.used_bytes if disk else 0,
                              disk_total=disk.capacity_bytes if disk else 0).to_dict()]

    @router.post("/sandboxes/{sandbox_id}/pause", status_code=204)
    async def pause(sandbox_id: str) -> Response:
        if not await sessions.pause(sandbox_id):
            raise Conflict(f"sandbox {sandbox_id} is already paused")
        return Response(status_code=204)

    @router.post("/sandboxes/{sandbox_id}/connect")
    @router.post("/v2/sandboxes/{sandbox_id}/connect")
    async def connect(sandbox_id: str, request: Request) -> JSONResponse:
        body = _parse(ConnectSandboxV2, await _body(request))
        was_paused = sessions.get(sandbox_id).record.paused
        session = await sessions.resume(sandbox_id, _unset(body.timeout))
        return JSONResponse(created(session), status_code=201 if was_paused else 200)

    @router.post("/sandboxes/{sandbox_id}/resume", status_code=201)
    async def resume(sandbox_id: str, request: Request) -> dict[str, Any]:
        body = await _body(request)
        if not sessions.get(sandbox_id).record.paused:
            raise Conflict(f"sandbox {sandbox_id} is already running")
        timeout = body.get("timeout")
        return created(await sessions.resume(
            sandbox_id, timeout if isinstance(timeout, int) else None))

    for method, path, what in NOT_OFFERED:
        router.add_api_route(path, _not_offered(what), methods=[method],
                             include_in_schema=False)
    return router


def load_route(runtime: Runtime, node: str) -> Route:
    """`GET /tenon/load`: the runtime's `NodeLoad` as node `node`, as JSON (its dataclass
    fields). A control-plane call: the app's middleware checks the API key."""

    async def load(_: Request) -> JSONResponse:
        return JSONResponse(dataclasses.asdict(node_load(runtime, node)))

    return Route(LOAD_PATH, load, methods=["GET"])


# E2B API calls this server answers with an explicit refusal rather than a bare 404.
NOT_OFFERED = [
    ("POST", "/sandboxes/{sandbox_id}/fork", "forking a sandbox"),
    ("POST", "/sandboxes/{sandbox_id}/snapshots", "snapshots"),
    ("GET", "/snapshots", "snapshots"),
    ("PUT", "/sandboxes/{sandbox_id}/network", "network rules"),
    ("GET", "/sandboxes/{sandbox_id}/logs", "sandbox logs (see the event log)"),
    ("GET", "/v2/sandboxes/{sandbox_id}/logs", "sandbox logs (see the event log)"),
    ("GET", "/sandboxes/metrics", "metrics of several sandboxes (see /metrics)"),
    ("GET", "/templates", "templates other than base"),
    ("POST", "/v3/templates", "building templates"),
    ("GET", "/volumes", "volumes"),
    ("POST", "/volumes", "volumes"),
    ("GET", "/secrets", "secrets"),
    ("POST", "/secrets", "secrets"),
]


def _not_offered(what: str) -> Any:
    async def refuse() -> JSONResponse:
        return JSONResponse({"code": 501, "message": f"{what} is not offered by tenon serve"},
                            status_code=501)

    return refuse


def _disk_mb(sessions: SessionManager) -> int:
    limits = sessions.runtime.workspaces.limits
    return limits.disk_bytes // (1024 * 1024) if limits is not None else 0


def _metadata_filter(raw: str | None) -> dict[str, str]:
    """The SDK's list filter: url-encoded `key=value` pairs, each part quoted once more."""
    if not raw:
        return {}
    return {urllib.parse.unquote(k): urllib.parse.unquote(v)
            for k, v in urllib.parse.parse_qsl(raw, keep_blank_values=True)}


def _int_param(raw: str | None, name: str, default: int) -> int:
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError as exc:
        raise BadRequest(f"{name} must be an integer, got {raw!r}") from exc
    if value < 0:
        raise BadRequest(f"{name} must not be negative, got {value}")
    return value
