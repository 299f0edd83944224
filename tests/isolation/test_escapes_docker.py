"""Each escape tried from a Docker sandbox, asserted to fail: reach a listener on the host's
loopback, read another agent's workspace, see or signal host processes, exhaust another
sandbox's pids or inotify instances, fill a shared disk or memory, write outside the
persistent directories. (Filling the workspace's own filesystem, and reading a workspace as
another host uid, are tried in tests/runtime/test_workspace_limits_docker.py.)"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import shutil
import socket
import stat
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tenon.sandbox.base import SandboxSpec
from tenon.state.workspace import WorkspaceStore
from tenon.units import MIB

pytestmark = pytest.mark.docker

IMAGE = "tenon-base:bookworm"

# Connects to each (host, port) given and prints one line per target. The bridge gateway
# (the host's address on the container's network) comes from the default route, if any.
_PROBE = """
import socket, sys
targets = [("127.0.0.1", int(port)) for port in sys.argv[1:]]
for line in open("/proc/net/route").read().splitlines()[1:]:
    fields = line.split()
    if fields[1] == "00000000":
        gateway = socket.inet_ntoa(bytes.fromhex(fields[2])[::-1])
        targets += [(gateway, int(port)) for port in sys.argv[1:]]
for host, port in targets:
    try:
        socket.create_connection((host, port), timeout=3).close()
        print(host, port, "connected")
    except OSError as exc:
        print(host, port, type(exc).__name__)
"""

_FETCH = """
import sys, urllib.request
try:
    print(urllib.request.urlopen(sys.argv[1], timeout=3).read().decode())
except Exception as exc:
    print(type(exc).__name__, exc)
"""

# Opens inotify instances until the kernel refuses, says how many, then holds them.
_INOTIFY_HOG = """
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
fds = []
while len(fds) < 100000:
    fd = libc.inotify_init1(0)
    if fd < 0:
        break
    fds.append(fd)
print(len(fds), os.strerror(ctypes.get_errno()), flush=True)
if sys.argv[1:] == ["hold"]:
    time.sleep(300)
"""


def python_command(code: str, *args: object) -> str:
    """A shell command running `code` with python3 (base64: no quoting to get wrong)."""
    encoded = base64.b64encode(code.encode()).decode()
    return f'python3 -c "$(echo {encoded} | base64 -d)" {" ".join(map(str, args))}'


@pytest.fixture(scope="module")
def sandbox_network_restored() -> Iterator[None]:
    """Removes the sandboxes' Docker network afterwards if these tests made it."""
    import docker.errors

    from tenon.sandbox.docker import SANDBOX_NETWORK
    from tenon.sandbox.dockerd import connect

    client = connect(timeout_s=30)
    existed = bool(client.networks.list(names=[SANDBOX_NETWORK]))
    yield
    if not existed:
        for network in client.networks.list(names=[SANDBOX_NETWORK]):
            with contextlib.suppress(docker.errors.APIError):  # in use by someone else
                network.remove()
    client.close()


@pytest.fixture
def backend(sandbox_network_restored: None, docker_backend: Any) -> Any:
    return docker_backend


@pytest.fixture
def store() -> Iterator[WorkspaceStore]:
    """Plain persistent roots under a state dir every uid may traverse (not list), as in
    production: only the roots' own modes and owners keep one agent from another."""
    state_dir = Path(tempfile.mkdtemp(prefix="tenon-iso-", dir="/tmp"))
    state_dir.chmod(0o711)
    yield WorkspaceStore(state_dir)
    shutil.rmtree(state_dir)


@pytest.fixture
async def sandboxes(backend: Any, store: WorkspaceStore) -> AsyncIterator[Any]:
    """`make(agent_id, **spec fields)` materializes a sandbox on that agent's persistent
    root; every sandbox made is destroyed at the end."""
    made: list[Any] = []

    async def make(agent_id: str, **overrides: Any) -> Any:
        fields: dict[str, Any] = {"sandbox_id": f"sb-{uuid.uuid4().hex[:8]}", "image": IMAGE,
                                  "workspace": store.create(agent_id),
                                  "tmp_size_bytes": 16 * MIB, "max_pids": 64}
        sandbox = await backend.materialize(SandboxSpec(**{**fields, **overrides}))
        made.append(sandbox)
        return sandbox

    yield make
    for sandbox in made:
        await sandbox.destroy()


def uid_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid line for pid {pid}")


def as_uid(uid: int, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                           "--", *argv], capture_output=True, text=True, check=False)


