"""Backends chosen by a type tag and imported lazily."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from tenon.errors import ConfigError

if TYPE_CHECKING:
    from tenon.host.domain import WorkloadDomain
    from tenon.sandbox.base import SandboxBackend

BACKENDS = {
    "process": ("tenon.sandbox.process", "ProcessBackend"),
    "docker": ("tenon.sandbox.docker", "DockerBackend"),
}


def make_backend(name: str, domain: WorkloadDomain, state_dir: Path) -> SandboxBackend:
    """Instantiate the backend called `name`; unknown names get a clear error."""
    try:
        module_name, class_name = BACKENDS[name]
    except KeyError:
        known = ", ".join(sorted(BACKENDS))
        raise ConfigError(f"unknown backend {name!r}; known backends: {known}") from None
    cls = getattr(importlib.import_module(module_name), class_name)
    if name == "process":
        return cls(domain, state_dir=state_dir)  # type: ignore[no-any-return]
    return cls(domain)  # type: ignore[no-any-return]
