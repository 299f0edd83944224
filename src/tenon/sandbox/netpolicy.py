"""What a sandbox may reach on the network: a pure, validated policy (no I/O).

Semantics follow E2B's `allow_internet_access` and `network` {`allow_out`, `deny_out`}:

- No network unless asked: `NetworkPolicy()` reaches nothing but the sandbox's own loopback.
- `allow_internet_access=True` gives outbound connections to every public address.
  `False` is the same as `deny_out=["0.0.0.0/0"]` (`ALL_TRAFFIC`).
- `allow_out` entries (IPv4 addresses, CIDRs, hostnames) always win over `deny_out` entries
  (addresses and CIDRs only). A destination in neither list is allowed when internet access is.
- The host's loopback and private networks (`PRIVATE_NETS`: the host's LAN, its Docker
  bridges, link-local metadata services) are denied unless an `allow_out` entry names them.
- A hostname is resolved (IPv4) when the sandbox starts, and its addresses are allowed on every
  port for the sandbox's lifetime; it is not matched by TLS SNI or HTTP Host. A name behind a
  CDN therefore opens the CDN addresses it resolved to. Hostnames need the rest denied
  (internet access off, or `ALL_TRAFFIC` in `deny_out`), as in E2B; then DNS to the sandbox's
  resolver is allowed too, and only then (or with internet access on).

Refused with a one-line `NetworkRuleError`, never ignored: wildcard or malformed hostnames, a
hostname in `deny_out`, IPv6 entries (sandbox networks are IPv4 only), ports and port ranges,
invalid CIDRs, and hostnames while all other traffic is allowed.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tenon.errors import ConfigError

ALL_TRAFFIC = "0.0.0.0/0"
# Denied unless an allow_out entry names them: the host's networks, not the internet.
PRIVATE_NETS = ("0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
                "172.16.0.0/12", "192.168.0.0/16", "224.0.0.0/3")
_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")
_MAX_ENTRIES = 256


class NetworkRuleError(ConfigError):
    """A network rule Tenon cannot honour (malformed, or a kind it cannot enforce)."""


def _network(entry: str, field: str) -> ipaddress.IPv4Network | None:
    """The entry as an IPv4 network, None if it is no address at all (a hostname)."""
    if ":" in entry:
        what = "ports are" if re.fullmatch(r"[^:]+:[0-9-]+", entry) else "IPv6 is"
        raise NetworkRuleError(f"{field} entry {entry!r}: {what} not supported "
                               f"(IPv4 addresses, CIDRs and hostnames only)")
    if not re.fullmatch(r"[0-9./]+", entry):
        return None
    try:
        return ipaddress.IPv4Network(entry, strict=True)
    except ValueError as exc:
        raise NetworkRuleError(f"{field} entry {entry!r} is not a valid IPv4 address or "
                               f"CIDR: {exc}") from None


def _hostname(entry: str, field: str) -> str:
    name = entry.lower().rstrip(".")
    if field == "deny_out":
        raise NetworkRuleError(f"deny_out entry {entry!r}: only addresses and CIDRs can be "
                               f"denied, not hostnames")
    if "*" in name:
        raise NetworkRuleError(f"allow_out entry {entry!r}: wildcard hostnames are not "
                               f"supported (names are resolved when the sandbox starts)")
    if len(name) > 253 or "." not in name or not all(_LABEL.match(p) for p in name.split(".")):
        raise NetworkRuleError(f"{field} entry {entry!r} is neither an IPv4 address, a CIDR "
                               f"nor a valid hostname")
    return name


def _entries(values: Iterable[Any], field: str) -> tuple[str, ...]:
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise NetworkRuleError(f"{field} must be a list of strings, got {values!r}")
    entries = tuple(values)
    if len(entries) > _MAX_ENTRIES:
        raise NetworkRuleError(f"{field} has {len(entries)} entries; at most {_MAX_ENTRIES}")
    bad = [e for e in entries if not isinstance(e, str) or not e.strip()]
    if bad:
        raise NetworkRuleError(f"{field} entries must be non-empty strings, got {bad[0]!r}")
    return tuple(e.strip() for e in entries)


@dataclass(frozen=True)
class NetworkPolicy:
    """Validated outbound rules of one sandbox; the default reaches nothing."""

    allow_internet_access: bool = False
    allow_out: tuple[str, ...] = ()
    deny_out: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.allow_internet_access, bool):
            raise NetworkRuleError(f"allow_internet_access must be true or false, got "
                                   f"{self.allow_internet_access!r}")
        allow, deny = _entries(self.allow_out, "allow_out"), _entries(self.deny_out, "deny_out")
        object.__setattr__(self, "allow_out", allow)
        object.__setattr__(self, "deny_out", deny)
        for entry in deny:
            if _network(entry, "deny_out") is None:
                _hostname(entry, "deny_out")
        for entry in allow:
            if _network(entry, "allow_out") is None:
                _hostname(entry, "allow_out")
        if self.hostnames and not self.denies_by_default:
            raise NetworkRuleError(
                f"allow_out names hostnames ({', '.join(self.hostnames)}) while all other "
                f"traffic is allowed: add {ALL_TRAFFIC} to deny_out or turn internet access off")

    @classmethod
    def from_value(cls, value: object) -> NetworkPolicy:
        """From a spec or record value: a policy, a bool (internet on or off) or a mapping
        with the field names (`from_dict`)."""
        if isinstance(value, NetworkPolicy):
            return value
        if isinstance(value, bool):
            return cls(allow_internet_access=value)
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        raise NetworkRuleError(f"network must be true, false or a mapping of rules, "
                               f"got {value!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NetworkPolicy:
        known = {"allow_internet_access", "allow_out", "deny_out"}
        unknown = set(data) - known
        if unknown:
            raise NetworkRuleError(f"unknown network fields {sorted(unknown)}; "
                                   f"known: {sorted(known)}")
        return cls(allow_internet_access=data.get("allow_internet_access", False),
                   allow_out=tuple(data.get("allow_out") or ()),
                   deny_out=tuple(data.get("deny_out") or ()))

    def to_dict(self) -> dict[str, Any]:
        return {"allow_internet_access": self.allow_internet_access,
                "allow_out": list(self.allow_out), "deny_out": list(self.deny_out)}

    def __bool__(self) -> bool:
        """Whether the sandbox needs a network at all (some destination may be reached)."""
        return self.allow_internet_access or bool(self.allow_out)

    @property
    def denies_by_default(self) -> bool:
        """A destination named in no list is denied."""
        return not self.allow_internet_access or ALL_TRAFFIC in self.deny_out

    @property
    def hostnames(self) -> tuple[str, ...]:
        return tuple(_hostname(e, "allow_out") for e in self.allow_out
                     if _network(e, "allow_out") is None)

    @property
    def allowed_networks(self) -> tuple[ipaddress.IPv4Network, ...]:
        return tuple(n for e in self.allow_out if (n := _network(e, "allow_out")) is not None)

    @property
    def denied_networks(self) -> tuple[ipaddress.IPv4Network, ...]:
        return tuple(n for e in self.deny_out if (n := _network(e, "deny_out")) is not None)

    @property
    def needs_dns(self) -> bool:
        """Whether the sandbox may query its resolver: only for names it may reach."""
        return bool(self.hostnames) or not self.denies_by_default


@dataclass(frozen=True)
class ResolvedRules:
    """A policy with its hostnames resolved: what the packet filter enforces, in order."""

    allow: tuple[ipaddress.IPv4Network, ...]  # allow_out entries and resolved names: first
    deny: tuple[ipaddress.IPv4Network, ...]  # deny_out entries and the private networks
    default_accept: bool  # for a destination in neither list
    dns_servers: tuple[str, ...]  # the sandbox's resolvers
    dns_needed: bool  # whether the resolvers may be queried (else they are rejected)


def resolve_rules(policy: NetworkPolicy, addresses: Mapping[str, Iterable[str]],
                  dns_servers: Iterable[str]) -> ResolvedRules:
    """The filter rules of `policy`, with `addresses` (hostname -> IPv4 addresses resolved
    at sandbox start); a name without an address is refused."""
    resolved: list[ipaddress.IPv4Network] = []
    for name in policy.hostnames:
        found = [ipaddress.IPv4Network(a) for a in addresses.get(name, ())]
        if not found:
            raise NetworkRuleError(f"allow_out hostname {name!r} resolved to no IPv4 address")
        resolved.extend(found)
    deny = (*policy.denied_networks, *(ipaddress.IPv4Network(n) for n in PRIVATE_NETS))
    return ResolvedRules(allow=tuple(dict.fromkeys((*policy.allowed_networks, *resolved))),
                         deny=tuple(dict.fromkeys(deny)),
                         default_accept=not policy.denies_by_default,
                         dns_servers=tuple(dns_servers), dns_needed=policy.needs_dns)
