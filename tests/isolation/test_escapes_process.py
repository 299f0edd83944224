"""Escape attempts from process-backend sandboxes; each must fail, as the default user and
as root inside the sandbox (`who`).

The Docker backend's counterparts live beside this file; the disk-fill escape is tried in
tests/runtime/test_workspace_limits.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tenon.errors import SandboxDied, SandboxError
from tenon.sandbox.base import ExecIO, SandboxSpec
from tenon.sandbox.images import image_rootfs
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


async def run(sandbox: ProcessSandbox, command: str, timeout_s: float = 20.0,
              user: str | None = None) -> str:
    result = await sandbox.exec(command, timeout_s=timeout_s,
                                io=None if user is None else ExecIO(user=user))
    return result.output


@pytest.fixture(params=["user", "root"])
def who(request: pytest.FixtureRequest) -> str:
    """Who runs the escape attempt inside the sandbox: the default user, or root."""
    return str(request.param)


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


async def test_live_sandboxes_map_disjoint_host_id_ranges(sandboxes):
    first, second = await sandboxes("a"), await sandboxes("b")
    ranges = []
    for sandbox in (first, second):
        await run(sandbox, "sleep 60 &")
        [leftover] = sandbox.processes()
        for name in ("uid_map", "gid_map"):
            mapping = read_text(Path(f"/proc/{leftover.host_pid}/{name}"))
            inside, outside, count = mapping.split()
            assert (inside, int(outside), count) == ("0", sandbox.id_base, "65536")
        assert os.stat(f"/proc/{leftover.host_pid}").st_uid == sandbox.id_base + 1000
        ranges.append(range(sandbox.id_base, sandbox.id_base + 65536))
    assert not set(ranges[0]) & set(ranges[1])


async def test_a_rebuilt_sandbox_gets_its_previous_range_back(process_backend, sandboxes):
    first = await sandboxes("a")
    id_base, spec = first.id_base, first.spec
    await run(first, "echo mine > /workspace/f; echo r > /etc/r", user="root")
    await first.destroy()
    # On disk every file keeps its id as the sandbox sees it; the root is host root's.
    root = spec.workspace
    assert (root.stat().st_uid, root.stat().st_mode & 0o777) == (0, 0o700)
    assert (root / "workspace" / "f").stat().st_uid == 0
    assert (root / "upper" / "etc" / "r").stat().st_uid == 0
    tried = as_uid(id_base, "cat", str(root / "workspace" / "f"))
    assert "Permission denied" in tried.stderr
    again = await process_backend.materialize(spec)
    try:
        assert again.id_base == id_base
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


async def test_one_sandbox_cannot_read_another_sandboxs_files(sandboxes):
    owner, other = await sandboxes("owner"), await sandboxes("other")
    await run(owner, "echo API_KEY=hunter2 > /workspace/.env; echo h > ~/.netrc")
    root = owner.spec.workspace
    for host_uid in (other.id_base, other.id_base + 1000):  # its root, its default user
        assert as_uid(host_uid, "stat", str(root)).returncode == 0  # the parent lets it in
        for argv in (["cat", str(root / "workspace" / ".env")], ["ls", str(root)],
                     ["cat", str(root / "home" / ".netrc")]):
            tried = as_uid(host_uid, *argv)
            assert tried.returncode != 0, argv
            assert "Permission denied" in tried.stderr
    seen = await run(other, f"cat {root}/workspace/.env 2>&1; ls / ", user="root")
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


async def test_the_default_seccomp_filter_denies_what_docker_denies(sandboxes, who):
    import errno

    sandbox = await sandboxes("a")
    output = await run(sandbox, _TRY_SYSCALLS, user=who)
    results = {line.split()[0]: (int(line.split()[1]), int(line.split()[2]))
               for line in output.splitlines()}
    assert sorted(results) == sorted(_BLOCKED), output
    for name, (rc, err) in results.items():
        assert (rc, err) == (-1, errno.EPERM), f"{name}: {output}"


async def test_every_sandbox_process_runs_under_the_filter(sandboxes, who):
    sandbox = await sandboxes("a")
    status = await run(sandbox, "grep -E '^(Seccomp|NoNewPrivs):' /proc/self/status; "
                                "grep -E '^(Seccomp|CapEff):' /proc/1/status", user=who)
    assert "Seccomp:\t2" in status  # the action (filter mode)
    assert "NoNewPrivs:\t1" in status
    assert status.count("Seccomp:\t2") == 2  # pid 1 (the reaper) is filtered too...
    assert "CapEff:\t0000000000000000" in status  # ...and without capabilities
    namespaces = await run(sandbox, "unshare -U true 2>&1; unshare -n true 2>&1; echo end",
                           user=who)
    assert namespaces.count("Operation not permitted") == 2


async def test_ordinary_work_still_runs_under_the_filter(sandboxes, who):
    sandbox = await sandboxes("a")
    script = ("import subprocess, threading, socket, os, tempfile, multiprocessing\n"
              "t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()\n"
              "print(subprocess.run(['echo', 'child'], capture_output=True, text=True)"
              ".stdout.strip())\n"
              "a, b = socket.socketpair(); a.send(b'pair'); print(b.recv(4).decode())\n"
              "with multiprocessing.Pool(2) as pool: print(sum(pool.map(abs, [-1, -2])))\n"
              "print(os.uname().sysname)\n")
    result = await sandbox.exec(f"python3 -c \"{script}\"", timeout_s=30, io=ExecIO(user=who))
    assert result.exit_code == 0, result.output
    assert result.output.split() == ["thread", "child", "pair", "3", "Linux"]


def _connect_script(*targets: tuple[str, int]) -> str:
    """An action printing, for each (host, port), "host:port connected" or "... refused"."""
    lines = ["import socket"]
    for host, port in targets:
        lines += [
            "s = socket.socket(); s.settimeout(3)",
            f"try:\n s.connect(('{host}', {port})); print('{host}:{port} connected', "
            f"s.recv(16).decode())\nexcept OSError as e: print('{host}:{port} refused', e)",
        ]
    return "python3 -c \"" + "\n".join(lines) + "\""


@pytest.fixture
def host_loopback_listener() -> Iterator[int]:
    """A listener on the host's 127.0.0.1 that greets whoever connects; yields its port."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                conn, _ = listener.accept()
                conn.sendall(b"host-secret")
                conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join()
    listener.close()


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


