"""File content digests for workspace manifests.

Version 2 manifests name a file's content by its *block digest*, which reads only the
file's data extents (`SEEK_DATA`/`SEEK_HOLE`): `truncate -s 8G f` costs no read at all.
The file is cut into 4 KiB blocks; a block that is a hole or all zero bytes carries no
data. The digest is sha256 over, for each maximal run of consecutive non-zero blocks,
its bytes followed by its offset and length (two unsigned 64-bit little-endian
integers), then the file's size (same encoding) and a version tag. Read from the end the
encoding is unambiguous, so distinct contents give distinct inputs.

Two files with the same bytes therefore have the same digest whatever their holes: a
sparse file and a dense copy of it (a copy across filesystems, `cp --sparse=never`)
verify alike, and the allocation a filesystem happens to choose never fails a rebuild.
The price is a zero-block check on the data read (`bytes.find` of a zero block, at
memory speed; a per-block pass only in chunks that hold one).

Version 1 manifests used plain sha256 of the bytes (`plain_sha256`), still computed to
verify a record written by an older controller.
"""

from __future__ import annotations

import errno
import hashlib
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass

from tenon.errors import WorkspaceError

BLOCK_BYTES = 4096
_CHUNK_BYTES = 1024 * 1024  # a multiple of BLOCK_BYTES
_ZERO_BLOCK = bytes(BLOCK_BYTES)
_RUN = struct.Struct("<QQ")
_TAG = b"tenon-blocks-v1"


@dataclass
class HashBudget:
    """What hashing may still spend: bytes to read and a wall-clock deadline
    (`time.monotonic()`); None means unbounded. Counts files and bytes hashed."""

    max_bytes: int | None = None
    deadline_s: float | None = None
    num_files: int = 0
    num_bytes: int = 0

    def spend(self, num_bytes: int) -> None:
        self.num_bytes += num_bytes
        if self.max_bytes is not None and self.num_bytes > self.max_bytes:
            raise HashBudgetExceeded(f"more than max_hash_bytes={self.max_bytes} to hash")
        if self.deadline_s is not None and time.monotonic() > self.deadline_s:
            raise HashBudgetExceeded("hashing took longer than max_seconds")


class HashBudgetExceeded(WorkspaceError):
    """Hashing went past a `HashBudget` bound (the message names it)."""


class _Runs:
    """Feeds runs of non-zero blocks to the hash, merging runs across chunk boundaries."""

    def __init__(self) -> None:
        self.hash = hashlib.sha256()
        self.start: int | None = None  # offset of the open run
        self.end = 0

    def data(self, offset: int, chunk: memoryview) -> None:
        if self.start is not None and offset != self.end:
            self.close()
        if self.start is None:
            self.start = offset
        self.hash.update(chunk)
        self.end = offset + len(chunk)

    def close(self) -> None:
        if self.start is not None:
            self.hash.update(_RUN.pack(self.start, self.end - self.start))
            self.start = None

    def feed(self, offset: int, chunk: bytes) -> None:
        view = memoryview(chunk)
        if chunk.find(_ZERO_BLOCK) < 0:  # no zero block anywhere, aligned or not
            self.data(offset, view)
            return
        for at in range(0, len(chunk), BLOCK_BYTES):
            block = view[at:at + BLOCK_BYTES]
            if block == _ZERO_BLOCK[:len(block)]:
                self.close()
            else:
                self.data(offset + at, block)


def block_digest(path: str, budget: HashBudget | None = None) -> tuple[str, int]:
    """The file's block digest (hex) and size, reading only its data extents."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        runs = _Runs()
        # Extents start block-aligned; align anyway so zero blocks are judged alike.
        for offset, chunk in data_chunks(fd, path, size, align_bytes=BLOCK_BYTES):
            if budget is not None:
                budget.spend(len(chunk))
            runs.feed(offset, chunk)
        runs.close()
        runs.hash.update(_RUN.pack(size, 0) + _TAG)
    finally:
        os.close(fd)
    if budget is not None:
        budget.num_files += 1
    return runs.hash.hexdigest(), size


def data_chunks(fd: int, path: str | os.PathLike[str], size: int, *,
                align_bytes: int = 1) -> Iterator[tuple[int, bytes]]:
    """The first `size` bytes of the open file `fd` as (offset, bytes) chunks of its data
    extents only (holes are skipped, never read), each extent's start aligned down to
    `align_bytes` but never back into bytes already given (on a filesystem of smaller
    blocks). `path` names the file in errors."""
    offset = given = 0
    while offset < size:
        try:
            offset = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: only a hole is left
                raise
            return
        end = min(os.lseek(fd, offset, os.SEEK_HOLE), size)
        offset = max(offset - offset % align_bytes, given)
        while offset < end:
            chunk = os.pread(fd, min(_CHUNK_BYTES, end - offset), offset)
            if not chunk:
                raise OSError(errno.EIO, f"{path} ended early at byte {offset}")
            yield offset, chunk
            offset += len(chunk)
        given = offset


def plain_sha256(path: str, budget: HashBudget | None = None) -> tuple[str, int]:
    """sha256 of every byte of the file (version 1 manifests) and its size."""
    digest = hashlib.sha256()
    size = 0
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        while chunk := os.read(fd, _CHUNK_BYTES):
            if budget is not None:
                budget.spend(len(chunk))
            digest.update(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if budget is not None:
        budget.num_files += 1
    return digest.hexdigest(), size
