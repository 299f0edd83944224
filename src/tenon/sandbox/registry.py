"""A backend by the name the CLI's `--backend` flag gives, built through its typed config."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tenon.errors import ConfigError
from tenon.sandbox.config import BackendConfig, parse_backend_config

if TYPE_CHECKING:
    from tenon.host.domain import WorkloadDomain
    from tenon.sandbox.base import SandboxBackend

# The backends that run real sandboxes; "sim" needs a simulated domain and the runtime's
# clock, so it is built from its config (`sandbox.config.SimBackendConfig`) instead.
BACKENDS = ("docker", "process")


def backend_config(name: str, state_dir: Path) -> BackendConfig:
    """The config the flags `--backend name --state-dir state_dir` select."""
    if name not in BACKENDS:
        raise ConfigError(f"unknown backend {name!r}; known backends: {', '.join(BACKENDS)}")
    return parse_backend_config({"type": name, "state_dir": state_dir})


def make_backend(name: str, domain: WorkloadDomain, state_dir: Path) -> SandboxBackend:
    """Instantiate the backend called `name` (its module imported only now); an unknown
    name is a ConfigError listing the known ones."""
    return backend_config(name, state_dir).make(domain)
