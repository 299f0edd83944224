"""The default seccomp filter of process-backend sandboxes: a small static helper.

`seccomp_exec.c` (beside this module) loads the filter and execs its arguments; it is the
first program of every sandbox process (the init and each action, after nsenter). The
filter is generated once with Debian's libseccomp (the same file compiled as a generator)
and compiled into the static helper, built at setup into `HELPER` and bound read-only into
each sandbox at `SANDBOX_HELPER`.

    python -m tenon.sandbox.seccomp build    # needs gcc and libseccomp-dev
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tenon.errors import BackendUnavailable
from tenon.host import helpers

SOURCE = Path(__file__).with_name("seccomp_exec.c")
HELPER_DIR = helpers.HELPER_DIR
HELPER_NAME = "seccomp-exec"
HELPER = HELPER_DIR / HELPER_NAME
SANDBOX_HELPER_DIR = "/usr/lib/tenon"  # where sandboxes see HELPER_DIR (read-only)
SANDBOX_HELPER = f"{SANDBOX_HELPER_DIR}/{HELPER_NAME}"
_BUILD_FIX = "run: python -m tenon.sandbox.seccomp build (needs gcc and libseccomp-dev)"


def check(helper: Path = HELPER) -> list[str]:
    """Problems with the installed helper: missing, or built from another source."""
    wrong = helpers.staleness(helper, (SOURCE,))
    return [] if wrong is None else [f"the seccomp helper {helper} {wrong}; {_BUILD_FIX}"]


def require(helper: Path = HELPER) -> None:
    if problems := check(helper):
        raise BackendUnavailable(problems[0])


def _compile(compiler: str, output: Path, *flags: str) -> None:
    result = subprocess.run([compiler, "-O2", "-Wall", "-o", str(output), *flags, str(SOURCE)]
                            + (["-lseccomp"] if "-DTENON_SECCOMP_GENERATE" in flags else []),
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise BackendUnavailable(f"building the seccomp helper failed (apt-get install gcc "
                                 f"libseccomp-dev?): {result.stderr.strip()}")


def write_bpf_header(compiler: str, work: Path) -> Path:
    """Generate the filter with libseccomp and write it to `work`/tenon_seccomp_bpf.h as
    `static const unsigned char tenon_bpf[]` (what the helper and the launcher load)."""
    _compile(compiler, work / "generate", "-DTENON_SECCOMP_GENERATE")
    bpf = subprocess.run([str(work / "generate")], capture_output=True, check=True).stdout
    if not bpf or len(bpf) % 8:  # whole struct sock_filter entries
        raise BackendUnavailable(f"the seccomp generator wrote {len(bpf)} bytes of BPF")
    body = ",".join(str(byte) for byte in bpf)
    header = work / "tenon_seccomp_bpf.h"
    header.write_text(
        f"static const unsigned char tenon_bpf[] __attribute__((aligned(8))) = {{{body}}};\n")
    return header


def build(helper: Path = HELPER) -> Path:
    """Generate the filter, compile it into the static helper, and install the helper
    (atomically) with the digest of its source."""
    compiler = helpers.compiler()
    if compiler is None:
        raise BackendUnavailable("gcc is missing; run: apt-get install gcc libseccomp-dev")

    def compile_into(built: Path) -> None:
        write_bpf_header(compiler, built.parent)
        _compile(compiler, built, "-static", f"-I{built.parent}")

    return helpers.install(helper, (SOURCE,), compile_into)


def main(argv: list[str]) -> int:
    return helpers.build_command(argv, "tenon.sandbox.seccomp", build)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
