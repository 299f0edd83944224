"""envd's Connect `filesystem.Filesystem` service over `SandboxFiles`.

The sandbox is the one named by the request's `E2b-Sandbox-Id` header, found through a
`FilesResolver`; its files are touched in a worker thread, never on the event loop. Answers
follow envd: Stat describes the entry itself (a final symlink is not followed), ListDir
follows a symlink to the listed directory and takes depth 0 as 1, MakeDir answers
ALREADY_EXISTS for an existing directory (the SDK's `make_dir` then returns False), Move
creates the destination's parents, and Remove of a missing path succeeds (envd removes with
`os.RemoveAll`). Errors are `ConnectError`s with the code the SDK maps to its exception
(NOT_FOUND: FileNotFoundException). The `user` the SDK sends (Authorization: Basic, as for
commands) is who a path outside the persistent directories is reached as (`SandboxFiles`);
the persistent directories are reachable whoever asks. Watching (WatchDir, CreateWatcher,
GetWatcherEvents, RemoveWatcher) answers UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from typing import Any, TypeVar

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from e2b.envd.filesystem import filesystem_pb as pb
from e2b.envd.filesystem.filesystem_connect import Filesystem, FilesystemASGIApplication
from protobuf.wkt import Timestamp

from tenon.service.envd_process import AUTH_HEADER, basic_auth_user
from tenon.service.errors import ServiceError
from tenon.service.files import Entry, EntryType, FilesResolver, NotFound, SandboxFiles

SANDBOX_ID_HEADER = "E2b-Sandbox-Id"

_T = TypeVar("_T")
_FILE_TYPES = {EntryType.FILE: pb.FileType.FILE, EntryType.DIR: pb.FileType.DIRECTORY,
               EntryType.OTHER: pb.FileType.UNSPECIFIED}


def entry_info(entry: Entry) -> pb.EntryInfo:
    """`entry` as envd's EntryInfo: a symlink carries its target's type and `is_symlink`."""
    info = pb.EntryInfo(
        name=entry.name, type=_FILE_TYPES[entry.type], path=entry.path, size=entry.size,
        mode=entry.mode, permissions=entry.permissions, owner=entry.owner, group=entry.group,
        modified_time=Timestamp(seconds=entry.modified_ns // 1_000_000_000,
                                nanos=entry.modified_ns % 1_000_000_000),
        is_symlink=entry.is_symlink, metadata=dict(entry.metadata))
    if entry.symlink_target is not None:
        info.symlink_target = entry.symlink_target
    return info


def sandbox_id(headers: Mapping[str, str]) -> str:
    """The sandbox a request is for (headers are case-insensitive); INVALID_ARGUMENT
    without one."""
    value = headers.get(SANDBOX_ID_HEADER)
    if not value:
        raise ConnectError(Code.INVALID_ARGUMENT, f"missing {SANDBOX_ID_HEADER} header")
    return value


class FilesystemService(Filesystem):
    """The Filesystem protocol; the watcher methods keep the protocol's UNIMPLEMENTED."""

    def __init__(self, resolver: FilesResolver) -> None:
        self._resolver = resolver

    @asynccontextmanager
    async def _files(self, ctx: RequestContext[Any, Any], *, write: bool,
                     paths: Sequence[str]) -> AsyncIterator[SandboxFiles]:
        sid = sandbox_id(ctx.request_headers)
        user = basic_auth_user(ctx.request_headers.get(AUTH_HEADER))
        try:
            opener = self._resolver.writing if write else self._resolver.reading
            async with opener(sid, paths, user) as files:
                yield files
        except ServiceError as exc:  # a file operation's FilesError too
            raise ConnectError(exc.connect_code, str(exc)) from exc

    async def _run(self, ctx: RequestContext[Any, Any], write: bool, paths: Sequence[str],
                   op: Callable[[SandboxFiles], _T]) -> _T:
        async with self._files(ctx, write=write, paths=paths) as files:
            return await asyncio.to_thread(op, files)

    async def stat(self, request: pb.StatRequest,
                   ctx: RequestContext[pb.StatRequest, pb.StatResponse], /) -> pb.StatResponse:
        entry = await self._run(ctx, False, [request.path],
                                  lambda f: f.stat(request.path))
        return pb.StatResponse(entry=entry_info(entry))

    async def list_dir(self, request: pb.ListDirRequest,
                       ctx: RequestContext[pb.ListDirRequest, pb.ListDirResponse], /,
                       ) -> pb.ListDirResponse:
        depth = max(request.depth, 1)
        entries = await self._run(ctx, False, [request.path],
                                  lambda f: f.list_dir(request.path, depth))
        return pb.ListDirResponse(entries=[entry_info(e) for e in entries])

    async def make_dir(self, request: pb.MakeDirRequest,
                       ctx: RequestContext[pb.MakeDirRequest, pb.MakeDirResponse], /,
                       ) -> pb.MakeDirResponse:
        entry = await self._run(ctx, True, [request.path],
                                  lambda f: f.make_dir(request.path))
        return pb.MakeDirResponse(entry=entry_info(entry))

    async def move(self, request: pb.MoveRequest,
                   ctx: RequestContext[pb.MoveRequest, pb.MoveResponse], /) -> pb.MoveResponse:
        entry = await self._run(ctx, True, [request.source, request.destination],
                                lambda f: f.rename(request.source, request.destination))
        return pb.MoveResponse(entry=entry_info(entry))

    async def remove(self, request: pb.RemoveRequest,
                     ctx: RequestContext[pb.RemoveRequest, pb.RemoveResponse], /,
                     ) -> pb.RemoveResponse:
        await self._run(ctx, True, [request.path], lambda f: _remove_all(f, request.path))
        return pb.RemoveResponse()


def _remove_all(files: SandboxFiles, path: str) -> None:
    with suppress(NotFound):
        files.remove(path)


def filesystem_app(resolver: FilesResolver) -> FilesystemASGIApplication:
    """The ASGI app serving `/filesystem.Filesystem/*` for the resolver's sandboxes."""
    return FilesystemASGIApplication(FilesystemService(resolver))
