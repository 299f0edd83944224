"""`commands.run(user=...)` of the official e2b SDK against `tenon serve` on the process
backend: the SDK's Authorization header picks who the command runs as inside the sandbox."""

from __future__ import annotations

import os
from collections.abc import Iterator

import e2b_scenarios as scenarios
import pytest
from e2b import CommandExitException

from tenon.service.envd_process import basic_auth_user
from tenon.service.testing import ServerHandle, running_server

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    state = tmp_path_factory.mktemp("serve-user") / "state"
    with running_server(state, budget="2GiB", backend="process") as handle:
        saved = {key: os.environ.get(key) for key in handle.env()}
        os.environ.update(handle.env())
        try:
            yield handle
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def test_commands_run_as_the_user_the_sdk_names(server: ServerHandle) -> None:
    with scenarios.sandbox() as sbx:
        assert sbx.commands.run("id -u").stdout == "1000\n"  # the SDK's default: "user"
        assert sbx.commands.run("id -u; echo $HOME", user="root").stdout == "0\n/root\n"
        sbx.commands.run("echo '10.9.9.9 probe' >> /etc/hosts", user="root")
        assert "probe" in sbx.commands.run("cat /etc/hosts").stdout
        with pytest.raises(CommandExitException):
            sbx.commands.run("touch /etc/x", user="user")
        with pytest.raises(CommandExitException) as unknown:
            sbx.commands.run("true", user="nobody-here")  # type: ignore[arg-type]
        assert unknown.value.exit_code == 126
        assert "unknown user 'nobody-here'" in unknown.value.stderr
        assert sbx.commands.run("echo fine").stdout == "fine\n"  # the sandbox is unharmed


@pytest.mark.parametrize(("header", "user"), [(None, None), ("Basic cm9vdDo=", "root"),
                                              ("basic dXNlcjo=", "user"), ("Basic Og==", None)])
def test_the_basic_authorization_header_names_the_user(header: str | None,
                                                       user: str | None) -> None:
    assert basic_auth_user(header) == user


@pytest.mark.parametrize("header", ["Bearer abc", "Basic !!!", "Basic //79"])
def test_a_malformed_authorization_header_is_refused(header: str) -> None:
    from connectrpc.errors import ConnectError

    with pytest.raises(ConnectError, match="Basic base64"):
        basic_auth_user(header)
