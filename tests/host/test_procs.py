"""/proc helpers, against this test's own process tree (no root needed)."""

import os
import signal
import subprocess
import sys
import time

from tenon.host.procs import (
    descendants,
    kill_pids,
    process_info,
    read_environ_token,
    session_members,
)


def start_tree(token="abc123"):
    """sh (new session) -> sleep child; returns (sh process, its child pid)."""
    proc = subprocess.Popen(["sh", "-c", "sleep 30 & echo $!; wait"], stdout=subprocess.PIPE,
                            start_new_session=True, env={**os.environ, "TENON_TOKEN": token})
    child = int(proc.stdout.readline())
    return proc, child


def test_process_info_of_self_and_of_a_gone_pid():
    me = process_info(os.getpid())
    assert me.ppid == os.getppid()
    assert me.sid == os.getsid(0)
    assert me.pgid == os.getpgid(0)
    assert "python" in me.command or "pytest" in me.command
    assert process_info(2**31 - 1) is None


def test_descendants_sessions_environ_and_kill():
    proc, child = start_tree()
    try:
        candidates = [proc.pid, child, os.getpid()]
        assert descendants(proc.pid, candidates) == [child]
        assert descendants(os.getpid(), candidates) == sorted([proc.pid, child])
        assert session_members(proc.pid, candidates) == sorted([proc.pid, child])
        assert read_environ_token(child, "TENON_TOKEN") == "abc123"
        assert read_environ_token(child, "NOPE") is None
        assert read_environ_token(2**31 - 1, "TENON_TOKEN") is None
        assert kill_pids([child, proc.pid], signal.SIGKILL) == [child, proc.pid]
        proc.wait(timeout=5)
        deadline = time.monotonic() + 5
        while process_info(child) and time.monotonic() < deadline:
            time.sleep(0.01)  # reaped by init once sh is gone
        assert kill_pids([child], signal.SIGKILL) == []
    finally:
        proc.kill()
        proc.communicate()


def test_zombie_command_falls_back_to_comm():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 5
    while (info := process_info(proc.pid)) and not info.command.startswith("[") and \
            time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        assert info is None or info.command.startswith("[")
    finally:
        proc.wait()
