"""The official e2b SDK's files API against `tenon serve`, outside the persistent
directories: paths go through the sandbox's live root (its writable overlay) as the user the
SDK names, on each backend. A root command's /etc file is readable, a root upload runs, the
default user is refused where the sandbox refuses it, planted symlinks stay in the sandbox,
and a paused (torn-down) sandbox is rebuilt for such a path with its files intact."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import e2b_scenarios as scenarios
import pytest
from e2b import NotFoundException, Sandbox, SandboxException

from tenon.service.testing import ServerHandle, running_server

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]


@pytest.fixture(scope="module", params=["process", pytest.param("docker",
                                                                 marks=pytest.mark.docker)])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerHandle]:
    state = tmp_path_factory.mktemp(f"serve-root-{request.param}") / "state"
    with running_server(state, budget="2GiB", backend=request.param) as handle:
        saved = {key: os.environ.get(key) for key in handle.env()}
        os.environ.update(handle.env())
        try:
            yield handle
            assert [s.sandbox_id for s in Sandbox.list().next_items()] == []
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def _events(server: ServerHandle, kind: str, sandbox_id: str) -> list[dict[str, object]]:
    lines = (server.state_dir / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines)
            if e["kind"] == kind and e.get("agent_id") == sandbox_id]


def test_a_file_root_wrote_by_command_is_read_and_listed(server: ServerHandle) -> None:
    with scenarios.sandbox() as sbx:
        sbx.commands.run("echo 'port = 8080' > /etc/app.conf", user="root")
        assert sbx.files.read("/etc/app.conf") == "port = 8080\n"
        entry = sbx.files.get_info("/etc/app.conf")
        assert (entry.owner, entry.group, entry.mode) == ("root", "root", 0o644)
        assert "app.conf" in [e.name for e in sbx.files.list("/etc")]
        assert "root:" in sbx.files.read("/etc/passwd")  # the image, through the overlay
        with pytest.raises(NotFoundException):
            sbx.files.read("/etc/no-such-file")


def test_root_uploads_a_tool_a_command_runs_and_the_user_writes_as_itself(
        server: ServerHandle) -> None:
    with scenarios.sandbox() as sbx:
        sbx.files.write("/opt/tools/tool.sh", "#!/bin/sh\necho tool-ran\n", user="root")
        out = sbx.commands.run("stat -c '%U %u %g %a' /opt/tools /opt/tools/tool.sh; "
                               "sh /opt/tools/tool.sh")
        assert out.stdout == "root 0 0 755\nroot 0 0 644\ntool-ran\n"
        # the default user writes where the sandbox lets it (/var/tmp is 1777), as itself
        sbx.files.write("/var/tmp/mine.txt", "mine")
        assert sbx.commands.run("stat -c '%u %g' /var/tmp/mine.txt").stdout == "1000 1000\n"
        assert sbx.files.get_info("/var/tmp/mine.txt").owner == "user"
        # and moves and removes there as the sandbox allows it
        sbx.files.rename("/var/tmp/mine.txt", "/var/tmp/moved.txt")
        sbx.files.remove("/var/tmp/moved.txt")
        assert sbx.commands.run("ls /var/tmp").stdout == ""


def test_the_default_user_is_refused_where_the_sandbox_refuses_it(server: ServerHandle) -> None:
    with scenarios.sandbox() as sbx:
        with pytest.raises(SandboxException, match="403|permission denied"):
            sbx.files.write("/etc/x", "x")
        with pytest.raises(SandboxException, match="permission denied"):
            sbx.files.make_dir("/opt/mine")
        with pytest.raises(SandboxException, match="403|permission denied"):
            sbx.files.read("/etc/shadow")  # 0640 root:shadow
        with pytest.raises(SandboxException, match="permission denied"):
            sbx.files.remove("/etc/passwd")
        # nothing was made or removed (a failing test raises CommandExitException)
        sbx.commands.run("test ! -e /etc/x && test ! -e /opt/mine && test -s /etc/passwd")
        shadow = sbx.commands.run("cat /etc/shadow", user="root").stdout
        assert sbx.files.read("/etc/shadow", user="root") == shadow
        with pytest.raises(SandboxException, match="unknown user"):
            sbx.files.read("/etc/hostname", user="nobody-here")  # type: ignore[arg-type]


def test_planted_symlinks_never_reach_a_host_file(server: ServerHandle) -> None:
    marker = Path(f"/var/tmp/tenon-host-marker-{secrets.token_hex(4)}")
    marker.write_text("host-secret")
    escape = Path(f"/etc/tenon-escape-{secrets.token_hex(4)}")
    try:
        with scenarios.sandbox() as sbx:
            sbx.commands.run(f"ln -s / /etc/rootlink; ln -s ../../../..{marker} /etc/marklink; "
                             "ln -s ../../../../etc/shadow /etc/shadowlink; "
                             "ln -s /proc/1/root /etc/proclink", user="root")
            for path in (f"/etc/rootlink{marker}", "/etc/marklink"):
                with pytest.raises(NotFoundException):
                    sbx.files.read(path, user="root")
            shadow = sbx.commands.run("cat /etc/shadow", user="root").stdout
            assert sbx.files.read("/etc/shadowlink", user="root") == shadow
            with pytest.raises(SandboxException):  # a magic link is not followed at all
                sbx.files.read("/etc/proclink/etc/hostname", user="root")
            # writing through them creates the sandbox's own files
            sbx.files.write("/etc/marklink", "pwned", user="root")
            sbx.files.write(f"/etc/rootlink{escape}", "x", user="root")
            assert sbx.commands.run(f"cat {marker} {escape}").stdout == "pwnedx"
            info = sbx.files.get_info("/etc/rootlink")
            assert (info.type.value, info.symlink_target) == ("symlink", "/")
        assert marker.read_text() == "host-secret"
        assert not escape.exists()
    finally:
        marker.unlink()
        escape.unlink(missing_ok=True)


def test_a_paused_sandbox_is_rebuilt_for_a_root_path_with_its_files(
        server: ServerHandle) -> None:
    with scenarios.sandbox() as sbx:
        sbx.commands.run("echo kept > /etc/app.conf", user="root")
        sbx.files.write("/opt/uploaded", "also kept", user="root")
        sbx.pause()
        assert len(_events(server, "teardown", sbx.sandbox_id)) == 1
        rebuilds = len(_events(server, "rebuild", sbx.sandbox_id))
        assert sbx.files.read("/etc/app.conf") == "kept\n"
        assert len(_events(server, "rebuild", sbx.sandbox_id)) == rebuilds + 1
        assert sbx.files.read("/opt/uploaded") == "also kept"
        assert sbx.commands.run("cat /opt/uploaded").stdout == "also kept"


def test_a_new_sandbox_is_made_live_for_a_root_path(server: ServerHandle) -> None:
    with scenarios.sandbox() as sbx:
        sbx.files.write("/etc/first.conf", "before any command", user="root")
        assert sbx.commands.run("cat /etc/first.conf").stdout == "before any command"
