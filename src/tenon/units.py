"""Byte sizes and durations as users write them ("3GiB", "512MiB", "10s")."""

from __future__ import annotations

import re
from fractions import Fraction

from tenon.errors import ConfigError

MIB = 1024 * 1024
GIB = 1024 * MIB
# Byte counts cross into the kernel (memory.max, memory.limit_in_bytes) and into SQLite as
# signed 64-bit integers; a size beyond that is a typo, not a budget.
MAX_SIZE_BYTES = 2**63 - 1

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(-?[0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, *, what: str = "size") -> int:
    """Parse "3GiB", "512MB", "1048576" into bytes.

    Negatives, unknown units and sizes above MAX_SIZE_BYTES (8 EiB) raise ConfigError. The
    number is taken exactly (no float rounding or overflow), then truncated to whole bytes.
    """
    if isinstance(text, int):
        value_bytes = text
    else:
        match = _SIZE_RE.match(text)
        if not match:
            raise ConfigError(
                f"{what}: cannot parse {_shorten(text)!r} as a size (e.g. 3GiB, 512MiB)")
        number, unit = match.groups()
        factor = _SIZE_UNITS.get(unit.lower())
        if factor is None:
            raise ConfigError(f"{what}: unknown unit {unit!r} in {text!r}")
        try:
            value_bytes = int(Fraction(number) * factor)
        except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
            raise ConfigError(f"{what}: too many digits in {_shorten(text)!r}") from None
    if value_bytes < 0:
        raise ConfigError(f"{what}: must not be negative, got {text!r}")
    if value_bytes > MAX_SIZE_BYTES:
        raise ConfigError(f"{what}: {_shorten(str(text))!r} is beyond the largest size a 64-bit "
                          f"byte count holds ({MAX_SIZE_BYTES} bytes, 8 EiB)")
    return value_bytes


def _shorten(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


def parse_duration(text: str | float, *, what: str = "duration") -> float:
    """Parse "10s", "250ms", "2m", "1.5" into seconds; reject negatives."""
    if isinstance(text, int | float):
        seconds = float(text)
    else:
        match = re.match(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h)?\s*$", text)
        if not match:
            raise ConfigError(f"{what}: cannot parse {text!r} as a duration (e.g. 10s, 250ms)")
        number, unit = match.groups()
        scale = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}[unit]
        seconds = float(number) * scale
    if seconds < 0:
        raise ConfigError(f"{what}: must not be negative, got {text!r}")
    return seconds


def format_bytes(value_bytes: float) -> str:
    """Human form with binary units, e.g. 1.5 GiB."""
    for unit, factor in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if abs(value_bytes) >= factor:
            return f"{value_bytes / factor:.1f} {unit}"
    return f"{int(value_bytes)} B"