@contextlib.contextmanager
def host_listener(address: str) -> Iterator[int]:
    with socket.socket() as listener:
        listener.bind((address, 0))
        listener.listen()
        yield listener.getsockname()[1]


def remap_base() -> int:
    """The first host id of Docker's remapped range (dockremap's in /etc/subuid)."""
    for line in Path("/etc/subuid").read_text().splitlines():
        name, first, _count = line.split(":")
        if name == "dockremap":
            return int(first)
    raise AssertionError("no dockremap range in /etc/subuid: is userns-remap on?")


DOCKER_DEFAULT_CAPS = "00000000a80425fb"  # Docker's default capability set


async def test_sandboxes_run_as_remapped_non_root_uids(sandboxes):
    """Under userns-remap every container's root is the range's first host id, never host
    root; the default user holds no capability, root inside holds Docker's default set over
    the container's own user namespace only."""
    first, second = await sandboxes("one"), await sandboxes("two")
    base = remap_base()
    assert base != 0
    assert {uid_of(first.init_pid), uid_of(second.init_pid)} == {base}
    status = "id -u; grep -E '^(CapEff|NoNewPrivs|Seccomp):' /proc/self/status"
    as_user = await first.exec(status, timeout_s=10)
    assert as_user.output.split() == [
        "1000",
        "CapEff:", "0000000000000000",  # no capability at all
        "NoNewPrivs:", "1",
        "Seccomp:", "2",  # Docker's default profile filters syscalls
    ]
    as_root = await first.exec(status, timeout_s=10, user="root")
    assert as_root.output.split() == ["0", "CapEff:", DOCKER_DEFAULT_CAPS, "NoNewPrivs:", "1",
                                      "Seccomp:", "2"]
    running = await first.exec("sleep 30 & echo $!", timeout_s=10, user="root")
    inner = int(running.output)
    host_pids = [pid for pid in first.cgroup.pids() if _ns_pid(pid) == inner]
    assert [uid_of(pid) for pid in host_pids] == [base]  # root inside is host id `base`


