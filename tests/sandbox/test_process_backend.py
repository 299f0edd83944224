"""The process backend against the real kernel: its launcher, namespaces, cgroups."""

import asyncio
import os
import shutil
import socket
import uuid
from pathlib import Path

import pytest

from tenon.errors import ImageNotFound, SandboxDied, SandboxError, SandboxFrozen
from tenon.host.domain import WorkloadDomain
from tenon.sandbox import launcher
from tenon.sandbox.base import Sandbox, SandboxSpec
from tenon.sandbox.images import build_builtin, image_rootfs
from tenon.sandbox.process import ProcessBackend
from tenon.units import MIB

pytestmark = pytest.mark.sandbox

IMAGE = "tenon-base:bookworm"
STATE_DIR = Path("/var/lib/tenon")


def _missing_prerequisite() -> str | None:
    if os.geteuid() != 0:
        return "the process backend needs root (cgroups, nsenter)"
    if problems := launcher.check():
        return problems[0]
    if not Path("/sys/fs/cgroup").exists():
        return "no /sys/fs/cgroup"
    return None


@pytest.fixture(scope="session")
def base_image() -> Path:
    """The base image rootfs, built once (mmdebstrap, ~20 s) when it is missing."""
    if reason := _missing_prerequisite():
        pytest.skip(reason)
    try:
        return image_rootfs(IMAGE, STATE_DIR)
    except ImageNotFound:
        if shutil.which("mmdebstrap") is None:
            pytest.skip("base image missing and mmdebstrap not installed")
        build_builtin(IMAGE)
        return image_rootfs(IMAGE, STATE_DIR)


@pytest.fixture
def domain(base_image):
    d = WorkloadDomain.open(f"tenon-test-{uuid.uuid4().hex[:8]}")
    yield d
    d.remove()
    leftovers = list(Path("/sys/fs/cgroup").glob(f"*/{d.name}")) + list(
        Path("/sys/fs/cgroup").glob(d.name)
    )
    assert leftovers == [], f"cgroups left behind: {leftovers}"


@pytest.fixture
def backend(domain):
    return ProcessBackend(domain, state_dir=STATE_DIR)


def make_spec(workspace: Path, **overrides) -> SandboxSpec:
    fields = {
        "sandbox_id": f"sb-{uuid.uuid4().hex[:8]}",
        "image": IMAGE,
        "workspace": workspace,
        "max_pids": 128,
        "tmp_size_bytes": 256 * MIB,
    }
    return SandboxSpec(**{**fields, **overrides})


@pytest.fixture
async def sandbox(backend, tmp_path):
    workspace = tmp_path / "ws"
    workspace.mkdir()
    sb = await backend.materialize(make_spec(workspace))
    yield sb
    await sb.destroy()


async def run(sb, command: str, timeout_s: float = 10.0, **kw):
    return await sb.exec(command, timeout_s=timeout_s, **kw)


def test_check_reports_no_problem(backend):
    assert backend.check() == []


async def test_exec_returns_output_and_exit_code(sandbox):
    assert isinstance(sandbox, Sandbox)
    result = await run(sandbox, "echo out; echo err >&2; pwd; exit 7")
    assert result.exit_code == 7
    assert result.output.splitlines() == ["out", "err", "/workspace"]
    assert not result.truncated
    assert not result.timed_out
    killed = await run(sandbox, "kill -9 $$")
    assert killed.exit_code == -9


async def test_spec_env_reaches_the_action_but_host_env_does_not(backend, tmp_path):
    os.environ["TENON_HOST_SECRET"] = "leak"
    try:
        sb = await backend.materialize(make_spec(tmp_path, env={"GREETING": "hi"}))
        try:
            result = await run(sb, "echo $GREETING; env")
        finally:
            await sb.destroy()
    finally:
        del os.environ["TENON_HOST_SECRET"]
    assert result.output.startswith("hi\n")
    assert "TENON_HOST_SECRET" not in result.output


