"""Host-side file access to a sandbox's filesystem, confined by the kernel.

A sandbox path maps to a host directory that plays "/" for it ("the top"):
/workspace/..., /home/user/... and /tmp/... go to `root/workspace`, `root/home` and
`root/tmp` (`PERSISTENT_MOUNTS`), read-write, without the sandbox being live (the fast
path). Any other absolute path goes through the live sandbox's own root (`LiveRoot`:
/proc/<its init>/root, which shows its writable overlay root and every mount in it) as the
request's user; without a live root it goes to `image_root` (a base rootfs), read-only,
and is not found without one. A relative path, `~` and `~/...` are relative to
/home/user. `..` is collapsed lexically first, as envd does.

Invariants:
- Every host path is opened by openat2(2) from an fd of the top with RESOLVE_IN_ROOT and
  RESOLVE_NO_MAGICLINKS: the kernel resolves each component, symlinks included (absolute
  ones as if the top were "/"), so nothing resolves outside the top, and a symlink swapped
  in between a check and a use is resolved again, inside the top. The final component of
  remove and rename is acted on through its parent's fd (`*at` calls, no following): they
  act on a link itself, as envd does. Trees are removed fd-relative (`shutil.rmtree` with
  `dir_fd`), which never follows a symlink.
- A symlink whose target lies in another mapped directory (e.g. /workspace/x -> /tmp/y)
  resolves inside its own top (to /workspace/tmp/y): confinement wins over fidelity. Under
  the live root a symlink resolves as in the sandbox (its mounts included).
- On the persistent directories new files and directories get the uid/gid of their top
  and modes 0644/0755; existing ones keep theirs. Under the live root the I/O runs with
  the thread's filesystem identity set to the user's host ids (`fsids.acting_as`): the
  kernel checks access as that user, and what it creates is that user's.
- A write larger than `max_write_bytes` is refused before anything is created.

Every method blocks on file I/O: async callers run it in a thread.
"""

from __future__ import annotations

import enum
import errno
import os
import posixpath
import re
import shutil
import stat
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

from connectrpc.code import Code

from tenon.errors import TenonError
from tenon.sandbox.base import HOME_DIR, PERSISTENT_MOUNTS
from tenon.service.errors import ServiceError
from tenon.service.fsids import acting_as
from tenon.service.inroot import closing_fd as _closing
from tenon.service.inroot import openat2
from tenon.service.liveroot import LiveRoot

FILE_MODE = 0o644
DIR_MODE = 0o755
CHUNK_BYTES = 64 * 1024
# Bounds on one listing, so a sandbox's tree cannot exhaust the server's memory, stack or
# fds: deeper levels are not descended into; more entries fail the listing.
MAX_LIST_DEPTH = 128
MAX_LIST_ENTRIES = 100_000


class FilesError(ServiceError, TenonError, OSError):
    """A file operation refused or failed; the message is one line naming the path.
    `http_status` and `connect_code` are what envd answers, which the SDK maps to its
    matching exception (404/NOT_FOUND: FileNotFoundException, 400/INVALID_ARGUMENT:
    InvalidArgumentException, 507: NotEnoughSpaceException)."""

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.path = path

    def __str__(self) -> str:
        return str(self.args[0])


class NotFound(FilesError, FileNotFoundError):
    http_status = 404
    connect_code = Code.NOT_FOUND


class AlreadyExists(FilesError, FileExistsError):
    http_status = 409
    connect_code = Code.ALREADY_EXISTS


class NotADirectory(FilesError, NotADirectoryError):
    http_status = 400
    connect_code = Code.INVALID_ARGUMENT


class IsADirectory(FilesError, IsADirectoryError):
    http_status = 400
    connect_code = Code.INVALID_ARGUMENT


class ReadOnly(FilesError, PermissionError):
    http_status = 403
    connect_code = Code.PERMISSION_DENIED


class PermissionDenied(FilesError, PermissionError):
    """The request's user may not do this (as envd: 403, PERMISSION_DENIED)."""

    http_status = 403
    connect_code = Code.PERMISSION_DENIED


class TooLarge(FilesError):
    http_status = 413
    connect_code = Code.INVALID_ARGUMENT


class BadMetadata(FilesError):
    http_status = 400
    connect_code = Code.INVALID_ARGUMENT


class InvalidPath(FilesError):
    http_status = 400
    connect_code = Code.INVALID_ARGUMENT


class NoSpace(FilesError):
    http_status = 507
    connect_code = Code.RESOURCE_EXHAUSTED


