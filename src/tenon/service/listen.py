"""An ASGI app on uvicorn on this event loop, for as long as a block runs."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import uvicorn

from tenon.errors import ConfigError


@contextlib.asynccontextmanager
async def listening(app: Any, host: str, port: int) -> AsyncIterator[str]:
    """Serve `app` on `host:port` (0: any free port) while the block runs; yields the base
    URL actually bound. ConfigError when it cannot listen there."""
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=5, backlog=4096)
    config.load()
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)  # what Server.serve() sets up
    try:
        await server.startup()
    except SystemExit as exc:  # uvicorn exits when it cannot bind
        raise ConfigError(f"cannot listen on {host}:{port} (in use, or not an address "
                          "of this host)") from exc
    if server.should_exit:
        raise ConfigError(f"cannot listen on {host}:{port}")
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        await server.shutdown()
