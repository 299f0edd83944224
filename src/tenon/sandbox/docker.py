"""The `docker` backend: one container per sandbox, inside the workload domain.

`cgroup_parent=/<domain>` puts each container's cgroup at `<domain>/<container id>`
(cgroupfs driver), so all it allocates is charged to the budget. Its init (docker-init +
`sleep infinity`) only idles; each action is a fresh `sh -c` via `docker exec`, killed on
timeout from the host (exec pid, descendants, anything with its TENON_EXEC_ID). With an
`ExecIO` the exec keeps stdout and stderr apart (demuxed frames), attaches stdin to its
socket when asked for, and is signalled from the host the same way.

Filesystem: the root is writable and persistent (`docker_root`): an overlay of the image's
rootfs below and the agent's persistent `upper/` above, mounted on the host and made the
container's root by a pivot in its mount namespace, with the persistent directories bound
over it. What root inside installs (apt-get, pip into the system site-packages) or edits
(/etc, /testbed) survives destroy + materialize. /dev and /sys/fs/cgroup are read-only;
/dev/shm (a tmpfs capped at `tmp_size_bytes`), /dev/mqueue and the disposable tmpfs are
writable and dropped with the container.

Isolation: Docker remaps user namespaces (`"userns-remap": "default"`): container id `i` is
host id `R + i` (R from /etc/subuid for dockremap). Actions run as uid 1000 (no capability,
no-new-privileges: setuid binaries gain nothing), or with `user="root"` as root of the
container's user namespace with Docker's default capabilities, which are capabilities over
that namespace only: host uid R, never host root. Every container shares the one range, so
an agent's files are kept from another's by the persistent root's mode (0700, owned by R
while live, by host root between sandboxes) and by each container's private mount
namespace, not by distinct uids; kernel per-user counters are counted per user namespace
and, above it, all containers' together under the namespace owner (host root): inotify
instances and watches, user namespaces, and RLIMIT_MSGQUEUE bytes. Each container has its
own pid, IPC, mount, network and user namespaces (network `none`, or with network the
`SANDBOX_NETWORK` bridge and the spec's nftables rules in the container's network
namespace (`netfilter`): the host's loopback, its private networks, so its services bound to
every address too, and other sandboxes are out of reach), Docker's default seccomp
profile, a pids cgroup capped at `max_pids` and its memory in the domain.
docs/ISOLATION.md lists each escape tried against this.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import os
import signal
import socket
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import docker
import docker.errors
from docker.models.containers import Container
from docker.utils.socket import STDERR, frames_iter

from tenon.errors import (
    BackendUnavailable,
    HostError,
    SandboxDied,
    SandboxError,
    SandboxFrozen,
)
from tenon.host import nsinspect, procfs, procs
from tenon.host.domain import remove_empty_domain_dirs
from tenon.host.layout import CGROUP_ROOT
from tenon.sandbox import netfilter
from tenon.sandbox._exec import (
    EXEC_ID_VAR,
    OutputBuffer,
    cwd_env_argv,
    describe,
    exec_env,
    kill_action,
    signal_action,
)
from tenon.sandbox.base import (
    DEFAULT_STATE_DIR,
    HOME_DIR,
    PERSISTENT_MOUNTS,
    BackendCapacity,
    ExecIO,
    ExecResult,
    ProcessInfo,
    SandboxSpec,
)
from tenon.sandbox.container_files import unexpected_writable_mounts
from tenon.sandbox.docker_enter import NEW_ROOT
from tenon.sandbox.docker_root import (
    PLACEHOLDER_COMMAND,
    USER_ID,
    enter_root,
    make_mount_points,
    mount_root,
    own_remapped_root,
    placeholder_image,
    remap_base,
    shifted_lower,
    unmount_root,
)
from tenon.sandbox.dockerd import DAEMON_FIX as _DAEMON_FIX
from tenon.sandbox.dockerd import connect
from tenon.sandbox.images import image_rootfs
from tenon.sandbox.ownership import hide_persistent_root
from tenon.sandbox.usernet import HOST_CERTS
from tenon.sandbox.users import (
    UNKNOWN_USER_EXIT_CODE,
    SandboxUser,
    UnknownUser,
    resolve_user,
)

if TYPE_CHECKING:
    from tenon.host.domain import SandboxCgroup, WorkloadDomain

logger = logging.getLogger(__name__)

SANDBOX_LABEL = "tenon.sandbox"
# Sandboxes with network join this bridge, made on first use and left in place (like
# docker0). On it a container reaches the outside (NAT) and host services bound to every
# address (through the gateway), but not the host's loopback and, unlike on Docker's default
# bridge, not another container: inter-container traffic is dropped (enable_icc=false).
SANDBOX_NETWORK = "tenon-sandboxes"
_ICC_OPTION = "com.docker.network.bridge.enable_icc"
DOMAIN_LABEL = "tenon.domain"
_PAUSED_REFUSAL = "cannot exec in a paused container"
_HELD_POLL_S = 0.02
WORKSPACE = PERSISTENT_MOUNTS["workspace"]
_READY_TIMEOUT_S = 10.0
# Docker keeps stdout and stderr as two pipes, so their relative order would be lost;
# one pipe for both keeps the interleaving. The action is still exactly `sh -c command`.
_MERGED_SH = ("/bin/sh", "-c", 'exec 2>&1; exec /bin/sh -c "$1"', "sh")
_IO_GRACE_S = 0.1  # after the exec exits, how long a background holder may keep its output
_PID_POLL_S = 0.005  # how often to ask for a just-started exec's pid
_REAP_TIMEOUT_S = 2.0  # how long a killed exec's process may take to be reaped by the shim
_CANCEL_KILL_TIMEOUT_S = 10.0  # how long a cancelled interactive command's kill may take
USERS = {"user": f"{USER_ID}:{USER_ID}", "root": "0:0"}  # `exec(user=...)` -> Docker's user
# Docker's own mounts moved from the placeholder root onto the sandbox's tree; with network
# also Docker's /etc/hosts, /etc/hostname and /etc/resolv.conf (else the image's own).
_MOVED_MOUNTS = ("/proc", "/dev", "/sys", *PERSISTENT_MOUNTS.values())
_NETWORK_FILES = ("/etc/hosts", "/etc/hostname", "/etc/resolv.conf")
DOCKER_DNS = "127.0.0.11"  # Docker's resolver in containers on a user-defined network
_NSENTER = "/usr/bin/nsenter"
# Writable mounts that hold no action's state besides the persistent and inspected ones:
# the root (persistent) and the device nodes Docker binds in a user namespace.
_KEPT_WRITABLE = frozenset(["/", *(f"/dev/{name}" for name in
                                   ("null", "zero", "full", "random", "urandom", "tty"))])
# Per-container values of namespaced kernel limits (its own IPC namespace): POSIX queues.
_SYSCTLS = {"fs.mqueue.queues_max": "64", "fs.mqueue.msg_max": "10"}


T = TypeVar("T")

# The SDK blocks, and an exec's output drain holds a thread for the action's whole life (a
# frozen one too). On asyncio's default pool (cores + 4 threads) a burst of held actions
# starved every other Docker call, teardown included; this pool is sized for many sandboxes.
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=512, thread_name_prefix="tenon-docker")


async def _in_pool(fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(_POOL, functools.partial(fn, *args))


def container_options(spec: SandboxSpec, root_dir: Path | None = None,
                      image: str | None = None) -> dict[str, Any]:
    """`containers.create` keyword arguments shared by Tenon and the bare baseline. With
    `root_dir` (the sandbox's merged tree) the container starts from the placeholder `image`
    with the tree bound at `NEW_ROOT` (`docker_enter` pivots onto it); without, from
    `spec.image` with Docker's own root, read-only. The persistent root must be owned for
    the remapped container (`own_remapped_root`)."""
    root = spec.workspace.resolve()
    volumes = {str(root / sub): {"bind": target, "mode": "rw"}
               for sub, target in PERSISTENT_MOUNTS.items()}
    if root_dir is not None:
        volumes[str(root_dir)] = {"bind": NEW_ROOT, "mode": "rw"}
    if spec.network:  # the host's CA certificates (`usernet.HOST_CERTS`)
        volumes[HOST_CERTS] = {"bind": HOST_CERTS, "mode": "ro"}
    tmpfs = {path: f"size={spec.tmp_size_bytes},mode=1777" for path in spec.disposable}
    return {
        "image": image if root_dir is not None and image else spec.image,
        "command": PLACEHOLDER_COMMAND if root_dir is not None else ["sleep", "infinity"],
        "init": True,  # docker-init reaps orphans, so leftovers never pile up as zombies
        # The placeholder root is read-only (and detached once the tree is the root).
        "read_only": True,
        "network_mode": SANDBOX_NETWORK if spec.network else "none",
        "volumes": volumes,
        "working_dir": WORKSPACE,
        "tmpfs": tmpfs,
        # Its own IPC namespace, SysV objects, POSIX queues (/dev/mqueue) and /dev/shm (a
        # tmpfs of shm_size): never joinable by another container, whatever the daemon's
        # default-ipc-mode.
        "ipc_mode": "private",
        "shm_size": spec.tmp_size_bytes,
        "pids_limit": spec.max_pids,
        "sysctls": _SYSCTLS,
        # Docker's default capabilities, for root inside only (bounded by its user
        # namespace); uid 1000 holds none. Each exec names its user (`USERS`).
        "security_opt": ["no-new-privileges"],
        "user": USERS["root" if root_dir is not None else "user"],
        "environment": {"HOME": HOME_DIR, **spec.env},
    }


def ensure_sandbox_network(client: docker.DockerClient, name: str = SANDBOX_NETWORK) -> None:
    """Create the sandboxes' network unless it exists; SandboxError if one of that name
    lets containers talk to each other."""
    try:
        network = client.networks.get(name)
    except docker.errors.NotFound:
        try:
            client.networks.create(name, driver="bridge", check_duplicate=True,
                                   options={_ICC_OPTION: "false"})
            return
        except docker.errors.APIError:  # made meanwhile by another controller: check it
            network = client.networks.get(name)
    if problem := _network_problem(network.attrs, name):
        raise SandboxError(problem)


def _network_problem(attrs: dict[str, Any], name: str) -> str | None:
    if (attrs.get("Options") or {}).get(_ICC_OPTION) != "false":
        return (f"Docker network {name} lets containers reach each other; "
                f"run: docker network rm {name}")
    return None


def engine_problems(client: docker.DockerClient) -> list[str]:
    """What in the Engine's setup would weaken a sandbox's isolation, each with its fix."""
    problems = []
    if not any(o.startswith("name=seccomp") for o in client.info().get("SecurityOptions", [])):
        problems.append("Docker runs containers without seccomp; start dockerd with its "
                        "default seccomp profile")
    for network in client.networks.list(names=[SANDBOX_NETWORK]):
        if network.name == SANDBOX_NETWORK and (
                problem := _network_problem(network.attrs, SANDBOX_NETWORK)):
            problems.append(problem)
    return problems


def _container_cgroup(init_pid: int, domain_name: str, fallback: str) -> str:
    """The container's cgroup relative to the domain, as its init's memory hierarchy has it."""
    with contextlib.suppress(OSError):
        for controllers, path in procfs.cgroups_of(init_pid):
            if "memory" in controllers and path.startswith(f"/{domain_name}/"):
                return path.removeprefix(f"/{domain_name}/")
    return fallback  # pure v2 has no "memory" line; cgroupfs names it <domain>/<id> there too


def _first_exec(client: docker.DockerClient, container_id: str, deadline: float) -> None:
    """Block until `true` runs inside the container (the readiness criterion)."""
    while True:
        try:
            exec_id = client.api.exec_create(container_id, ["true"])["Id"]
            client.api.exec_start(exec_id)
            if client.api.exec_inspect(exec_id)["ExitCode"] == 0:
                return
        except docker.errors.APIError as exc:
            if time.monotonic() > deadline:
                raise SandboxError(f"container {container_id[:12]} never ran: {exc}") from exc
        if time.monotonic() > deadline:
            raise SandboxError(f"container {container_id[:12]} not ready in time")
        time.sleep(0.01)


class DockerBackend:
    """Materializes sandboxes as Docker containers inside the workload domain, each on its
    own writable root (`docker_root`) under `state_dir`."""

    name = "docker"
    simulated = False

    def __init__(self, domain: WorkloadDomain, client: docker.DockerClient | None = None, *,
                 state_dir: Path = DEFAULT_STATE_DIR) -> None:
        self.domain = domain
        self._client = client
        self.state_dir = state_dir

    @property
    def roots_dir(self) -> Path:
        """Where the domain's sandboxes' trees are mounted, one directory per sandbox id."""
        return self.state_dir / "docker" / "roots" / self.domain.name

    @property
    def client(self) -> docker.DockerClient:
        if self._client is None:
            self._client = connect()
        return self._client

    def capacity(self) -> BackendCapacity:
        """Actions the Engine serves well at once: 4 per core, because each exec is a round
        of API calls the daemon handles on the host's cores, and concurrent ones beyond that
        slow every action down more than the extra concurrency gains. Workflows worth
        keeping live: twice that, so that one's model wait leaves a ready action to serve;
        more only queue, each of their sandboxes torn down and rebuilt while it waits
        (`PolicyConfig.max_live_workflows`)."""
        max_actions = 4 * len(os.sched_getaffinity(0))
        return BackendCapacity(max_admitted_actions=max_actions,
                               max_live_workflows=2 * max_actions)

    def remove_leftovers(self, sandbox_prefix: str = "") -> list[str]:
        """Remove every container labelled with this domain (a dead controller's) whose
        sandbox id starts with `sandbox_prefix`, then the root trees mounted for them."""
        removed = [f"container:{cid[:12]}" for cid in remove_domain_containers(
            self.client, self.domain.name, sandbox_prefix=sandbox_prefix)]
        if self.roots_dir.is_dir():
            for merged in sorted(self.roots_dir.iterdir()):
                if merged.name.startswith(sandbox_prefix) and not self._container_exists(
                        self.client, merged.name):
                    unmount_root(merged)
                    removed.append(f"root:{merged.name}")
        return removed

    def release_domain(self) -> None:
        """Remove the `<hierarchy>/<domain>` directories Docker's cgroupfs driver made in
        hierarchies the domain does not own (`remove_parent_cgroups`)."""
        remove_parent_cgroups(self.domain.name)
        with contextlib.suppress(OSError):  # left only if a root is still mounted in it
            self.roots_dir.rmdir()

    def image_root(self, image: str) -> Path | None:
        """None: a sandbox's root is its own overlay, read through the sandbox."""
        return None

    def check(self, image: str = "tenon-base:bookworm") -> list[str]:
        try:
            client = self.client
            client.ping()
        except Exception as exc:
            return [f"Docker Engine does not answer ({exc}); {_DAEMON_FIX}"]
        try:
            image_rootfs(image, self.state_dir)
            remap_base(client)
            return engine_problems(client)
        except SandboxError as exc:
            return [str(exc)]
        except Exception as exc:
            return [f"cannot query Docker's security options ({exc}); {_DAEMON_FIX}"]

    async def materialize(self, spec: SandboxSpec) -> DockerSandbox:
        return await _in_pool(self._materialize, spec)

    def _materialize(self, spec: SandboxSpec) -> DockerSandbox:
        client = self.client
        start = time.perf_counter()
        try:
            base = remap_base(client)
            placeholder = placeholder_image(client, self.state_dir)
        except SandboxError:
            raise
        except Exception as exc:  # requests' ConnectionError and friends
            raise BackendUnavailable(f"Docker Engine failed ({exc}); {_DAEMON_FIX}") from exc
        lower = shifted_lower(spec.image, self.state_dir, base)
        root = spec.workspace.resolve()
        own_remapped_root(root, base)
        merged = self.roots_dir / spec.sandbox_id
        self.roots_dir.mkdir(mode=0o711, parents=True, exist_ok=True)
        self.roots_dir.chmod(0o711)  # Docker binds the tree as container root, not host root
        mount_root(lower, root, merged)
        try:
            make_mount_points(merged, [*PERSISTENT_MOUNTS.values(), *spec.disposable,
                                       *((HOST_CERTS,) if spec.network else ())],
                              list(_NETWORK_FILES) if spec.network else [], base)
            return self._start(client, spec, merged, placeholder, base, start)
        except BaseException:
            if not self._container_exists(client, spec.sandbox_id):
                with contextlib.suppress(SandboxError):
                    unmount_root(merged)
            raise

    @staticmethod
    def _container_exists(client: docker.DockerClient, sandbox_id: str) -> bool:
        """Whether the sandbox's container exists; True when Docker cannot say."""
        try:
            client.containers.get(f"tenon-{sandbox_id}")
        except docker.errors.NotFound:
            return False
        except Exception:
            return True
        return True

    def _start(self, client: docker.DockerClient, spec: SandboxSpec, merged: Path,
               placeholder: str, base: int, start: float) -> DockerSandbox:
        options = container_options(spec, merged, placeholder)
        if spec.network:
            try:
                ensure_sandbox_network(client)
            except SandboxError:
                raise
            except docker.errors.APIError as exc:
                raise SandboxError(f"cannot make network {SANDBOX_NETWORK}: {exc}") from exc
            except Exception as exc:  # requests' ConnectionError and friends
                raise BackendUnavailable(f"Docker Engine failed ({exc}); {_DAEMON_FIX}") from exc
        try:
            # create + start, not run: run would try to pull a missing image.
            container = client.containers.create(
                name=f"tenon-{spec.sandbox_id}",
                labels={SANDBOX_LABEL: spec.sandbox_id, DOMAIN_LABEL: self.domain.name},
                cgroup_parent=f"/{self.domain.name}",
                **options,
            )
            try:
                container.start()
            except BaseException:
                with contextlib.suppress(Exception):
                    container.remove(force=True)
                raise
        except docker.errors.APIError as exc:
            raise SandboxError(f"cannot start container for {spec.sandbox_id}: {exc}") from exc
        except Exception as exc:  # requests' ConnectionError and friends
            raise BackendUnavailable(f"Docker Engine failed ({exc}); {_DAEMON_FIX}") from exc
        try:
            container_id = _created_id(container)
            container.reload()
            init_pid = int(container.attrs["State"]["Pid"])
            _pivot(init_pid, spec, base)
            if spec.network:  # its rules, before its first command (`netfilter`)
                netfilter.enforce(_NSENTER, init_pid, spec.network,
                                  (DOCKER_DNS, *netfilter.host_nameservers()))
            _first_exec(client, container_id, time.monotonic() + _READY_TIMEOUT_S)
            relative = _container_cgroup(init_pid, self.domain.name, container_id)
            cgroup = self.domain.adopt(spec.sandbox_id, relative)
            # Snapshot after the first exec has exited: docker-init and its idle child.
            init_pids = frozenset(cgroup.pids())
            own_state = _own_namespace_state(init_pid, spec.sandbox_id)
        except BaseException:
            with contextlib.suppress(Exception):
                container.remove(force=True)
            raise
        ready_s = time.perf_counter() - start
        logger.info("sandbox %s ready in %.3f s (cgroup %s)", spec.sandbox_id, ready_s, relative)
        parts = (client, container, cgroup, init_pid, init_pids, merged)
        return DockerSandbox(spec, relative, *parts, ready_s, base, own_state)


def _pivot(init_pid: int, spec: SandboxSpec, base: int) -> None:
    """Make the container's root its tree: move Docker's mounts onto it, pivot, and make
    /dev and /sys/fs/cgroup (each cgroup hierarchy too) read-only."""
    if (uid_map := procfs_uid_map(init_pid)) != base:
        raise SandboxError(f"container of {spec.sandbox_id} maps root to host uid {uid_map}, "
                           f"not {base}; is another daemon.json in use?")
    moves = [*_MOVED_MOUNTS, *spec.disposable,
             *((*_NETWORK_FILES, HOST_CERTS) if spec.network else ())]
    cgroups = [m.mount_point for m in procfs.mount_table(init_pid)
               if m.mount_point.startswith("/sys/fs/cgroup")]
    enter_root(init_pid, moves, ["/dev", *sorted(set(cgroups))])


def procfs_uid_map(pid: int) -> int | None:
    """The host uid container root of `pid` maps to (None: not in a user namespace)."""
    for line in Path(f"/proc/{pid}/uid_map").read_text().splitlines():
        inside, outside, _count = line.split()
        if inside == "0":
            return None if outside == "0" else int(outside)
    return None


@dataclass(eq=False)
class DockerSandbox:
    """A live container; its cgroup is adopted into the workload domain."""

    spec: SandboxSpec
    cgroup_name: str  # relative to the domain
    client: docker.DockerClient
    container: Container
    cgroup: SandboxCgroup
    init_pid: int  # docker-init, the container's pid 1: a way into its namespaces
    init_pids: frozenset[int]  # docker-init and its idle child, never reported or killed
    root_dir: Path  # the sandbox's tree (overlay) as mounted on the host
    ready_s: float  # create -> first successful exec
    remap_base: int  # host uid of root inside; container id i is host id remap_base + i
    # What the namespaces held before any action ran (Docker's embedded DNS server listens
    # on 127.0.0.11 in every container on a user-defined network): never an action's state.
    own_state: frozenset[str]
    _destroyed: bool = False

    @property
    def host_uid(self) -> int:
        """The host uid of the default user inside (uid 1000)."""
        return self.remap_base + USER_ID

    @property
    def root_pid(self) -> int:
        """A host pid whose /proc/<pid>/root is the sandbox's root (docker-init)."""
        return self.init_pid

    @property
    def id_base(self) -> int:
        """The host id of the sandbox's id 0: its id i is host id id_base + i."""
        return self.remap_base

    async def exec(
        self, command: str, *, timeout_s: float, max_output_bytes: int = 65536,
        io: ExecIO | None = None, user: str | None = None,
    ) -> ExecResult:
        """`Sandbox.exec` as `user` (else `io.user`): a user of the sandbox's /etc/passwd;
        "root" is root of the container's user namespace, None the default user (uid 1000).
        An unknown user fails the command (exit 126, as `docker exec -u`), not the sandbox."""
        if self._destroyed:
            raise SandboxError(f"sandbox {self.spec.sandbox_id} was destroyed")
        name = user if user is not None else (io.user if io is not None else None)
        try:
            who = await asyncio.to_thread(resolve_user, (self.root_dir,), name)
        except UnknownUser as exc:
            message = f"{exc}\n"
            if io is not None and io.on_stderr is not None:
                io.on_stderr(message.encode())
            return ExecResult(exit_code=UNKNOWN_USER_EXIT_CODE, output=message, truncated=False,
                              duration_s=0.0)
        try:
            frozen = self.cgroup.is_frozen()
        except OSError as exc:
            raise SandboxDied(f"sandbox {self.spec.sandbox_id} lost its cgroup: {exc}") from exc
        if frozen:
            raise SandboxFrozen(f"sandbox {self.spec.sandbox_id} is frozen by the gate")
        control = None if io is None else _DockerControl(self, io)
        start = time.perf_counter()
        try:
            while True:
                result = await self._exec_once(command, timeout_s, max_output_bytes, control,
                                               who)
                if result.exit_code != 126 or _PAUSED_REFUSAL not in result.output:
                    code = result.exit_code if control is None else control.exit_code(result)
                    return dataclasses.replace(result, exit_code=code,
                                               duration_s=time.perf_counter() - start)
                # The gate froze the container while runc was starting the exec, and Docker
                # refuses to exec into a paused container: the command never ran. It runs
                # once the gate lets the sandbox go, as a process sandbox's would.
                logger.debug("sandbox %s: exec refused while held; waiting for the thaw",
                             self.spec.sandbox_id)
                while self.cgroup.is_frozen():  # noqa: ASYNC110 - the kernel's freezer state
                    await asyncio.sleep(_HELD_POLL_S)
        finally:
            if control is not None:
                control.finish()

    async def _exec_once(self, command: str, timeout_s: float, max_output_bytes: int,
                         control: _DockerControl | None, user: SandboxUser) -> ExecResult:
        token = uuid.uuid4().hex
        api = self.client.api
        start = time.perf_counter()
        io = None if control is None else control.io
        try:
            exec_id, raw = await _in_pool(self._start, command, token, io, user)
        except docker.errors.APIError as exc:
            raise SandboxDied(f"exec in {self.spec.sandbox_id} failed: {exc}") from exc
        # The unix-socket transport hands back a SocketIO; shutdown() needs the real socket.
        sock: socket.socket = getattr(raw, "_sock", raw)
        output = OutputBuffer(max_output_bytes)
        emit = None if io is None else _emitter(io, asyncio.get_running_loop())
        drain = asyncio.ensure_future(_in_pool(_drain, raw, output, emit))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        held_at_start = self.cgroup.held_s()
        timed_out = False
        poll_s = 0.02
        try:
            if control is not None:
                control.attach(exec_id, token, sock)
            while not drain.done():
                # running time only: time held frozen by the gate extends the deadline
                remaining = deadline + (self.cgroup.held_s() - held_at_start) - loop.time()
                if remaining <= 0:
                    timed_out = True
                    logger.info("sandbox %s: timeout", self.spec.sandbox_id)
                    await self._kill_exec(exec_id, token)
                    break
                await asyncio.wait({drain}, timeout=min(remaining, poll_s))
                poll_s = min(poll_s * 2, 0.25)
                if drain.done():
                    break
                info = await _in_pool(api.exec_inspect, exec_id)
                if not info["Running"]:  # exited; a background child holds the output open
                    await asyncio.wait({drain}, timeout=_IO_GRACE_S)
                    break
        except BaseException:  # cancelled (Ctrl-C): a held exec would never end, nor let
            with contextlib.suppress(OSError):  # Docker answer about its container
                self.cgroup.thaw()
            if control is not None:  # an interactive command leaves nothing behind
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(self._kill_exec(exec_id, token)),
                                           _CANCEL_KILL_TIMEOUT_S)
            raise
        finally:
            if control is not None:
                control.detach()
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            await drain
            raw.close()
            sock.close()
        info = await _in_pool(api.exec_inspect, exec_id)
        code = -9 if timed_out else info.get("ExitCode")
        code = -1 if code is None else int(code)
        elapsed_s = time.perf_counter() - start
        return ExecResult(code, output.text(), output.truncated, elapsed_s, timed_out=timed_out)

    def _start(self, command: str, token: str, io: ExecIO | None,
               user: SandboxUser) -> tuple[str, Any]:
        """Create and start the exec: without `io` stderr joins stdout (one interleaved
        stream, `_MERGED_SH`); with it the streams stay apart, stdin is attached when asked,
        and the command runs in `io.cwd` (a missing one fails as the shell's cd does)."""
        api = self.client.api
        home = {"HOME": user.home}
        if io is None:
            env = {**home, **self.spec.env, EXEC_ID_VAR: token}
            argv = [*_MERGED_SH, command]
        else:
            env = {**home, **self.spec.env, **exec_env(io.env), EXEC_ID_VAR: token}
            argv = cwd_env_argv(io.cwd or WORKSPACE, {}, command)
        stdin = io is not None and io.stdin
        exec_id = api.exec_create(self.container.id, argv, environment=env, workdir=WORKSPACE,
                                  stdin=stdin, user=f"{user.uid}:{user.gid}")
        exec_id = exec_id["Id"]
        return exec_id, api.exec_start(exec_id, socket=True)

    async def _exec_pid(self, exec_id: str) -> int:
        """The exec's host pid once it started; 0 when it ended (or never ran)."""
        while True:
            info = await _in_pool(self.client.api.exec_inspect, exec_id)
            if pid := int(info.get("Pid") or 0):
                return pid
            if info.get("ExitCode") is not None:
                return 0
            await asyncio.sleep(_PID_POLL_S)

    async def _signal_exec(self, exec_id: str, token: str, signum: int) -> None:
        """Send `signum` to the exec's tree, parents first (`signal_action`)."""
        root_pid = await self._exec_pid(exec_id)
        if root_pid:
            signal_action(root_pid, self._pids(), token, signum, exclude=set(self.init_pids))

    async def _kill_exec(self, exec_id: str, token: str) -> None:
        info = await _in_pool(self.client.api.exec_inspect, exec_id)
        root_pid = int(info.get("Pid") or 0)
        logger.info("sandbox %s: killing tree of pid %d", self.spec.sandbox_id, root_pid)
        await kill_action(root_pid, self._pids, token, exclude=set(self.init_pids))
        # The exec's own process is reaped by Docker's shim, not by us: until it is, the
        # boundary's check would see it left in the sandbox and keep it resident.
        # Nothing signals the reap: poll.
        deadline = time.monotonic() + _REAP_TIMEOUT_S
        while root_pid and procs.exists(root_pid) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.005)

    def _pids(self) -> list[int]:
        try:
            return self.cgroup.pids()
        except OSError:  # the container (and its cgroup) is gone
            return []

    def processes(self) -> list[ProcessInfo]:
        """Processes in the container's cgroup other than docker-init and its idle child."""
        return describe(sorted(set(self._pids()) - self.init_pids))

    def leftover_state(self) -> list[str] | None:
        """State a later action could observe outside the persistent and disposable paths:
        /dev/shm files, POSIX and SysV IPC objects and sockets of the container's namespaces
        (`host.nsinspect`, through docker-init's pid). The root is persistent (its writes
        are kept like /workspace's), so files are not listed; the container's mount table
        is read, so that a writable mount nobody inspects makes the answer unknown rather
        than empty.
        """
        sandbox_id = self.spec.sandbox_id
        try:
            unexpected = unexpected_writable_mounts(self.init_pid, self.spec.disposable)
            if unexpected := [m for m in unexpected if m not in _KEPT_WRITABLE]:
                logger.warning("sandbox %s: writable mounts nobody inspects: %s",
                               sandbox_id, ", ".join(unexpected))
                return None
            in_namespaces = [item for item in nsinspect.namespace_state(self.init_pid)
                             if item not in self.own_state]
        except Exception as exc:
            logger.warning("sandbox %s: cannot list leftover state: %s", sandbox_id, exc)
            return None
        return in_namespaces

    def oom_killed(self) -> bool:
        """Docker's own OOMKilled flag (a cross-check; the domain's OOM counters are primary)."""
        try:
            self.container.reload()
        except Exception:
            return False
        return bool(self.container.attrs["State"].get("OOMKilled"))

    async def destroy(self) -> None:
        await _in_pool(self._destroy)

    def _destroy(self) -> None:
        if self._destroyed:
            return
        with contextlib.suppress(HostError, OSError):
            self.cgroup.thaw()  # a frozen container cannot be killed promptly
        try:
            self.container.remove(force=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            if "already in progress" not in str(exc):
                msg = f"cannot remove container of {self.spec.sandbox_id}: {exc}"
                raise SandboxError(msg) from exc
        # Docker removes the container's cgroup itself; this clears anything left behind.
        try:
            self.cgroup.remove()
        except HostError as exc:
            msg = f"cgroup of {self.spec.sandbox_id} outlived its container: {exc}"
            raise SandboxError(msg) from exc
        unmount_root(self.root_dir)  # nothing runs on it: the cgroup is gone
        with contextlib.suppress(OSError):  # the domain's last tree: its directory too
            self.root_dir.parent.rmdir()
        # Every container's root is the same host uid: between sandboxes only host root
        # may enter this persistent root.
        root = self.spec.workspace.resolve()
        try:
            hide_persistent_root(root)
        except FileNotFoundError:
            pass  # the workspace is gone already
        except OSError as exc:
            msg = f"cannot take {root} back from uid {self.remap_base}: {exc}"
            raise SandboxError(msg) from exc
        self._destroyed = True


def _own_namespace_state(init_pid: int, sandbox_id: str) -> frozenset[str]:
    """The namespaces' state before any action; empty when it cannot be read (the
    leftover check then reports Docker's own sockets too: resident-only, never unsafe)."""
    try:
        return frozenset(nsinspect.namespace_state(init_pid))
    except Exception as exc:
        logger.warning("sandbox %s: cannot read its namespaces at start: %s", sandbox_id, exc)
        return frozenset()


def _created_id(container: Container) -> str:
    """A created container's id (the SDK types it optional: a model built without attrs)."""
    if container.id is None:
        raise SandboxError(f"Docker returned a container without an id: {container!r}")
    return container.id


def _drain(raw: Any, sink: OutputBuffer,
           emit: Callable[[int, bytes], None] | None) -> None:
    """Copy exec output frames into `sink` (bounded) and to `emit` (stream, payload), reading
    on to the end, so the writer never blocks on a full pipe. Runs in a pool thread."""
    with contextlib.suppress(OSError):
        for stream, payload in frames_iter(raw, tty=False):  # type: ignore[no-untyped-call]
            sink.add(payload)
            if emit is not None:
                emit(stream, payload)


def _emitter(io: ExecIO, loop: asyncio.AbstractEventLoop) -> Callable[[int, bytes], None]:
    """Hands a frame from the drain's thread to its callback in the event loop, in order;
    a callback's exception is logged, the draining goes on."""

    def deliver(callback: Callable[[bytes], None], payload: bytes) -> None:
        try:
            callback(payload)
        except Exception:
            logger.exception("an output callback failed; the output is still captured")

    def emit(stream: int, payload: bytes) -> None:
        callback = io.on_stderr if stream == STDERR else io.on_stdout
        if callback is not None:
            loop.call_soon_threadsafe(deliver, callback, payload)

    return emit


class _DockerControl:
    """`ExecControl` of one command; follows its exec across a refused start (see exec),
    calls `on_start` with itself once, and is inert once the command's exec returned.

    Stdin goes through the exec's attach socket (closing it is the command's EOF). Bytes
    written to an exec Docker refused to start (the gate held the container) are lost."""

    def __init__(self, sandbox: DockerSandbox, io: ExecIO) -> None:
        self.io = io
        self._sandbox = sandbox
        self._exec: tuple[str, str] | None = None  # (exec id, exec token)
        self._sock: socket.socket | None = None
        self._stdin_open = io.stdin
        self._started = False
        self._done = False
        self._signals: set[int] = set()
        self._lock = asyncio.Lock()

    def exit_code(self, result: ExecResult) -> int:
        """The result's exit code, negative (as a process sandbox reports it) when a signal
        sent through this control killed the shell: Docker reports 128 + signum."""
        signum = result.exit_code - 128
        return -signum if signum in self._signals else result.exit_code

    def attach(self, exec_id: str, token: str, sock: socket.socket) -> None:
        self._exec, self._sock = (exec_id, token), sock
        if not self._started:
            self._started = True
            if self.io.on_start is not None:
                self.io.on_start(self)

    def detach(self) -> None:
        self._sock = None

    def finish(self) -> None:
        self._done = True
        self._stdin_open = False

    async def write_stdin(self, data: bytes) -> None:
        async with self._lock:  # concurrent writes never interleave their bytes
            if not self._stdin_open or self._sock is None:
                raise SandboxError("the command's stdin is not open")
            try:
                await _in_pool(self._sock.sendall, data)
            except OSError as exc:
                raise SandboxError(f"the command no longer reads its stdin: {exc}") from exc

    async def close_stdin(self) -> None:
        async with self._lock:
            if self._stdin_open and self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_WR)
            self._stdin_open = False

    async def signal(self, signum: int) -> None:
        """Signal the command's tree; SIGKILL then waits until it is gone, after the gate
        lets the container go if it holds it (a frozen process only dies once thawed)."""
        if self._done or self._exec is None:
            return
        exec_id, token = self._exec
        sandbox = self._sandbox
        self._signals.add(signum)
        await sandbox._signal_exec(exec_id, token, signum)
        if signum != signal.SIGKILL:
            return
        with contextlib.suppress(OSError):  # the cgroup is gone with the container
            while not self._done and sandbox.cgroup.is_frozen():  # noqa: ASYNC110 - the freezer
                await asyncio.sleep(_HELD_POLL_S)
        if not self._done:
            await sandbox._kill_exec(exec_id, token)


