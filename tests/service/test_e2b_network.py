"""E2B's network options through the official SDK against `tenon serve`: `pip install`
from PyPI with `allow_out` naming only its hosts and `deny_out` ALL_TRAFFIC, everything else
refused; no network unless asked; rules Tenon cannot honour refused with a 400."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
from e2b import ALL_TRAFFIC, Sandbox, SandboxException
from e2b.sandbox.commands.command_handle import CommandExitException

from tenon.service.testing import ServerHandle, running_server

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

PYPI_ONLY = {"allow_out": ["pypi.org", "files.pythonhosted.org"], "deny_out": [ALL_TRAFFIC]}
PIP = ("python3 -m venv /tmp/venv && /tmp/venv/bin/pip install -q --no-cache-dir "
       "--disable-pip-version-check iniconfig==2.0.0 && /tmp/venv/bin/python -c "
       "'import iniconfig; print(\"imported\")'")
PROBE = ("python3 -c \"import socket\ntry:\n socket.create_connection(('203.0.113.7', 443), 5)"
         "\n print('connected')\nexcept OSError as e: print('refused', e)\"")


@pytest.fixture(scope="module", params=["process", pytest.param("docker",
                                                                 marks=pytest.mark.docker)])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerHandle]:
    state: Path = tmp_path_factory.mktemp(f"serve-net-{request.param}") / "state"
    with running_server(state, budget="2GiB", backend=request.param) as handle:
        yield handle


def test_pip_installs_through_rules_naming_only_pypi(server: ServerHandle) -> None:
    with mock.patch.dict(os.environ, server.env()):
        sandbox = Sandbox.create(network=PYPI_ONLY)
        try:
            installed = sandbox.commands.run(PIP, timeout=240)
            assert "imported" in installed.stdout
            probe = sandbox.commands.run(PROBE, timeout=30)
            assert probe.stdout.startswith("refused"), probe.stdout
        finally:
            sandbox.kill()


def test_no_network_unless_asked(server: ServerHandle) -> None:
    with mock.patch.dict(os.environ, server.env()):
        sandbox = Sandbox.create()
        try:
            with pytest.raises(CommandExitException):
                sandbox.commands.run("getent hosts pypi.org", timeout=30)
            probe = sandbox.commands.run(PROBE, timeout=30)
            assert probe.stdout.startswith("refused"), probe.stdout
        finally:
            sandbox.kill()


@pytest.mark.parametrize(("network", "message"), [
    ({"allow_out": ["*.pypi.org"], "deny_out": [ALL_TRAFFIC]}, "wildcard"),
    ({"deny_out": ["pypi.org"]}, "not hostnames"),
    ({"allow_out": ["10.0.0.1:22"]}, "ports are not supported"),
])
def test_rules_tenon_cannot_honour_are_refused(server: ServerHandle, network: dict[str, list[str]],
                                               message: str) -> None:
    with mock.patch.dict(os.environ, server.env()), \
            pytest.raises(SandboxException, match=f"400: .*{message}"):
        Sandbox.create(network=network)  # type: ignore[arg-type]
