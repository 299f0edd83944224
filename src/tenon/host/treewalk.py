"""A directory tree's metadata, one record per entry, without reading any file.

Capture and verification of an agent's persistent root stat every entry and compare the
result with the previous capture's; only entries whose metadata differ are read. At
50,000 entries a pure-Python `os.scandir` walk takes ~110 ms, so the walk is a small static
C helper (`treewalk.c`, ~30 ms), built at setup into `HELPER`:

    python -m tenon.host.treewalk build    # needs gcc

Without the helper (or when its stamp names another source) the same records come from
Python. A record is `(path, header, target)`; the header is the text

    "T MODE DEV INO SIZE MTIME_NS CTIME_NS MAJOR:MINOR OPAQUE"

(T: f, d, l, c, b, p, s or ?; MODE: permission bits in octal; OPAQUE: 1 for a directory
whose `trusted.overlay.opaque` or `user.overlay.opaque` xattr is "y"), so two walks of an
untouched entry give equal headers and a comparison is one string equality.
"""

from __future__ import annotations

import functools
import os
import stat
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

from tenon.errors import HostError
from tenon.host import helpers

SOURCE = Path(__file__).with_name("treewalk.c")
HELPER = helpers.HELPER_DIR / "tenon-treewalk"
OPAQUE_XATTRS = ("trusted.overlay.opaque", "user.overlay.opaque")
_KINDS = {stat.S_IFREG: "f", stat.S_IFDIR: "d", stat.S_IFLNK: "l", stat.S_IFCHR: "c",
          stat.S_IFBLK: "b", stat.S_IFIFO: "p", stat.S_IFSOCK: "s"}


class Walk(NamedTuple):
    """A walk's records as three parallel lists (cheaper than a tuple per entry)."""

    paths: list[str]  # relative to the walked root, POSIX-style
    headers: list[str]  # see the module docstring
    targets: list[str]  # a symlink's target; "" otherwise


class Header(NamedTuple):
    """A record's header, parsed."""

    kind: str
    mode: int
    dev: int
    ino: int
    size_bytes: int
    mtime_ns: int
    ctime_ns: int
    rdev: tuple[int, int]
    opaque: bool

    @classmethod
    def parse(cls, header: str) -> Header:
        kind, mode, dev, ino, size, mtime, ctime, rdev, opaque = header.split(" ")
        major, minor = rdev.split(":")
        return cls(kind, int(mode, 8), int(dev), int(ino), int(size), int(mtime), int(ctime),
                   (int(major), int(minor)), opaque == "1")


@functools.cache
def helper_usable(helper: Path = HELPER) -> bool:
    """Whether `helper` is installed and built from this source."""
    return helpers.staleness(helper, (SOURCE,)) is None


def walk(root: Path, skip: Iterable[str] = (), *, helper: Path | None = HELPER) -> Walk:
    """Every entry below `root` (not `root` itself; top-level names in `skip` left out with
    their subtrees), never following a symlink. HostError when the tree cannot be read."""
    skip = tuple(skip)
    if helper is not None and helper_usable(helper):
        return _walk_helper(helper, root, skip)
    return walk_python(root, skip)


def _walk_helper(helper: Path, root: Path, skip: tuple[str, ...]) -> Walk:
    result = subprocess.run([str(helper), str(root), *skip], capture_output=True, check=False)
    if result.returncode != 0:
        raise HostError(result.stderr.decode(errors="replace").strip()
                        or f"{helper} exited {result.returncode}")
    fields = os.fsdecode(result.stdout).split("\0")
    return Walk(fields[1::3], fields[0::3][:len(fields) // 3], fields[2::3])


def header_of(st: os.stat_result, opaque: bool) -> str:
    """The header the C helper prints for `st`."""
    kind = _KINDS.get(stat.S_IFMT(st.st_mode), "?")
    return (f"{kind} {stat.S_IMODE(st.st_mode):o} {st.st_dev} {st.st_ino} {st.st_size} "
            f"{st.st_mtime_ns} {st.st_ctime_ns} {os.major(st.st_rdev)}:{os.minor(st.st_rdev)} "
            f"{int(opaque)}")


def is_opaque(path: str | Path) -> bool:
    for name in OPAQUE_XATTRS:
        try:
            if os.getxattr(path, name, follow_symlinks=False) == b"y":
                return True
        except OSError:
            continue
    return False


def walk_python(root: Path, skip: tuple[str, ...] = ()) -> Walk:
    """`walk` in Python (the helper's fallback; the same records)."""
    out = Walk([], [], [])
    try:
        _walk_dir(os.fspath(root), "", out, set(skip))
    except OSError as exc:
        raise HostError(f"cannot walk {root}: {exc}") from exc
    return out


def _walk_dir(full: str, rel: str, out: Walk, skip: set[str]) -> None:
    with os.scandir(full) as entries:
        for entry in entries:
            if not rel and entry.name in skip:
                continue
            path = f"{rel}/{entry.name}" if rel else entry.name
            st = entry.stat(follow_symlinks=False)
            is_dir = stat.S_ISDIR(st.st_mode)
            target = os.readlink(entry.path) if stat.S_ISLNK(st.st_mode) else ""
            out.paths.append(path)
            out.headers.append(header_of(st, is_dir and is_opaque(entry.path)))
            out.targets.append(target)
            if is_dir:
                _walk_dir(entry.path, path, out, skip)


def build(helper: Path = HELPER) -> Path:
    """Compile the static helper and install it (atomically) with its source's digest."""
    compiler = helpers.compiler()
    if compiler is None:
        raise HostError("gcc is missing; run: apt-get install gcc")

    def compile_into(built: Path) -> None:
        result = subprocess.run([compiler, "-O2", "-Wall", "-static", "-o", str(built),
                                 str(SOURCE)], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise HostError(f"building {helper.name} failed: {result.stderr.strip()}")

    installed = helpers.install(helper, (SOURCE,), compile_into)
    helper_usable.cache_clear()
    return installed


def main(argv: list[str]) -> int:
    return helpers.build_command(argv, "tenon.host.treewalk", build)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