class EntryType(enum.Enum):
    FILE = "file"
    DIR = "dir"
    OTHER = "other"  # a device, socket, fifo, or the unreadable target of a symlink


@dataclass(frozen=True)
class Entry:
    """One file as envd describes it. For a symlink, `type` and `mode` are its target's
    and `symlink_target` is the target's sandbox path (the link's own text when it
    dangles); `size`, `permissions` and times are the link's own."""

    name: str
    path: str  # sandbox path as requested (not symlink-resolved)
    type: EntryType
    size: int
    mode: int  # permission bits only (0o777), as envd reports them
    permissions: str  # Go's FileMode.String(): "-rw-r--r--", "drwxr-xr-x", "Lrwxrwxrwx"
    owner: str
    group: str
    modified_ns: int
    symlink_target: str | None = None
    # `user.e2b.<key>` extended attributes of a file or directory, prefix stripped
    metadata: Mapping[str, str] = field(default_factory=dict)

    @property
    def is_symlink(self) -> bool:
        return self.symlink_target is not None


class FilesResolver(Protocol):
    """Finds the files of a sandbox by id. Unknown ids raise
    `tenon.service.errors.SandboxNotFound` on entry. `writing` holds off teardown and
    rebuild for its duration and keeps the sandbox's recorded digest right afterwards.
    When one of `paths` lies outside the persistent directories (`is_persistent`), the
    sandbox is made live (rebuilt if torn down) and held so for the duration, and those
    paths are reached through its root as `user` (None: the default user)."""

    def reading(self, sandbox_id: str, paths: Sequence[str] = (), user: str | None = None,
                ) -> AbstractAsyncContextManager[SandboxFiles]: ...

    def writing(self, sandbox_id: str, paths: Sequence[str] = (), user: str | None = None,
                ) -> AbstractAsyncContextManager[SandboxFiles]: ...


def go_mode_string(st_mode: int) -> str:
    """`st_mode` as Go's FileMode.String() prints it (envd's `permissions`)."""
    letters = ""
    kind = stat.S_IFMT(st_mode)
    flags = {"d": kind == stat.S_IFDIR, "L": kind == stat.S_IFLNK,
             "D": kind in (stat.S_IFBLK, stat.S_IFCHR), "p": kind == stat.S_IFIFO,
             "S": kind == stat.S_IFSOCK, "u": bool(st_mode & stat.S_ISUID),
             "g": bool(st_mode & stat.S_ISGID), "c": kind == stat.S_IFCHR,
             "t": bool(st_mode & stat.S_ISVTX)}
    for letter in "dalTLDpSugct":
        if flags.get(letter):
            letters += letter
    rwx = "".join(ch if st_mode & (1 << (8 - i)) else "-" for i, ch in enumerate("rwxrwxrwx"))
    return (letters or "-") + rwx


def is_persistent(path: str) -> bool:
    """Whether `path` lies in a persistent directory (the fast path: no live sandbox
    needed); True for a path `normalize` refuses (it fails before any top is used)."""
    try:
        norm = normalize(path)
    except InvalidPath:
        return True  # refused before any top is needed
    return any(norm == m or norm.startswith(m + "/") for m in PERSISTENT_MOUNTS.values())


@dataclass(frozen=True)
class _Location:
    path: str  # normalized absolute sandbox path
    mount: str  # the sandbox directory the top appears at ("/" for the image)
    top: Path | None  # host directory playing "/"; None: nothing there (or `live`)
    rel: str  # path below the top, "" for the top itself
    writable: bool
    live: bool = False  # under the live root: the top is `LiveRoot.top_fd`

    def sandbox_path(self, rel: str) -> str:
        return posixpath.join(self.mount, rel) if rel else self.mount

    @property
    def parent_rel(self) -> str:
        return posixpath.dirname(self.rel)

    @property
    def name(self) -> str:
        return posixpath.basename(self.rel)


