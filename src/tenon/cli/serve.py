"""`tenon serve`: the E2B-compatible server of one host."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from tenon.cli.errors import fail, require_writable_dir
from tenon.errors import TenonError
from tenon.units import parse_size

DEFAULT_STATE_DIR = Path("/var/lib/tenon")


def serve_cmd(
    budget: Annotated[str, typer.Option(help="Memory budget of the sandboxes' workload "
                                             "domain, e.g. 8GiB.")],
    backend: Annotated[str, typer.Option(help="process or docker")] = "process",
    state_dir: Annotated[Path, typer.Option(help="Tenon's state directory (sandboxes, "
                                                 "their workspaces and records).")] = (
        DEFAULT_STATE_DIR),
    image_dir: Annotated[Path | None, typer.Option(
        help="Where the base images are (default: the state directory).")] = None,
    listen: Annotated[str, typer.Option(help="HOST:PORT to listen on (port 0: any free "
                                             "one).")] = "127.0.0.1:49982",
    api_keys_file: Annotated[Path | None, typer.Option(
        help="File with the accepted API keys, one a line. Default: $TENON_API_KEYS "
             "(comma-separated), else a key made once in the state directory.")] = None,
    policy: Annotated[str, typer.Option(help="Control policy (tenon, or a baseline).")] = (
        "tenon"),
    max_file_size: Annotated[str, typer.Option(
        help="Largest file a client may write through the files API.")] = "100MiB",
    setting: Annotated[list[str] | None, typer.Option(
        "--set", help="Policy parameter key=value (repeatable).")] = None,
    node_name: Annotated[str | None, typer.Option(
        help="The name this server's load is published under (GET /tenon/load) for a "
             "cluster's front door (default: $TENON_NODE_NAME, else the hostname).")] = None,
) -> None:
    """Serve E2B's API (the official SDK works unchanged) over Tenon's runtime."""
    from tenon.cli.bench import parse_settings
    from tenon.service.server import ServeSettings, load_api_keys, serve

    try:
        host, _, port = listen.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--listen: expected HOST:PORT, got {listen!r}")
        require_writable_dir(state_dir, what="--state-dir")
        keys, source = load_api_keys(keys_file=api_keys_file, state_dir=state_dir)
        settings = ServeSettings(budget_bytes=parse_size(budget, what="--budget"),
                                 backend=backend, state_dir=state_dir, image_dir=image_dir,
                                 host=host,
                                 port=int(port), api_keys=tuple(keys), policy=policy,
                                 policy_config=parse_settings(setting or []),
                                 max_write_bytes=parse_size(max_file_size,
                                                            what="--max-file-size"),
                                 **({"node_name": node_name} if node_name else {}))
        asyncio.run(serve(settings, announce=[f"tenon serve: API keys from {source}"]))
    except (TenonError, ValidationError, ValueError) as exc:
        fail(exc, {"budget_bytes": "--budget", "port": "--listen",
                   "max_write_bytes": "--max-file-size"})
