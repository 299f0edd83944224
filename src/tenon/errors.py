"""One root exception; subclasses also inherit the matching builtin."""

from __future__ import annotations


class TenonError(Exception):
    """Root of every error Tenon raises on purpose."""


class ConfigError(TenonError, ValueError):
    """A configuration value is unknown, out of bounds or inconsistent."""


class HostError(TenonError, OSError):
    """The host (cgroups, /proc) refused or lacks something Tenon needs."""


class CgroupUnavailable(HostError):
    """A cgroup controller or file Tenon needs is missing on this host."""


class SandboxError(TenonError, RuntimeError):
    """A sandbox could not be created, used or destroyed."""


class BackendUnavailable(SandboxError):
    """The backend's prerequisites (bubblewrap, Docker Engine, base image) are missing."""


class ImageNotFound(BackendUnavailable, LookupError):
    """No image has this name (the message names the images there are), or the name is
    not one an image can have."""


class SandboxDied(SandboxError):
    """The sandbox's init exited while Tenon still needed it."""


class NotBusy(SandboxError):
    """A command meant to run alongside an agent's action found no action in flight: run it
    as an action of its own instead."""


class UnknownAgent(TenonError, KeyError):
    """No open agent has this id in the runtime."""


class CommandTimeout(SandboxError, TimeoutError):
    """An action ran past its timeout; its whole process tree was killed."""


class SandboxFrozen(SandboxError):
    """An exec was attempted on a sandbox the gate holds frozen."""


class WorkspaceError(TenonError, OSError):
    """A workspace path is invalid, or its content does not match its manifest."""


class RecoveryError(TenonError, RuntimeError):
    """A recovery record is missing or inconsistent; the agent stays blocked."""


class TraceError(TenonError, ValueError):
    """A trace file is malformed; the message names file, line and field."""


class ModelError(TenonError, ValueError):
    """A saved predictor model is unusable (wrong feature version, corrupt)."""


class ClusterFull(TenonError, RuntimeError):
    """No node of the cluster has room for a new agent now; retry after `retry_after_s`."""

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NodeLost(TenonError, ConnectionError):
    """A cluster node (its Tenon) is gone: its process died or its host left the cluster."""


class AgentLost(RecoveryError):
    """An agent of a lost node could not continue elsewhere (resident-only, or its committed
    workspace could not be adopted); the reason says which."""
