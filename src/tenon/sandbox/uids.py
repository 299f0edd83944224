"""Host ids for live sandboxes, from a fixed range nobody else uses: one uid per sandbox
(`UidAllocator`, the Docker backend), or one range of 65536 ids per sandbox
(`IdRangeAllocator`, the process backend, whose user namespace maps 0..65535 onto it).

A sandbox's processes run as host ids of its own (gid the same number), so per-user kernel
limits (inotify instances and watches, RLIMIT_NPROC, message-queue bytes, user namespaces)
are per sandbox, and one sandbox's files are not another's.

The range is `FIRST_UID` .. `FIRST_UID + NUM_UIDS - 1` (1,700,000,000 .. 1,700,065,535):
far above the ids distributions hand out to users (below 60000) and to subordinate ranges
(useradd's default SUB_UID_MAX is 600,100,000); `check()` reports a clash with
/etc/passwd, /etc/group, /etc/subuid or /etc/subgid anyway.

The id ranges follow: 1,700,065,536 + k * 65536 for k below `NUM_RANGES`.

A uid (a range: its first id) is held by an exclusive flock(2) on `LOCK_DIR/<uid>`
(`RANGE_LOCK_DIR/<first id>`) for as long as its sandbox
lives, so every controller on the host (and a test run beside a service) draws from the
same pool; the kernel drops the lock if the holder dies. Release unlinks the file, and
acquiring re-checks that the locked file is still the one at that path.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
from pathlib import Path

from tenon.errors import SandboxError

logger = logging.getLogger(__name__)

FIRST_UID = 1_700_000_000
NUM_UIDS = 65536
LOCK_DIR = Path("/run/tenon/uids")
# Id ranges (`IdRangeAllocator`): 65536 ids each, the first one right after the uids above.
RANGE_IDS = 65536
FIRST_RANGE_BASE = FIRST_UID + NUM_UIDS
NUM_RANGES = 4096
RANGE_LOCK_DIR = Path("/run/tenon/idranges")
_ID_FILES = {"/etc/passwd": 2, "/etc/group": 2}  # path -> field holding the id
_SUBORDINATE_FILES = ("/etc/subuid", "/etc/subgid")


class UidAllocator:
    """Hands out host uids for live sandboxes; thread-safe and shared across processes."""

    _what = "sandbox uids"

    def __init__(self, first: int = FIRST_UID, num_uids: int = NUM_UIDS,
                 lock_dir: Path = LOCK_DIR, etc: Path = Path("/")) -> None:
        if first < 65536 or num_uids < 1 or first + num_uids > 2**32 - 1:
            raise ValueError(f"uid range {first}+{num_uids} must lie in 65536..2^32-2")
        self.first = first
        self.num_uids = num_uids
        self.lock_dir = lock_dir
        self._etc = etc
        self._held: dict[int, int] = {}  # uid -> fd of its locked file
        self._next = 0  # next-fit: a just-released uid is the last one handed out again
        self._lock = threading.Lock()
        self._stride = 1  # ids handed out are first, first + stride, ...

    def __contains__(self, uid: int) -> bool:
        offset = uid - self.first
        return 0 <= offset < self.num_uids * self._stride and offset % self._stride == 0

    def _covers(self, uid: int) -> bool:
        return self.first <= uid < self.first + self.num_uids * self._stride

    def check(self) -> list[str]:
        """Clashes of the range with users, groups and subordinate ranges (empty if none)."""
        last = self.first + self.num_uids * self._stride - 1
        problems = []
        for name, field in _ID_FILES.items():
            for line in self._lines(name):
                parts = line.split(":")
                if (len(parts) > field and parts[field].isdigit()
                        and self._covers(int(parts[field]))):
                    problems.append(f"{name} entry {parts[0]!r} uses id {parts[field]}, inside "
                                    f"the sandbox uid range {self.first}-{last}")
        for name in _SUBORDINATE_FILES:
            for line in self._lines(name):
                parts = line.split(":")
                if len(parts) != 3 or not (parts[1].isdigit() and parts[2].isdigit()):
                    continue
                start, count = int(parts[1]), int(parts[2])
                if start <= last and self.first < start + count:
                    problems.append(f"{name} range {parts[0]}:{start}:{count} overlaps the "
                                    f"sandbox uid range {self.first}-{last}")
        return problems

    def _lines(self, name: str) -> list[str]:
        try:
            return (self._etc / name.lstrip("/")).read_text().splitlines()
        except FileNotFoundError:
            return []

    def acquire(self, preferred: int | None = None) -> int:
        """A free uid: `preferred` when it is in the range and free (an agent's previous uid,
        so its files need no chown), else the next free one. SandboxError when none is."""
        with self._lock:
            self.lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            if preferred is not None and preferred in self and self._try(preferred):
                return preferred
            for step in range(self.num_uids):
                uid = self.first + (self._next + step) % self.num_uids * self._stride
                if self._try(uid):
                    self._next = ((uid - self.first) // self._stride + 1) % self.num_uids
                    return uid
        raise SandboxError(f"all {self.num_uids} {self._what} from {self.first} are in use")

    def _try(self, uid: int) -> bool:
        if uid in self._held:
            return False
        path = self.lock_dir / str(uid)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.stat(path).st_ino != os.fstat(fd).st_ino:  # released and unlinked meanwhile
                os.close(fd)
                return False
        except FileNotFoundError:
            os.close(fd)
            return False
        except BlockingIOError:
            os.close(fd)
            return False
        self._held[uid] = fd
        return True

    def release(self, uid: int) -> None:
        """Give `uid` back (idempotent). Call only once nothing runs as it any more."""
        with self._lock:
            fd = self._held.pop(uid, None)
            if fd is None:
                return
            with contextlib.suppress(FileNotFoundError):
                (self.lock_dir / str(uid)).unlink()
            os.close(fd)

    def held(self) -> list[int]:
        with self._lock:
            return sorted(self._held)


class IdRangeAllocator(UidAllocator):
    """Hands out ranges of `RANGE_IDS` host ids (uid and gid alike), one per live sandbox
    of the process backend, which maps its user namespace's 0..65535 onto the range; each
    is named by its first id. The ranges start right after `UidAllocator`'s uids, so the
    two never overlap; the locks live in a directory of their own."""

    def __init__(self, first: int = FIRST_RANGE_BASE, num_ranges: int = NUM_RANGES,
                 lock_dir: Path = RANGE_LOCK_DIR, etc: Path = Path("/")) -> None:
        if first < 65536 or num_ranges < 1 or first + num_ranges * RANGE_IDS > 2**32 - 1:
            raise ValueError(f"id ranges {first}+{num_ranges}x{RANGE_IDS} must lie in "
                             f"65536..2^32-2")
        super().__init__(first, 1, lock_dir, etc)
        self._what = "sandbox id ranges"
        self.num_uids = num_ranges
        self._stride = RANGE_IDS


_shared_ranges: list[IdRangeAllocator] = []


def shared_range_allocator() -> IdRangeAllocator:
    """The process-wide id range allocator the process backend uses unless given its own."""
    with _shared_lock:
        if not _shared_ranges:
            _shared_ranges.append(IdRangeAllocator())
        return _shared_ranges[0]


_shared: list[UidAllocator] = []
_shared_lock = threading.Lock()


def shared_allocator() -> UidAllocator:
    """The process-wide allocator every backend uses unless given its own."""
    with _shared_lock:
        if not _shared:
            _shared.append(UidAllocator())
        return _shared[0]