def _fs_error(err: OSError, path: str) -> FilesError:
    code = err.errno
    if code == errno.ENOENT:
        return NotFound(f"path '{path}' does not exist", path)
    if code == errno.EEXIST:
        return AlreadyExists(f"path '{path}' already exists", path)
    if code == errno.ENOTDIR:
        return NotADirectory(f"a component of '{path}' is not a directory", path)
    if code == errno.EISDIR:
        return IsADirectory(f"path '{path}' is a directory", path)
    if code in (errno.EACCES, errno.EPERM):
        return PermissionDenied(f"permission denied on '{path}'", path)
    if code == errno.EROFS:
        return ReadOnly(f"path '{path}' is on a read-only filesystem", path)
    if code in (errno.ENOSPC, errno.EDQUOT):
        return NoSpace(f"not enough disk space to write '{path}'", path)
    if code in (errno.ENAMETOOLONG, errno.EINVAL, errno.ELOOP, errno.ENXIO, errno.EXDEV,
                errno.ENOTEMPTY, errno.EBUSY):
        return InvalidPath(f"cannot use '{path}': {os.strerror(code or 0)}", path)
    return FilesError(f"error on '{path}': {os.strerror(code or 0)}", path)


def normalize(path: str) -> str:
    """The absolute sandbox path `path` names (relative to /home/user, `~` expanded, `..`
    collapsed); InvalidPath for an empty path or one with a NUL byte."""
    if not path or "\0" in path:
        raise InvalidPath(f"invalid path '{path}'", path)
    if path == "~" or path.startswith("~/"):
        path = HOME_DIR + path[1:]
    elif not path.startswith("/"):
        path = posixpath.join(HOME_DIR, path)
    return "/" + posixpath.normpath(path).lstrip("/")  # normpath keeps a leading "//"


