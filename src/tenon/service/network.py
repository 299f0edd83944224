"""E2B's outbound network fields of a sandbox create, as a `NetworkPolicy`.

`allow_internet_access` and `network` {`allowOut`, `denyOut`} keep E2B's meaning
(`sandbox.netpolicy`), with one difference: a create that names neither gets no network, as
every Tenon sandbox (E2B's default is internet access on). The `network` fields Tenon cannot
honour (an egress proxy, per-host transforms, a host mask, DNS servers of the caller's
choice) are refused with a 400 naming the field, never ignored.
"""

from __future__ import annotations

from typing import Any

from e2b.api.client.types import Unset

from tenon.sandbox.netpolicy import NetworkPolicy, NetworkRuleError
from tenon.service.errors import BadRequest

# SandboxNetworkConfig attribute -> its name on the wire, for the refusals.
_REFUSED = {"egress_proxy": "egressProxy", "rules": "rules", "mask_request_host":
            "maskRequestHost", "dns_servers": "dnsServers"}


def _given(value: Any) -> bool:
    return not isinstance(value, Unset) and value is not None


def policy_of(allow_internet_access: Any, network: Any) -> NetworkPolicy | None:
    """The policy a create asks for; None when it names neither field (the server's
    default applies). BadRequest for fields or rules Tenon cannot honour."""
    if not _given(allow_internet_access) and not _given(network):
        return None
    allow_out: list[str] = []
    deny_out: list[str] = []
    if _given(network):
        for attr, wire in _REFUSED.items():
            if _given(getattr(network, attr, None)):
                raise BadRequest(f"network.{wire} is not supported by tenon serve "
                                 f"(allowOut and denyOut are)")
        allow_out = list(network.allow_out) if _given(network.allow_out) else []
        deny_out = list(network.deny_out) if _given(network.deny_out) else []
    try:
        return NetworkPolicy(
            allow_internet_access=(allow_internet_access if _given(allow_internet_access)
                                   else False),
            allow_out=tuple(allow_out), deny_out=tuple(deny_out))
    except NetworkRuleError as exc:
        raise BadRequest(str(exc)) from None