async def test_timeout_kills_the_whole_tree(sandbox):
    result = await run(
        sandbox,
        "sleep 100 & setsid sleep 101 & (sh -c 'sleep 102 &') ; echo started; sleep 1000",
        timeout_s=0.5,
    )
    assert result.timed_out
    assert result.exit_code < 0
    assert "started" in result.output
    assert sandbox.processes() == []
    ps = await run(sandbox, LIST_PROCESSES)
    assert [line.split()[1] for line in ps.output.splitlines()] == [
        "tenon-launch",
        "sh",
        "python3",
    ]  # pid 1 (the reaper), and this action (sh, python3)


# pid and comm of every process the sandbox can see
LIST_PROCESSES = (
    "python3 -c \"import os\nfor p in sorted(int(p) for p in os.listdir('/proc') "
    "if p.isdigit()):\n    print(p, open(f'/proc/{p}/comm').read().strip())\""
)


async def test_output_is_bounded_and_the_writer_never_blocks(sandbox):
    result = await run(
        sandbox, "head -c 5000000 /dev/zero | tr '\\0' x; echo done >&2", max_output_bytes=1000
    )
    assert result.exit_code == 0
    assert result.truncated
    assert len(result.output) == 1000
    assert set(result.output) == {"x"}


async def test_no_network(sandbox):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        code = (
            f"import socket\ns=socket.socket()\ns.settimeout(2)\n"
            f"try:\n s.connect(('127.0.0.1',{port})); print('connected')\n"
            f"except OSError as e: print('refused', e)\n"
        )
        result = await run(
            sandbox, f'python3 -c "{code}"; ls /sys/class/net 2>/dev/null; cat /proc/net/dev'
        )
    finally:
        listener.close()
    assert "refused" in result.output
    assert "connected" not in result.output
    interfaces = [
        line.split(":")[0].strip()
        for line in result.output.splitlines()
        if ":" in line and "|" not in line and "refused" not in line
    ]
    assert interfaces == ["lo"]


async def test_cannot_see_host_processes(sandbox):
    result = await run(sandbox, LIST_PROCESSES)
    pids = [int(line.split()[0]) for line in result.output.splitlines()]
    assert pids[0] == 1  # the launcher's pid 1, the reaper
    assert len(pids) == 3  # and this action: sh, python3
    assert os.getpid() not in pids
    assert "pytest" not in result.output


async def test_cannot_read_host_files(sandbox, tmp_path):
    secret = Path("/root") / f"tenon-secret-{uuid.uuid4().hex[:6]}"
    secret.write_text("host secret")
    outside = tmp_path / "outside.txt"
    outside.write_text("outside workspace")
    try:
        result = await run(
            sandbox, f"cat {secret} {outside} /root/* 2>&1; cat /etc/hostname; hostname"
        )
    finally:
        secret.unlink()
    assert "host secret" not in result.output
    assert "outside workspace" not in result.output
    assert socket.gethostname() not in result.output.splitlines()[-2:]
    assert result.output.splitlines()[-1] == "sandbox"


async def test_writes_only_to_the_persistent_directories(sandbox):
    result = await run(
        sandbox,
        "for p in /usr/x /etc/x /x /dev/x; do touch $p 2>/dev/null "
        "&& echo wrote $p; done; echo hi > /workspace/w.txt && "
        "echo data > /tmp/t && echo home > ~/h && cat /tmp/t",
    )
    assert "wrote" not in result.output
    assert result.output.strip() == "data"
    root = sandbox.spec.workspace
    assert (root / "workspace" / "w.txt").read_text() == "hi\n"
    assert (root / "tmp" / "t").read_text() == "data\n"  # /tmp persists with the agent
    assert (root / "home" / "h").read_text() == "home\n"  # and so does HOME
    assert sandbox.leftover_state() == []
    await run(sandbox, "echo x > /dev/shm/seg")
    assert sandbox.leftover_state() == ["/dev/shm/seg"]