# A point-to-point link from the documentation range TEST-NET-2 (RFC 5737): never routed on
# the internet. TEST-NET-1 (192.0.2.0/24) is not used because some hosts, this project's CI
# machine among them, number their own uplink from it.
_TEST_LINK = ("198.51.100.201", "198.51.100.202", 30)


def _only_the_default_route_covers(address: str) -> bool:
    routes = subprocess.run(["ip", "route", "show", "match", address], capture_output=True,
                            text=True, check=True).stdout.split("\n")
    local = subprocess.run(["ip", "route", "show", "table", "local", "match", address],
                           capture_output=True, text=True, check=True).stdout.strip()
    return all(r.startswith("default") for r in routes if r.strip()) and not local


@pytest.fixture
def test_net_listener() -> Iterator[tuple[str, int]]:
    """A listener in a network namespace of its own, reached from the host through a veth
    pair numbered from `_TEST_LINK`. Everything is removed after."""
    if shutil.which("ip") is None:
        pytest.skip("ip is missing (apt-get install iproute2)")
    host_address, ns_address, prefix = _TEST_LINK
    if not all(_only_the_default_route_covers(a) for a in (host_address, ns_address)):
        pytest.fail(f"{host_address} or {ns_address} is in use on this host; pick another "
                    f"_TEST_LINK")
    suffix = uuid.uuid4().hex[:6]
    netns, host_end, ns_end = f"tenon-test-{suffix}", f"tnh{suffix}", f"tnn{suffix}"
    ip("netns", "add", netns)
    try:
        ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end, "netns", netns)
        ip("addr", "add", f"{host_address}/{prefix}", "dev", host_end)
        ip("link", "set", host_end, "up")
        ip("-n", netns, "addr", "add", f"{ns_address}/{prefix}", "dev", ns_end)
        ip("-n", netns, "link", "set", ns_end, "up")
        ip("-n", netns, "link", "set", "lo", "up")
        server = (f"import socket; s = socket.socket(); s.bind(('{ns_address}', 8081)); "
                  "s.listen()\nprint('ready', flush=True)\n"
                  "while True:\n c, _ = s.accept(); c.sendall(b'test-net'); c.close()")
        with subprocess.Popen(["ip", "netns", "exec", netns, sys.executable, "-c", server],
                              stdout=subprocess.PIPE, text=True) as proc:
            try:
                assert proc.stdout is not None
                assert proc.stdout.readline().strip() == "ready"
                yield ns_address, 8081
            finally:
                proc.kill()
    finally:
        subprocess.run(["ip", "link", "del", host_end], check=False, capture_output=True)
        ip("netns", "del", netns)


