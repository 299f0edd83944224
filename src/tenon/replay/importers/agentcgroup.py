"""Import AgentCgroup runs (`<task>/attempt_*/tool_calls.json` + `resources.json`) as a trace.

How the figures are derived (the memory series is `podman stats` of the whole container,
about one sample a second, so it includes the agent's own node process):

- Samples reading "0B / 0B" (the container already gone) are dropped.
- The series is read as piecewise linear between samples (constant before the first and
  after the last). An action's `avg` is the time-average of that curve over [start, end],
  its `peak` the curve's maximum there; an action with no sample inside therefore gets the
  interpolated values at its start and end (a zero-length action: the value at its start).
- The agent baseline is the lowest sample taken while no tool call ran, between the first
  call's start and the last call's end (samples outside include the container's start-up
  before node is up and its shutdown after the agent exits). It is
  subtracted from every figure (clamped at 0), so the profile describes the sandbox's tool
  memory; the raw baseline is kept in the workflow's metadata (`agent_baseline_bytes`).
  Growth of the agent's own heap over a run is thus counted as sandbox memory, which errs
  on the side of more memory.
- `resident_after` is the level memory settles to in the gap before the next action: the
  lowest sample inside the gap, or if none lies there, the lower of the curve's values at
  the gap's two ends. For the last action the gap runs to the last sample.
- Model wait = this call's start minus the previous call's end (clamped at 0: parallel tool
  calls overlap); the first wait runs from the first sample. Duration = end - start, >= 0.
- Every workflow is submitted at 0 (the bench builds bursts); the original start epoch is
  kept in metadata (`start_epoch`).
"""

from __future__ import annotations

import json
import logging
import os
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Final

from tenon.errors import ConfigError, TraceError
from tenon.predict.classify import classify_action
from tenon.replay.importers.naming import family_of
from tenon.replay.trace import Action, Memory, Step, Trace, Workflow, make_header
from tenon.units import parse_size

logger = logging.getLogger(__name__)

DEFAULT_BASE_IMAGE: Final = "tenon-base:bookworm"
# Long heredocs add nothing the predictor can use beyond their start; keeps traces small.
MAX_COMMAND_CHARS: Final = 1000


@dataclass(frozen=True)
class _Call:
    start_s: float
    end_s: float
    tool: str
    command: str


@dataclass(frozen=True)
class _Series:
    """A memory series: epochs ascending, values in bytes."""

    epochs: list[float]
    values: list[float]

    def at(self, epoch: float) -> float:
        index = bisect_left(self.epochs, epoch)
        if index == 0:
            return self.values[0]
        if index == len(self.epochs):
            return self.values[-1]
        t0, t1 = self.epochs[index - 1], self.epochs[index]
        v0, v1 = self.values[index - 1], self.values[index]
        return v0 + (v1 - v0) * (epoch - t0) / (t1 - t0) if t1 > t0 else v1

    def inside(self, start: float, end: float) -> list[float]:
        """Values of the samples with start < epoch < end."""
        return self.values[bisect_right(self.epochs, start) : bisect_left(self.epochs, end)]

    def window(self, start: float, end: float) -> tuple[float, float]:
        """(time-average, maximum) of the piecewise-linear curve over [start, end]."""
        first = self.at(start)
        if end <= start:
            return first, first
        lo, hi = bisect_right(self.epochs, start), bisect_left(self.epochs, end)
        times = [start, *self.epochs[lo:hi], end]
        values = [first, *self.values[lo:hi], self.at(end)]
        area = sum(
            (times[i + 1] - times[i]) * (values[i] + values[i + 1]) / 2
            for i in range(len(times) - 1)
        )
        return area / (end - start), max(values)


