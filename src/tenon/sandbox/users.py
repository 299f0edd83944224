"""Who a command runs as inside a sandbox, and the image's own settings for commands.

A user name resolves through the sandbox's /etc/passwd (and /etc/group for its
supplementary groups), read from the host side without following symlinks: the agent's
writable root can hold any file there. The default user is the unprivileged "user"
(uid/gid 1000, HOME /home/user) whatever the image says; "root" is uid 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tenon.errors import SandboxError
from tenon.sandbox.base import HOME_DIR

DEFAULT_USER = "user"
DEFAULT_UID = 1000
MAX_ID = 65535  # ids 0..65535 exist inside a sandbox
_MAX_ETC_FILE_BYTES = 1 << 20


UNKNOWN_USER_EXIT_CODE = 126  # what `docker exec -u` answers for a user it cannot find


class UnknownUser(SandboxError):
    """A command asked for a user the sandbox does not know."""


@dataclass(frozen=True)
class SandboxUser:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str

    @property
    def is_root(self) -> bool:
        return self.uid == 0


def read_etc(layers: tuple[Path, ...], name: str) -> str:
    """/etc/`name` from the first of `layers` (root directories, topmost first) that has
    it; "" when none has it or a layer holds a symlink, a whiteout or a non-file there."""
    for layer in layers:
        etc = layer / "etc"
        try:
            if not stat.S_ISDIR(etc.lstat().st_mode):
                return ""
        except FileNotFoundError:
            continue
        try:
            fd = os.open(etc / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            continue
        except OSError:
            return ""  # a symlink, or a whiteout (a char device) hiding the lower file
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return ""
            return f.read(_MAX_ETC_FILE_BYTES).decode(errors="replace")
    return ""


def _entries(text: str, num_fields: int) -> list[list[str]]:
    rows = [line.split(":") for line in text.splitlines() if line and not line.startswith("#")]
    return [row for row in rows if len(row) >= num_fields]


def _id(text: str) -> int | None:
    return int(text) if text.isdigit() and int(text) <= MAX_ID else None


def resolve_user(layers: tuple[Path, ...], name: str | None) -> SandboxUser:
    """The user `name` (None: the default user) as the sandbox's /etc/passwd defines it;
    UnknownUser when it has no such user."""
    name = name or DEFAULT_USER
    passwd = _entries(read_etc(layers, "passwd"), 7)
    entry = next((row for row in passwd if row[0] == name), None)
    if name == DEFAULT_USER:
        uid, gid, home = DEFAULT_UID, DEFAULT_UID, HOME_DIR
    elif entry is not None and (uid_ := _id(entry[2])) is not None \
            and (gid_ := _id(entry[3])) is not None:
        uid, gid, home = uid_, gid_, entry[5] or "/"
    elif name == "root":
        uid, gid, home = 0, 0, "/root"
    else:
        raise UnknownUser(f"unknown user {name!r}: the sandbox's /etc/passwd has no such "
                          f"entry (use 'root', '{DEFAULT_USER}' or a user the image defines)")
    groups = {gid}
    for row in _entries(read_etc(layers, "group"), 4):
        if name in row[3].split(",") and (group_id := _id(row[2])) is not None:
            groups.add(group_id)
    return SandboxUser(name=name, uid=uid, gid=gid, groups=tuple(sorted(groups)), home=home)


@dataclass(frozen=True)
class ImageConfig:
    """What an image says about its commands (image.json "config", as Docker's): their
    variables and working directory."""

    env: Mapping[str, str]
    workdir: str | None


def image_config(image_json: Path) -> ImageConfig:
    """The "config" of `image_json` (Env as NAME=VALUE strings, WorkingDir); empty when the
    file or the section is missing."""
    data: object = {}
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(image_json.read_text())
    config = data.get("config") if isinstance(data, dict) else None
    if not isinstance(config, dict):
        return ImageConfig(env={}, workdir=None)
    env = {}
    for item in config.get("Env") or []:
        if isinstance(item, str) and "=" in item:
            key, _, value = item.partition("=")
            env[key] = value
    workdir = config.get("WorkingDir")
    return ImageConfig(env=env, workdir=workdir if isinstance(workdir, str) and
                       workdir.startswith("/") else None)
