"""A live sandbox's root as the host reaches it, and who a file request acts as there.

The host reaches the root a sandbox runs in (its writable overlay root and every mount in
it) as /proc/<pid>/root of a process inside (its pid 1); a path opened from an fd of it
with openat2's RESOLVE_IN_ROOT (`inroot`) resolves as in the sandbox. Both real backends'
sandboxes offer it (`RootedSandbox`); simulated ones do not.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from tenon.sandbox.users import DEFAULT_UID, MAX_ID, SandboxUser, UnknownUser, resolve_user
from tenon.service.errors import BadRequest, SandboxUnavailable


@dataclass(frozen=True)
class LiveRoot:
    """A live sandbox's root as the host reaches it, and who a request acts as there.

    `top_fd` is an O_PATH fd of /proc/<pid>/root for a process of the sandbox (its init),
    owned by whoever made the `LiveRoot`; the sandbox's id i is host id `id_base + i`;
    `user` is the request's user as the sandbox's /etc/passwd defines it."""

    top_fd: int
    id_base: int
    user: SandboxUser

    def host_ids(self) -> tuple[int, int, tuple[int, ...]]:
        """The user's host uid, gid and supplementary groups."""
        base = self.id_base
        return (base + self.user.uid, base + self.user.gid,
                tuple(base + g for g in self.user.groups))

    def name_of(self, host_id: int) -> str:
        """What the sandbox calls a host id: root, E2B's `user` (1000), else the number."""
        inside = host_id - self.id_base
        if inside == 0:
            return "root"
        if inside == DEFAULT_UID:
            return "user"
        return str(inside) if 0 <= inside <= MAX_ID else str(host_id)


@runtime_checkable
class RootedSandbox(Protocol):
    """A live sandbox whose root the host reaches as /proc/<root_pid>/root, its id i being
    host id `id_base + i` (both real backends' sandboxes; not the simulated ones)."""

    @property
    def root_pid(self) -> int: ...

    @property
    def id_base(self) -> int: ...


def open_live_root(sandbox: object, user: str | None) -> LiveRoot | None:
    """`sandbox`'s root, open, with `user` (None: the default user) as its /etc/passwd
    defines it; None for a sandbox without a root on the host. BadRequest for a user the
    sandbox does not know, SandboxUnavailable when its pid 1 is gone."""
    if not isinstance(sandbox, RootedSandbox):
        return None
    try:
        fd = os.open(f"/proc/{sandbox.root_pid}/root",
                     os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise SandboxUnavailable(f"the sandbox's root cannot be opened: {exc.strerror}") from exc
    try:
        who = resolve_user((Path(f"/proc/self/fd/{fd}"),), user)
    except UnknownUser as exc:
        os.close(fd)
        raise BadRequest(str(exc)) from exc
    except BaseException:
        os.close(fd)
        raise
    return LiveRoot(fd, sandbox.id_base, who)
