"""The process backend's writable root and root user: what root installs or edits outside
the persistent directories lives in the agent's upper layer and survives a rebuild; the
default user stays unprivileged."""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import uuid
import zipfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tenon.host.domain import WorkloadDomain
from tenon.sandbox import launcher
from tenon.sandbox.base import ExecIO, SandboxSpec
from tenon.sandbox.images import image_rootfs
from tenon.sandbox.process import ProcessBackend
from tenon.sandbox.process_sandbox import ProcessSandbox
from tenon.units import MIB

pytestmark = [pytest.mark.sandbox, pytest.mark.cgroups]

IMAGE = "tenon-base:bookworm"
STATE_DIR = Path("/var/lib/tenon")


@pytest.fixture
def backend() -> Iterator[ProcessBackend]:
    if os.geteuid() != 0:
        pytest.skip("the process backend needs root")
    if problems := launcher.check():
        pytest.skip(problems[0])
    image_rootfs(IMAGE, STATE_DIR)
    domain = WorkloadDomain.open(f"tenon-test-{uuid.uuid4().hex[:8]}")
    yield ProcessBackend(domain, state_dir=STATE_DIR)
    domain.remove()


@pytest.fixture
def root() -> Iterator[Path]:
    path = STATE_DIR / f"test-root-{uuid.uuid4().hex[:8]}"
    path.mkdir(mode=0o700)
    yield path
    shutil.rmtree(path)


def spec(root: Path) -> SandboxSpec:
    return SandboxSpec(sandbox_id=f"sb-{uuid.uuid4().hex[:8]}", image=IMAGE, workspace=root,
                       max_pids=128, tmp_size_bytes=64 * MIB)


@pytest.fixture
async def materialize(backend: ProcessBackend) -> AsyncIterator[object]:
    live: list[ProcessSandbox] = []

    async def make(root: Path) -> ProcessSandbox:
        sandbox = await backend.materialize(spec(root))
        live.append(sandbox)
        return sandbox

    yield make
    for sandbox in live:
        await sandbox.destroy()


async def sh(sandbox: ProcessSandbox, command: str, user: str | None = None) -> str:
    result = await sandbox.exec(command, timeout_s=120, io=ExecIO(user=user))
    assert result.exit_code == 0, result.output
    return result.output


def build_deb(where: Path) -> Path:
    """A tiny architecture-independent package installing /usr/share/tenon-probe/hello."""
    tree = where / "tenon-probe"
    (tree / "DEBIAN").mkdir(parents=True)
    (tree / "DEBIAN" / "control").write_text(
        "Package: tenon-probe\nVersion: 1.0\nArchitecture: all\n"
        "Maintainer: Tenon tests <tests@example.invalid>\nDescription: probe\n")
    (tree / "usr" / "share" / "tenon-probe").mkdir(parents=True)
    (tree / "usr" / "share" / "tenon-probe" / "hello").write_text("hello from a deb\n")
    deb = where / "tenon-probe_1.0_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(tree), str(deb)],
                   check=True, capture_output=True)
    shutil.rmtree(tree)
    return deb


def build_wheel(where: Path) -> Path:
    """A pure-Python wheel with one module, `tenon_probe`."""
    files = {"tenon_probe.py": b"ANSWER = 42\n",
             "tenon_probe-1.0.dist-info/METADATA":
                 b"Metadata-Version: 2.1\nName: tenon-probe\nVersion: 1.0\n",
             "tenon_probe-1.0.dist-info/WHEEL":
                 b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
                 b"Tag: py3-none-any\n"}
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append("tenon_probe-1.0.dist-info/RECORD,,")
    wheel = where / "tenon_probe-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr("tenon_probe-1.0.dist-info/RECORD", "\n".join(record) + "\n")
    return wheel


async def test_roots_installs_and_edits_survive_a_rebuild(materialize, root):
    if shutil.which("dpkg-deb") is None:
        pytest.skip("dpkg-deb is missing (apt-get install dpkg)")
    first = await materialize(root)
    await sh(first, "true")  # the persistent directories exist now
    staged = root / "workspace"
    for built in (build_deb(staged), build_wheel(staged)):
        os.chown(built, 1000, 1000)
    await sh(first, "apt-get install -y /workspace/tenon-probe_1.0_all.deb",
             user="root")
    await sh(first, "pip install --no-index --break-system-packages "
                    "/workspace/tenon_probe-1.0-py3-none-any.whl", user="root")
    await sh(first, "echo '10.1.2.3 tenon-probe.internal' >> /etc/hosts; "
                    "mkdir -p /testbed && echo patched > /testbed/module.py", user="root")
    await first.destroy()

    again = await materialize(root)
    check = await sh(again, "cat /usr/share/tenon-probe/hello; dpkg -s tenon-probe | "
                            "grep Status; python3 -c 'import tenon_probe; "
                            "print(tenon_probe.ANSWER, tenon_probe.__file__)'; "
                            "grep tenon-probe.internal /etc/hosts; cat /testbed/module.py")
    assert check.splitlines() == [
        "hello from a deb", "Status: install ok installed",
        "42 /usr/local/lib/python3.11/dist-packages/tenon_probe.py",
        "10.1.2.3 tenon-probe.internal", "patched"]
    # all of it in the agent's upper layer, in canonical ids; nothing in the shared image
    upper = root / "upper"
    assert (upper / "usr/share/tenon-probe/hello").stat().st_uid == 0
    assert (upper / "etc/hosts").is_file()
    rootfs = image_rootfs(IMAGE, STATE_DIR)
    assert not (rootfs / "usr/share/tenon-probe").exists()
    image_hosts = rootfs / "etc/hosts"
    assert not image_hosts.exists() or "tenon-probe" not in image_hosts.read_text()


async def test_apt_can_hand_files_to_its_own_user(materialize, root):
    sandbox = await materialize(root)
    # what apt does before a download: chown a partial directory to _apt (uid 42)
    out = await sh(sandbox, "mkdir -p /var/cache/probe && chown _apt:root /var/cache/probe && "
                            "stat -c '%U %u' /var/cache/probe", user="root")
    assert out.split() == ["_apt", "42"]
    assert (root / "upper/var/cache/probe").stat().st_uid == 42  # canonical on disk


async def test_the_default_user_is_unprivileged(materialize, root):
    sandbox = await materialize(root)
    out = await sandbox.exec("id -u; id -g; echo $HOME; touch /etc/x 2>&1; "
                             "grep CapEff /proc/self/status", timeout_s=10)
    lines = out.output.splitlines()
    assert lines[:3] == ["1000", "1000", "/home/user"]
    assert "Permission denied" in lines[3]
    assert lines[4].split() == ["CapEff:", "0000000000000000"]
    root_caps = await sh(sandbox, "id -u; echo $HOME; grep CapEff /proc/self/status",
                         user="root")
    assert root_caps.split() == ["0", "/root", "CapEff:", "00000000a80425fb"]  # Docker's set


async def test_an_unknown_user_is_a_clear_error(materialize, root):
    sandbox = await materialize(root)
    failed = await sandbox.exec("echo ran", timeout_s=10, io=ExecIO(user="nobody-here"))
    assert failed.exit_code == 126  # as `docker exec -u`: the command fails, nothing ran
    assert failed.output.startswith("unknown user 'nobody-here'")
    await sh(sandbox, "useradd -u 2000 -m builder", user="root")
    out = await sh(sandbox, "id -u; echo $HOME", user="builder")  # the sandbox's own passwd
    assert out.split() == ["2000", "/home/builder"]
