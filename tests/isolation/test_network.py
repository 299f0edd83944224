"""Network rules of process-backend sandboxes, enforced by nftables in the sandbox's network
namespace: PyPI through rules naming only its hosts, everything else refused, rules that
root of the sandbox's user namespace cannot flush, and both /dev/net/tun modes."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tenon.sandbox.netpolicy import ALL_TRAFFIC, NetworkPolicy, NetworkRuleError
from tenon.sandbox.process import ProcessSandbox

pytestmark = [pytest.mark.sandbox, pytest.mark.cgroups]

PYPI_HOSTS = ("pypi.org", "files.pythonhosted.org")
PYPI_ONLY = NetworkPolicy(allow_out=PYPI_HOSTS)
# A public address no rule names (TEST-NET-3), the slirp gateway (the host) and the host's LAN.
ELSEWHERE = (("203.0.113.7", 443), ("10.0.2.2", 22), ("192.168.1.1", 80), ("1.1.1.1", 443))
PIP_INSTALL = ("python3 -m venv /tmp/venv && /tmp/venv/bin/pip install --no-cache-dir "
               "--disable-pip-version-check -q iniconfig==2.0.0 && "
               "/tmp/venv/bin/python -c 'import iniconfig; print(\"imported\", "
               "iniconfig.__name__)'")


def connect_script(*targets: tuple[str, int]) -> str:
    """An action printing "host:port connected" or "host:port refused <error>" per target."""
    lines = ["import socket"]
    for host, port in targets:
        lines += [
            "s = socket.socket(); s.settimeout(5)",
            f"try:\n s.connect(('{host}', {port})); print('{host}:{port} connected')\n"
            f"except OSError as e: print('{host}:{port} refused', e)",
        ]
    return "python3 -c \"" + "\n".join(lines) + "\""


async def test_pip_installs_from_pypi_with_rules_naming_only_its_hosts(sandboxes):
    sandbox: ProcessSandbox = await sandboxes("pip", network=PYPI_ONLY)
    installed = await sandbox.exec(PIP_INSTALL, timeout_s=180)
    assert installed.exit_code == 0, installed.output
    assert "imported iniconfig" in installed.output
    probe = await sandbox.exec(connect_script(*ELSEWHERE), timeout_s=60)
    lines = probe.output.splitlines()
    assert [line.split()[1] for line in lines] == ["refused"] * len(ELSEWHERE), probe.output
    assert all("Connection refused" in line for line in lines), probe.output


async def test_without_network_nothing_but_loopback_is_reachable(sandboxes):
    sandbox = await sandboxes("none")
    probe = await sandbox.exec(connect_script(("203.0.113.7", 443)), timeout_s=30)
    assert "refused" in probe.output, probe.output
    assert "unreachable" in probe.output, probe.output
    lookup = await sandbox.exec("getent hosts pypi.org || echo no-name", timeout_s=30)
    assert lookup.output.strip() == "no-name"


async def test_ip_rules_deny_dns_when_no_hostname_is_allowed(sandboxes):
    sandbox = await sandboxes("ips", network=NetworkPolicy(allow_out=("203.0.113.0/24",)))
    lookup = await sandbox.exec("getent hosts pypi.org || echo no-name", timeout_s=30)
    assert lookup.output.strip() == "no-name"
    probe = await sandbox.exec(connect_script(("198.51.100.9", 443)), timeout_s=30)
    assert "198.51.100.9:443 refused [Errno 111]" in probe.output, probe.output


def nft(pid: int, *args: str, user_ns: bool = False) -> subprocess.CompletedProcess[str]:
    """nft in the network namespace of `pid`; with `user_ns`, from inside the sandbox's user
    namespace with every capability there (what root inside could ever hold)."""
    enter = ["nsenter", "-t", str(pid), "-n"]
    if user_ns:
        enter += ["-U", "--preserve-credentials"]
    return subprocess.run([*enter, "--", "nft", *args], capture_output=True, text=True,
                          check=False)


async def test_root_of_the_sandbox_user_namespace_cannot_change_the_rules(sandboxes):
    sandbox = await sandboxes("locked", network=PYPI_ONLY)
    pid = sandbox.child_pid
    before = nft(pid, "list", "table", "inet", "tenon")
    assert before.returncode == 0, before.stderr
    assert "policy drop" in before.stdout
    for attempt in (("flush", "ruleset"), ("delete", "table", "inet", "tenon")):
        tried = nft(pid, *attempt, user_ns=True)
        assert tried.returncode != 0
        assert "Operation not permitted" in tried.stderr, tried.stderr
    assert nft(pid, "list", "table", "inet", "tenon").stdout == before.stdout
    probe = await sandbox.exec(connect_script(("203.0.113.7", 443)), timeout_s=30)
    assert "refused" in probe.output


async def test_slirp4netns_runs_confined_once_connected(sandboxes):
    """Root on the host, but in a mount namespace of its own with no capability except
    CAP_NET_BIND_SERVICE (which slirp4netns keeps for port forwarding; none is set up) and
    under its seccomp filter."""
    sandbox = await sandboxes("caps", network=NetworkPolicy(allow_internet_access=True))
    assert sandbox._usernet is not None
    pid = sandbox._usernet.pid
    status = await asyncio.to_thread(Path(f"/proc/{pid}/status").read_text)
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    assert fields["CapEff"].strip() == f"{1 << 10:016x}"  # CAP_NET_BIND_SERVICE alone
    assert fields["CapBnd"].strip() == f"{1 << 10:016x}"
    assert fields["Seccomp"].strip() == "2"
    assert os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")


async def test_a_hostname_that_does_not_resolve_fails_the_start_cleanly(process_backend,
                                                                         sandboxes):
    held_before = process_backend.ids.held()
    policy = NetworkPolicy(allow_out=("no-such-host.invalid",), deny_out=(ALL_TRAFFIC,))
    with pytest.raises(NetworkRuleError, match="no-such-host.invalid"):
        await sandboxes("unresolved", network=policy)
    assert await asyncio.to_thread(sandbox_cgroups, process_backend.domain.name) == []
    assert process_backend.ids.held() == held_before  # its id range went back


def sandbox_cgroups(domain: str) -> list[Path]:
    root = Path("/sys/fs/cgroup")
    return [*root.glob(f"*/{domain}/*/"), *root.glob(f"{domain}/*/")]


_TUN_CHILD = textwrap.dedent("""
    import asyncio, json, shutil, sys, uuid
    from pathlib import Path
    from tenon.host.domain import WorkloadDomain
    from tenon.sandbox.base import SandboxSpec
    from tenon.sandbox.netpolicy import NetworkPolicy
    from tenon.sandbox.process import ProcessBackend

    async def main():
        domain = WorkloadDomain.open(f"tenon-test-{uuid.uuid4().hex[:8]}")
        root = Path(sys.argv[1])
        sandbox = None
        try:
            backend = ProcessBackend(domain, state_dir=Path("/var/lib/tenon"))
            spec = SandboxSpec(sandbox_id=f"tun-{uuid.uuid4().hex[:8]}",
                               image="tenon-base:bookworm", workspace=root,
                               network=NetworkPolicy(allow_out=tuple(sys.argv[2:])))
            sandbox = await backend.materialize(spec)
            result = await sandbox.exec(sys.stdin.read(), timeout_s=60)
            print(json.dumps({"exit": result.exit_code, "output": result.output}))
        finally:
            if sandbox is not None:
                await sandbox.destroy()
            domain.remove()

    asyncio.run(main())
