"""NetworkPolicy: E2B semantics, refusals with one-line reasons, and the nft rules it renders
(pure: no network namespace needed)."""

from __future__ import annotations

import ipaddress

import pytest

from tenon.sandbox.base import SandboxSpec
from tenon.sandbox.netfilter import render
from tenon.sandbox.netpolicy import (
    ALL_TRAFFIC,
    PRIVATE_NETS,
    NetworkPolicy,
    NetworkRuleError,
    resolve_rules,
)


def net(text: str) -> ipaddress.IPv4Network:
    return ipaddress.IPv4Network(text)


def test_the_default_reaches_nothing():
    policy = NetworkPolicy()
    assert not policy
    rules = resolve_rules(policy, {}, ("10.0.2.3",))
    assert rules.allow == ()
    assert not rules.default_accept
    assert not rules.dns_needed


def test_internet_access_allows_public_addresses_but_not_the_hosts_networks():
    rules = resolve_rules(NetworkPolicy(allow_internet_access=True), {}, ("10.0.2.3",))
    assert rules.default_accept
    assert rules.dns_needed
    assert {str(n) for n in rules.deny} == set(PRIVATE_NETS)


def test_allow_out_wins_over_deny_out_and_over_the_private_networks():
    policy = NetworkPolicy(allow_internet_access=True, allow_out=("192.168.7.0/24", "8.8.8.8"),
                           deny_out=("8.8.8.0/24",))
    rules = resolve_rules(policy, {}, ())
    assert rules.allow == (net("192.168.7.0/24"), net("8.8.8.8/32"))
    assert rules.deny[0] == net("8.8.8.0/24")
    script = render(rules)
    # the allow rule comes before every deny rule in the chain
    assert script.index("192.168.7.0/24, 8.8.8.8/32 } accept") < script.index("8.8.8.0/24")


def test_hostnames_become_their_resolved_addresses_and_open_dns():
    policy = NetworkPolicy(allow_out=("PyPI.org.", "files.pythonhosted.org"))
    assert policy.hostnames == ("pypi.org", "files.pythonhosted.org")
    rules = resolve_rules(policy, {"pypi.org": ["151.101.0.223"],
                                   "files.pythonhosted.org": ["151.101.0.223", "1.2.3.4"]},
                          ("10.0.2.3",))
    assert rules.allow == (net("151.101.0.223/32"), net("1.2.3.4/32"))
    assert rules.dns_needed
    assert not rules.default_accept
    assert "ip daddr { 10.0.2.3 } accept" in render(rules)


def test_ip_rules_alone_reject_dns():
    rules = resolve_rules(NetworkPolicy(allow_out=("1.2.3.4",)), {}, ("10.0.2.3",))
    assert "ip daddr { 10.0.2.3 } reject" in render(rules)


def test_a_hostname_without_an_address_is_refused():
    with pytest.raises(NetworkRuleError, match="'pypi.org' resolved to no IPv4 address"):
        resolve_rules(NetworkPolicy(allow_out=("pypi.org",)), {"pypi.org": []}, ())


def test_internet_off_is_the_same_as_denying_all_traffic():
    off = NetworkPolicy(allow_out=("1.2.3.4",))
    deny_all = NetworkPolicy(allow_internet_access=True, allow_out=("1.2.3.4",),
                             deny_out=(ALL_TRAFFIC,))
    assert not resolve_rules(off, {}, ()).default_accept
    assert not resolve_rules(deny_all, {}, ()).default_accept
    assert resolve_rules(off, {}, ()).allow == resolve_rules(deny_all, {}, ()).allow


@pytest.mark.parametrize(("fields", "message"), [
    ({"allow_out": ("*.example.com",)}, "wildcard hostnames are not supported"),
    ({"deny_out": ("example.com",)}, "not hostnames"),
    ({"allow_out": ("1.2.3.4:443",)}, "ports are not supported"),
    ({"allow_out": ("1.2.3.4:1000-2000",)}, "ports are not supported"),
    ({"allow_out": ("2001:db8::/32",)}, "IPv6 is not supported"),
    ({"deny_out": ("10.0.0.1/8",)}, "has host bits set"),
    ({"allow_out": ("1.2.3.4/33",)}, "not a valid IPv4 address or CIDR"),
    ({"allow_out": ("999.1.1.1",)}, "not a valid IPv4 address or CIDR"),
    ({"allow_out": ("not a host",)}, "neither an IPv4 address, a CIDR nor a valid hostname"),
    ({"allow_out": ("",)}, "non-empty strings"),
    ({"allow_out": "pypi.org"}, "must be a list of strings"),
    ({"allow_internet_access": True, "allow_out": ("pypi.org",)},
     "add 0.0.0.0/0 to deny_out or turn internet access off"),
    ({"allow_internet_access": "yes"}, "must be true or false"),
])
def test_rules_tenon_cannot_honour_are_refused_in_one_line(fields, message):
    with pytest.raises(NetworkRuleError, match=message) as raised:
        NetworkPolicy(**fields)
    assert "\n" not in str(raised.value)


def test_a_spec_takes_a_bool_a_mapping_or_a_policy():
    def spec(network: object) -> SandboxSpec:
        return SandboxSpec(sandbox_id="s", image="i", workspace=".",  # type: ignore[arg-type]
                           network=network)  # type: ignore[arg-type]

    assert spec(False).network == NetworkPolicy()
    assert spec(True).network == NetworkPolicy(allow_internet_access=True)
    record = {"allow_internet_access": False, "allow_out": ["pypi.org"], "deny_out": []}
    assert spec(record).network == NetworkPolicy(allow_out=("pypi.org",))
    assert NetworkPolicy.from_value(spec(record).network.to_dict()) == spec(record).network
    with pytest.raises(NetworkRuleError, match="unknown network fields"):
        spec({"allowOut": ["pypi.org"]})