async def test_no_capabilities(sandbox):
    result = await run(
        sandbox,
        "grep -E 'Cap(Eff|Prm)' /proc/self/status; id -u; "
        "unshare -r true 2>/dev/null && echo UNSHARED; "
        "mount -t tmpfs none /mnt 2>/dev/null && echo MOUNTED; "
        "grep NoNewPrivs /proc/self/status",
    )
    lines = result.output.splitlines()
    assert lines[0].split() == ["CapEff:", "0000000000000000"] or lines[1].split() == [
        "CapEff:",
        "0000000000000000",
    ]
    assert all(line.split()[1] == "0000000000000000" for line in lines[:2])
    assert lines[2] == "1000"
    assert "UNSHARED" not in result.output
    assert "MOUNTED" not in result.output
    assert lines[-1].split() == ["NoNewPrivs:", "1"]


async def test_runs_as_unprivileged_ids_of_its_own_range(sandbox):
    await run(sandbox, "sleep 30 &")
    [leftover] = sandbox.processes()
    # the default user is 1000 inside: the range's 1000th id outside
    assert os.stat(f"/proc/{leftover.host_pid}").st_uid == sandbox.id_base + 1000
    with open(f"/proc/{leftover.host_pid}/uid_map") as f:  # noqa: ASYNC230 - procfs, instant
        uid_map = f.read().split()
    assert uid_map == ["0", str(sandbox.id_base), "65536"]
    assert sandbox.id_base in sandbox._ids.held()
    root = sandbox.spec.workspace
    assert (root.stat().st_uid, root.stat().st_mode & 0o777) == (0, 0o700)


async def test_pids_limit(backend, tmp_path):
    sb = await backend.materialize(make_spec(tmp_path, max_pids=32))
    try:
        result = await run(
            sb,
            "n=0; for i in $(seq 100); do sleep 30 & n=$((n+1)); done 2>&1; "
            "ls /proc | grep -cE '^[0-9]+$'",
            timeout_s=20,
        )
        assert "fork" in result.output.lower() or "resource" in result.output.lower()
        assert len(sb.cgroup.pids()) <= 32
    finally:
        await sb.destroy()


async def test_disposable_tmpfs_is_charged_to_the_sandbox_and_released(backend, domain,
                                                                         tmp_path):
    sb = await backend.materialize(make_spec(tmp_path, disposable=("/scratch",)))
    before = sb.cgroup.reading().usage_bytes
    result = await run(sb, "head -c 52428800 /dev/urandom > /scratch/blob && echo ok")
    assert result.output.strip() == "ok"
    grown = sb.cgroup.reading().usage_bytes - before
    assert 45 * MIB < grown < 80 * MIB
    domain_before = domain.reading().usage_bytes
    cgroup_dirs = list(sb.cgroup.dirs.values())
    await sb.destroy()
    await sb.destroy()  # idempotent
    assert domain_before - domain.reading().usage_bytes > 40 * MIB
    assert not any(d.exists() for d in cgroup_dirs)


async def test_processes_lists_leftovers_only(sandbox):
    clean = await run(sandbox, "true")
    assert clean.exit_code == 0
    assert sandbox.processes() == []
    await run(sandbox, "sleep 60 &")
    leftovers = sandbox.processes()
    assert [p.command for p in leftovers] == ["sleep 60"]


async def test_frozen_sandbox_refuses_exec(sandbox):
    sandbox.cgroup.freeze()
    try:
        with pytest.raises(SandboxFrozen):
            await run(sandbox, "true")
    finally:
        sandbox.cgroup.thaw()
    assert (await run(sandbox, "echo back")).output == "back\n"


async def test_dead_init_raises_sandbox_died(sandbox):
    os.kill(sandbox.child_pid, 9)
    await asyncio.sleep(0.05)
    with pytest.raises(SandboxDied):
        await run(sandbox, "true")
    await sandbox.destroy()
    with pytest.raises(SandboxError):
        await run(sandbox, "true")


