"""The trace format: versioned JSON lines, one header then one workflow per line.

    {"format": "tenon-trace", "version": 1, "source": "...", "created": "2026-...Z"}
    {"id": "...", "submit_s": 0.0, "base_image": "...", "family": "...", "task_prompt": null,
     "metadata": {...}, "steps": [{"model_wait_s": 2.1, "action": {"command": "pytest -x",
     "tool": "Bash", "action_class": "test_runner", "duration_s": 4.2,
     "memory": {"avg_bytes": ..., "peak_bytes": ..., "resident_after_bytes": ...},
     "reproduce": {"mode": "load"}}}]}

Every line is validated; the first bad line raises `TraceError` naming the file, the line and
the field (`trace.jsonl:7: steps.3.action.memory.peak_bytes: must be >= avg_bytes`), so a
malformed line never silently drops data.

Memory figures are levels, not increments: the sandbox's memory above its idle level with the
agent's own process excluded. `peak_bytes` includes what earlier actions left resident, and
`resident_after_bytes` is everything the sandbox keeps once the action ends (so a replay sets
its resident files to that size rather than adding to them).
"""

from __future__ import annotations

import json
import logging
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from tenon.errors import TraceError
from tenon.predict.classify import ActionClass

logger = logging.getLogger(__name__)

TRACE_FORMAT: Final = "tenon-trace"
TRACE_VERSION: Final = 1
# A sandbox action above 1 TiB is a unit mistake, not a measurement.
MAX_BYTES: Final = 1 << 40
# A single model wait or action longer than a day is a broken timestamp.
MAX_SECONDS: Final = 86_400.0
# A submission more than a week after the trace start is a broken timestamp too; the
# simulated bench also stops at a week of clock time.
MAX_SUBMIT_S: Final = 7 * 86_400.0

MetadataValue = str | int | float | bool | None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Memory(_Strict):
    """The memory profile of one action, in bytes, for the sandbox's tools (not the agent)."""

    avg_bytes: int = Field(ge=0, le=MAX_BYTES, description="time-average over the action")
    peak_bytes: int = Field(ge=0, le=MAX_BYTES, description="maximum during the action")
    resident_after_bytes: int = Field(
        ge=0, le=MAX_BYTES, description="memory the sandbox keeps after the action ends"
    )

    @field_validator("peak_bytes")
    @classmethod
    def _peak_at_least_avg(cls, value: int, info: ValidationInfo) -> int:
        avg_bytes = info.data.get("avg_bytes")
        if avg_bytes is not None and value < avg_bytes:
            raise ValueError("must be >= avg_bytes")
        return value


class Reproduce(_Strict):
    """How a replay reproduces the action: the load program (`load`) or the command itself."""

    mode: Literal["load", "literal"] = "load"


class Action(_Strict):
    command: str = Field(description="the text the agent issued; the predictor's input")
    tool: str = Field(min_length=1, description="the agent's tool name (Bash, Read, ...)")
    action_class: ActionClass
    duration_s: float = Field(ge=0, le=MAX_SECONDS)
    memory: Memory
    reproduce: Reproduce = Reproduce()


class Step(_Strict):
    model_wait_s: float = Field(ge=0, le=MAX_SECONDS, description="model latency before it")
    action: Action


class Workflow(_Strict):
    id: str = Field(min_length=1)
    submit_s: float = Field(ge=0, le=MAX_SUBMIT_S, allow_inf_nan=False,
                            description="seconds from the trace start")
    base_image: str = Field(min_length=1)
    family: str = Field(min_length=1, description="e.g. the repository name")
    task_prompt: str | None = None
    metadata: dict[str, MetadataValue] = Field(default_factory=dict)
    steps: list[Step] = Field(min_length=1)

    @property
    def profiled_peak_bytes(self) -> int:
        return profiled_peak_bytes(self)

    @property
    def task(self) -> str:
        """The task the workflow attempts: `metadata["task"]` when an importer recorded one
        (attempts at one task share it), else the workflow id. Replayed copies of a workflow
        share it too."""
        task = self.metadata.get("task")
        return task if isinstance(task, str) and task else self.id


class TraceHeader(_Strict):
    format: Literal["tenon-trace"] = TRACE_FORMAT
    version: Literal[1] = TRACE_VERSION
    source: str = Field(min_length=1, description="what the trace was made from")
    created: str = Field(description="ISO-8601 UTC time the trace was written")
    metadata: dict[str, MetadataValue] = Field(default_factory=dict)


