"""envd's plain-HTTP file transfer, `GET /files` and `POST /files`, over `SandboxFiles`.

GET streams the file at `?path=` (a symlink followed inside its top) with the content type
Go's `http.ServeContent` picks (by extension, else sniffed: UTF-8 text or octet-stream),
gzip-compressed when the client accepts gzip. The sandbox stays held (`reading`) until the
last byte is sent. POST takes the SDK's two forms: `multipart/form-data` with one or more
parts named `file` (each written to `?path=` when given, else to its filename, which the SDK
sets to the sandbox path), or `application/octet-stream` (`?path=` required), optionally
`Content-Encoding: gzip`. It answers the JSON list `[{"name", "type": "file", "path"}]` the
SDK reads. Parts are written in order: a failing part leaves the earlier ones written, as
in envd. Each part is received into a host spool first (at most `max_write_bytes`; above
that the request fails with 413 before the file is touched), and only then written under
`writing`, so a slow upload does not hold off the sandbox's teardown.

Errors answer envd's JSON body `{"code": status, "message": ...}` with the status the SDK
maps to its exception (404: FileNotFoundException, 400: InvalidArgumentException, 507:
NotEnoughSpaceException). `?username=` (what the SDK sends) is who a path outside the
persistent directories is read or written as (`SandboxFiles`); `X-Metadata-*` headers are
stored as the file's `user.e2b.*` extended attributes; Range requests get the whole file.
"""

from __future__ import annotations

import asyncio
import mimetypes
import os
import posixpath
import tempfile
import zlib
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from email.utils import formatdate
from typing import IO, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from tenon.service.envd_filesystem import SANDBOX_ID_HEADER, filesystem_app
from tenon.service.errors import ServiceError
from tenon.service.files import CHUNK_BYTES, FilesResolver, TooLarge, normalize
from tenon.service.multipart import MultipartError, boundary_of, iter_parts

__all__ = ["files_routes", "filesystem_app"]

_SPOOL_MEMORY_BYTES = 1 << 20
_SNIFF_BYTES = 512
_METADATA_HEADER = "x-metadata-"


class BadUpload(ValueError):
    """The request is not what the SDK sends."""


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


def _failure(exc: ServiceError) -> JSONResponse:
    return _error(exc.http_status, str(exc))


def files_routes(resolver: FilesResolver, *, max_write_bytes: int) -> list[Route]:
    """The `/files` route (GET download, POST upload) for the resolver's sandboxes."""
    handler = _FilesHandler(resolver, max_write_bytes)
    return [Route("/files", handler.dispatch, methods=["GET", "POST"])]