def import_agentcgroup(
    directory: str | os.PathLike[str], *, base_image: str = DEFAULT_BASE_IMAGE
) -> Trace:
    """A trace with one workflow per attempt directory found under `directory`.

    Attempts missing a file, or with no tool calls or no samples, are skipped with a warning
    and counted in the header's metadata (`num_skipped`, `skipped`); malformed files raise
    TraceError naming the file.
    """
    root = Path(directory)
    if not root.is_dir():
        raise ConfigError(f"{root}: not a directory of AgentCgroup runs")
    attempts = sorted(p for p in [root, *root.rglob("attempt_*")] if _is_attempt(p))
    workflows: list[Workflow] = []
    skipped: list[str] = []
    for attempt in attempts:
        name = _attempt_name(root, attempt)
        missing = [f for f in ("tool_calls.json", "resources.json") if not (attempt / f).is_file()]
        if missing:
            logger.warning("skipping %s: missing %s", name, ", ".join(missing))
            skipped.append(name)
            continue
        workflow = _import_attempt(attempt, name, base_image)
        if workflow is None:
            skipped.append(name)
        else:
            workflows.append(workflow)
    if not workflows:
        raise TraceError(
            f"{root}: no importable AgentCgroup runs (<task>/attempt_*/ with "
            f"tool_calls.json and resources.json); skipped {len(skipped)}"
        )
    logger.info("imported %d workflows from %s, skipped %d", len(workflows), root, len(skipped))
    header = make_header(
        f"agentcgroup:{root.resolve()}", num_skipped=len(skipped), skipped=",".join(skipped)
    )
    return Trace(header=header, workflows=workflows)


def _is_attempt(path: Path) -> bool:
    return path.is_dir() and (
        path.name.startswith("attempt_") or (path / "tool_calls.json").is_file()
    )


def _attempt_name(root: Path, attempt: Path) -> str:
    if attempt == root:
        return root.name
    return attempt.relative_to(root).as_posix()


def _import_attempt(attempt: Path, name: str, base_image: str) -> Workflow | None:
    calls = _read_calls(attempt / "tool_calls.json")
    series = _read_series(attempt / "resources.json")
    if not calls or series is None:
        logger.warning("skipping %s: %s", name, "no tool calls" if not calls else "no samples")
        return None
    baseline = _agent_baseline(calls, series)
    steps: list[Step] = []
    previous_end = series.epochs[0]
    for index, call in enumerate(calls):
        avg, peak = series.window(call.start_s, call.end_s)
        gap_end = calls[index + 1].start_s if index + 1 < len(calls) else series.epochs[-1]
        in_gap = series.inside(call.end_s, gap_end)
        if in_gap:
            settled = min(in_gap)
        else:
            settled = min(series.at(call.end_s), series.at(max(gap_end, call.end_s)))
        memory = Memory(
            avg_bytes=_above(avg, baseline),
            peak_bytes=max(_above(peak, baseline), _above(avg, baseline)),
            resident_after_bytes=_above(settled, baseline),
        )
        action = Action(
            command=call.command,
            tool=call.tool,
            action_class=classify_action(call.tool, call.command),
            duration_s=round(call.end_s - call.start_s, 3),
            memory=memory,
        )
        wait_s = round(max(0.0, call.start_s - previous_end), 3)
        steps.append(Step(model_wait_s=wait_s, action=action))
        previous_end = max(previous_end, call.end_s)
    task = attempt.parent.name if attempt.name.startswith("attempt_") else attempt.name
    return Workflow(
        id=name,
        submit_s=0.0,
        base_image=base_image,
        family=family_of(task),
        task_prompt=None,
        metadata={
            "source": "agentcgroup",
            "task": task,
            "start_epoch": round(series.epochs[0], 3),
            "agent_baseline_bytes": int(baseline),
            "num_samples": len(series.epochs),
        },
        steps=steps,
    )


def _above(value: float, baseline: float) -> int:
    return max(0, round(value - baseline))


