"""`tenon serve`: one runtime, its sessions and the ASGI app, on uvicorn, until a signal.

The runtime is opened with `keep_agents`: stopping the server (SIGINT, SIGTERM) tears each
idle, restartable sandbox down to its committed workspace and keeps every record, so the
next server on the same state directory answers for the same sandboxes; a crash is
recovered the same way (docs/RECOVERY.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tenon.errors import ConfigError
from tenon.policy.config import PolicyConfig
from tenon.predict.online import OnlinePredictor
from tenon.predict.static import StaticPredictor
from tenon.runtime.controller import Runtime
from tenon.runtime.open import open_runtime
from tenon.sandbox.images import image_store
from tenon.service.api import load_route
from tenon.service.app import TenonApp
from tenon.service.listen import listening
from tenon.service.live import LiveView
from tenon.service.metrics import metrics_route
from tenon.service.sessions import DEFAULT_TEMPLATE, SessionManager

logger = logging.getLogger(__name__)

API_KEYS_ENV = "TENON_API_KEYS"
NODE_NAME_ENV = "TENON_NODE_NAME"
API_KEY_FILE = "api-key"  # in the state directory: the key made when none is given
DEFAULT_PORT = 49982
DEFAULT_IMAGE = "tenon-base:bookworm"


def default_node_name() -> str:
    """$TENON_NODE_NAME, else the host's name."""
    return os.environ.get(NODE_NAME_ENV) or socket.gethostname()


class ServeSettings(BaseModel):
    """Everything `tenon serve` takes; an unknown key is an error."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    budget_bytes: int = Field(gt=0)
    backend: str = "process"
    state_dir: Path
    image_dir: Path | None = None  # the image store (default: $TENON_IMAGE_DIR, else
    # /var/lib/tenon/images; a state directory holding images/ is read as that)
    host: str = "127.0.0.1"
    port: int = Field(DEFAULT_PORT, ge=0, le=65535)
    api_keys: tuple[str, ...] = ()
    policy: str = "tenon"
    policy_config: dict[str, Any] = Field(default_factory=dict)
    image: str = DEFAULT_IMAGE
    max_write_bytes: int = Field(100 * 1024 * 1024, gt=0)
    node_name: str = Field(default_factory=default_node_name, min_length=1)
    """The name this server's load is published under (`GET /tenon/load`) for a cluster's
    front door."""


def load_api_keys(*, keys_file: Path | None, state_dir: Path) -> tuple[list[str], str]:
    """The accepted keys and where they came from: `keys_file` (one a line), else the
    TENON_API_KEYS variable (comma-separated), else a key made once and kept in the state
    directory (mode 0600)."""
    if keys_file is not None:
        try:
            keys = [line.strip() for line in keys_file.read_text().splitlines()
                    if line.strip() and not line.startswith("#")]
        except OSError as exc:
            raise ConfigError(f"--api-keys-file {keys_file}: {exc.strerror or exc}") from exc
        if not keys:
            raise ConfigError(f"--api-keys-file {keys_file}: holds no key")
        return keys, str(keys_file)
    if os.environ.get(API_KEYS_ENV):
        keys = [k.strip() for k in os.environ[API_KEYS_ENV].split(",") if k.strip()]
        if keys:
            return keys, f"${API_KEYS_ENV}"
    path = state_dir / API_KEY_FILE
    if not path.exists():
        state_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(f"e2b_{secrets.token_hex(20)}\n")
    return [path.read_text().strip()], str(path)


async def serve(settings: ServeSettings, *, announce: Sequence[str] = ()) -> None:
    """Run the server until SIGINT or SIGTERM."""
    config = PolicyConfig.model_validate(settings.policy_config)
    predictor = OnlinePredictor(StaticPredictor(heavy_peak_bytes=config.heavy_peak_bytes),
                                heavy_peak_bytes=config.heavy_peak_bytes)
    images = settings.image_dir or settings.state_dir
    async with open_runtime(budget_bytes=settings.budget_bytes, backend=settings.backend,
                            state_dir=images, run_dir=settings.state_dir, keep_agents=True,
                            policy=settings.policy, config=config,
                            predictor=predictor) as runtime:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        async with serving(runtime, settings.state_dir, api_keys=settings.api_keys,
                           host=settings.host, port=settings.port, image=settings.image,
                           image_root=runtime.backend.image_root,
                           images=image_store(images).names,
                           max_write_bytes=settings.max_write_bytes,
                           node_name=settings.node_name) as url:
            for line in announce:
                print(line, flush=True)
            print(f"tenon serve: listening on {url}", flush=True)
            await stop.wait()
    print("tenon serve: stopped; sandboxes kept for the next start", file=sys.stderr)


@contextlib.asynccontextmanager
async def serving(runtime: Runtime, state_dir: Path, *, api_keys: Sequence[str],
                  host: str = "127.0.0.1", port: int = 0, image: str = DEFAULT_IMAGE,
                  image_root: Any = None, max_write_bytes: int = 100 * 1024 * 1024,
                  node_name: str | None = None,
                  images: Callable[[], list[str]] | None = None) -> AsyncIterator[str]:
    """Serve `runtime` over E2B's API on this event loop while the block runs; yields the
    base URL. The sessions' store is in `state_dir`; `node_name` (default: the host's) names
    the load it publishes; `images()` lists the image names a template id may give besides
    `base` (`image`).  The bench uses it to drive a runtime
    through the front door in the same process."""
    sessions = SessionManager(runtime, state_dir, templates={DEFAULT_TEMPLATE: image},
                              images=images,
                              image_root=image_root, max_write_bytes=max_write_bytes)
    await sessions.start()
    live = LiveView(runtime)
    live.start()  # the memory series starts with the server, not at the first page view
    try:
        pages = [*_pages(runtime, live), load_route(runtime, node_name or default_node_name())]
        app = TenonApp(sessions, api_keys, extra_routes=pages,
                       max_write_bytes=max_write_bytes)
        async with listening(app, host, port) as url:
            yield url
    finally:
        await live.stop()
        await sessions.close()


def _pages(runtime: Runtime, live: LiveView) -> list[Any]:
    """/metrics and the live view."""
    return [metrics_route(runtime), *live.routes()]
