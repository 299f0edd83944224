"""A real `tenon serve` in a child process, for tests, benchmarks and examples that drive it
with the official SDK: started on a free loopback port, stopped (and restartable) by pid; and
a cluster's front door on a thread of this process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tenon.service.frontdoor import FrontDoorSettings

READY_TIMEOUT_S = 60.0
IMAGE_DIR = Path("/var/lib/tenon")  # where setup builds the base image
STOP_TIMEOUT_S = 60.0


@dataclass
class ServerHandle:
    """One server process over one state directory; `restart` keeps directory and port."""

    state_dir: Path
    budget: str
    backend: str
    extra_args: tuple[str, ...]
    image_dir: Path = IMAGE_DIR
    api_key: str = field(default_factory=lambda: f"e2b_{secrets.token_hex(16)}")
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    extra_env: Mapping[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def env(self) -> dict[str, str]:
        """What the SDK reads to reach this server instead of E2B's cloud."""
        return {"E2B_API_URL": self.url, "E2B_SANDBOX_URL": self.url,
                "E2B_API_KEY": self.api_key}

    def start(self) -> None:
        self.log_path = self.state_dir.parent / f"{self.state_dir.name}-serve.log"
        env = {**os.environ, **self.extra_env, "TENON_API_KEYS": self.api_key}
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tenon.cli.main", "serve", "--budget", self.budget,
             "--backend", self.backend, "--state-dir", str(self.state_dir),
             "--listen", f"127.0.0.1:{self.port}", "--image-dir", str(self.image_dir),
             *self.extra_args],
            stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True)
        log.close()
        assert self.proc.stdout is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline().decode()
            if not line:
                break
            if "listening on http://" in line:
                self.port = int(line.rsplit(":", 1)[1])
                self._wait_answering(deadline)
                return
        self.stop()
        raise RuntimeError(f"tenon serve did not start; its log: {self.tail_log()}")

    def _wait_answering(self, deadline: float) -> None:
        request = urllib.request.Request(f"{self.url}/v2/sandboxes",
                                         headers={"X-API-Key": self.api_key})
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, urllib.error.URLError), \
                    urllib.request.urlopen(request, timeout=5) as response:
                if response.status == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"tenon serve did not answer; its log: {self.tail_log()}")

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        """Stop the server (SIGTERM: a clean stop; SIGKILL: a crash); its exit status."""
        if self.proc is None:
            return None
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            proc.send_signal(sig)
        try:
            code = proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        return code

    def restart(self, sig: int = signal.SIGTERM) -> None:
        self.stop(sig)
        self.start()

    def tail_log(self, lines: int = 20) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@contextlib.contextmanager
def running_server(state_dir: Path, *, budget: str = "2GiB", backend: str = "process",
                   extra_args: Sequence[str] = (), image_dir: Path = IMAGE_DIR,
                   env: Mapping[str, str] | None = None) -> Iterator[ServerHandle]:
    """A started server (`env`: more environment, e.g. TENON_NODE_NAME); stopped with
    SIGTERM on exit (which keeps its sandboxes on disk: remove `state_dir` to drop them)."""
    handle = ServerHandle(state_dir, budget, backend, tuple(extra_args), image_dir,
                          extra_env=dict(env or {}))
    handle.start()
    try:
        yield handle
    finally:
        handle.stop()


@contextlib.contextmanager
def running_front_door(settings: FrontDoorSettings) -> Iterator[str]:
    """A cluster's front door serving on its own event loop in a thread of this process;
    yields its URL and stops it on exit."""
    from tenon.service.frontdoor import serve_front_door

    loop = asyncio.new_event_loop()
    started = threading.Event()
    url: list[str] = []
    failed: list[BaseException] = []

    def ready(bound: str) -> None:
        url.append(bound)
        started.set()

    task = loop.create_task(serve_front_door(settings, ready=ready))

    def run() -> None:
        try:
            loop.run_until_complete(task)
        except asyncio.CancelledError:
            pass
        except BaseException as exc:  # handed to the test's thread
            failed.append(exc)
        finally:
            started.set()

    thread = threading.Thread(target=run, name="front-door", daemon=True)
    thread.start()
    started.wait(READY_TIMEOUT_S)
    try:
        if failed or not url:
            raise RuntimeError("the front door did not start") from (
                failed[0] if failed else None)
        yield url[0]
    finally:
        loop.call_soon_threadsafe(task.cancel)
        thread.join(STOP_TIMEOUT_S)
        loop.close()
