"""The small static C programs Tenon builds at setup (the sandbox launcher, the tree walker),
each installed in `HELPER_DIR` beside a stamp holding the digest of its sources, so a build
from other sources is seen as stale and rebuilt."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from tenon.errors import TenonError

HELPER_DIR = Path("/usr/local/lib/tenon")


@functools.cache  # the sources do not change under a running controller
def sources_digest(sources: tuple[Path, ...]) -> str:
    digest = hashlib.sha256()
    for source in sources:
        digest.update(source.read_bytes())
    return digest.hexdigest()


def _stamp(binary: Path) -> Path:
    return binary.with_name(binary.name + ".sha256")


def staleness(binary: Path, sources: Sequence[Path]) -> str | None:
    """None when `binary` is installed and built from `sources`; else what is wrong with it
    ("is missing" or "was built from other sources")."""
    if not os.access(binary, os.X_OK):
        return "is missing"
    try:
        built_from = _stamp(binary).read_text().strip()
    except OSError:
        built_from = ""
    if built_from != sources_digest(tuple(sources)):
        return "was built from other sources"
    return None


def compiler() -> str | None:
    return shutil.which("gcc") or shutil.which("cc")


def install(binary: Path, sources: Sequence[Path], compile_into: Callable[[Path], None]) -> Path:
    """Build `binary` with `compile_into(output)` in a directory beside it (the callable
    raises on failure), then put it in place in one rename and stamp it with `sources`'s
    digest."""
    binary.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=binary.parent) as tmp:
        built = Path(tmp) / binary.name
        compile_into(built)
        built.chmod(0o755)
        os.replace(built, binary)
    _stamp(binary).write_text(sources_digest(tuple(sources)) + "\n")
    return binary


def build_command(argv: list[str], module: str, build: Callable[[], Path]) -> int:
    """`python -m MODULE build`: build and install a helper, print its path; a failure is
    one line and exit 1 (TenonError), bad usage exit 2."""
    if argv != ["build"]:
        print(f"usage: python -m {module} build", file=sys.stderr)
        return 2
    try:
        print(build())
    except TenonError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