@pytest.mark.parametrize("network", [False, True])
async def test_the_hosts_loopback_is_out_of_reach(sandboxes, host_loopback_listener, network,
                                                  who):
    sandbox = await sandboxes("a", network=network)
    port = host_loopback_listener
    output = await run(sandbox, _connect_script(("127.0.0.1", port), ("10.0.2.2", port)),
                       user=who)
    assert "host-secret" not in output
    assert [line.split()[1] for line in output.splitlines()] == ["refused", "refused"], output
    with socket.create_connection(("127.0.0.1", port), timeout=3) as probe:
        assert probe.recv(16) == b"host-secret"  # the listener itself answers


async def test_outbound_connections_work_with_network_allowed(sandboxes, test_net_listener):
    host, port = test_net_listener
    allowed = await sandboxes("allowed", network=True)
    denied = await sandboxes("denied")
    reached = await run(allowed, _connect_script(test_net_listener))
    assert reached.strip() == f"{host}:{port} connected test-net"
    assert f"{host}:{port} refused" in await run(denied, _connect_script(test_net_listener))
    assert allowed.processes() == []  # slirp4netns is the backend's, not a leftover
    assert allowed.leftover_state() == []


async def test_each_sandbox_has_its_own_network_namespace(sandboxes):
    for sandbox in (await sandboxes("a", network=True), await sandboxes("b")):
        assert (os.readlink(f"/proc/{sandbox.child_pid}/ns/net")
                != os.readlink("/proc/self/ns/net"))


async def test_slirp4netns_is_stopped_at_destroy_and_its_death_is_reported(sandboxes):
    sandbox = await sandboxes("a", network=True)
    slirp = sandbox._usernet
    assert slirp is not None
    os.kill(slirp.pid, signal.SIGKILL)
    for _ in range(200):
        if slirp.exited() is not None:
            break
        await asyncio.sleep(0.01)
    with pytest.raises(SandboxDied, match="slirp4netns"):
        await sandbox.exec("true", timeout_s=5)
    other = await sandboxes("b", network=True)
    other_slirp = other._usernet
    assert other_slirp is not None
    await other.destroy()
    assert other_slirp.exited() is not None
    with pytest.raises(ProcessLookupError):
        os.kill(other_slirp.pid, 0)


async def test_host_processes_can_be_neither_seen_nor_signalled(sandboxes, who):
    sandbox = await sandboxes("a")
    host_sleep = await asyncio.create_subprocess_exec("sleep", "60")
    try:
        output = await run(sandbox, f"ls /proc | grep -cE '^[0-9]+$'; "
                                    f"kill -9 {host_sleep.pid} 2>&1; kill -9 1 2>&1; "
                                    f"cat /proc/{host_sleep.pid}/cmdline 2>&1", user=who)
        assert host_sleep.returncode is None  # still alive
        os.kill(host_sleep.pid, 0)
    finally:
        host_sleep.kill()
        await host_sleep.wait()
    lines = output.splitlines()
    # the launcher's pid 1, and this action's shell, ls and grep; the host has hundreds
    assert int(lines[0]) <= 5
    assert (await run(sandbox, "echo alive")).strip() == "alive"  # pid 1 shrugged off SIGKILL
    assert "No such process" in output
    assert "sleep" not in output.replace(f"kill -9 {host_sleep.pid}", "")


_OUTSIDE = ("/", "/etc", "/etc/passwd", "/usr/bin", "/var/tmp", "/root", "/opt", "/run",
            "/dev", "/proc/sys/kernel", "/sys/fs/cgroup", "/usr/lib/tenon")


async def test_writes_outside_the_persistent_directories_stay_in_the_agents_upper_layer(
        process_backend, sandboxes, who):
    sandbox = await sandboxes("a")
    tries = "; ".join(f"(echo x > {path}/tenon-escape || echo x >> {path}) 2>/dev/null "
                      f"&& echo WROTE {path}" for path in _OUTSIDE)
    output = await run(sandbox, f"{tries}; echo done", user=who)
    assert output.splitlines()[-1] == "done", output
    written = {line.split()[1] for line in output.splitlines()[:-1]}
    if who == "user":
        assert written == {"/var/tmp"}, output  # the image's only world-writable directory
    else:
        assert {"/", "/etc", "/usr/bin", "/root", "/opt"} <= written, output
        assert not written & {"/dev", "/proc/sys/kernel", "/sys/fs/cgroup"}, output
    upper = sandbox.spec.workspace / "upper"
    for path in written:
        landed = upper / path.lstrip("/")
        assert (landed / "tenon-escape").is_file() or landed.is_file(), path
    assert sandbox.leftover_state() == []
    rootfs = image_rootfs(sandbox.spec.image, process_backend.state_dir)
    assert escaped_files(rootfs) == []  # neither in the shared image rootfs nor on the host


