"""Import mini-swe-agent trajectories (`*.traj.json`, format mini-swe-agent-1.1) as a trace.

Timings come from the message timestamps: an assistant message's `extra.timestamp` is when
the model's response arrived and a tool message's `extra.timestamp` when its command finished.
So the model wait of a step is the assistant timestamp minus the previous tool message's (for
the first step: minus `extra.response.created`, the request start), and an action's duration
is its tool message's timestamp minus the assistant's. When one response carries several
actions, they run one after another: the second waits 0 and starts when the first finished.

The trajectories carry no memory data, so the caller names a memory profile: a JSON file
mapping action class -> {avg_bytes, peak_bytes, resident_after_bytes} (with an optional
"default" entry for classes it does not list), or a callable `(action_class, command, step)
-> Memory`, e.g. a predictor.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

from pydantic import ValidationError

from tenon.errors import TraceError
from tenon.predict.classify import ACTION_CLASSES, classify_action
from tenon.replay.importers.naming import family_of
from tenon.replay.trace import Action, Memory, Step, Trace, Workflow, make_header

logger = logging.getLogger(__name__)

TRAJECTORY_FORMAT: Final = "mini-swe-agent-1.1"
DEFAULT_BASE_IMAGE: Final = "tenon-base:bookworm"
SHELL_TOOL: Final = "bash"
MemoryProfile = Mapping[str, Memory] | Callable[[str, str, int], Memory]

_PROFILE_HELP: Final = (
    "a memory profile is required: mini-swe-agent trajectories carry no memory data. Pass a "
    'JSON file mapping action class to figures, e.g. {"test_runner": {"avg_bytes": 300000000, '
    '"peak_bytes": 900000000, "resident_after_bytes": 0}, "default": {...}} (classes: '
    + ", ".join(ACTION_CLASSES)
    + "), or a predictor callable (action_class, command, step_index) -> Memory"
)


def load_memory_profile(path: str | os.PathLike[str]) -> dict[str, Memory]:
    """Read a JSON memory profile; TraceError names the file and the bad entry."""
    source = Path(path)
    try:
        document = json.loads(source.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceError(f"{source}: cannot read memory profile: {exc}") from exc
    if not isinstance(document, dict) or not document:
        raise TraceError(f"{source}: expected an object mapping action class to figures")
    profile = {}
    for name, figures in document.items():
        if name not in ACTION_CLASSES and name != "default":
            raise TraceError(
                f"{source}: {name}: unknown action class (one of "
                f"{', '.join(ACTION_CLASSES)}, or default)"
            )
        try:
            profile[name] = Memory.model_validate(figures)
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(part) for part in first["loc"])
            message = first["msg"].removeprefix("Value error, ")
            raise TraceError(f"{source}: {name}.{field}: {message}") from exc
    return profile


def import_mini_swe_agent(
    directory: str | os.PathLike[str],
    memory_profile: MemoryProfile | str | os.PathLike[str] | None,
    *,
    base_image: str = DEFAULT_BASE_IMAGE,
) -> Trace:
    """One workflow per trajectory file under `directory` (or `directory` itself if a file)."""
    if memory_profile is None:
        raise TraceError(_PROFILE_HELP)
    if isinstance(memory_profile, str | os.PathLike):
        memory_profile = load_memory_profile(memory_profile)
    root = Path(directory)
    files = [root] if root.is_file() else sorted(root.rglob("*.traj.json"))
    if not files:
        raise TraceError(f"{root}: no mini-swe-agent trajectories (*.traj.json)")
    workflows = []
    for path in files:
        workflow = _import_trajectory(path, memory_profile, base_image)
        if workflow is None:
            continue
        workflows.append(workflow)
    if not workflows:
        raise TraceError(f"{root}: no trajectory had an action")
    header = make_header(f"mini-swe-agent:{root.resolve()}")
    return Trace(header=header, workflows=workflows)


def _memory_for(profile: MemoryProfile, action_class: str, command: str, step: int) -> Memory:
    if callable(profile):
        predicted = profile(action_class, command, step)
        return predicted if isinstance(predicted, Memory) else Memory.model_validate(predicted)
    memory = profile.get(action_class) or profile.get("default")
    if memory is None:
        raise TraceError(
            f"memory profile has no entry for action class {action_class!r} and no 'default' entry"
        )
    return memory


def _import_trajectory(path: Path, profile: MemoryProfile, base_image: str) -> Workflow | None:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceError(f"{path}: cannot read trajectory: {exc}") from exc
    if not isinstance(document, dict) or not isinstance(document.get("messages"), list):
        raise TraceError(f"{path}: messages: expected a trajectory object with a messages list")
    found = document.get("trajectory_format")
    if found != TRAJECTORY_FORMAT:
        logger.warning(
            "%s: trajectory_format %r, expected %r; trying anyway", path, found, TRAJECTORY_FORMAT
        )
    messages: list[Any] = document["messages"]
    steps: list[Step] = []
    task_prompt = None
    previous_s: float | None = None
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TraceError(f"{path}: messages.{index}: expected an object")
        role = message.get("role")
        if role == "user" and task_prompt is None:
            task_prompt = _task_prompt(message.get("content"))
        if role != "assistant":
            continue
        extra = message.get("extra") or {}
        actions = extra.get("actions") or []
        if not actions:
            continue
        where = f"{path}: messages.{index}.extra"
        received_s = _number(extra.get("timestamp"), f"{where}.timestamp")
        if previous_s is None:
            created = (extra.get("response") or {}).get("created")
            previous_s = float(created) if isinstance(created, int | float) else received_s
        results = _tool_timestamps(messages, index, len(actions), path)
        start_s = received_s
        for number, (action, finished_s) in enumerate(zip(actions, results, strict=True)):
            command = action.get("command") if isinstance(action, dict) else None
            if not isinstance(command, str):
                raise TraceError(f"{where}.actions.{number}.command: expected a string")
            action_class = classify_action(SHELL_TOOL, command)
            memory = _memory_for(profile, action_class, command, len(steps))
            wait_s = max(0.0, start_s - previous_s) if number == 0 else 0.0
            steps.append(
                Step(
                    model_wait_s=round(wait_s, 3),
                    action=Action(
                        command=command,
                        tool=SHELL_TOOL,
                        action_class=action_class,
                        duration_s=round(max(0.0, finished_s - start_s), 3),
                        memory=memory,
                    ),
                )
            )
            start_s = previous_s = max(start_s, finished_s)
    if not steps:
        logger.warning("%s: no actions; skipped", path)
        return None
    instance = str(document.get("instance_id") or path.name.removesuffix(".traj.json"))
    info = document.get("info")
    info = info if isinstance(info, dict) else {}
    environment = (info.get("config") or {}).get("environment") or {}
    return Workflow(
        id=instance,
        submit_s=0.0,
        base_image=base_image,
        family=family_of(instance),
        task_prompt=task_prompt,
        metadata={
            "source": "mini-swe-agent",
            "original_image": str(environment.get("image", "")) or None,
            "exit_status": str(info.get("exit_status", "")) or None,
        },
        steps=steps,
    )


def _tool_timestamps(messages: list[Any], index: int, count: int, path: Path) -> list[float]:
    """Finish times of the `count` tool messages answering the assistant message at `index`."""
    found: list[float] = []
    for later in messages[index + 1 :]:
        if len(found) == count or not isinstance(later, dict) or later.get("role") == "assistant":
            break
        if later.get("role") == "tool":
            extra = later.get("extra") or {}
            found.append(_number(extra.get("timestamp"), f"{path}: tool message extra.timestamp"))
    if len(found) < count:
        # The run ended (e.g. submitted) before the command's result: treat it as instant.
        last = (
            found[-1]
            if found
            else _number(
                (messages[index].get("extra") or {}).get("timestamp"), f"{path}: timestamp"
            )
        )
        found.extend([last] * (count - len(found)))
    return found


def _number(value: Any, where: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise TraceError(f"{where}: expected seconds as a number, got {value!r}")
    return float(value)


def _task_prompt(content: Any) -> str | None:
    if isinstance(content, list):
        content = "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    if not isinstance(content, str) or not content.strip():
        return None
    match = re.search(r"<pr_description>(.*?)</pr_description>", content, re.DOTALL)
    text = match.group(1) if match else content
    text = text.replace("Consider the following PR description:", "", 1)
    return text.strip()