""")


@pytest.mark.parametrize("mode", [0o600, 0o666], ids=["tun-0600", "tun-0666"])
def test_both_tun_device_modes_connect(process_backend, roots, mode):
    """The sandbox and its slirp4netns run in a private mount namespace whose /dev/net/tun
    is a copy of the node with `mode` (the host's own mode is one of the two)."""
    if shutil.which("unshare") is None or shutil.which("mknod") is None:
        pytest.skip("unshare and mknod are needed (util-linux, coreutils)")
    root = roots / "tun"
    root.mkdir()
    setup = ("set -e; d=$(mktemp -d); mount -t tmpfs tenon-tun \"$d\"; "
             "mknod \"$d/tun\" c 10 200; chmod " + f"{mode:o}" + " \"$d/tun\"; "
             "mount --bind \"$d/tun\" /dev/net/tun; stat -c %a /dev/net/tun >&2; "
             "exec \"$@\"")
    probe = connect_script(("pypi.org", 443), ("203.0.113.7", 443))
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", setup, "tun",
         sys.executable, "-c", _TUN_CHILD, str(root), "pypi.org"],
        input=probe, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.splitlines()[0] == f"{mode:o}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    lines = result["output"].splitlines()
    assert lines[0] == "pypi.org:443 connected", result
    assert lines[1].startswith("203.0.113.7:443 refused"), result