def _agent_baseline(calls: list[_Call], series: _Series) -> float:
    last_end_s = max(call.end_s for call in calls)
    idle = [
        value
        for epoch, value in zip(series.epochs, series.values, strict=True)
        if calls[0].start_s <= epoch <= last_end_s
        and not any(c.start_s <= epoch <= c.end_s for c in calls)
    ]
    if idle:
        return min(idle)
    ordered = sorted(series.values)
    return ordered[len(ordered) // 2]


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceError(f"{path}: cannot read JSON: {exc}") from exc


def _read_calls(path: Path) -> list[_Call]:
    records = _load_json(path)
    if not isinstance(records, list):
        raise TraceError(f"{path}: expected a list of tool calls")
    calls = []
    for index, record in enumerate(records):
        where = f"{path}: [{index}]"
        if not isinstance(record, dict):
            raise TraceError(f"{where}: expected an object")
        tool = record.get("tool")
        if not isinstance(tool, str) or not tool:
            raise TraceError(f"{where}.tool: required string missing")
        start_s = _iso_epoch(record.get("timestamp"), f"{where}.timestamp")
        end_raw = record.get("end_timestamp")
        end_s = start_s if end_raw is None else _iso_epoch(end_raw, f"{where}.end_timestamp")
        tool_input = record.get("input")
        tool_input = tool_input if isinstance(tool_input, dict) else {}
        command = command_text(tool, tool_input)
        calls.append(_Call(start_s, max(start_s, end_s), tool, command))
    calls.sort(key=lambda call: call.start_s)
    return calls


def command_text(tool: str, tool_input: dict[str, Any]) -> str:
    """The text the predictor sees: the shell command for Bash, key arguments otherwise."""
    if isinstance(tool_input.get("command"), str):
        text = str(tool_input["command"])
    else:
        keys = ("file_path", "path", "pattern", "glob", "url", "query", "description")
        args = [str(tool_input[key]) for key in keys if isinstance(tool_input.get(key), str)]
        text = " ".join([tool, *args])
    return text[:MAX_COMMAND_CHARS]


def _iso_epoch(value: Any, where: str) -> float:
    if not isinstance(value, str):
        raise TraceError(f"{where}: expected an ISO-8601 timestamp, got {value!r}")
    try:
        moment = datetime.fromisoformat(value)
    except ValueError as exc:
        raise TraceError(f"{where}: not an ISO-8601 timestamp: {value!r}") from exc
    if moment.tzinfo is None:
        raise TraceError(f"{where}: timestamp {value!r} has no zone (expected ...Z, UTC)")
    return moment.timestamp()


def _read_series(path: Path) -> _Series | None:
    document = _load_json(path)
    samples = document.get("samples") if isinstance(document, dict) else None
    if not isinstance(samples, list):
        raise TraceError(f"{path}: expected an object with a list of samples")
    points = []
    for index, sample in enumerate(samples):
        where = f"{path}: samples[{index}]"
        if not isinstance(sample, dict) or not isinstance(sample.get("epoch"), int | float):
            raise TraceError(f"{where}.epoch: expected UNIX seconds")
        usage = sample.get("mem_usage")
        if isinstance(usage, str) and usage.replace(" ", "") == "0B/0B":
            continue  # podman's reading once the container is gone, not a measurement
        points.append((float(sample["epoch"]), float(parse_mem_usage(usage, where))))
    if not points:
        return None
    points.sort()
    return _Series([epoch for epoch, _ in points], [value for _, value in points])


def parse_mem_usage(text: Any, where: str = "mem_usage") -> int:
    """`"185.3MB / 134.5GB"` -> 185300000 (decimal units, as podman prints them)."""
    if not isinstance(text, str):
        raise TraceError(f"{where}.mem_usage: expected a string like '185.3MB / 134.5GB'")
    try:
        return parse_size(text.split("/", 1)[0].strip(), what=f"{where}.mem_usage")
    except ConfigError as exc:
        raise TraceError(str(exc)) from exc