def _ns_pid(pid: int) -> int | None:
    """The pid `pid` has in its own (innermost) pid namespace."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    return None


@pytest.mark.parametrize("network", [False, True], ids=["network-none", "network-bridge"])
async def test_host_loopback_listener_is_unreachable(sandboxes, network):
    sandbox = await sandboxes("prober", network=network)
    with host_listener("127.0.0.1") as loopback_port:
        probe = await sandbox.exec(python_command(_PROBE, loopback_port), timeout_s=30)
    assert probe.exit_code == 0, probe.output
    lines = probe.output.splitlines()
    assert "connected" not in probe.output
    # The container's 127.0.0.1 is its own loopback; with a bridge, the gateway is tried too.
    assert len(lines) == (2 if network else 1)


async def test_host_services_are_out_of_reach_even_on_all_addresses(sandboxes):
    """A sandbox with network reaches neither the host's loopback nor a service bound to
    every address through the bridge gateway: its network rules deny the host's private
    networks (`netpolicy.PRIVATE_NETS`) unless allowed by name."""
    sandbox = await sandboxes("prober", network=True)
    with host_listener("127.0.0.1") as loopback_port, host_listener("0.0.0.0") as any_port:
        probe = await sandbox.exec(python_command(_PROBE, loopback_port, any_port), timeout_s=30)
    lines = probe.output.splitlines()
    assert len(lines) == 4, probe.output  # both ports on the loopback and on the gateway
    assert "connected" not in probe.output


async def test_sandboxes_with_network_cannot_reach_each_other(sandboxes):
    from tenon.sandbox.docker import SANDBOX_NETWORK

    server, client = await sandboxes("server", network=True), await sandboxes("client",
                                                                               network=True)
    serve = await server.exec(
        "python3 -m http.server 8080 >/dev/null 2>&1 & "
        "for i in $(seq 100); do python3 -c \"import socket; "
        "socket.create_connection(('127.0.0.1', 8080))\" 2>/dev/null && break; sleep 0.1; "
        "done; echo serving", timeout_s=30)
    assert serve.output == "serving\n"
    await asyncio.to_thread(server.container.reload)
    address = server.container.attrs["NetworkSettings"]["Networks"][SANDBOX_NETWORK]["IPAddress"]
    fetch = python_command(_FETCH, f"http://{address}:8080/")
    tried = await client.exec(fetch, timeout_s=30)
    assert "Directory listing" not in tried.output
    assert tried.output.startswith(("TimeoutError", "URLError")), tried.output
    # The same request from the server's own network namespace is answered.
    itself = await server.exec(fetch, timeout_s=30)
    assert "Directory listing" in itself.output
    assert client.leftover_state() == []
    assert "tcp listener 0.0.0.0:8080" in (server.leftover_state() or [])


@pytest.mark.parametrize("user", ["user", "root"])
async def test_another_agents_workspace_is_unreadable(sandboxes, store, user):
    """Docker's remapping gives every container the same host ids, so what keeps one agent
    from another's files is the mount namespace (another agent's root is not there to open,
    for root inside either) and, on the host, the roots' owner and mode: owned by the range's
    root (the persistent directories by its uid 1000), 0700, so no other host uid (a
    process-backend sandbox's, say) may read them."""
    owner, intruder = await sandboxes("owner"), await sandboxes("intruder")
    wrote = await owner.exec("echo hunter2 > /workspace/secret; echo hunter2 > ~/secret",
                             timeout_s=10)
    assert wrote.exit_code == 0, wrote.output
    root = store.path_for("owner")
    secret = root / "workspace" / "secret"
    inside = await intruder.exec(
        f"cat {secret} {root}/home/secret; ls {root}; "
        "grep -c . /proc/self/mountinfo >/dev/null && "
        f"(grep -F {root} /proc/self/mountinfo || echo no mount of it)", timeout_s=10,
        user=user)
    assert "hunter2" not in inside.output
    assert "No such file or directory" in inside.output
    assert "no mount of it" in inside.output
    found = await intruder.exec("grep -rl hunter2 / --exclude-dir=proc --exclude-dir=sys "
                                "2>/dev/null | head -3; echo done", timeout_s=60, user=user)
    assert found.output == "done\n", found.output
    base = remap_base()
    owners = {root: base, root / "workspace": base + 1000, root / "home": base + 1000}
    for path, owner in owners.items():
        st = path.stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (owner, 0o700), path
    outsider = 1_999_000_000  # a host uid outside Docker's range
    for argv in (["cat", str(secret)], ["ls", str(root)], ["ls", str(root / "home")]):
        tried = as_uid(outsider, *argv)
        assert tried.returncode != 0, argv
        assert "Permission denied" in tried.stderr
    assert secret.read_text() == "hunter2\n"  # the path is right


async def test_ipc_objects_stay_in_their_sandbox(sandboxes):
    maker, neighbour = await sandboxes("maker"), await sandboxes("neighbour")
    made = await maker.exec("ipcmk -M 4096 && ipcmk -Q && ipcmk -S 1 && touch /dev/mqueue/q "
                            "&& echo x > /dev/shm/seg && ipcs | grep -c 0x", timeout_s=10)
    assert made.output.splitlines()[-1] == "3", made.output
    seen = await neighbour.exec("ipcs | grep -c 0x; ls -A /dev/shm /dev/mqueue", timeout_s=10)
    assert seen.output.split() == ["0", "/dev/mqueue:", "/dev/shm:"]


async def test_a_reused_uid_has_no_way_into_its_previous_agents_workspace(
        backend, store, sandboxes):
    from tenon.sandbox.uids import UidAllocator

    first = await sandboxes("first")
    uid = first.host_uid
    await first.exec("echo hunter2 > /workspace/secret", timeout_s=10)
    await first.destroy()
    # The next agent gets the same host uid (a pool of one), as can happen once it is free.
    reuse = UidAllocator(first=uid, num_uids=1, lock_dir=store.root.parent / "uids")
    backend.uids = reuse
    second = await sandboxes("second")
    assert second.host_uid == uid
    secret = store.path_for("first") / "workspace" / "secret"
    tried = as_uid(uid, "cat", str(secret))
    assert tried.returncode != 0
    assert "Permission denied" in tried.stderr
    keys = await second.exec(
        python_command("import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
                       "r = libc.syscall(248, b'user', b'tenon', b'x', 1, -4); "
                       "print(r, os.strerror(ctypes.get_errno()))"), timeout_s=10)
    # add_key(2) into the uid's user keyring, which would outlive the sandbox: refused.
    assert keys.output == "-1 Operation not permitted\n"


@pytest.mark.parametrize("user", ["user", "root"])
async def test_host_processes_are_invisible_and_unsignalable(sandboxes, user):
    sandbox = await sandboxes("signaller")
    uid = uid_of(sandbox.init_pid)
    # The worst case: a host process of the sandbox's own uid, which a shared pid
    # namespace would let the sandbox signal.
    bystander = await asyncio.create_subprocess_exec(
        "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", "sleep", "300")
    try:
        listed = await sandbox.exec(
            "for p in /proc/[0-9]*; do echo ${p#/proc/} $(tr '\\0' ' ' < $p/cmdline); done",
            timeout_s=10, user=user)
        pids = {int(line.split()[0]) for line in listed.output.splitlines()}
        assert bystander.pid not in pids
        assert os.getpid() not in pids
        assert "sleep 300" not in listed.output
        assert "pytest" not in listed.output
        assert max(pids) < 100, listed.output  # the container's own pid namespace
        killed = await sandbox.exec(f"kill -KILL {bystander.pid}; kill -KILL -1", timeout_s=10,
                                    user=user)
        assert "No such process" in killed.output
        with pytest.raises(TimeoutError):  # it would have exited at once
            await asyncio.wait_for(asyncio.shield(bystander.wait()), 0.5)
    finally:
        bystander.kill()
        await bystander.wait()


async def test_pids_exhaustion_stays_in_its_sandbox(sandboxes):
    forker, neighbour = await sandboxes("forker", max_pids=32), await sandboxes("neighbour")
    bomb = await forker.exec("for i in $(seq 100); do sleep 300 & done", timeout_s=30)
    assert "Cannot fork" in bomb.output
    num_forker = len(forker.cgroup.pids())
    assert 20 < num_forker <= 32
    spawned = await neighbour.exec(
        "for i in $(seq 40); do sleep 0.2 & done; wait; echo spawned 40", timeout_s=30)
    assert spawned.exit_code == 0, spawned.output
    assert spawned.output == "spawned 40\n"


async def test_inotify_exhaustion_stays_in_its_container(sandboxes):
    """Each container's user namespace caps its users' inotify instances
    (`CONTAINER_USER_LIMITS`), so a hog takes only its share of what host root's limit
    (which counts every remapped container) allows, and a neighbour still gets its own."""
    from tenon.sandbox.docker_root import CONTAINER_USER_LIMITS

    cap = CONTAINER_USER_LIMITS["max_inotify_instances"]
    hog, neighbour = await sandboxes("hog"), await sandboxes("neighbour")
    holding = await hog.exec(
        f"{python_command(_INOTIFY_HOG, 'hold')} > /tmp/held 2>&1 & "
        "while [ ! -s /tmp/held ]; do sleep 0.05; done; cat /tmp/held", timeout_s=30)
    num_held, reason = holding.output.split(maxsplit=1)
    assert 0 < int(num_held) <= cap
    assert reason.strip() == "Too many open files"
    again = await hog.exec(python_command(_INOTIFY_HOG), timeout_s=30)
    assert again.output.split()[0] == "0"  # its user's instances are used up
    raised = await hog.exec(f"echo {cap * 4} > /proc/sys/user/max_inotify_instances",
                            timeout_s=10, user="root")
    assert raised.exit_code != 0  # root inside cannot lift its own cap
    other = await neighbour.exec(python_command(_INOTIFY_HOG), timeout_s=30)
    assert int(other.output.split()[0]) > cap // 2, other.output


async def test_memory_backed_dirs_fill_up_at_their_cap(sandboxes):
    """/dev/shm and disposable paths are tmpfs of `tmp_size_bytes` each, charged to the
    sandbox: filling one fails there, as a full workspace does in its own filesystem."""
    sandbox = await sandboxes("filler", disposable=("/scratch",), tmp_size_bytes=16 * MIB)
    for directory in ("/dev/shm", "/scratch"):
        filled = await sandbox.exec(
            f"dd if=/dev/zero of={directory}/fill bs=1M count=64 2>&1; "
            f"du -k {directory}/fill", timeout_s=30)
        assert "No space left on device" in filled.output, filled.output
        assert int(filled.output.split()[-2]) <= 16 * 1024
        await sandbox.exec(f"rm {directory}/fill", timeout_s=10)


# Places of the image a command may not write as the default user: they stay the image's.
IMAGE_TARGETS = ["/tenon-escape", "/etc/tenon-escape", "/etc/passwd", "/etc/hosts",
                 "/usr/bin/tenon-escape", "/root/tenon-escape", "/opt/tenon-escape"]
# Places neither the user nor root inside may write: the host's or the kernel's.
KERNEL_TARGETS = ["/dev/tenon-escape", "/sys/fs/cgroup/tenon-escape",
                  "/proc/sys/kernel/hostname", "/proc/sysrq-trigger", "/sys/kernel/tenon"]


@pytest.mark.parametrize("user", ["user", "root"])
async def test_writes_reach_only_the_agents_own_layers(sandboxes, store, user):
    """The root is writable, into the agent's own upper layer only: as the default user only
    where the image lets it (/var/tmp), as root anywhere of the image; never /dev, /sys or the
    kernel's files, as either."""
    sandbox = await sandboxes("writer")
    denied = KERNEL_TARGETS + (IMAGE_TARGETS if user == "user" else [])
    for path in denied:
        tried = await sandbox.exec(f"echo x >> {path}", timeout_s=10, user=user)
        assert tried.exit_code != 0, path
        assert any(reason in tried.output for reason in (
            "Read-only file system", "Permission denied", "No such file or directory",
            "Directory nonexistent")), \
            tried.output
    allowed = ["/var/tmp/tenon-w"] + (IMAGE_TARGETS if user == "root" else [])
    wrote = await sandbox.exec(" && ".join(f"echo x >> {path}" for path in allowed)
                               + " && echo ok", timeout_s=10, user=user)
    assert wrote.output == "ok\n", wrote.output
    upper = store.path_for("writer") / "upper"
    for path in allowed:
        assert (upper / path.lstrip("/")).read_text().endswith("x\n"), path
    kept = await sandbox.exec("touch /workspace/w /home/user/h /tmp/t && echo ok", timeout_s=10)
    assert kept.output == "ok\n"
    assert sandbox.leftover_state() == []


# Each line tries one privileged operation from root inside and prints its outcome.
_ROOT_ESCAPES = """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
def tried(name, ret):
    print(name, "ok" if ret == 0 else errno.errorcode[ctypes.get_errno()])
tried("mount", libc.mount(b"none", b"/mnt", b"tmpfs", 0, None))
tried("bind-host", libc.mount(b"/proc/1/root", b"/mnt", None, 4096, None))
tried("init_module", libc.syscall(175, None, 0, b""))
tried("unshare-user", libc.unshare(0x10000000))
tried("unshare-mount", libc.unshare(0x20000))
tried("setns-host-net", libc.setns(os.open("/proc/1/ns/net", os.O_RDONLY), 0))
tried("chroot-out", libc.chroot(b"/proc/1/root/.."))
tried("reboot", libc.reboot(0x4321FEDC))
tried("swapoff", libc.swapoff(b"/"))
tried("settime", libc.clock_settime(0, (ctypes.c_long * 2)(0, 0)))
tried("mknod-disk", libc.mknod(b"/tmp/sda", 0o60600, os.makedev(8, 0)))
"""


async def test_root_inside_cannot_use_host_privileges(sandboxes):
    """Root of the container's user namespace has Docker's default capabilities over that
    namespace only: mounting, loading a module, new namespaces, the time, a raw disk and
    rebooting are all refused (by the capability set or Docker's seccomp profile)."""
    sandbox = await sandboxes("rooted")
    result = await sandbox.exec(python_command(_ROOT_ESCAPES), timeout_s=30, user="root")
    outcomes = dict(line.split() for line in result.output.splitlines())
    allowed_anyway = {"setns-host-net", "chroot-out"}  # its own namespace and root: harmless
    refused = {name: outcome for name, outcome in outcomes.items() if name not in allowed_anyway}
    assert len(outcomes) == 11, result.output
    assert all(outcome in {"EPERM", "EACCES"} for outcome in refused.values()), outcomes
    # The file a refused mknod would have made, and a raw disk, are not there.
    listed = await sandbox.exec("ls /tmp/sda /dev/sda 2>&1 | wc -l; ls /dev", timeout_s=10,
                                user="root")
    assert "sda" not in listed.output.split("\n", 1)[1]


# Root inside tries to take the loopback down (SIOCSIFFLAGS), the least any change of the
# namespace's network configuration (nftables rules included) needs: CAP_NET_ADMIN over the
# network namespace, which Docker made in the host's user namespace.
_NET_ADMIN = """
import ctypes, errno, fcntl, socket, struct
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    fcntl.ioctl(s, 0x8914, struct.pack("16sH14x", b"lo", 0))
    print("changed")
except OSError as exc:
    print(errno.errorcode[exc.errno])
flags = struct.unpack("16sH14x", fcntl.ioctl(s, 0x8913, struct.pack("16sH14x", b"lo", 0)))[1]
print("lo up" if flags & 1 else "lo down")
"""


async def test_root_inside_cannot_change_its_network_namespace(sandboxes):
    sandbox = await sandboxes("netadmin", network=True)
    tried = await sandbox.exec(python_command(_NET_ADMIN), timeout_s=30, user="root")
    assert tried.output.split() == ["EPERM", "lo", "up"], tried.output
