"""Which sandbox backend to run: one typed config per backend, told apart by its `type` tag.

`parse_backend_config` validates a mapping (from a file, a request or the CLI's flags) into
one of the configs; unknown fields and unknown types are refused with a `ConfigError`. A
config's `make` imports its backend only then, so choosing `process` never imports the
Docker SDK, and the simulator imports no OS-facing code.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from tenon.errors import ConfigError
from tenon.sandbox.base import DEFAULT_STATE_DIR

if TYPE_CHECKING:
    from tenon.clock import Clock
    from tenon.host.domain import WorkloadDomain
    from tenon.sandbox.base import DomainMeter, SandboxBackend



def _workload_domain(domain: DomainMeter, backend: str) -> WorkloadDomain:
    from tenon.host.domain import WorkloadDomain

    if not isinstance(domain, WorkloadDomain):
        raise ConfigError(
            f"the {backend} backend runs in a real workload domain (cgroups), "
            f"not in {type(domain).__name__}"
        )
    return domain


class ProcessBackendConfig(BaseModel):
    """Linux namespaces (bubblewrap) and cgroups, no daemon: the embedded default."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["process"] = Field(default="process", description="Selects this backend.")
    state_dir: Path = Field(
        default=DEFAULT_STATE_DIR,
        description="Where base images are unpacked into root filesystems and sandboxes' "
        "mounts are staged (the runtime's state directory).",
    )

    def make(self, domain: DomainMeter, clock: Clock | None = None) -> SandboxBackend:
        """The backend, materializing in `domain` (a `WorkloadDomain`); `clock` is unused."""
        from tenon.sandbox.process import ProcessBackend

        return ProcessBackend(_workload_domain(domain, self.type), state_dir=self.state_dir)


class DockerBackendConfig(BaseModel):
    """Docker Engine through the Docker SDK (the daemon at DOCKER_HOST, else the local
    socket), one container per sandbox."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["docker"] = Field(default="docker", description="Selects this backend.")
    state_dir: Path = Field(
        default=DEFAULT_STATE_DIR,
        description="Where base images' root filesystems are read and sandboxes' writable "
        "roots are mounted (the runtime's state directory).",
    )

    def make(self, domain: DomainMeter, clock: Clock | None = None) -> SandboxBackend:
        """The backend, materializing in `domain` (a `WorkloadDomain`); `clock` is unused."""
        from tenon.sandbox.docker import DockerBackend

        return DockerBackend(_workload_domain(domain, self.type), state_dir=self.state_dir)


class SimBackendConfig(BaseModel):
    """Simulated sandboxes that run load profiles on the injected clock (`sandbox.sim`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["sim"] = Field(default="sim", description="Selects this backend.")
    materialize_s: float = Field(
        default=0.02, ge=0.0, description="Clock time a materialization takes."
    )
    base_bytes: int = Field(
        default=0, ge=0, description="Memory an idle sandbox's init holds, charged to it."
    )

    def make(self, domain: DomainMeter, clock: Clock | None = None) -> SandboxBackend:
        """The backend, materializing in `domain` (a `SimDomain`) on `clock` (required:
        the runtime's own, so that simulated time is the time the controller sees)."""
        from tenon.sandbox.sim import SimBackend, SimDomain

        if not isinstance(domain, SimDomain):
            raise ConfigError(
                f"the sim backend runs in a SimDomain, not in {type(domain).__name__}"
            )
        if clock is None:
            raise ConfigError("the sim backend needs the runtime's clock")
        return SimBackend(
            domain, clock, materialize_s=self.materialize_s, base_bytes=self.base_bytes
        )


BackendConfig = Annotated[
    ProcessBackendConfig | DockerBackendConfig | SimBackendConfig,
    Field(discriminator="type"),
]
BACKEND_TYPES = ("process", "docker", "sim")
_ADAPTER: TypeAdapter[BackendConfig] = TypeAdapter(BackendConfig)


def parse_backend_config(data: Mapping[str, Any]) -> BackendConfig:
    """The config `data` describes (its "type" picks the backend); ConfigError naming the
    offending field when a field or the type is unknown or a value out of bounds."""
    try:
        return _ADAPTER.validate_python(dict(data))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'type'}: {err['msg']}"
            for err in exc.errors()
        )
        raise ConfigError(
            f"backend config {dict(data)!r}: {problems} (types: {', '.join(BACKEND_TYPES)})"
        ) from None


def make_backend(
    config: BackendConfig, domain: DomainMeter, *, clock: Clock | None = None
) -> SandboxBackend:
    """The backend `config` selects, imported only now, materializing in `domain`."""
    return config.make(domain, clock)
