"""How the CLI reports bad input: one line on stderr naming the problem, and exit status 2.

A user's mistake is never a traceback. Every command funnels its expected failures (Tenon's
own errors, a configuration that does not validate, a path it cannot write) through `fail`.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.text import Text

from tenon.errors import ConfigError

# Usage errors exit 2, like the argument parser's own.
EXIT_BAD_INPUT = 2

# Wide enough that rich never wraps the line; the message is printed as plain text so a
# bracket in user input is not taken for markup.
_stderr = Console(stderr=True, soft_wrap=True, highlight=False)


def one_line(message: str) -> str:
    """Collapse a possibly multi-line message into one line (parts joined by "; ")."""
    return "; ".join(part.strip() for part in message.splitlines() if part.strip())


def describe_validation(exc: ValidationError, names: Mapping[str, str] | None = None, *,
                        prefix: str = "") -> str:
    """A pydantic error as `--budget: input should be greater than 0`, naming the option the
    user gave: `names` maps a model field to its flag; other fields get `prefix` + their name.
    """
    names = names or {}
    parts = []
    for error in exc.errors():
        loc = [str(part) for part in error["loc"]]
        field = names.get(loc[0], prefix + loc[0]) if loc else exc.title
        if len(loc) > 1:
            field = " ".join([field, ".".join(loc[1:])])
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown setting"
        parts.append(f"{field}: {message[:1].lower()}{message[1:]}")
    return "; ".join(parts)


def fail(exc: Exception, names: Mapping[str, str] | None = None) -> NoReturn:
    """Print `error: <one line>` on stderr and exit with status 2."""
    message = describe_validation(exc, names) if isinstance(exc, ValidationError) else str(exc)
    _stderr.print(Text("error: ", style="red") + Text(one_line(message) or type(exc).__name__))
    raise typer.Exit(EXIT_BAD_INPUT)


def require_writable_dir(path: Path, *, what: str) -> Path:
    """Create `path` (and parents) and prove a file can be written in it, before any work starts."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{what}: {path} is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".tenon-probe-"):
            pass
    except OSError as exc:
        raise ConfigError(f"{what}: cannot write to {path}: {_reason(exc)}") from None
    return path


def require_writable_file(path: Path, *, what: str) -> Path:
    """Check that `path` can be written later: its directory is writable and it is no directory."""
    if path.is_dir():
        raise ConfigError(f"{what}: {path} is a directory, expected a file path")
    if path.exists() and not os.access(path, os.W_OK):
        raise ConfigError(f"{what}: cannot write to {path}: permission denied")
    require_writable_dir(path.parent, what=what)
    return path


def write_text(path: Path, text: str, *, what: str) -> None:
    """Write an output file, turning an OS refusal into a one-line ConfigError."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as exc:
        raise ConfigError(f"{what}: cannot write {path}: {_reason(exc)}") from None


def parse_positive_float(text: str, *, what: str, example: str, max_value: float) -> float:
    """A finite number in (0, max_value]; anything else is a one-line ConfigError."""
    try:
        value = float(text.strip())
    except ValueError:
        raise ConfigError(f"{what}: expected a number like {example}, got {text!r}") from None
    if not math.isfinite(value):
        raise ConfigError(f"{what}: must be a finite number, got {text!r}")
    if value <= 0:
        raise ConfigError(f"{what}: must be positive, got {text!r}")
    if value > max_value:
        raise ConfigError(f"{what}: must be at most {max_value:g}, got {text!r}")
    return value


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)
