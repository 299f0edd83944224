"""The seccomp helper: built from its source, checked against it, and effective."""

from __future__ import annotations

import errno
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tenon.errors import BackendUnavailable
from tenon.sandbox import seccomp

_PROBE = ("import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
          "print(libc.syscall(272, 0x10000000), ctypes.get_errno(), libc.getpid() > 0)")


@pytest.fixture(scope="module")
def helper(tmp_path_factory) -> Path:
    if shutil.which("gcc") is None or not Path("/usr/include/seccomp.h").exists():
        pytest.skip("needs gcc and libseccomp-dev (scripts/setup.sh installs them)")
    return seccomp.build(tmp_path_factory.mktemp("helper") / "seccomp-exec")


def test_check_names_a_missing_or_stale_helper_and_the_fix(tmp_path, helper):
    missing = seccomp.check(tmp_path / "absent")
    assert len(missing) == 1
    assert "missing" in missing[0]
    assert "python -m tenon.sandbox.seccomp build" in missing[0]
    assert seccomp.check(helper) == []
    stale = tmp_path / "seccomp-exec"
    shutil.copy(helper, stale)
    (tmp_path / "seccomp-exec.sha256").write_text("0" * 64 + "\n")
    assert "built from other sources" in seccomp.check(stale)[0]
    with pytest.raises(BackendUnavailable, match="other sources"):
        seccomp.require(stale)


def test_the_helper_denies_unshare_and_runs_the_rest(helper):
    probe = [sys.executable, "-c", _PROBE]
    unfiltered = subprocess.run(probe, capture_output=True, text=True, check=True).stdout
    filtered = subprocess.run([str(helper), *probe], capture_output=True, text=True,
                              check=True).stdout
    assert filtered.split() == ["-1", str(errno.EPERM), "True"]
    assert filtered != unfiltered  # as root, unshare(CLONE_NEWUSER) succeeds without it


def test_the_helper_reports_a_missing_program_like_a_shell(helper):
    result = subprocess.run([str(helper), "/nonexistent/program"], capture_output=True,
                            text=True, check=False)
    assert result.returncode == 127
    assert "No such file" in result.stderr
    assert subprocess.run([str(helper)], check=False, capture_output=True).returncode == 126


def test_syscalls_newer_than_the_profile_fail_with_enosys_so_libc_falls_back(helper):
    probe = ("import ctypes; libc = ctypes.CDLL(None, use_errno=True)\n"
             "for nr in (435, 452, 461, 511, 438):\n"  # clone3, fchmodat2, lsm_*, last; pidfd_getfd
             "    ctypes.set_errno(0); libc.syscall(nr, 0, 0, 0, 0); print(ctypes.get_errno())")
    result = subprocess.run([str(helper), sys.executable, "-c", probe], capture_output=True,
                            text=True, check=True)
    assert result.stdout.split() == [str(errno.ENOSYS)] * 4 + [str(errno.EPERM)]