class SandboxFiles:
    """The files of one sandbox, seen from the host (see the module docstring)."""

    def __init__(self, root: Path, *, image_root: Path | None, max_write_bytes: int,
                 live: LiveRoot | None = None) -> None:
        self._root = root
        self._image_root = image_root
        self._live = live
        self.max_write_bytes = max_write_bytes

    # -- paths ---------------------------------------------------------------------------

    def locate(self, path: str) -> _Location:
        """Where `path` lives; InvalidPath for an empty path or one with a NUL byte."""
        norm = normalize(path)
        for sub, mount in PERSISTENT_MOUNTS.items():
            if norm == mount or norm.startswith(mount + "/"):
                return _Location(norm, mount, self._root / sub,
                                 norm[len(mount):].lstrip("/"), True)
        if self._live is not None:
            return _Location(norm, "/", None, norm.lstrip("/"), True, live=True)
        return _Location(norm, "/", self._image_root, norm.lstrip("/"), False)

    @contextmanager
    def _top(self, loc: _Location) -> Iterator[int]:
        """An fd of the top; under the live root, the thread acts as the request's user
        while it is held."""
        if loc.live and self._live is not None:
            uid, gid, groups = self._live.host_ids()
            with acting_as(uid, gid, groups):
                yield self._live.top_fd
            return
        if loc.top is None:
            raise NotFound(f"path '{loc.path}' does not exist", loc.path)
        try:
            fd = os.open(loc.top, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as err:
            raise _fs_error(err, loc.path) from err
        with _closing(fd):
            yield fd

    def _writable(self, path: str) -> _Location:
        loc = self.locate(path)
        if not loc.writable:
            raise ReadOnly(f"path '{loc.path}' is on a read-only filesystem", loc.path)
        return loc

    @contextmanager
    def _open(self, top: int, loc: _Location, rel: str, flags: int) -> Iterator[int]:
        try:
            fd = openat2(top, rel, flags)
        except OSError as err:
            raise _fs_error(err, loc.path) from err
        with _closing(fd):
            yield fd

    # -- reading -------------------------------------------------------------------------

    def stat(self, path: str) -> Entry:
        """The entry at `path` itself (a final symlink is described, not followed); a path
        under a non-directory is NotFound, as for `os.path.exists`."""
        loc = self.locate(path)
        try:
            with self._top(loc) as top, self._open(top, loc, loc.parent_rel,
                                                   os.O_PATH | os.O_DIRECTORY) as parent:
                try:
                    st = os.stat(loc.name or ".", dir_fd=parent, follow_symlinks=False)
                except OSError as err:
                    raise _fs_error(err, loc.path) from err
                where = f"/proc/self/fd/{parent}/{loc.name or '.'}"
                return self._entry(top, loc, loc.rel, loc.path, st, where)
        except NotADirectory as exc:
            raise NotFound(f"path '{loc.path}' does not exist", loc.path) from exc

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
        except NotFound:
            return False
        return True

    def list_dir(self, path: str, depth: int = 1) -> list[Entry]:
        """Entries under the directory `path` (a symlink to one is followed), `depth` levels
        deep (at most MAX_LIST_DEPTH), each directory's entries sorted by name and followed
        by their own children; symlinked directories inside are listed, not descended into.
        TooLarge past MAX_LIST_ENTRIES entries."""
        loc = self.locate(path)
        entries: list[Entry] = []
        with self._top(loc) as top, self._open(top, loc, loc.rel,
                                               os.O_RDONLY | os.O_DIRECTORY) as fd:
            self._walk(top, loc, fd, self._rel_of(top, fd), loc.path,
                       min(max(depth, 1), MAX_LIST_DEPTH), entries)
        return entries

    def _walk(self, top: int, loc: _Location, dir_fd: int, real_rel: str, shown: str,
              depth: int, out: list[Entry]) -> None:
        for name in sorted(os.listdir(dir_fd)):
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed while listing
            child_rel = posixpath.join(real_rel, name)
            child_shown = posixpath.join(shown, name)
            if len(out) >= MAX_LIST_ENTRIES:
                raise TooLarge(f"listing '{loc.path}' has more than {MAX_LIST_ENTRIES} "
                               "entries; list a smaller depth or a subdirectory", loc.path)
            out.append(self._entry(top, loc, child_rel, child_shown, st,
                                   f"/proc/self/fd/{dir_fd}/{name}"))
            if depth > 1 and stat.S_ISDIR(st.st_mode):
                try:
                    sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                                  | os.O_CLOEXEC, dir_fd=dir_fd)
                except OSError:
                    continue  # replaced by a non-directory while listing
                with _closing(sub):
                    self._walk(top, loc, sub, child_rel, child_shown, depth - 1, out)

    @contextmanager
    def open_read(self, path: str) -> Iterator[IO[bytes]]:
        """The regular file at `path` (symlinks followed inside the top), open for reading;
        a fifo or device is refused without blocking. Only the open acts as the request's
        user: the file may be read, and the block left, from any thread."""
        loc = self.locate(path)
        with self._top(loc) as top:
            try:
                fd = openat2(top, loc.rel, os.O_RDONLY | os.O_NONBLOCK)
            except OSError as err:
                raise _fs_error(err, loc.path) from err
        try:
            _check_regular(fd, loc.path)
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        with os.fdopen(fd, "rb") as f:
            yield f

    def read(self, path: str) -> bytes:
        with self.open_read(path) as f:
            return f.read()

    # -- writing -------------------------------------------------------------------------

    def write(self, path: str, data: bytes | IO[bytes],
              metadata: Mapping[str, str] | None = None) -> Entry:
        """Creates or truncates the file at `path` (and its missing parent directories) and
        writes `data` (bytes, or a seekable binary file read from its position to its end).
        A symlink at `path` is written through (inside the top); a fifo or device there is
        refused without blocking. Non-empty `metadata` replaces the file's `user.e2b.*`
        extended attributes (keys lowercased), as envd stores upload metadata."""
        loc = self._writable(path)
        _check_metadata(metadata or {}, loc.path)
        if isinstance(data, bytes):
            size = len(data)
        else:
            start = data.tell()
            size = data.seek(0, os.SEEK_END) - start
            data.seek(start)
        if size > self.max_write_bytes:
            raise TooLarge(f"writing {size} bytes to '{loc.path}' is over the limit of "
                           f"{self.max_write_bytes} bytes", loc.path)
        if not loc.rel:
            raise IsADirectory(f"path '{loc.path}' is a directory", loc.path)
        with self._top(loc) as top:
            owner = None if loc.live else os.fstat(top)
            os.close(self._ensure_dirs(top, loc, loc.parent_rel, owner))
            with _closing(self._create_file(top, loc, owner)) as fd:
                try:
                    if isinstance(data, bytes):
                        view = memoryview(data)
                        while view:
                            view = view[os.write(fd, view):]
                    else:
                        while chunk := data.read(CHUNK_BYTES):
                            os.write(fd, chunk)
                except OSError as err:
                    raise _fs_error(err, loc.path) from err
                if metadata:
                    _store_metadata(fd, metadata, loc.path)
        return self.stat(loc.path)

    def _create_file(self, top: int, loc: _Location, owner: os.stat_result | None) -> int:
        """`owner`: whose a new file becomes (None: the thread's filesystem identity's)."""
        base = os.O_WRONLY | os.O_NONBLOCK
        created = True
        try:
            try:
                fd = openat2(top, loc.rel, base | os.O_CREAT | os.O_EXCL, FILE_MODE)
            except FileExistsError:
                try:
                    fd = openat2(top, loc.rel, base)
                    created = False
                except FileNotFoundError:  # a dangling symlink: create its target
                    fd = openat2(top, loc.rel, base | os.O_CREAT, FILE_MODE)
        except OSError as err:
            raise _fs_error(err, loc.path) from err
        try:
            _check_regular(fd, loc.path)
            os.set_blocking(fd, True)
            os.ftruncate(fd, 0)
            if created and owner is not None:
                os.fchown(fd, owner.st_uid, owner.st_gid)
            if created:
                os.fchmod(fd, FILE_MODE)
        except BaseException as exc:
            os.close(fd)
            if isinstance(exc, OSError) and not isinstance(exc, FilesError):
                raise _fs_error(exc, loc.path) from exc
            raise
        return fd

    def _ensure_dirs(self, top: int, loc: _Location, rel: str,
                     owner: os.stat_result | None) -> int:
        """An O_PATH fd of the directory `rel`, creating each missing component (0755,
        `owner`'s, None: the thread's filesystem identity's); symlinks among existing
        components are followed inside the top."""
        done = ""
        fd = os.dup(top)
        try:
            for part in [p for p in rel.split("/") if p]:
                try:
                    os.mkdir(part, DIR_MODE, dir_fd=fd)
                except FileExistsError:
                    pass
                else:
                    self._adopt_dir(fd, part, owner)
                done = posixpath.join(done, part)
                os.close(fd)
                fd = -1
                fd = openat2(top, done, os.O_PATH | os.O_DIRECTORY)
        except OSError as err:
            if fd >= 0:
                os.close(fd)
            shown = loc.sandbox_path(done) if err.errno == errno.ENOTDIR else loc.path
            raise _fs_error(err, shown) from err
        return fd

    @staticmethod
    def _adopt_dir(parent: int, name: str, owner: os.stat_result | None) -> None:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                         dir_fd=parent)
        except OSError:
            return  # swapped for something else already: not ours to chown
        with _closing(fd):
            if owner is not None:
                os.fchown(fd, owner.st_uid, owner.st_gid)
            os.fchmod(fd, DIR_MODE)

    def make_dir(self, path: str) -> Entry:
        """Creates the directory `path` and its missing parents. AlreadyExists if a
        directory is there, NotADirectory if something else is."""
        loc = self.locate(path)
        try:
            existing = self.stat(path)
        except NotFound:
            pass
        else:
            if existing.type is EntryType.DIR:
                raise AlreadyExists(f"directory '{loc.path}' already exists", loc.path)
            raise NotADirectory(f"path '{loc.path}' exists but is not a directory", loc.path)
        loc = self._writable(path)
        with self._top(loc) as top:
            os.close(self._ensure_dirs(top, loc, loc.rel, None if loc.live else os.fstat(top)))
        return self.stat(loc.path)

    def remove(self, path: str) -> None:
        """Removes the file, symlink (not its target) or directory tree at `path`."""
        loc = self._writable(path)
        if not loc.rel:
            raise InvalidPath(f"cannot remove the mount point '{loc.path}'", loc.path)
        with self._top(loc) as top, self._open(top, loc, loc.parent_rel,
                                               os.O_PATH | os.O_DIRECTORY) as parent:
            try:
                st = os.stat(loc.name, dir_fd=parent, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    with _closing(os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC,
                                          dir_fd=parent)) as parent_rd:
                        shutil.rmtree(loc.name, dir_fd=parent_rd)
                else:
                    os.unlink(loc.name, dir_fd=parent)
            except OSError as err:
                raise _fs_error(err, loc.path) from err

    def rename(self, source: str, destination: str) -> Entry:
        """Moves `source` (a symlink itself, not its target) to `destination`, creating the
        destination's missing parents; replaces a file there, as rename(2) does."""
        src = self._writable(source)
        dst = self._writable(destination)
        for loc in (src, dst):
            if not loc.rel:
                raise InvalidPath(f"cannot move the mount point '{loc.path}'", loc.path)
        with self._top(src) as src_top, self._top(dst) as dst_top, \
                self._open(src_top, src, src.parent_rel, os.O_PATH | os.O_DIRECTORY) as sp:
            try:
                os.stat(src.name, dir_fd=sp, follow_symlinks=False)
            except OSError as err:
                raise _fs_error(err, src.path) from err
            owner = None if dst.live else os.fstat(dst_top)
            with _closing(self._ensure_dirs(dst_top, dst, dst.parent_rel, owner)) as dp:
                try:
                    os.rename(src.name, dst.name, src_dir_fd=sp, dst_dir_fd=dp)
                except OSError as err:
                    raise _fs_error(err, dst.path) from err
        return self.stat(dst.path)

    # -- entries -------------------------------------------------------------------------

    def _rel_of(self, top: int, fd: int) -> str:
        """The path of `fd` below the top (both open): where the kernel resolved it."""
        top_path = os.readlink(f"/proc/self/fd/{top}")
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path == top_path:
            return ""
        if not path.startswith(top_path.rstrip("/") + "/"):
            raise FilesError(f"'{path}' resolved outside its root", path)
        return path[len(top_path.rstrip("/")) + 1:]

    def _entry(self, top: int, loc: _Location, rel: str, shown: str, st: os.stat_result,
               where: str) -> Entry:
        """The entry of `st`; `where` names it for the xattr calls (through a held fd)."""
        kind, mode, target = _entry_type(st.st_mode), st.st_mode & 0o777, None
        if stat.S_ISLNK(st.st_mode):
            try:
                with _closing(openat2(top, rel, os.O_PATH)) as fd:
                    target_st = os.fstat(fd)
                    target = loc.sandbox_path(self._rel_of(top, fd))
                kind, mode = _entry_type(target_st.st_mode), target_st.st_mode & 0o777
            except OSError:
                kind, mode, target = EntryType.OTHER, 0, shown
        if loc.live and self._live is not None:
            owner, group = self._live.name_of(st.st_uid), self._live.name_of(st.st_gid)
        else:
            top_uid = os.fstat(top).st_uid
            owner = _user_name(st.st_uid, top_uid, loc.writable)
            group = _user_name(st.st_gid, top_uid, loc.writable)
        shown = _printable(shown)
        return Entry(name=posixpath.basename(shown) or "/", path=shown, type=kind,
                     size=st.st_size, mode=mode, permissions=go_mode_string(st.st_mode),
                     owner=owner, group=group,
                     modified_ns=st.st_mtime_ns,
                     symlink_target=None if target is None else _printable(target),
                     metadata={} if stat.S_ISLNK(st.st_mode) else _read_metadata(where))


