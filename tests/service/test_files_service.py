"""The Filesystem Connect service and /files over real HTTP on loopback, driven by the
official SDK's filesystem client and the generated Connect client, over tmp roots."""

from __future__ import annotations

import asyncio
import gzip
import os
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.api.client_sync import get_envd_api
from e2b.connection_config import ConnectionConfig
from e2b.envd.filesystem import filesystem_pb as pb
from e2b.envd.filesystem.filesystem_connect import FilesystemClientSync
from e2b.exceptions import (
    FileNotFoundException,
    InvalidArgumentException,
    NotFoundException,
    SandboxException,
)
from e2b.sandbox.filesystem.filesystem import FileType
from e2b.sandbox_sync.filesystem.filesystem import Filesystem
from packaging.version import Version
from starlette.applications import Starlette
from starlette.types import Receive, Scope, Send

from tenon.service.envd_filesystem import filesystem_app
from tenon.service.errors import SandboxNotFound
from tenon.service.files import SandboxFiles
from tenon.service.files_http import files_routes
from tenon.service.multipart import MultipartError, MultipartParser, content_disposition

SID = "sbx-one"
MAX_WRITE_BYTES = 64 * 1024


@dataclass
class FakeResolver:
    """Sandboxes by id over tmp roots; counts how each was held."""

    sandboxes: dict[str, SandboxFiles]
    held: list[tuple[str, str]] = field(default_factory=list)
    num_open: int = 0

    @asynccontextmanager
    async def _hold(self, kind: str, sandbox_id: str) -> AsyncIterator[SandboxFiles]:
        if sandbox_id not in self.sandboxes:
            raise SandboxNotFound(f"sandbox '{sandbox_id}' not found")
        self.held.append((kind, sandbox_id))
        self.num_open += 1
        try:
            yield self.sandboxes[sandbox_id]
        finally:
            self.num_open -= 1

    def reading(self, sandbox_id: str, paths: Any = (), user: str | None = None) -> Any:
        return self._hold("read", sandbox_id)

    def writing(self, sandbox_id: str, paths: Any = (), user: str | None = None) -> Any:
        return self._hold("write", sandbox_id)


@dataclass
class Served:
    url: str
    root: Path
    resolver: FakeResolver

    def sdk(self, sandbox_id: str = SID, version: str = "0.6.7") -> Filesystem:
        config = ConnectionConfig(api_key="e2b_test", request_timeout=10, http_version="1.1",
                                  extra_sandbox_headers={"E2b-Sandbox-Id": sandbox_id})
        return Filesystem(self.url, Version(version), config, get_envd_api(config, self.url))

    def host(self, sub: str, *parts: str) -> Path:
        return self.root.joinpath(sub, *parts)


