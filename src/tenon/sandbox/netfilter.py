"""Enforce a `NetworkPolicy` with nftables inside a sandbox's network namespace.

The rules go into the sandbox's own network namespace from the host (`nsenter -t PID -n nft
-f -`) before its first command runs. That namespace is owned by the host's initial user
namespace (the process backend creates it as root before bubblewrap starts; Docker creates
its containers' as root), so nothing inside the sandbox, not even root of the sandbox's own
user namespace, holds CAP_NET_ADMIN over it: the rules cannot be flushed from inside.

One table, `inet tenon`, one output chain (policy drop), in this order: DNS to the sandbox's
resolver (accepted when the policy needs names, rejected otherwise), the sandbox's own
loopback, IPv6 rejected, the allow list, the deny list (with the host's private networks),
then the default. Denied TCP connections get a reset (ECONNREFUSED at once), other traffic
an ICMP "administratively prohibited".
"""

from __future__ import annotations

import contextlib
import ipaddress
import shutil
import socket
import subprocess
from collections.abc import Iterable

from tenon.errors import BackendUnavailable, SandboxError
from tenon.sandbox.netpolicy import NetworkPolicy, NetworkRuleError, ResolvedRules, resolve_rules

TABLE = "tenon"
APPLY_TIMEOUT_S = 10.0
_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}


def nft_path() -> str:
    """The host's nft binary; BackendUnavailable naming the package when it is missing."""
    found = shutil.which("nft", path=_ENV["PATH"])
    if found is None:
        raise BackendUnavailable("nft is missing (sandboxes with network rules need it); "
                                 "run: apt-get install nftables")
    return found


def _set(networks: Iterable[ipaddress.IPv4Network]) -> str:
    return "{ " + ", ".join(str(n) for n in networks) + " }"


def render(rules: ResolvedRules) -> str:
    """The nft script for `rules` (replaces any earlier `inet tenon` table atomically)."""
    reject = ("meta l4proto tcp reject with tcp reset", "reject with icmpx type admin-prohibited")
    lines = ["type filter hook output priority 0; policy drop;"]
    if rules.dns_servers:
        verdict = "accept" if rules.dns_needed else reject[1]
        lines.append(f"ip daddr {{ {', '.join(rules.dns_servers)} }} {verdict}")
    lines += ['oif "lo" accept', "meta nfproto ipv6 " + reject[1]]
    if rules.allow:
        lines.append(f"ip daddr {_set(rules.allow)} accept")
    if rules.deny:
        lines += [f"ip daddr {_set(rules.deny)} {r}" for r in reject]
    lines += ["accept"] if rules.default_accept else list(reject)
    body = "\n".join(f"        {line}" for line in lines)
    return (f"table inet {TABLE}\ndelete table inet {TABLE}\n"
            f"table inet {TABLE} {{\n    chain output {{\n{body}\n    }}\n}}\n")


def host_nameservers(resolv_conf: str = "/etc/resolv.conf") -> tuple[str, ...]:
    """The host's IPv4 nameservers other than loopback ones: where Docker's resolver, which
    runs in the container's network namespace, forwards a container's queries."""
    try:
        with open(resolv_conf) as f:
            words = [line.split() for line in f]
    except OSError:
        return ()
    found = []
    for parts in words:
        if len(parts) >= 2 and parts[0] == "nameserver":
            with contextlib.suppress(ValueError):
                address = ipaddress.IPv4Address(parts[1])
                if not address.is_loopback:
                    found.append(str(address))
    return tuple(found)


def resolve(policy: NetworkPolicy, dns_servers: Iterable[str]) -> ResolvedRules:
    """Resolve the policy's hostnames (IPv4, with the host's resolver) into its rules."""
    addresses: dict[str, list[str]] = {}
    for name in policy.hostnames:
        try:
            infos = socket.getaddrinfo(name, None, family=socket.AF_INET,
                                       type=socket.SOCK_STREAM)
        except OSError as exc:
            raise NetworkRuleError(f"allow_out hostname {name!r} could not be resolved: "
                                   f"{exc}") from None
        addresses[name] = sorted({str(info[4][0]) for info in infos})
    return resolve_rules(policy, addresses, dns_servers)


def apply(nsenter: str, pid: int, rules: ResolvedRules) -> None:
    """Load `rules` into the network namespace of `pid`; SandboxError with nft's message."""
    try:
        done = subprocess.run([nsenter, "-t", str(pid), "-n", "--", nft_path(), "-f", "-"],
                              input=render(rules).encode(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env=_ENV, timeout=APPLY_TIMEOUT_S,
                              check=False)
    except subprocess.TimeoutExpired:
        raise SandboxError(f"loading the network rules into pid {pid}'s network namespace "
                           f"took over {APPLY_TIMEOUT_S} s") from None
    if done.returncode != 0:
        message = " ".join(done.stdout.decode(errors="replace").split())[:500]
        raise SandboxError(f"could not load the network rules into pid {pid}'s network "
                           f"namespace (nft exit code {done.returncode}): {message}")


def enforce(nsenter: str, pid: int, policy: NetworkPolicy,
            dns_servers: Iterable[str]) -> ResolvedRules:
    """Resolve and load `policy` for the network namespace of `pid` (blocking: from async
    code, run it in a thread); the rules loaded."""
    rules = resolve(policy, dns_servers)
    apply(nsenter, pid, rules)
    return rules
