"""Escape attempts from process-backend sandboxes; each must fail.

The Docker backend's counterparts live beside this file; the disk-fill escape is tried in
tests/runtime/test_workspace_limits.py.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest

from tenon.sandbox.process import ProcessSandbox

pytestmark = [pytest.mark.sandbox, pytest.mark.cgroups]

# Opens inotify instances until the kernel refuses, reports how many and why, then keeps
# them open (in the background) so the uid stays at its limit.
_EXHAUST_INOTIFY = (
    "python3 -c \"import ctypes, os, time\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "n = 0\n"
    "while libc.inotify_init() >= 0: n += 1\n"
    "print(n, os.strerror(ctypes.get_errno()), flush=True)\n"
    "time.sleep(300)\" > /workspace/inotify.out 2>&1 &"
)
_ONE_INOTIFY = ("python3 -c \"import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
                "fd = libc.inotify_init(); "
                "print('ok' if fd >= 0 else os.strerror(ctypes.get_errno()))\"")


async def run(sandbox: ProcessSandbox, command: str, timeout_s: float = 20.0) -> str:
    result = await sandbox.exec(command, timeout_s=timeout_s)
    return result.output


def read_text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


async def wait_for_text(path: Path) -> str:
    for _ in range(500):
        if text := read_text(path).strip():
            return text
        await asyncio.sleep(0.02)
    raise AssertionError(f"{path} stayed empty")


def as_uid(uid: int, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                           "--", *argv], capture_output=True, text=True, check=False)


async def test_live_sandboxes_run_as_distinct_host_uids(sandboxes):
    first, second = await sandboxes("a"), await sandboxes("b")
    assert first.host_uid != second.host_uid
    for sandbox in (first, second):
        await run(sandbox, "sleep 60 &")
        [leftover] = sandbox.processes()
        assert os.stat(f"/proc/{leftover.host_pid}").st_uid == sandbox.host_uid
        assert sandbox.spec.workspace.stat().st_uid == sandbox.host_uid


async def test_a_rebuilt_sandbox_gets_its_previous_uid_back(process_backend, sandboxes):
    first = await sandboxes("a")
    uid, spec = first.host_uid, first.spec
    await first.destroy()
    again = await process_backend.materialize(spec)
    try:
        assert again.host_uid == uid
    finally:
        await again.destroy()


async def test_exhausting_inotify_instances_does_not_reach_another_sandbox(sandboxes):
    hog, neighbour = await sandboxes("hog"), await sandboxes("neighbour")
    await run(hog, _EXHAUST_INOTIFY)
    exhausted = await wait_for_text(hog.spec.workspace / "workspace" / "inotify.out")
    count, reason = exhausted.split(maxsplit=1)
    assert int(count) > 0
    assert "Too many open files" in reason
    assert (await run(hog, _ONE_INOTIFY)).strip() == "Too many open files"  # hog is at its limit
    assert (await run(neighbour, _ONE_INOTIFY)).strip() == "ok"


async def test_exhausting_pids_does_not_reach_another_sandbox(sandboxes):
    hog, neighbour = await sandboxes("hog", max_pids=32), await sandboxes("neighbour")
    forked = await run(hog, "for i in $(seq 64); do sleep 60 & done 2>&1; echo done")
    assert "fork" in forked.lower() or "resource" in forked.lower()
    assert len(hog.cgroup.pids()) <= 32
    busy = await run(neighbour, "for i in $(seq 20); do sleep 0.2 & done; wait; echo ok")
    assert busy.strip() == "ok"


async def test_one_sandbox_uid_cannot_read_another_sandboxs_files(sandboxes):
    owner, other = await sandboxes("owner"), await sandboxes("other")
    await run(owner, "echo API_KEY=hunter2 > /workspace/.env; echo h > ~/.netrc")
    root = owner.spec.workspace
    assert as_uid(other.host_uid, "stat", str(root)).returncode == 0  # the parent lets it in
    for argv in (["cat", str(root / "workspace" / ".env")], ["ls", str(root)],
                 ["cat", str(root / "home" / ".netrc")]):
        tried = as_uid(other.host_uid, *argv)
        assert tried.returncode != 0, argv
        assert "Permission denied" in tried.stderr
    seen = await run(other, f"cat {root}/workspace/.env 2>&1; ls / ")
    assert "hunter2" not in seen  # and inside its sandbox the path does not even exist
    assert "No such file" in seen


# Each tries a syscall Docker's default profile denies to a container without capabilities,
# with arguments that, without the filter, make most of them succeed (unshare, personality)
# or fail otherwise (EINVAL, EFAULT, ENOSYS) for an unprivileged uid: EPERM for all is the
# filter's answer.
_BLOCKED = {
    "unshare": (272, 0x10000000),  # CLONE_NEWUSER: allowed to an unprivileged user otherwise
    "setns": (308, 0, 0),
    "keyctl": (250, 0, 0),  # KEYCTL_GET_KEYRING_ID
    "add_key": (248, 0, 0, 0, 0, 0),
    "bpf": (321, 0, 0, 0),
    "perf_event_open": (298, 0, 0, -1, -1, 0),
    "userfaultfd": (323, 0),
    "mount": (165, 0, 0, 0, 0, 0),
    "umount2": (166, 0, 0),
    "pivot_root": (155, 0, 0),
    "kexec_load": (246, 0, 0, 0, 0),
    "init_module": (175, 0, 0, 0),
    "open_by_handle_at": (304, 0, 0, 0),
    "fanotify_init": (300, 0, 0),
    "syslog": (103, 3, 0, 0),  # SYSLOG_ACTION_READ_ALL
    "personality": (135, 0x0040000),  # ADDR_NO_RANDOMIZE
}
_TRY_SYSCALLS = (
    "python3 -c \"import ctypes, os, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "for name, nr, *args in [" + ", ".join(
        f"('{name}', {', '.join(map(str, call))})" for name, call in _BLOCKED.items()) + "]:\n"
    "    ctypes.set_errno(0)\n"
    "    rc = libc.syscall(nr, *[ctypes.c_long(a) for a in args])\n"
    "    print(name, rc, ctypes.get_errno())\n"
    "\""
)


async def test_the_default_seccomp_filter_denies_what_docker_denies(sandboxes):
    import errno

    sandbox = await sandboxes("a")
    output = await run(sandbox, _TRY_SYSCALLS)
    results = {line.split()[0]: (int(line.split()[1]), int(line.split()[2]))
               for line in output.splitlines()}
    assert sorted(results) == sorted(_BLOCKED), output
    for name, (rc, err) in results.items():
        assert (rc, err) == (-1, errno.EPERM), f"{name}: {output}"


async def test_every_sandbox_process_runs_under_the_filter(sandboxes):
    sandbox = await sandboxes("a")
    status = await run(sandbox, "grep -E '^(Seccomp|NoNewPrivs):' /proc/self/status; "
                                "grep '^Seccomp:' /proc/1/status /proc/2/status")
    assert "Seccomp:\t2" in status  # the action (filter mode)
    assert "NoNewPrivs:\t1" in status
    assert "/proc/2/status:Seccomp:\t2" in status  # the init
    namespaces = await run(sandbox, "unshare -U true 2>&1; unshare -n true 2>&1; echo end")
    assert namespaces.count("Operation not permitted") == 2


async def test_ordinary_work_still_runs_under_the_filter(sandboxes):
    sandbox = await sandboxes("a")
    script = ("import subprocess, threading, socket, os, tempfile, multiprocessing\n"
              "t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()\n"
              "print(subprocess.run(['echo', 'child'], capture_output=True, text=True)"
              ".stdout.strip())\n"
              "a, b = socket.socketpair(); a.send(b'pair'); print(b.recv(4).decode())\n"
              "with multiprocessing.Pool(2) as pool: print(sum(pool.map(abs, [-1, -2])))\n"
              "print(os.uname().sysname)\n")
    result = await sandbox.exec(f"python3 -c \"{script}\"", timeout_s=30)
    assert result.exit_code == 0, result.output
    assert result.output.split() == ["thread", "child", "pair", "3", "Linux"]