_METADATA_PREFIX = "user.e2b."
_METADATA_KEY = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_METADATA_VALUE = re.compile(r"[\x20-\x7e]*")


def _check_metadata(metadata: Mapping[str, str], path: str) -> None:
    for key, value in metadata.items():
        if not _METADATA_KEY.fullmatch(key) or not _METADATA_VALUE.fullmatch(value):
            raise BadMetadata(f"invalid metadata {key!r} for '{path}': keys are HTTP tokens, "
                              "values printable ASCII", path)


def _store_metadata(fd: int, metadata: Mapping[str, str], path: str) -> None:
    try:
        for name in os.listxattr(fd):
            if name.startswith(_METADATA_PREFIX):
                os.removexattr(fd, name)
        for key, value in metadata.items():
            os.setxattr(fd, _METADATA_PREFIX + key.lower(), value.encode())
    except OSError as err:
        raise BadMetadata(f"cannot store metadata on '{path}': {os.strerror(err.errno or 0)}",
                          path) from err


def _read_metadata(where: str) -> dict[str, str]:
    found: dict[str, str] = {}
    try:
        for name in os.listxattr(where, follow_symlinks=False):
            if name.startswith(_METADATA_PREFIX):
                value = os.getxattr(where, name, follow_symlinks=False)
                found[name[len(_METADATA_PREFIX):]] = value.decode("utf-8", "replace")
    except OSError:
        return found  # no xattr support, or the entry went away meanwhile
    return found


def _printable(path: str) -> str:
    """`path` as valid UTF-8 (a name that is not shows U+FFFD where it is not)."""
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _check_regular(fd: int, path: str) -> None:
    mode = os.fstat(fd).st_mode
    if stat.S_ISDIR(mode):
        raise IsADirectory(f"path '{path}' is a directory", path)
    if not stat.S_ISREG(mode):
        raise InvalidPath(f"path '{path}' is not a regular file", path)


def _entry_type(st_mode: int) -> EntryType:
    if stat.S_ISREG(st_mode):
        return EntryType.FILE
    if stat.S_ISDIR(st_mode):
        return EntryType.DIR
    return EntryType.OTHER


def _user_name(uid: int, top_uid: int, writable: bool) -> str:
    """The name the sandbox knows an id by: root, E2B's `user` (its own host uid on the
    persistent mounts, uid 1000 in the image), else the number, as envd falls back to."""
    if uid == 0:
        return "root"
    if (writable and uid == top_uid) or (not writable and uid == 1000):
        return "user"
    return str(uid)