def remove_parent_cgroups(domain_name: str, cgroup_root: Path = CGROUP_ROOT) -> None:
    """Remove the empty `<hierarchy>/<domain>` directories Docker's cgroupfs driver made in
    hierarchies the domain does not own (blkio, devices, unified...). Call after
    `WorkloadDomain.remove()`; it is here because only this backend creates them."""
    remove_empty_domain_dirs(domain_name, cgroup_root)


def remove_domain_containers(client: docker.DockerClient, domain_name: str, *,
                             sandbox_prefix: str = "") -> list[str]:
    """Remove every container labelled with `domain_name` (after a controller crash) whose
    sandbox id starts with `sandbox_prefix`; the ids of those removed."""
    removed = []
    label = f"{DOMAIN_LABEL}={domain_name}"
    for container in client.containers.list(all=True, filters={"label": label}):
        if not str(container.labels.get(SANDBOX_LABEL, "")).startswith(sandbox_prefix):
            continue
        with contextlib.suppress(docker.errors.NotFound):
            container.remove(force=True)
            removed.append(str(container.id))
    if removed:
        logger.info("removed %d leftover containers of domain %s", len(removed), domain_name)
    return removed


def cleanup_domain_containers(client: docker.DockerClient, domain_name: str) -> int:
    """`remove_domain_containers`, counted."""
    return len(remove_domain_containers(client, domain_name))