def escaped_files(rootfs: Path) -> list[Path]:
    candidates = [Path(base, p.lstrip("/"), "tenon-escape") for base in ("/", rootfs)
                  for p in _OUTSIDE]
    return [c for c in candidates if c.exists()]


async def test_a_network_that_cannot_start_fails_the_materialization_cleanly(process_backend,
                                                                             sandboxes):
    process_backend._slirp4netns = "/bin/false"  # exits at once, as a failing slirp4netns
    held_before = process_backend.ids.held()
    with pytest.raises(SandboxError, match="slirp4netns could not connect"):
        await sandboxes("a", network=True)
    assert process_backend.ids.held() == held_before  # the id range went back
    assert sandbox_cgroups(process_backend) == []  # and the cgroup with it


def sandbox_cgroups(backend) -> list[Path]:
    """The sandbox cgroups under the backend's domain, in every hierarchy."""
    name = backend.domain.name
    return [*Path("/sys/fs/cgroup").glob(f"*/{name}/*/"), *Path("/sys/fs/cgroup").glob(
        f"{name}/*/")]


def _mount_count() -> int:
    with open("/proc/self/mountinfo") as f:
        return sum(1 for _ in f)


async def test_mounting_fails_even_for_root(sandboxes, who):
    sandbox = await sandboxes("a")
    host_mounts = _mount_count()
    output = await run(sandbox, "for m in 'mount --bind /workspace /mnt' "
                                "'mount -t tmpfs none /mnt' 'mount -t proc proc /mnt' "
                                "'mount -o remount,rw /proc/sys' 'umount -l /workspace'; do "
                                "$m 2>/dev/null && echo MOUNTED $m; done; "
                                "grep -c . /proc/self/mountinfo", user=who)
    assert "MOUNTED" not in output
    inside = await run(sandbox, "grep -c . /proc/self/mountinfo")
    assert output.split()[-1] == inside.strip()  # the sandbox's mount table is unchanged
    assert _mount_count() == host_mounts


# finit_module(fd of /dev/null), init_module, delete_module("ext4"), kexec_file_load
_MODULE_CALLS = (
    "python3 -c \"import ctypes, os\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "fd = os.open('/dev/null', os.O_RDONLY)\n"
    "for nr, *args in [(313, fd, b'', 0), (175, 0, 0, b''), (176, b'ext4', 0),"
    " (320, fd, fd, 0, 0, 0)]:\n"
    "    ctypes.set_errno(0); rc = libc.syscall(nr, *args); print(rc, ctypes.get_errno())\n"
    "\""
)


async def test_loading_a_kernel_module_fails(sandboxes, who):
    import errno

    sandbox = await sandboxes("a")
    output = await run(sandbox, f"{_MODULE_CALLS}; modprobe dummy 2>&1; echo end", user=who)
    results = [line.split() for line in output.splitlines()[:4]]
    assert results == [["-1", str(errno.EPERM)]] * 4, output
    assert "dummy" not in read_text(Path("/proc/modules"))  # absent on a kernel without modules


_PROC_WRITES = ("/proc/sys/kernel/hostname", "/proc/sys/vm/drop_caches",
                "/proc/sys/kernel/core_pattern", "/proc/sys/net/ipv4/ip_forward",
                "/proc/sysrq-trigger", "/proc/sys/fs/protected_symlinks")


async def test_writing_proc_sys_fails(sandboxes, who):
    sandbox = await sandboxes("a")
    before = {path: read_text(Path(path)) for path in _PROC_WRITES if readable(path)}
    tries = "; ".join(f"(echo 0 > {path}) 2>/dev/null && echo WROTE {path}"
                      for path in _PROC_WRITES)
    output = await run(sandbox, f"{tries}; echo done", user=who)
    assert output.strip() == "done", output
    assert {path: read_text(Path(path)) for path in before} == before


