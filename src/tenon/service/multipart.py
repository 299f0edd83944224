"""A streaming multipart/form-data reader: parts come out as they arrive, never buffered
whole. Boundaries follow RFC 2046 (a delimiter line is CRLF "--" boundary, then optional
space and CRLF, or "--" at the end; a line that merely starts with the delimiter is data),
and Content-Disposition parameters are read as Go's mime.ParseMediaType reads them
(quoted strings unescaped, RFC 2231 `filename*`), so a file part's name is what envd sees.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterator
from typing import Any
from urllib.parse import unquote

MAX_PART_HEADER_BYTES = 16 * 1024


class MultipartError(ValueError):
    """The body is not well-formed multipart."""


def boundary_of(content_type: str) -> bytes:
    match = re.search(r'boundary=(?:"([^"]+)"|([^;\s]+))', content_type, re.IGNORECASE)
    if not match:
        raise MultipartError("multipart body without a boundary")
    return (match.group(1) or match.group(2)).encode("latin-1")


_PARAM = re.compile(r';\s*([\w*-]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;]*)')


def content_disposition(value: str) -> tuple[str, str]:
    """(name, filename) of a Content-Disposition header, quoted strings unescaped and RFC
    2231 `filename*` decoded, as Go's mime.ParseMediaType does."""
    params: dict[str, str] = {}
    for key, raw in _PARAM.findall(value):
        if raw.startswith('"'):
            raw = re.sub(r"\\(.)", r"\1", raw[1:-1])
        params[key.lower()] = raw.strip()
    filename = params.get("filename", "")
    if "filename*" in params and "''" in params["filename*"]:
        charset, _, encoded = params["filename*"].partition("''")
        filename = unquote(encoded, encoding=charset or "utf-8")
    return params.get("name", ""), filename


class MultipartParser:
    """A push parser: `feed` bytes, get events ("part", (name, filename)), ("data", bytes),
    ("end", None) for each part in order. Raises MultipartError on a malformed body."""

    def __init__(self, boundary: bytes) -> None:
        self._first = b"--" + boundary
        self._delimiter = b"\r\n--" + boundary
        self._buf = b""
        self._state = "preamble"

    def feed(self, chunk: bytes) -> Iterator[tuple[str, Any]]:
        self._buf += chunk
        while True:
            if self._state == "preamble":
                at = self._buf.find(self._first)
                if at < 0:
                    self._buf = self._buf[-len(self._first):]  # a preamble is dropped
                    return
                if len(self._buf) < at + len(self._first) + 2:
                    return
                self._buf = self._buf[at + len(self._first):]
                self._state = "after-delimiter"
            elif self._state == "after-delimiter":
                self._buf = self._buf.lstrip(b" \t")  # transport padding
                if len(self._buf) < 2:
                    return
                if self._buf.startswith(b"--"):
                    self._state, self._buf = "done", b""
                    return
                if not self._buf.startswith(b"\r\n"):
                    raise MultipartError("malformed multipart body")
                self._buf, self._state = self._buf[2:], "headers"
            elif self._state == "headers":
                end = self._buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(self._buf) > MAX_PART_HEADER_BYTES:
                        raise MultipartError("multipart part headers too large")
                    return
                yield "part", self._part_headers(self._buf[:end])
                self._buf, self._state = self._buf[end + 4:], "data"
            elif self._state == "data":
                at = self._buf.find(self._delimiter)
                if at < 0:
                    keep = len(self._delimiter) + 1
                    if len(self._buf) > keep:
                        yield "data", self._buf[:-keep]
                        self._buf = self._buf[-keep:]
                    return
                after = at + len(self._delimiter)
                if len(self._buf) < after + 2:
                    if at:
                        yield "data", self._buf[:at]
                        self._buf = self._buf[at:]
                    return
                if (self._buf[after:after + 2] != b"--"
                        and self._buf[after:after + 1] not in (b"\r", b" ", b"\t")):
                    yield "data", self._buf[:after]  # the boundary only prefixes a data line
                    self._buf = self._buf[after:]
                    continue
                if at:
                    yield "data", self._buf[:at]
                yield "end", None
                self._buf = self._buf[after:]
                self._state = "after-delimiter"
            else:
                self._buf = b""
                return

    def close(self) -> None:
        if self._state != "done":
            raise MultipartError("multipart body ended before its closing boundary")

    @staticmethod
    def _part_headers(raw: bytes) -> tuple[str, str]:
        for line in raw.decode("utf-8", "replace").split("\r\n"):
            key, _, value = line.partition(":")
            if key.strip().lower() == "content-disposition":
                return content_disposition(value)
        raise MultipartError("multipart part without Content-Disposition")


async def iter_parts(body: AsyncIterator[bytes], boundary: bytes,
                     ) -> AsyncIterator[tuple[str, str, AsyncIterator[bytes]]]:
    """Each part as (name, filename, its data), in order; whatever of a part's data is not
    consumed before the next part is asked for is skipped."""
    parser = MultipartParser(boundary)

    async def events() -> AsyncIterator[tuple[str, Any]]:
        async for chunk in body:
            for event in parser.feed(chunk):
                yield event
        parser.close()

    stream = events()

    async def data() -> AsyncIterator[bytes]:
        async for kind, value in stream:
            if kind == "end":
                return
            yield value
        raise MultipartError("multipart body ended inside a part")

    async for kind, value in stream:
        if kind == "part":
            name, filename = value
            yield name, filename, data()
