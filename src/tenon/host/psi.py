"""Pressure stall information and the host's available memory, from /proc."""

from __future__ import annotations

from pathlib import Path

from tenon.errors import HostError
from tenon.host.types import PressureReading


def parse_pressure(text: str) -> PressureReading:
    """Parse a PSI file ("some avg10=.. avg60=.. avg300=.. total=..", then "full ...")."""
    fields: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        kind, *pairs = line.split()
        fields[kind] = dict(p.split("=", 1) for p in pairs)
    try:
        some, full = fields["some"], fields.get("full", {"avg10": "0", "avg60": "0", "total": "0"})
        return PressureReading(
            some_avg10=float(some["avg10"]), some_avg60=float(some["avg60"]),
            full_avg10=float(full["avg10"]), full_avg60=float(full["avg60"]),
            some_total_us=int(some["total"]), full_total_us=int(full["total"]),
        )
    except (KeyError, ValueError) as exc:
        raise HostError(f"malformed PSI text {text!r}: {exc}") from exc


def read_pressure(path: Path = Path("/proc/pressure/memory")) -> PressureReading | None:
    """Memory PSI, or None when the kernel does not expose it."""
    try:
        return parse_pressure(path.read_text())
    except FileNotFoundError:
        return None


def host_mem_available_bytes(proc_root: Path = Path("/proc")) -> int:
    """MemAvailable from meminfo, in bytes."""
    for line in (proc_root / "meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise HostError(f"{proc_root / 'meminfo'} has no MemAvailable line")