async def test_missing_image_is_a_clear_error(domain, tmp_path, monkeypatch):
    monkeypatch.setenv("TENON_IMAGE_DIR", str(tmp_path / "images"))  # an empty store
    backend = ProcessBackend(domain, state_dir=tmp_path / "state")
    assert any("tenon image build" in p for p in backend.check())
    with pytest.raises(ImageNotFound, match="run: tenon image build"):
        await backend.materialize(make_spec(tmp_path))


async def test_lifecycle_is_fast(backend, tmp_path):
    loop = asyncio.get_running_loop()
    timings: dict[str, list[float]] = {"materialize": [], "exec": [], "destroy": []}
    for i in range(5):
        workspace = tmp_path / f"ws{i}"
        workspace.mkdir()
        start = loop.time()
        sb = await backend.materialize(make_spec(workspace))
        timings["materialize"].append(loop.time() - start)
        start = loop.time()
        await run(sb, "true")
        timings["exec"].append(loop.time() - start)
        start = loop.time()
        await sb.destroy()
        timings["destroy"].append(loop.time() - start)
    medians = {k: sorted(v)[len(v) // 2] for k, v in timings.items()}
    assert medians["materialize"] < 0.2, medians
    assert medians["exec"] < 0.2, medians
    assert medians["destroy"] < 0.2, medians


async def test_background_process_makes_the_boundary_resident_only(sandbox):
    from tenon.runtime.eligibility import check_restartable

    assert check_restartable(sandbox, agent_has_logical_state=True).restartable
    await run(sandbox, "sleep 100 > /dev/null 2>&1 &")
    verdict = check_restartable(sandbox, agent_has_logical_state=True)
    assert verdict.resident_only
    assert "sleep" in verdict.reason


_MQ_OPEN = ("python3 -c \"import ctypes; "
            "assert ctypes.CDLL('librt.so.1').mq_open(b'/jobs', 0o102, 0o600, None) >= 0\"")


@pytest.mark.parametrize(("command", "named"), [
    ("ipcmk -M 4096", "SysV shm"),
    ("ipcmk -Q", "SysV msg"),
    ("ipcmk -S 2", "SysV sem"),
    (_MQ_OPEN, "POSIX mqueue /dev/mqueue/jobs"),
    ("echo x > /dev/shm/seg", "/dev/shm/seg"),
])
async def test_ipc_objects_left_by_an_exited_action_make_the_boundary_resident_only(
        sandbox, command, named):
    from tenon.runtime.eligibility import check_restartable

    clean = await run(sandbox, "echo hi > /workspace/a; echo t > /tmp/b; echo h > ~/c")
    assert clean.exit_code == 0, clean.output
    assert sandbox.leftover_state() == []
    assert check_restartable(sandbox, agent_has_logical_state=True).restartable
    result = await run(sandbox, command)
    assert result.exit_code == 0, result.output
    assert sandbox.processes() == []  # nothing but the object itself is left
    leftovers = sandbox.leftover_state()
    assert len(leftovers) == 1
    assert leftovers[0].startswith(named)
    verdict = check_restartable(sandbox, agent_has_logical_state=True)
    assert verdict.resident_only
    assert named in verdict.reason


async def test_listening_sockets_are_reported(sandbox):
    from tenon.runtime.eligibility import check_restartable

    await run(sandbox, "python3 -c \"import socket, time; s = socket.socket(); "
                       "s.bind(('127.0.0.1', 8080)); s.listen(); u = socket.socket(1); "
                       "u.bind('/workspace/s.sock'); u.listen(); time.sleep(100)\" "
                       ">/dev/null 2>&1 &")
    for _ in range(200):
        leftovers = sandbox.leftover_state()
        if len(leftovers) == 2:
            break
        await asyncio.sleep(0.02)
    assert leftovers == ["tcp listener 127.0.0.1:8080", "unix listener /workspace/s.sock"]
    assert check_restartable(sandbox, agent_has_logical_state=True).resident_only


async def test_leftover_state_is_unknown_once_the_sandbox_is_gone(backend, tmp_path):
    sb = await backend.materialize(make_spec(tmp_path))
    await sb.destroy()
    assert sb.leftover_state() is None