class Trace(_Strict):
    header: TraceHeader
    workflows: list[Workflow]

    @property
    def num_actions(self) -> int:
        return sum(len(workflow.steps) for workflow in self.workflows)


def profiled_peak_bytes(workflow: Workflow) -> int:
    """A workflow's profiled peak: the largest peak over its actions."""
    return max(step.action.memory.peak_bytes for step in workflow.steps)


def make_header(source: str, **metadata: MetadataValue) -> TraceHeader:
    created = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return TraceHeader(source=source, created=created, metadata=metadata)


def write_trace(trace: Trace, path: str | os.PathLike[str]) -> Path:
    """Write atomically (a temporary file renamed into place); returns the path."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    with tmp.open("w", encoding="utf-8") as out:
        out.write(trace.header.model_dump_json() + "\n")
        for workflow in trace.workflows:
            out.write(workflow.model_dump_json() + "\n")
    tmp.replace(target)
    logger.info("wrote %d workflows to %s", len(trace.workflows), target)
    return target


def load_trace(path: str | os.PathLike[str], *, collect_errors: bool = False) -> Trace:
    """Read and validate a trace; raise TraceError at the first bad line.

    With `collect_errors=True` every line is checked and one TraceError lists all problems
    (also as its `errors` attribute, a list of "file:line: field: message" strings).
    """
    trace, errors = _read(Path(path), stop_at_first=not collect_errors)
    if errors:
        error = TraceError("\n".join(errors))
        error.errors = errors  # type: ignore[attr-defined]
        raise error
    assert trace is not None
    return trace


def check_trace(path: str | os.PathLike[str]) -> list[str]:
    """All problems of a trace file as "file:line: field: message" strings; [] when valid."""
    return _read(Path(path), stop_at_first=False)[1]


def _read(path: Path, *, stop_at_first: bool) -> tuple[Trace | None, list[str]]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read trace: {exc}") from exc
    errors: list[str] = []
    header: TraceHeader | None = None
    workflows: list[Workflow] = []
    seen_ids: dict[str, int] = {}
    lines = [(number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise TraceError(f"{path}:1: header: empty file, expected a tenon-trace header line")
    for number, line in lines:
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            errors.append(f"{where}: invalid JSON: {exc.msg} at column {exc.colno}")
        else:
            if header is None and number == lines[0][0]:
                header, problem = _parse_header(record)
            else:
                workflow, problem = _parse_workflow(record)
                if workflow is not None:
                    if workflow.id in seen_ids:
                        problem = f"id: duplicate workflow id {workflow.id!r} (first on line "
                        problem += f"{seen_ids[workflow.id]})"
                    else:
                        seen_ids[workflow.id] = number
                        workflows.append(workflow)
            if problem:
                errors.append(f"{where}: {problem}")
        if errors and (stop_at_first or header is None):
            break  # without a valid header the rest cannot be interpreted
    if errors or header is None:
        return None, errors
    return Trace(header=header, workflows=workflows), errors


def _parse_header(record: Any) -> tuple[TraceHeader | None, str | None]:
    if not isinstance(record, dict):
        return None, "header: expected a JSON object"
    if record.get("format") != TRACE_FORMAT:
        return None, f"format: expected {TRACE_FORMAT!r}, got {record.get('format')!r}"
    if record.get("version") != TRACE_VERSION:
        return None, (
            f"version: unsupported trace version {record.get('version')!r} "
            f"(this Tenon reads version {TRACE_VERSION})"
        )
    try:
        return TraceHeader.model_validate(record), None
    except ValidationError as exc:
        return None, _describe(exc)


def _parse_workflow(record: Any) -> tuple[Workflow | None, str | None]:
    if not isinstance(record, dict):
        return None, "workflow: expected a JSON object"
    try:
        return Workflow.model_validate(record), None
    except ValidationError as exc:
        return None, _describe(exc)


def _describe(exc: ValidationError) -> str:
    """The first pydantic error as `steps.3.action.memory.peak_bytes: must be >= avg_bytes`."""
    parts = []
    for error in exc.errors()[:3]:
        field = ".".join(str(part) for part in error["loc"]) or "line"
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown field"
        elif error["type"] == "missing":
            message = "required field missing"
        parts.append(f"{field}: {message}")
    more = len(exc.errors()) - len(parts)
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")