def make_app(resolver: FakeResolver) -> Any:
    files = Starlette(routes=files_routes(resolver, max_write_bytes=MAX_WRITE_BYTES))
    connect = filesystem_app(resolver)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        target = connect if scope.get("path", "").startswith("/filesystem.") else files
        await target(scope, receive, send)

    return app


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    root = tmp_path / "root"
    for sub in ("workspace", "home", "tmp"):
        (root / sub).mkdir(parents=True)
    image = tmp_path / "image"
    (image / "etc").mkdir(parents=True)
    (image / "etc" / "os-release").write_text("ID=test\n")
    resolver = FakeResolver({SID: SandboxFiles(root, image_root=image,
                                               max_write_bytes=MAX_WRITE_BYTES)})
    server = uvicorn.Server(uvicorn.Config(make_app(resolver), host="127.0.0.1", port=0,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            pytest.fail("uvicorn did not start")
        threading.Event().wait(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield Served(f"http://127.0.0.1:{port}", root, resolver)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        assert not thread.is_alive()


def raw_client(served: Served) -> FilesystemClientSync:
    return FilesystemClientSync(served.url, send_compression=None)


# -- through the SDK -------------------------------------------------------------------


def test_sdk_write_read_list_and_info(served: Served) -> None:
    fs = served.sdk()
    info = fs.write("/workspace/src/main.py", "print('hi')\n")
    assert (info.name, info.path, info.type) == ("main.py", "/workspace/src/main.py",
                                                  FileType.FILE)
    assert served.host("workspace", "src", "main.py").read_text() == "print('hi')\n"
    assert fs.read("/workspace/src/main.py") == "print('hi')\n"
    assert fs.read("../../workspace/src/main.py", format="bytes") == b"print('hi')\n"
    entry = fs.get_info("/workspace/src/main.py")
    assert (entry.type, entry.size, entry.mode, entry.permissions) == (
        FileType.FILE, 12, 0o644, "-rw-r--r--")
    assert (entry.owner, entry.symlink_target) == ("root", None)
    assert entry.modified_time.timestamp() == pytest.approx(
        served.host("workspace", "src", "main.py").stat().st_mtime, abs=1e-3)
    listed = fs.list("/workspace", depth=2)
    assert [(e.path, e.type) for e in listed] == [("/workspace/src", FileType.DIR),
                                                   ("/workspace/src/main.py", FileType.FILE)]
    assert fs.exists("/workspace/src")
    assert not fs.exists("/workspace/nope")
    assert fs.read("/etc/os-release") == "ID=test\n"


def test_sdk_write_files_multipart_and_octet_stream(served: Served) -> None:
    fs = served.sdk()
    infos = fs.write_files([{"path": "/tmp/a.txt", "data": "A"},
                            {"path": "b/c.bin", "data": b"\x00\xff"}])
    assert [i.path for i in infos] == ["/tmp/a.txt", "/home/user/b/c.bin"]
    assert served.host("home", "b", "c.bin").read_bytes() == b"\x00\xff"
    fs.write("/tmp/stream.bin", iter([b"x" * 1000, b"y" * 1000]))  # octet-stream
    assert served.host("tmp", "stream.bin").read_bytes() == b"x" * 1000 + b"y" * 1000
    fs.write("/tmp/gz.txt", "zipped " * 100, gzip=True)
    assert fs.read("/tmp/gz.txt", gzip=True) == "zipped " * 100
    with fs.read("/tmp/stream.bin", format="stream") as stream:
        assert b"".join(stream) == b"x" * 1000 + b"y" * 1000
    assert ("write", SID) in served.resolver.held


def test_sdk_metadata_round_trip(served: Served) -> None:
    fs = served.sdk()
    info = fs.write("/workspace/tagged", "x", metadata={"Kind": "report"})
    assert info.metadata == {"kind": "report"}
    assert fs.get_info("/workspace/tagged").metadata == {"kind": "report"}
    infos = fs.write_files([{"path": "/workspace/s1", "data": iter([b"a"])}],
                           metadata={"k": "v"})
    assert infos[0].metadata == {"k": "v"}
    assert [e.metadata for e in fs.list("/workspace")] == [{"k": "v"}, {"kind": "report"}]


def test_sdk_make_dir_rename_remove(served: Served) -> None:
    fs = served.sdk()
    assert fs.make_dir("/workspace/a/b") is True
    assert fs.make_dir("/workspace/a/b") is False
    moved = fs.rename("/workspace/a", "/home/user/z")
    assert (moved.path, moved.type) == ("/home/user/z", FileType.DIR)
    assert served.host("home", "z", "b").is_dir()
    fs.remove("/home/user/z")
    assert not served.host("home", "z").exists()
    fs.remove("/home/user/z")  # envd removes like RemoveAll: a missing path is fine
    with pytest.raises(FileNotFoundException):
        fs.rename("/home/user/z", "/home/user/y")


def test_sdk_errors_map_to_its_exceptions(served: Served) -> None:
    fs = served.sdk()
    fs.make_dir("/workspace/d")
    with pytest.raises(FileNotFoundException, match="/workspace/missing"):
        fs.read("/workspace/missing")
    with pytest.raises(FileNotFoundException):
        fs.get_info("/workspace/missing")
    with pytest.raises(FileNotFoundException):
        fs.list("/workspace/missing")
    with pytest.raises(InvalidArgumentException, match="is a directory"):
        fs.read("/workspace/d")
    with pytest.raises(InvalidArgumentException):
        fs.write("/workspace/d", "x")
    with pytest.raises(InvalidArgumentException):
        fs.list("/workspace/d/../../etc/os-release")
    with pytest.raises(SandboxException, match="read-only"):
        fs.write("/etc/passwd", "x")
    with pytest.raises(SandboxException, match="413"):
        fs.write("/workspace/big", b"x" * (MAX_WRITE_BYTES + 1))
    with pytest.raises(SandboxException, match="413"):
        fs.write("/workspace/big", iter([b"x" * MAX_WRITE_BYTES, b"x"]))
    assert not served.host("workspace", "big").exists()
    other = served.sdk("sbx-unknown")
    with pytest.raises(NotFoundException):
        other.read("/workspace/x")
    with pytest.raises(NotFoundException):
        other.write("/workspace/x", "x")
    with pytest.raises(NotFoundException):
        other.list("/workspace")


def test_sdk_symlink_entries(served: Served) -> None:
    fs = served.sdk()
    fs.write("/workspace/real.txt", "r")
    os.symlink("real.txt", served.host("workspace", "link"))
    os.symlink("/etc/shadow", served.host("workspace", "shadow"))
    info = fs.get_info("/workspace/link")
    assert (info.type, info.symlink_target) == (FileType.SYMLINK, "/workspace/real.txt")
    assert info.permissions == "Lrwxrwxrwx"
    assert fs.read("/workspace/link") == "r"
    with pytest.raises(FileNotFoundException):
        fs.read("/workspace/shadow")  # resolved as /workspace/etc/shadow, never the host's
    names = [e.name for e in fs.list("/workspace")]
    assert names == ["link", "real.txt"]  # a dangling link has no type: the SDK skips it


# -- the raw protocols -----------------------------------------------------------------


def test_connect_codes(served: Served) -> None:
    with raw_client(served) as client:
        headers = {"E2b-Sandbox-Id": SID}
        with pytest.raises(ConnectError) as missing:
            client.stat(pb.StatRequest(path="/workspace/none"), headers=headers)
        assert missing.value.code is Code.NOT_FOUND
        with pytest.raises(ConnectError) as no_header:
            client.stat(pb.StatRequest(path="/workspace"))
        assert no_header.value.code is Code.INVALID_ARGUMENT
        with pytest.raises(ConnectError) as unknown:
            client.stat(pb.StatRequest(path="/workspace"), headers={"E2b-Sandbox-Id": "x"})
        assert unknown.value.code is Code.NOT_FOUND
        with pytest.raises(ConnectError) as exists:
            client.make_dir(pb.MakeDirRequest(path="/workspace"), headers=headers)
        assert exists.value.code is Code.ALREADY_EXISTS
        with pytest.raises(ConnectError) as watch:
            client.create_watcher(pb.CreateWatcherRequest(path="/workspace"), headers=headers)
        assert watch.value.code is Code.UNIMPLEMENTED
        entries = client.list_dir(pb.ListDirRequest(path="/workspace", depth=0),
                                  headers=headers).entries
        assert entries == []


def test_connect_entry_info_fields(served: Served) -> None:
    served.host("workspace", "f").write_bytes(b"12345")
    os.symlink("f", served.host("workspace", "l"))
    with raw_client(served) as client:
        entry = client.stat(pb.StatRequest(path="/workspace/l"),
                            headers={"E2b-Sandbox-Id": SID}).entry
    assert entry is not None
    assert (entry.name, entry.path, entry.type, entry.is_symlink, entry.symlink_target) == (
        "l", "/workspace/l", pb.FileType.FILE, True, "/workspace/f")
    assert (entry.owner, entry.group) == ("root", "root")
    assert entry.modified_time is not None
    assert entry.modified_time.seconds == int(os.lstat(served.host("workspace", "l")).st_mtime)


def test_http_download_headers_and_errors(served: Served) -> None:
    served.host("workspace", "notes").write_bytes("héllo\n".encode())
    served.host("workspace", "blob").write_bytes(b"\x00\x01\x02")
    served.host("workspace", "page.html").write_bytes(b"<p>")
    headers = {"E2b-Sandbox-Id": SID, "Accept-Encoding": "identity"}
    with httpx.Client(base_url=served.url, headers=headers) as http:
        text = http.get("/files", params={"path": "/workspace/notes"})
        assert text.status_code == 200
        assert text.headers["content-type"] == "text/plain; charset=utf-8"
        assert text.headers["content-length"] == str(len("héllo\n".encode()))
        blob = http.get("/files", params={"path": "/workspace/blob"})
        assert blob.headers["content-type"] == "application/octet-stream"
        assert blob.content == b"\x00\x01\x02"
        html = http.get("/files", params={"path": "/workspace/page.html"})
        assert html.headers["content-type"].startswith("text/html")
        zipped = http.get("/files", params={"path": "/workspace/notes"},
                          headers={"Accept-Encoding": "br, gzip;q=0.5"})
        assert zipped.headers["content-encoding"] == "gzip"
        assert zipped.content == "héllo\n".encode()
        refused = http.get("/files", params={"path": "/workspace/notes"},
                           headers={"Accept-Encoding": "gzip;q=0"})
        assert "content-encoding" not in refused.headers
        missing = http.get("/files", params={"path": "/workspace/none"})
        assert missing.status_code == 404
        assert missing.json() == {"code": 404,
                                  "message": "path '/workspace/none' does not exist"}
        assert http.get("/files", params={"path": "/workspace"}).status_code == 400
        assert http.get("/files").status_code == 400
        assert http.get("/files", params={"path": "/x"},
                        headers={"E2b-Sandbox-Id": ""}).status_code == 400


def test_http_upload_forms(served: Served) -> None:
    headers = {"E2b-Sandbox-Id": SID}
    with httpx.Client(base_url=served.url, headers=headers) as http:
        raw = http.post("/files", params={"path": "/tmp/raw"}, content=gzip.compress(b"r"),
                        headers={"Content-Type": "application/octet-stream",
                                 "Content-Encoding": "gzip"})
        assert raw.json() == [{"name": "raw", "type": "file", "path": "/tmp/raw"}]
        assert served.host("tmp", "raw").read_bytes() == b"r"
        no_path = http.post("/files", content=b"r",
                            headers={"Content-Type": "application/octet-stream"})
        assert no_path.status_code == 400
        dup = http.post("/files", files=[("file", ("/tmp/d", b"1")), ("file", ("/tmp/d", b"2"))])
        assert dup.status_code == 400
        assert served.host("tmp", "d").read_bytes() == b"1"  # the first part was written
        other = http.post("/files", files=[("other", ("x", b"ignored")),
                                           ("file", ("/tmp/sp ace", b"q"))])
        assert other.json() == [{"name": "sp ace", "type": "file", "path": "/tmp/sp ace"}]
        bad = http.post("/files", content=b"x", headers={"Content-Type": "text/plain"})
        assert bad.status_code == 400


# -- multipart parsing -----------------------------------------------------------------


def test_multipart_parser_at_every_split_point() -> None:
    body = (b"preamble\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"; "
            b"filename=\"/a/b\"\r\nContent-Type: application/octet-stream\r\n\r\n"
            b"one\r\n--XyZ-not-a-boundary\r\n"
            b"\r\n--XyZ\r\nContent-Disposition: form-data; name=\"f2\"\r\n\r\n"
            b"\r\n--XyZ--\r\nepilogue")
    expected = [("file", "/a/b", b"one\r\n--XyZ-not-a-boundary\r\n"), ("f2", "", b"")]
    for split in range(len(body) + 1):
        parser = MultipartParser(b"XyZ")
        parts: list[tuple[str, str, bytes]] = []
        for chunk in (body[:split], body[split:]):
            for kind, value in parser.feed(chunk):
                if kind == "part":
                    parts.append((*value, b""))
                elif kind == "data":
                    name, filename, data = parts[-1]
                    parts[-1] = (name, filename, data + value)
        parser.close()
        assert parts == expected, split


def test_multipart_parser_rejects_truncated_bodies() -> None:
    parser = MultipartParser(b"b")
    list(parser.feed(b"--b\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nda"))
    with pytest.raises(MultipartError):
        parser.close()


def test_content_disposition_parameters() -> None:
    assert content_disposition(' form-data; name="file"; filename="/w/a \\"q\\".txt"') == (
        "file", '/w/a "q".txt')
    assert content_disposition(" form-data; name=file; filename*=UTF-8''%C3%A9t%C3%A9") == (
        "file", "été")


@pytest.mark.parametrize("client_leaves", [False, True])
async def test_download_holds_the_sandbox_until_sent_or_abandoned(
        tmp_path: Path, client_leaves: bool) -> None:
    root = tmp_path / "root"
    (root / "workspace").mkdir(parents=True)
    data = os.urandom(300_000)  # several chunks
    (root / "workspace" / "big").write_bytes(data)
    resolver = FakeResolver({SID: SandboxFiles(root, image_root=None,
                                               max_write_bytes=MAX_WRITE_BYTES)})
    app = make_app(resolver)
    scope = {"type": "http", "method": "GET", "path": "/files", "raw_path": b"/files",
             "query_string": b"path=/workspace/big", "root_path": "", "scheme": "http",
             "headers": [(b"e2b-sandbox-id", SID.encode())], "http_version": "1.1",
             "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1)}
    body: list[bytes] = []
    held_while_sending: list[int] = []

    requested = False
    never = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await never.wait()  # the client neither sends more nor disconnects
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            held_while_sending.append(resolver.num_open)
            if client_leaves:
                raise OSError("client went away")
            body.append(message.get("body", b""))

    if client_leaves:
        with pytest.raises(OSError, match="went away"):
            await app(scope, receive, send)
    else:
        await app(scope, receive, send)
        assert b"".join(body) == data
    assert held_while_sending[0] == 1
    assert resolver.num_open == 0
