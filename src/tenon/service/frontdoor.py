"""One E2B endpoint for a cluster of `tenon serve` nodes: a reverse proxy that places each
new sandbox on a node by predicted headroom and sends every later call for it to its node.

A client (the official SDK, with E2B_API_URL and E2B_SANDBOX_URL both set to the front
door) does not know the cluster exists:

- control-plane calls are authenticated with the front door's own keys and forwarded with
  the node's key; sandbox-side calls (the Connect services, envd's `/files`, `/health`) are
  forwarded unchanged to the node their `E2b-Sandbox-Id` header names (the node checks the
  sandbox's access token);
- `POST /sandboxes` predicts the sandbox's peak from `metadata["tenon.profile_peak_bytes"]`
  (else `placement.default_peak_bytes`), and `choose_node` picks a node over the loads read
  from every node's `GET /tenon/load` each `placement.refresh_s` (a node that does not
  answer is not alive). The chosen node's load counts the new sandbox (`with_agent`) until
  its next reading;
- when no node has room the answer is HTTP 503 with a `Retry-After` header (whole seconds,
  as the SDK reads it) and a one-line message naming why, node by node. The e2b SDK
  retries a 503 (`ConnectionConfig.retries`, 3 by default, waiting `Retry-After` seconds),
  then raises `e2b.ServiceBusyException` ("503: Service temporarily unavailable, please
  retry. - <message>");
- `GET /sandboxes` and `GET /v2/sandboxes` merge every node's listing; the front door pages
  the merged list itself (`limit`, `nextToken`, `x-next-token`);
- an id the front door does not know makes it list every node once (a restarted front door
  rebuilds its map that way); still unknown, the call goes to a live node, which answers
  exactly as a single server answers an unknown sandbox.

Bodies stream both ways (commands' output, file uploads and downloads); only the small JSON
bodies of creates and listings are read whole. `/metrics` (open) counts placements,
refusals and proxied requests; `/tenon/nodes` (with a key) shows each node's last load and
how many of its sandboxes the front door knows.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import math
import random
import signal
import urllib.parse
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import httpx
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tenon.policy.placement import NodeLoad, NoRoom, PlacementConfig, choose_node
from tenon.service.api import LOAD_PATH
from tenon.service.app import API_KEY_HEADER, Receive, Scope, Send
from tenon.service.envd_process import SANDBOX_HEADER
from tenon.service.listen import listening

logger = logging.getLogger(__name__)

DEFAULT_PORT = 49983
PEAK_METADATA_KEY = "tenon.profile_peak_bytes"
NODES_PATH = "/tenon/nodes"
LOAD_TIMEOUT_S = 2.0
"""A node whose load does not arrive within this counts as not alive until it does."""
CONNECT_TIMEOUT_S = 10.0
LISTINGS = ("/sandboxes", "/v2/sandboxes")
# Hop-by-hop headers (RFC 9110 7.6.1) belong to one connection, never forwarded.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate",
                        "proxy-authorization", "proxy-connection", "te", "trailer",
                        "transfer-encoding", "upgrade"})


class NodeSettings(BaseModel):
    """One `tenon serve` behind the front door."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, description="The node's name in placements and metrics.")
    url: str = Field(pattern=r"^https?://", description="Its base URL, e.g. http://n1:49982.")
    api_key: str = Field(min_length=1, description="A key the node accepts.")


