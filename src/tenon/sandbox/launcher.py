"""The process backend's launcher: a small static program that starts and enters sandboxes.

`launch.c` (beside this module) has two modes: `start` builds a sandbox (user namespace
over an id range, idmapped image and persistent root, overlay root, pivot_root, a reaper
as pid 1) and `enter` runs one command inside it as a given user; both load the default
seccomp filter last (`sandbox.seccomp` generates it; it is compiled into the launcher).
Built at setup into `LAUNCHER`, stamped with the digest of its sources so a stale build is
rebuilt:

    python -m tenon.sandbox.launcher build    # needs gcc and libseccomp-dev
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tenon.errors import BackendUnavailable
from tenon.sandbox import seccomp

SOURCE = Path(__file__).with_name("launch.c")
LAUNCHER = seccomp.HELPER_DIR / "tenon-launch"
_BUILD_FIX = "run: python -m tenon.sandbox.launcher build (needs gcc and libseccomp-dev)"


@functools.cache  # the sources do not change under a running controller
def source_digest() -> str:
    digest = hashlib.sha256()
    for source in (SOURCE, seccomp.SOURCE):
        digest.update(source.read_bytes())
    return digest.hexdigest()


def _stamp(binary: Path) -> Path:
    return binary.with_name(binary.name + ".sha256")


def check(binary: Path = LAUNCHER) -> list[str]:
    """Problems with the installed launcher: missing, or built from other sources."""
    if not os.access(binary, os.X_OK):
        return [f"the sandbox launcher {binary} is missing; {_BUILD_FIX}"]
    try:
        built_from = _stamp(binary).read_text().strip()
    except FileNotFoundError:
        built_from = ""
    if built_from != source_digest():
        return [f"the sandbox launcher {binary} was built from other sources; {_BUILD_FIX}"]
    return []


def require(binary: Path = LAUNCHER) -> None:
    if problems := check(binary):
        raise BackendUnavailable(problems[0])


def build(binary: Path = LAUNCHER) -> Path:
    """Generate the seccomp filter, compile the static launcher with it, and install it
    (atomically) with the digest of its sources."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise BackendUnavailable("gcc is missing; run: apt-get install gcc libseccomp-dev")
    binary.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=binary.parent) as tmp:
        work = Path(tmp)
        seccomp.write_bpf_header(compiler, work)
        built = work / binary.name
        result = subprocess.run([compiler, "-O2", "-Wall", "-Werror", "-static", f"-I{work}",
                                 "-o", str(built), str(SOURCE)],
                                capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise BackendUnavailable(f"building the sandbox launcher failed: "
                                     f"{result.stderr.strip()}")
        built.chmod(0o755)
        os.replace(built, binary)
    _stamp(binary).write_text(source_digest() + "\n")
    return binary


def main(argv: list[str]) -> int:
    if argv != ["build"]:
        print("usage: python -m tenon.sandbox.launcher build", file=sys.stderr)
        return 2
    try:
        print(build())
    except BackendUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
