"""`tenon bench` (the replay bench, with sweeps) and `tenon report`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markdown import Markdown
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tenon.errors import ConfigError
from tenon.policy.config import PolicyConfig
from tenon.replay.bench import BenchConfig, run_bench
from tenon.replay.driver import WorkflowRecord
from tenon.replay.report import draw, table_markdown
from tenon.units import parse_size

SWEEPABLE = ("qps", "red_fraction", "yellow_fraction", "admission_window_bytes",
             "lifecycle_limit")


def parse_seconds(text: str, *, what: str) -> float:
    raw = text.strip().lower().removesuffix("s")
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{what}: expected seconds like 10s, got {text!r}") from None
    if value <= 0:
        raise ConfigError(f"{what}: must be positive, got {text!r}")
    return value


def parse_settings(settings: list[str]) -> dict[str, Any]:
    """`--set key=value` pairs into PolicyConfig overrides (validated by name and bounds)."""
    out: dict[str, Any] = {}
    for item in settings:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        out[key.strip()] = _coerce(key.strip(), value.strip())
    PolicyConfig.model_validate(out)
    return out


def _coerce(key: str, value: str) -> Any:
    if value.lower() == "none":
        return None
    if key.endswith("_bytes"):
        return parse_size(value, what=key)
    try:
        return int(value)
    except ValueError:
        pass
    try:
        return float(value)
    except ValueError:
        return value


def sweep_points(sweep: str | None, qps: str | None) -> tuple[str | None, list[Any]]:
    """The swept parameter and its values (qps given as a list sweeps qps)."""
    if sweep:
        key, sep, values = sweep.partition("=")
        key = key.strip()
        if not sep or key not in SWEEPABLE:
            raise ConfigError(f"--sweep expects one of {', '.join(SWEEPABLE)}=v1,v2,..., "
                              f"got {sweep!r}")
        return key, [_coerce(key, v) for v in values.split(",") if v.strip()]
    if qps and "," in qps:
        return "qps", [float(v) for v in qps.split(",") if v.strip()]
    return None, [None]


def run_cli_bench(*, console: Console, base: dict[str, Any], sweep: str | None,
                  qps: str | None, json_path: Path | None) -> None:
    param, values = sweep_points(sweep, qps)
    points = []
    for value in values:
        fields = dict(base)
        fields["qps"] = float(qps) if qps and param != "qps" else fields.get("qps")
        if param == "qps":
            fields["qps"] = value
        elif param is not None:
            fields["policy_config"] = {**fields["policy_config"], param: value}
        if param is not None:
            fields["out_dir"] = Path(fields["out_dir"]) / f"{param}-{value}"
        config = BenchConfig.model_validate(fields)
        summary = _run_one(console, config)
        points.append({"value": value, **summary})
    if json_path is not None:
        result = points[0] if param is None else {"sweep": param, "points": points}
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2) + "\n")
        console.print(f"results: {json_path}")


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """SIGINT and SIGTERM both stop the bench the way Ctrl-C does (cleanup, partial results).

    A process started in the background by a non-interactive shell inherits SIGINT ignored,
    and Python then leaves it ignored: `kill -INT` did nothing. SIGTERM (what a service
    manager or `kill` sends) had no cleanup at all. Both now reach asyncio's SIGINT path.
    """
    def forward(signum: int, frame: object) -> None:
        del signum, frame
        os.kill(os.getpid(), signal.SIGINT)

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, forward)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run_one(console: Console, config: BenchConfig) -> dict[str, Any]:
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, transient=False)
    tasks: dict[str, Any] = {}
    failures: dict[str, int] = {}

    def started(name: str, total: int) -> None:
        tasks[name] = progress.add_task(f"{name:<24}", total=total)
        failures[name] = 0

    def done(name: str, record: WorkflowRecord) -> None:
        failures[name] += record.failed_attempts
        progress.update(tasks[name], advance=1,
                        description=f"{name:<24} failed attempts {failures[name]:>3}")

    console.print(f"[bold]replay[/bold] {config.trace} on {config.backend}, budget "
                  f"{config.budget_bytes / 2**30:.2f} GiB, speed {config.speed}x -> "
                  f"{config.out_dir}")
    start = time.monotonic()
    with progress, interruptible():
        summary = asyncio.run(run_bench(config, on_policy_start=started, on_done=done))
    written = draw(config.out_dir)
    console.print(Markdown(table_markdown(summary)))
    delays = config.out_dir / "delays.md"
    if delays.exists():
        console.print(Markdown(delays.read_text()))
    console.print(f"{time.monotonic() - start:.0f} s; wrote " +
                  ", ".join(str(p) for p in written))
    return summary