class FrontDoorSettings(BaseModel):
    """Everything the front door takes; an unknown key is an error."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    nodes: tuple[NodeSettings, ...] = Field(
        min_length=1, description="The nodes, each a NodeSettings or (name, url, api_key).")
    host: str = "127.0.0.1"
    port: int = Field(DEFAULT_PORT, ge=0, le=65535, description="0: any free port.")
    api_keys: tuple[str, ...] = Field(
        min_length=1, description="The keys clients use (X-API-Key); not the nodes' keys.")
    placement: PlacementConfig = Field(default_factory=PlacementConfig)

    @field_validator("nodes", mode="before")
    @classmethod
    def _triples(cls, nodes: Any) -> Any:
        if isinstance(nodes, list | tuple):
            return [dict(zip(("name", "url", "api_key"), node, strict=True))
                    if isinstance(node, list | tuple) else node for node in nodes]
        return nodes

    @model_validator(mode="after")
    def _unique_names(self) -> FrontDoorSettings:
        names = [node.name for node in self.nodes]
        if len(set(names)) != len(names):
            raise ValueError(f"node names must be unique, got {names}")
        return self


class FrontDoor:
    """The ASGI app. `start()` opens the nodes' client and the load poller, `close()` ends
    them; `serve_front_door` does both around uvicorn."""

    def __init__(self, settings: FrontDoorSettings, *, rng: random.Random | None = None
                 ) -> None:
        self.settings = settings
        self.nodes = {node.name: node for node in settings.nodes}
        self.loads = {name: NodeLoad(name, 0, alive=False) for name in self.nodes}
        self.placed: dict[str, str] = {}
        """Sandbox id -> the node that holds it."""
        self._keys = [key.encode() for key in settings.api_keys]
        self._rng = rng or random.Random()
        self._turn = 0
        self._client: httpx.AsyncClient | None = None
        self._poller: asyncio.Task[None] | None = None
        self._relisting: asyncio.Task[list[dict[str, Any]]] | None = None
        self.registry = CollectorRegistry()
        self._placements = Counter("tenon_frontdoor_placements", "Sandboxes placed, by node.",
                                   ["node"], registry=self.registry)
        self._refusals = Counter("tenon_frontdoor_refusals",
                                 "Creates refused because no node had room.",
                                 registry=self.registry)
        self._proxied = Counter("tenon_frontdoor_proxied_requests",
                                "Requests forwarded, by node and plane (control, sandbox).",
                                ["node", "plane"], registry=self.registry)
        self._alive = Gauge("tenon_frontdoor_node_alive",
                            "1 when the node's last load reading arrived.", ["node"],
                            registry=self.registry)

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RuntimeError("the front door is not started")
        return self._client

    async def start(self) -> None:
        """Open the client, read every node's load once, then keep reading it."""
        # No read timeout: a command's output streams as long as the command runs.
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S), trust_env=False,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=100))
        await self.refresh_loads()
        self._poller = asyncio.create_task(self._poll(), name="frontdoor-loads")

    async def close(self) -> None:
        for task in (self._poller, self._relisting):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._client is not None:
            await self._client.aclose()

    # -- loads and the sandbox map ------------------------------------------------------------

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.settings.placement.refresh_s)
            await self.refresh_loads()

    async def refresh_loads(self) -> None:
        """Read every node's load; one that does not answer is not alive."""
        readings = await asyncio.gather(*(self._read_load(node) for node in self.nodes.values()))
        for name, load in zip(self.nodes, readings, strict=True):
            self.loads[name] = load or dataclasses.replace(self.loads[name], alive=False)
            self._alive.labels(name).set(1 if load else 0)

    async def _read_load(self, node: NodeSettings) -> NodeLoad | None:
        try:
            response = await self.client.get(f"{node.url}{LOAD_PATH}", timeout=LOAD_TIMEOUT_S,
                                              headers={API_KEY_HEADER: node.api_key})
            response.raise_for_status()
            fields = {f.name for f in dataclasses.fields(NodeLoad)}
            reading = {k: v for k, v in response.json().items() if k in fields}
            # The front door's name for the node is the one placements and metrics use.
            return NodeLoad(**{**reading, "node": node.name, "alive": True})
        except (httpx.HTTPError, ValueError, TypeError) as exc:
            if self.loads[node.name].alive:
                logger.warning("front door: node %s gives no load: %r", node.name, exc)
            return None

    async def relist(self) -> None:
        """Learn where every sandbox is from each node's listing (concurrent callers share
        one listing)."""
        if self._relisting is None or self._relisting.done():
            self._relisting = asyncio.create_task(self.listing({}))
        await asyncio.shield(self._relisting)

    async def listing(self, query: dict[str, str]) -> list[dict[str, Any]]:
        """Every answering node's sandboxes under `query` (filters only); the map learns
        them."""
        async def one(node: NodeSettings) -> list[dict[str, Any]]:
            try:
                response = await self.client.get(f"{node.url}/v2/sandboxes", params=query,
                                                 headers={API_KEY_HEADER: node.api_key})
                response.raise_for_status()
                found: list[dict[str, Any]] = response.json()
            except (httpx.HTTPError, ValueError) as exc:
                if self.loads[node.name].alive:  # a lost node is reported by its loads
                    logger.warning("front door: node %s does not list: %r", node.name, exc)
                return []
            listed = {sandbox["sandboxID"] for sandbox in found}
            if not query:  # the whole listing: what the node no longer has is gone
                for gone in [i for i, n in self.placed.items()
                             if n == node.name and i not in listed]:
                    del self.placed[gone]
            self.placed.update(dict.fromkeys(listed, node.name))
            return found

        parts = await asyncio.gather(*(one(node) for node in self.nodes.values()))
        return [sandbox for part in parts for sandbox in part]

    def _any_live_node(self) -> NodeSettings | None:
        return next((self.nodes[name] for name, load in self.loads.items() if load.alive),
                    None)

    async def node_of(self, sandbox_id: str | None) -> NodeSettings | None:
        """The sandbox's node; for an unknown id, after one listing, a live node to answer
        as a single server does; None when no node is alive."""
        if sandbox_id and sandbox_id not in self.placed:
            await self.relist()
        if sandbox_id and sandbox_id in self.placed:
            return self.nodes[self.placed[sandbox_id]]
        return self._any_live_node()

    # -- requests -----------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # lifespan is off; websockets are not part of E2B's API
        path: str = scope["path"]
        headers = _headers(scope)
        if path.startswith(("/process.Process/", "/filesystem.Filesystem/")) or path in (
                "/files", "/health"):
            node = await self.node_of(headers.get(SANDBOX_HEADER))
            connect = path not in ("/files", "/health")
            await self._forward(node, scope, receive, send, plane="sandbox", connect=connect)
            return
        if path == "/metrics":
            await _send_bytes(send, 200, generate_latest(self.registry), CONTENT_TYPE_LATEST)
            return
        if not self._key_ok(headers.get(API_KEY_HEADER)):
            await _send_error(send, 401, "invalid or missing API key (X-API-Key)")
            return
        method: str = scope["method"]
        if path in LISTINGS and method == "POST":
            await self._create(scope, receive, send)
        elif path in LISTINGS and method == "GET":
            await self._list(scope, send)
        elif path == NODES_PATH and method == "GET":
            await _send_json(send, 200, {"nodes": self.describe()})
        else:
            sandbox_id = _sandbox_in_path(path)
            node = await self.node_of(sandbox_id)
            status = await self._forward(node, scope, receive, send, plane="control",
                                         connect=False)
            if sandbox_id is not None and method == "DELETE" and status == 204:
                self.placed.pop(sandbox_id, None)

    def describe(self) -> list[dict[str, Any]]:
        """Each node's last load and how many sandboxes the front door placed or found on it."""
        counts = {name: 0 for name in self.nodes}
        for name in self.placed.values():
            counts[name] += 1
        return [{"name": name, "url": node.url, "load": dataclasses.asdict(self.loads[name]),
                 "sandboxes": counts[name]} for name, node in self.nodes.items()]

    def _key_ok(self, key: str | None) -> bool:
        if not key:
            return False
        given = key.encode()
        return any(hmac.compare_digest(given, k) for k in self._keys)

    async def _create(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_body(receive)
        peak_bytes = self._predicted_peak(body)
        if isinstance(peak_bytes, str):
            await _send_error(send, 400, peak_bytes)
            return
        config = self.settings.placement
        while True:
            decision = choose_node(list(self.loads.values()), peak_bytes, config,
                                   rng=self._rng, turn=self._turn)
            if isinstance(decision, NoRoom):
                self._refusals.inc()
                retry_s = max(math.ceil(config.retry_after_s), 1)
                await _send_error(
                    send, 503, f"no node has room for a sandbox of predicted peak "
                    f"{peak_bytes >> 20} MiB ({decision.reason}); retryable: retry in "
                    f"{retry_s} s", headers=[(b"retry-after", str(retry_s).encode())])
                return
            self._turn += 1
            node = self.nodes[decision.node]
            try:
                response = await self.client.request(
                    scope["method"], _url(node, scope), content=body,
                    headers=_forwarded_headers(scope, api_key=node.api_key))
            except httpx.ConnectError as exc:  # nothing reached the node: place elsewhere
                logger.warning("front door: node %s unreachable: %r", node.name, exc)
                self.loads[node.name] = dataclasses.replace(self.loads[node.name], alive=False)
                continue
            except httpx.TransportError as exc:  # it may have created the sandbox: no retry
                await _send_error(send, 502, f"node {node.name} failed while creating the "
                                  f"sandbox: {exc!r}")
                return
            break
        self._proxied.labels(node.name, "control").inc()
        if response.status_code == 201:
            self.placed[response.json()["sandboxID"]] = node.name
            self.loads[node.name] = self.loads[node.name].with_agent(peak_bytes)
            self._placements.labels(node.name).inc()
            logger.info("front door: placed on %s (%s)", node.name, decision.reason)
        await _send_bytes(send, response.status_code, response.content,
                          response.headers.get("content-type", "application/json"))

    def _predicted_peak(self, body: bytes) -> int | str:
        """The new sandbox's predicted peak in bytes, or why the request is malformed."""
        try:
            parsed = json.loads(body) if body else {}
        except json.JSONDecodeError:
            parsed = {}  # the node answers a malformed body as a single server does
        metadata = parsed.get("metadata") if isinstance(parsed, dict) else None
        raw = metadata.get(PEAK_METADATA_KEY) if isinstance(metadata, dict) else None
        if raw is None:
            return self.settings.placement.default_peak_bytes
        try:
            peak = int(str(raw))
        except ValueError:
            peak = 0
        if peak <= 0:
            return f"metadata {PEAK_METADATA_KEY} must be a positive number of bytes, " \
                   f"got {raw!r}"
        return peak

    async def _list(self, scope: Scope, send: Send) -> None:
        query = dict(urllib.parse.parse_qsl(scope["query_string"].decode("latin-1"),
                                            keep_blank_values=True))
        try:
            start = _int_param(query.pop("nextToken", None), "nextToken") or 0
            wanted = _int_param(query.pop("limit", None), "limit")
        except ValueError as exc:
            await _send_error(send, 400, str(exc))
            return
        found = await self.listing(query)
        found.sort(key=lambda s: str(s.get("startedAt", "")),
                   reverse=query.get("order") == "desc")
        limit = wanted if wanted is not None else len(found) or 1
        headers = []
        if start + limit < len(found):
            headers.append((b"x-next-token", str(start + limit).encode()))
        await _send_json(send, 200, found[start:start + limit], headers=headers)

    async def _forward(self, node: NodeSettings | None, scope: Scope, receive: Receive,
                       send: Send, *, plane: str, connect: bool) -> int:
        """Stream the request to `node` and its answer back; the answer's status."""
        if node is None:
            message = "no node of the cluster answers"
            await _send_error(send, 502, message, connect_code="unavailable" if connect
                              else None)
            return 502
        request_headers = dict(_headers(scope))
        streams_body = "content-length" in request_headers or \
            "transfer-encoding" in request_headers
        request = self.client.build_request(
            scope["method"], _url(node, scope),
            headers=_forwarded_headers(scope, api_key=node.api_key if plane == "control"
                                       else None),
            content=_body_stream(receive) if streams_body else None)
        try:
            response = await self.client.send(request, stream=True)
        except httpx.TransportError as exc:
            logger.warning("front door: node %s unreachable: %r", node.name, exc)
            await _send_error(send, 502, f"node {node.name} does not answer: {exc!r}",
                              connect_code="unavailable" if connect else None)
            return 502
        self._proxied.labels(node.name, plane).inc()
        try:
            await _relay(response, receive, send)
        finally:
            await response.aclose()
        return response.status_code


async def _relay(response: httpx.Response, receive: Receive, send: Send) -> None:
    """Send `response` on as it arrives; stop reading it when the client goes away."""
    await send({"type": "http.response.start", "status": response.status_code,
                "headers": [(k, v) for k, v in response.headers.raw
                            if k.lower().decode("latin-1") not in HOP_BY_HOP]})

    async def pump() -> None:
        async for chunk in response.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def until_disconnect() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    relay = asyncio.ensure_future(pump())
    gone = asyncio.ensure_future(until_disconnect())
    try:
        await asyncio.wait((relay, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not relay.done():  # the client went away: stop reading the node's answer
            relay.cancel()
        await asyncio.gather(gone, return_exceptions=True)
    with contextlib.suppress(asyncio.CancelledError):
        await relay  # raises what broke the relay


async def _body_stream(receive: Receive) -> AsyncIterator[bytes]:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise httpx.ReadError("the client went away while sending its body")
        if message.get("body"):
            yield message["body"]
        if not message.get("more_body", False):
            return


async def _read_body(receive: Receive) -> bytes:
    return b"".join([chunk async for chunk in _body_stream(receive)])


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1")
            for k, v in scope.get("headers", [])}


def _forwarded_headers(scope: Scope, *, api_key: str | None) -> list[tuple[bytes, bytes]]:
    """The client's headers for the node: without hop-by-hop ones and Host; with the node's
    key in place of the front door's when `api_key` is given."""
    drop = HOP_BY_HOP | {"host"} | ({API_KEY_HEADER} if api_key is not None else set())
    headers = [(k, v) for k, v in scope.get("headers", [])
               if k.decode("latin-1").lower() not in drop]
    if api_key is not None:
        headers.append((API_KEY_HEADER.encode(), api_key.encode()))
    return headers


def _url(node: NodeSettings, scope: Scope) -> httpx.URL:
    raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
    query: bytes = scope.get("query_string", b"")
    return httpx.URL(node.url).copy_with(raw_path=raw_path + (b"?" + query if query else b""))


def _sandbox_in_path(path: str) -> str | None:
    """The id a control-plane path names (`/sandboxes/{id}...`, `/v2/sandboxes/{id}...`)."""
    parts = path.strip("/").split("/")
    if parts[:1] == ["v2"]:
        parts = parts[1:]
    if len(parts) >= 2 and parts[0] == "sandboxes":
        return urllib.parse.unquote(parts[1])
    return None


def _int_param(raw: str | None, name: str) -> int | None:
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError as exc:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from exc
    if value < 0:
        raise ValueError(f"{name} must not be negative, got {value}")
    return value


async def _send_bytes(send: Send, status: int, body: bytes, content_type: str, *,
                      headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_json(send: Send, status: int, body: Any, *,
                     headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    await _send_bytes(send, status, json.dumps(body).encode(), "application/json",
                      headers=headers)


async def _send_error(send: Send, status: int, message: str, *,
                      connect_code: str | None = None,
                      headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """An error in the body the SDK reads: the control plane's (`code`, `message`), or a
    Connect error's when `connect_code` is given."""
    await _send_json(send, status, {"code": connect_code or status, "message": message},
                     headers=headers)


async def serve_front_door(settings: FrontDoorSettings, *,
                           ready: Callable[[str], None] | None = None) -> None:
    """Serve the front door until cancelled, SIGINT or SIGTERM (signals only when run on
    the main thread); `ready` gets the URL it listens on once it answers."""
    door = FrontDoor(settings)
    await door.start()
    try:
        async with listening(door, settings.host, settings.port) as url:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            handled = []
            for signum in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(RuntimeError, ValueError):  # not the main thread
                    loop.add_signal_handler(signum, stop.set)
                    handled.append(signum)
            try:
                if ready is not None:
                    ready(url)
                await stop.wait()
            finally:
                for signum in handled:
                    loop.remove_signal_handler(signum)
    finally:
        await door.close()