def bare_docker_lifecycle(
    client: docker.DockerClient, image: str, n: int, workspace: Path | None = None
) -> dict[str, float]:
    """Baseline for the lifecycle benchmark: plain `docker run -d` with Tenon's flags minus
    the cgroup parent, timed until `true` execs, then `docker rm -f`. Medians in ms."""
    times_ms: dict[str, list[float]] = {"bare_run_ms": [], "bare_rm_ms": []}
    base = remap_base(client)
    with tempfile.TemporaryDirectory(prefix="tenon-bare-") as tmp:
        spec = SandboxSpec("bare", image, workspace or Path(tmp))
        own_remapped_root(spec.workspace, base)
        try:
            options = container_options(spec)
            for _ in range(n):
                start = time.perf_counter()
                container = client.containers.create(labels={"tenon.bare": "1"}, **options)
                try:
                    container.start()
                    _first_exec(client, _created_id(container),
                                time.monotonic() + _READY_TIMEOUT_S)
                    times_ms["bare_run_ms"].append((time.perf_counter() - start) * 1000)
                finally:
                    start = time.perf_counter()
                    container.remove(force=True)
                    times_ms["bare_rm_ms"].append((time.perf_counter() - start) * 1000)
        finally:
            hide_persistent_root(spec.workspace)
    return {"n": float(n)} | {key: statistics.median(ms) for key, ms in times_ms.items()}