class _HeldStreamingResponse(StreamingResponse):
    """A streaming response that closes `stack` (the file, then the sandbox hold) once
    sent, or once the client went away, whether or not the body was ever iterated."""

    def __init__(self, stack: AsyncExitStack, content: AsyncIterator[bytes],
                 **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._stack = stack

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._stack.aclose()


class _FilesHandler:
    def __init__(self, resolver: FilesResolver, max_write_bytes: int) -> None:
        self._resolver = resolver
        self._max_write_bytes = max_write_bytes

    async def dispatch(self, request: Request) -> Response:
        sid = request.headers.get(SANDBOX_ID_HEADER)
        if not sid:
            return _error(400, f"missing {SANDBOX_ID_HEADER} header")
        try:
            if request.method == "GET":
                return await self._download(request, sid)
            return await self._upload(request, sid)
        except ServiceError as exc:  # a file operation's FilesError too
            return _failure(exc)
        except (BadUpload, MultipartError) as exc:
            return _error(400, str(exc))

    # -- GET -----------------------------------------------------------------------------

    async def _download(self, request: Request, sid: str) -> Response:
        path = request.query_params.get("path")
        if not path:
            return _error(400, "missing path query parameter")
        stack = AsyncExitStack()
        try:
            files = await stack.enter_async_context(
                self._resolver.reading(sid, [path], _user(request)))
            opened = files.open_read(path)
            f = await asyncio.to_thread(opened.__enter__)
            stack.push(opened.__exit__)
            head = await asyncio.to_thread(f.read, _SNIFF_BYTES)
            st = os.fstat(f.fileno())
        except BaseException:
            await stack.aclose()
            raise
        headers = {"Last-Modified": formatdate(st.st_mtime, usegmt=True),
                   "Vary": "Accept-Encoding"}
        media_type = _content_type(path, head)
        body = _read_chunks(f, head)
        if _accepts_gzip(request.headers.get("accept-encoding", "")):
            headers["Content-Encoding"] = "gzip"
            body = _gzip_chunks(body)
        else:
            headers["Content-Length"] = str(st.st_size)
        return _HeldStreamingResponse(stack, body, media_type=media_type, headers=headers)

    # -- POST ----------------------------------------------------------------------------

    async def _upload(self, request: Request, sid: str) -> Response:
        async with self._resolver.reading(sid):
            pass  # an unknown sandbox fails before its body is received
        content_type = request.headers.get("content-type", "")
        media_type = content_type.split(";", 1)[0].strip().lower()
        path = request.query_params.get("path") or None
        metadata = {key[len(_METADATA_HEADER):].lower(): value
                    for key, value in request.headers.items()
                    if key.lower().startswith(_METADATA_HEADER)}
        body = _decoded(request.stream(), request.headers.get("content-encoding", ""))
        written: list[dict[str, Any]] = []
        if media_type == "application/octet-stream":
            if path is None:
                raise BadUpload("path query parameter is required for raw body upload")
            length = request.headers.get("content-length", "")
            if (length.isdigit() and int(length) > self._max_write_bytes
                    and "content-encoding" not in request.headers):
                raise TooLarge(f"writing {length} bytes to '{path}' is over the limit of "
                               f"{self._max_write_bytes} bytes", path)
            with await self._spool(body, path) as spool:
                written.append(await self._write(sid, path, spool, metadata, _user(request)))
        elif media_type.startswith("multipart/"):
            boundary = boundary_of(content_type)
            async for name, filename, data in iter_parts(body, boundary):
                if name != "file":
                    async for _ in data:
                        pass
                    continue
                target = path or filename
                if not target:
                    raise BadUpload("a file part has no filename and no path was given")
                if any(done["path"] == normalize(target) for done in written):
                    raise BadUpload(f"you cannot upload multiple files to the same path "
                                    f"'{normalize(target)}' in one upload request")
                with await self._spool(data, target) as spool:
                    written.append(await self._write(sid, target, spool, metadata,
                                                     _user(request)))
        else:
            raise BadUpload(f"unsupported content type: {content_type}, expected "
                            "multipart/form-data or application/octet-stream")
        return JSONResponse(written)

    async def _spool(self, chunks: AsyncIterator[bytes], path: str,
                     ) -> tempfile.SpooledTemporaryFile[bytes]:
        # Returned open: the caller closes it.
        spool: tempfile.SpooledTemporaryFile[bytes] = tempfile.SpooledTemporaryFile(  # noqa: SIM115
            max_size=_SPOOL_MEMORY_BYTES)
        size = 0
        try:
            pending: list[bytes] = []
            pending_bytes = 0
            async for chunk in chunks:
                size += len(chunk)
                if size > self._max_write_bytes:
                    raise TooLarge(f"writing more than {self._max_write_bytes} bytes to "
                                   f"'{path}' is over the limit", path)
                pending.append(chunk)
                pending_bytes += len(chunk)
                if pending_bytes >= CHUNK_BYTES * 4:
                    await asyncio.to_thread(spool.write, b"".join(pending))
                    pending, pending_bytes = [], 0
            await asyncio.to_thread(spool.write, b"".join(pending))
            spool.seek(0)
        except BaseException:
            spool.close()
            raise
        return spool

    async def _write(self, sid: str, path: str, data: IO[bytes],
                     metadata: dict[str, str], user: str | None) -> dict[str, Any]:
        async with self._resolver.writing(sid, [path], user) as files:
            entry = await asyncio.to_thread(files.write, path, data, metadata)
        answer: dict[str, Any] = {"name": entry.name, "type": "file", "path": entry.path}
        if entry.metadata:
            answer["metadata"] = dict(entry.metadata)
        return answer


def _user(request: Request) -> str | None:
    return request.query_params.get("username") or None


# -- download helpers --------------------------------------------------------------------


def _content_type(path: str, head: bytes) -> str:
    """By extension, else sniffed like Go's DetectContentType for text vs. binary."""
    guessed, _ = mimetypes.guess_type(posixpath.basename(path))
    if guessed:
        return guessed
    if b"\0" in head:
        return "application/octet-stream"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 3:  # not merely a character cut at the sniff boundary
            return "application/octet-stream"
    return "text/plain; charset=utf-8"


def _accepts_gzip(accept_encoding: str) -> bool:
    for item in accept_encoding.lower().split(","):
        coding, _, params = item.partition(";")
        if coding.strip() in ("gzip", "x-gzip"):
            q = params.strip().removeprefix("q=")
            try:
                return not params.strip() or float(q) > 0
            except ValueError:
                return False
    return False


async def _read_chunks(f: IO[bytes], head: bytes) -> AsyncIterator[bytes]:
    if head:
        yield head
    while chunk := await asyncio.to_thread(f.read, CHUNK_BYTES):
        yield chunk


async def _gzip_chunks(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    gz = zlib.compressobj(wbits=31)
    async for chunk in chunks:
        if out := gz.compress(chunk):
            yield out
    yield gz.flush()


# -- upload helpers ----------------------------------------------------------------------


async def _decoded(stream: AsyncIterator[bytes], encoding: str) -> AsyncIterator[bytes]:
    """The body with a gzip Content-Encoding undone, in bounded pieces (no bomb expands
    in one step)."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        async for chunk in stream:
            if chunk:
                yield chunk
        return
    if encoding != "gzip":
        raise BadUpload(f"unsupported content encoding: {encoding}")
    gz = zlib.decompressobj(wbits=31)
    try:
        async for chunk in stream:
            data = chunk
            while data:
                if out := gz.decompress(data, CHUNK_BYTES):
                    yield out
                data = gz.unconsumed_tail
        if out := gz.flush():
            yield out
    except zlib.error as exc:
        raise BadUpload(f"error decompressing request body: {exc}") from exc
    if not gz.eof:
        raise BadUpload("error decompressing request body: truncated gzip stream")