def readable(path: str) -> bool:
    """Whether `path` exists and may be read (drop_caches and sysrq-trigger are write-only)."""
    return os.path.exists(path) and bool(os.stat(path).st_mode & 0o444)


# ptrace(PTRACE_ATTACH) of each pid given, printing rc and errno
_PTRACE = ("python3 -c \"import ctypes, sys\n"
           "libc = ctypes.CDLL(None, use_errno=True)\n"
           "for pid in map(int, sys.argv[1:]):\n"
           "    ctypes.set_errno(0); rc = libc.ptrace(16, pid, 0, 0)\n"
           "    print(rc, ctypes.get_errno())\n"
           "\"")


async def test_ptrace_reaches_nothing_outside_the_action(sandboxes, who):
    import errno

    sandbox = await sandboxes("a")
    host_sleep = await asyncio.create_subprocess_exec("sleep", "60")
    try:
        # pid 1 (the reaper), and the host's sleep by its host pid (not in the pid namespace)
        output = await run(sandbox, f"{_PTRACE} 1 {host_sleep.pid}", user=who)
    finally:
        host_sleep.kill()
        await host_sleep.wait()
    lines = [line.split() for line in output.splitlines()]
    assert lines[0] == ["-1", str(errno.EPERM)], output
    assert lines[1] in (["-1", str(errno.ESRCH)], ["-1", str(errno.EPERM)]), output


async def test_chown_to_an_id_outside_the_range_fails(sandboxes, who):
    sandbox = await sandboxes("a")
    output = await run(sandbox, "touch /tmp/f; for id in 65536 70000 1700000000 4294967294; "
                                "do chown $id /tmp/f 2>/dev/null && echo CHOWNED $id; "
                                "chgrp $id /tmp/f 2>/dev/null && echo CHGRPED $id; done; "
                                "echo done", user=who)
    assert output.strip() == "done", output
    st = (sandbox.spec.workspace / "tmp" / "f").stat()
    assert (st.st_uid, st.st_gid) == ((0, 0) if who == "root" else (1000, 1000))


async def test_joining_another_namespace_fails(sandboxes, who):
    sandbox = await sandboxes("a")
    output = await run(sandbox, "for ns in mnt net pid user uts ipc cgroup; do "
                                "nsenter --target 1 --$ns true 2>/dev/null && echo JOINED $ns; "
                                "done; python3 -c \"import os\n"
                                "try:\n os.setns(os.open('/proc/1/ns/mnt', os.O_RDONLY), 0)\n"
                                " print('SETNS')\nexcept OSError as e: print(e.errno)\"",
                       user=who)
    assert "JOINED" not in output, output
    assert "SETNS" not in output, output


async def test_a_symlink_root_plants_at_a_mount_point_fails_the_rebuild(process_backend,
                                                                         sandboxes):
    sandbox = await sandboxes("a")
    # Without a network /etc/resolv.conf is no mount point: root may replace it with a link,
    # hoping a rebuild with a network binds the resolver's file over what it points to.
    planted = await run(sandbox, "rm /etc/resolv.conf && "
                                 "ln -s /proc/sys/kernel/hostname /etc/resolv.conf && "
                                 "echo planted", user="root")
    assert planted.strip() == "planted"
    spec = dataclasses.replace(sandbox.spec, network=True)
    await sandbox.destroy()
    held_before = process_backend.ids.held()
    host_mounts = _mount_count()
    with pytest.raises(SandboxError, match="a symlink is never followed"):
        await process_backend.materialize(spec)
    assert process_backend.ids.held() == held_before
    assert sandbox_cgroups(process_backend) == []
    assert _mount_count() == host_mounts


@pytest.mark.parametrize(("point", "target"), [("proc", "/"), ("workspace", "/etc"),
                                               ("dev", "/tmp")])
async def test_a_symlink_in_the_upper_layer_is_never_a_mount_point(process_backend, roots,
                                                                   point, target):
    root = roots / "planted"
    root.mkdir()
    (root / "upper").mkdir()
    (root / "upper" / point).symlink_to(target)  # as if the agent had left it there
    host_mounts = _mount_count()
    with pytest.raises(SandboxError, match="a symlink is never followed"):
        await process_backend.materialize(SandboxSpec(
            sandbox_id=f"sb-{uuid.uuid4().hex[:8]}", image="tenon-base:bookworm", workspace=root))
    assert _mount_count() == host_mounts
    assert sandbox_cgroups(process_backend) == []
