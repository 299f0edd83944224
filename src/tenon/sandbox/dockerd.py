"""A client for the local Docker Engine, shared by the Docker backend and the image store."""

from __future__ import annotations

import os
import socket

import docker

from tenon.errors import BackendUnavailable

DAEMON_FIX = "start dockerd (systemctl start docker), or run: bash scripts/setup.sh"


def connect(timeout_s: float = 30.0) -> docker.DockerClient:
    """A client for the local Engine; BackendUnavailable (with the fix) when none answers.

    A unix socket is tried by hand first: docker-py's constructor asks the daemon for its
    API version and, when that fails, leaks the socket it opened.
    """
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if host.startswith("unix://"):
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(timeout_s)
                probe.connect(host.removeprefix("unix://"))
        except OSError as exc:
            raise BackendUnavailable(
                f"Docker Engine does not answer at {host} ({exc}); {DAEMON_FIX}") from exc
    client: docker.DockerClient | None = None
    try:
        client = docker.from_env(timeout=int(timeout_s))
        client.ping()
    except Exception as exc:
        if client is not None:
            client.close()
        raise BackendUnavailable(f"Docker Engine does not answer ({exc}); {DAEMON_FIX}") from exc
    return client
