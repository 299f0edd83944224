"""The README's quickstart works as written: every code block under "## Quickstart" runs
verbatim, in order (bash blocks in bash with a timeout; the `tenon serve` line started in the
background as the README says, the variables its block exports given to the Python blocks
after it; Python blocks as scripts, top-level `await` allowed). A block is left out only with
a comment right above it saying why (`<!-- not run by tests/test_readme.py: REASON -->`)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SKIP_MARK = "<!-- not run by tests/test_readme.py:"
_BLOCK = re.compile(r"(?:<!-- not run by tests/test_readme\.py: (?P<why>.*?) -->\n)?"
                    r"```(?P<lang>\w+)\n(?P<code>.*?)\n```", re.DOTALL)
BLOCK_TIMEOUT_S = 900.0
SERVER_START_S = 120.0
# Python blocks run here: top-level await, as in an asyncio REPL.
_RUNNER = """\
import ast, asyncio, inspect, sys
code = compile(sys.stdin.read(), "README.md", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
result = eval(code, {"__name__": "__main__"})
if inspect.iscoroutine(result):
    asyncio.run(result)
"""


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int
    skipped: str | None


def quickstart_blocks(text: str | None = None) -> list[Block]:
    """The fenced blocks between "## Quickstart" and the next "## " heading."""
    text = README.read_text() if text is None else text
    start = text.index("\n## Quickstart")
    end = text.index("\n## ", start + 1)
    return [Block(m["lang"], m["code"], text.count("\n", 0, start + m.start()) + 2, m["why"])
            for m in _BLOCK.finditer(text[start:end])]


def test_the_quickstart_blocks_are_found_and_every_skip_says_why():
    blocks = quickstart_blocks()
    text = README.read_text()
    top = text[:text.index("\n## ")]
    assert "bash scripts/main.sh" in top  # the two top commands stay where they are
    assert "bash scripts/test.sh" in top
    assert not any("scripts/main.sh" in b.code or "scripts/test.sh" in b.code for b in blocks)
    assert text.count(SKIP_MARK) == sum(b.skipped is not None for b in blocks)
    assert all(b.skipped.strip() for b in blocks if b.skipped is not None)
    run = [b for b in blocks if b.skipped is None]
    assert [b.lang for b in run].count("python") >= 3
    assert sum("tenon serve " in b.code for b in run) == 1
    assert any("tenon image build -f" in b.code for b in run)
    assert any('template="hello:1"' in b.code for b in run)


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _run(block: Block, env: dict[str, str], cwd: Path) -> str:
    if block.lang == "python":
        argv = [sys.executable, "-c", _RUNNER]
        stdin = block.code
    else:
        argv = ["bash", "-euo", "pipefail", "-c", block.code]
        stdin = ""
    try:
        done = subprocess.run(argv, input=stdin, env=env, cwd=cwd, capture_output=True,
                              text=True, timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"README.md:{block.line}: the {block.lang} block ran past "
                    f"{BLOCK_TIMEOUT_S:.0f} s")
    assert done.returncode == 0, (f"README.md:{block.line}: the {block.lang} block exited "
                                  f"{done.returncode}\n{done.stdout}\n{done.stderr}")
    return done.stdout


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.5)
        return probe.connect_ex(("127.0.0.1", port)) == 0


class Server:
    """The README's `tenon serve` line, started in the background."""

    def __init__(self, line: str, env: dict[str, str], log: Path) -> None:
        command = line.split("#", 1)[0].strip()
        args = shlex.split(command)
        self.state_dir = Path(args[args.index("--state-dir") + 1])
        self.port = 49982  # the README says where it listens
        if _listening(self.port):
            pytest.fail(f"port {self.port} is taken: the README's server cannot start")
        self.existed = self.state_dir.exists()
        self.log = log
        with log.open("w") as out:
            self.proc = subprocess.Popen(["bash", "-c", f"exec {command}"], env=env,
                                         start_new_session=True, stdout=out,
                                         stderr=subprocess.STDOUT)
        deadline = time.monotonic() + SERVER_START_S
        while not _listening(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"`{command}` did not start listening:\n{log.read_text()}")
            time.sleep(0.2)

    def kill_sandboxes(self, env: dict[str, str]) -> None:
        url, key = env.get("E2B_API_URL"), env.get("E2B_API_KEY")
        if not url or not key:
            return
        with httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=60) as client:
            for sandbox in client.get("/sandboxes").json():
                client.delete(f"/sandboxes/{sandbox['sandboxID']}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if not self.existed:
            shutil.rmtree(self.state_dir, ignore_errors=True)


def _start_server(block: Block, env: dict[str, str], cwd: Path) -> Server:
    """Start the block's `tenon serve` line; run its other lines and keep what they export."""
    lines = block.code.splitlines()
    serve = next(line for line in lines if line.lstrip().startswith("tenon serve "))
    server = Server(serve, env, cwd / "serve.log")
    rest = "\n".join(line for line in lines if line is not serve)
    exported = _run(Block("bash", f"{rest}\nenv -0", block.line, None), env, cwd)
    env.update(item.split("=", 1) for item in exported.split("\0") if "=" in item)
    return server


def _remove_hello(created: list[str], env: dict[str, str]) -> None:
    tenon = [sys.executable, "-m", "tenon.cli.main"]
    for name in created:
        subprocess.run([*tenon, "image", "rm", name], env=env, capture_output=True)
        subprocess.run(["docker", "rmi", "-f", name], env=env, capture_output=True)
    if created:
        subprocess.run([*tenon, "image", "prune"], env=env, capture_output=True)


@pytest.mark.slow
@pytest.mark.sandbox
@pytest.mark.cgroups
@pytest.mark.disk
@pytest.mark.docker
def test_the_quickstart_runs_as_written(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("the quickstart runs as root (cgroups, sandboxes, Docker)")
    env = _environment()
    from tenon.sandbox.images import ImageStore

    had = set(ImageStore().names())
    hello_dir_existed = Path("/tmp/hello").exists()
    server: Server | None = None
    try:
        for block in quickstart_blocks():
            if block.skipped is not None:
                continue
            if block.lang == "bash" and "tenon serve " in block.code:
                server = _start_server(block, env, tmp_path)
                continue
            out = _run(block, env, tmp_path)
            if 'template="hello:1"' in block.code:
                assert "hello from my image" in out
            if "tenon image build -f" in block.code:
                assert {"hello:1", "hello:2"} <= set(ImageStore().names())
    finally:
        if server is not None:
            server.kill_sandboxes(env)
            server.stop()
        _remove_hello([n for n in ("hello:1", "hello:2") if n not in had], env)
        if not hello_dir_existed:
            shutil.rmtree("/tmp/hello", ignore_errors=True)
