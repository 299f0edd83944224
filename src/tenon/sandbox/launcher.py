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

import subprocess
import sys
from pathlib import Path

from tenon.errors import BackendUnavailable
from tenon.host import helpers
from tenon.sandbox import seccomp

SOURCE = Path(__file__).with_name("launch.c")
SOURCES = (SOURCE, seccomp.SOURCE)
LAUNCHER = helpers.HELPER_DIR / "tenon-launch"
_BUILD_FIX = "run: python -m tenon.sandbox.launcher build (needs gcc and libseccomp-dev)"


def check(binary: Path = LAUNCHER) -> list[str]:
    """Problems with the installed launcher: missing, or built from other sources."""
    wrong = helpers.staleness(binary, SOURCES)
    return [] if wrong is None else [f"the sandbox launcher {binary} {wrong}; {_BUILD_FIX}"]


def require(binary: Path = LAUNCHER) -> None:
    if problems := check(binary):
        raise BackendUnavailable(problems[0])


def build(binary: Path = LAUNCHER) -> Path:
    """Generate the seccomp filter, compile the static launcher with it, and install it
    (atomically) with the digest of its sources."""
    compiler = helpers.compiler()
    if compiler is None:
        raise BackendUnavailable("gcc is missing; run: apt-get install gcc libseccomp-dev")

    def compile_into(built: Path) -> None:
        seccomp.write_bpf_header(compiler, built.parent)
        result = subprocess.run([compiler, "-O2", "-Wall", "-Werror", "-static",
                                 f"-I{built.parent}", "-o", str(built), str(SOURCE)],
                                capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise BackendUnavailable(f"building the sandbox launcher failed: "
                                     f"{result.stderr.strip()}")

    return helpers.install(binary, SOURCES, compile_into)


def main(argv: list[str]) -> int:
    return helpers.build_command(argv, "tenon.sandbox.launcher", build)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
