"""What per-agent workspace filesystems cost: create, mount, unmount, delete and capture.

Run as root: `python -m tenon.replay.workspace_bench [--runs N] [--json PATH]`. Every figure
is a median over `runs` repetitions in a fresh directory under the state directory (the
same disk the runtime uses), removed at the end. Capture is timed on the same tree written
into an image-backed root and into a plain directory: the difference is what fsync through
the loop device adds to a teardown.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tenon.host.diskfs import DiskLimits
from tenon.state.workspace import WorkspaceStore
from tenon.units import MIB

NUM_SMALL_FILES = 500
SMALL_FILE_BYTES = 16 * 1024
LARGE_FILE_BYTES = 32 * MIB


def _timed_ms(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 2)


def _write_tree(root: Path) -> None:
    work = root / "workspace"
    for i in range(NUM_SMALL_FILES):
        (work / f"f{i:04d}.txt").write_bytes(os.urandom(SMALL_FILE_BYTES))
    (work / "large.bin").write_bytes(os.urandom(LARGE_FILE_BYTES))


def bench_workspaces(num_runs: int = 20, state_dir: Path = Path("/var/lib/tenon"),
                     limits: DiskLimits | None = None) -> dict[str, float | int]:
    """Median milliseconds of each workspace step with `limits` (default `DiskLimits()`)."""
    if num_runs < 1:
        raise ValueError(f"num_runs must be at least 1, got {num_runs}")
    limits = limits or DiskLimits()
    state_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=state_dir, prefix="bench-workspaces-") as tmp:
        store = WorkspaceStore(Path(tmp) / "image", limits=limits)
        plain = WorkspaceStore(Path(tmp) / "plain")
        create: list[float] = []
        unmount: list[float] = []
        attach: list[float] = []
        delete: list[float] = []
        capture_image: list[float] = []
        capture_plain: list[float] = []
        fresh_bytes = 0
        try:
            for i in range(num_runs):
                agent_id = f"bench-{i}"
                create.append(_timed_ms(functools.partial(store.create, agent_id)))
                fresh_bytes = store.image_for(agent_id).stat().st_blocks * 512
                unmount.append(_timed_ms(store.unmount_all))
                attach.append(_timed_ms(functools.partial(store.attach, agent_id)))
                delete.append(_timed_ms(functools.partial(store.delete, agent_id)))
            for i in range(max(1, num_runs // 4)):
                agent_id = f"tree-{i}"
                for which, timings in ((store, capture_image), (plain, capture_plain)):
                    _write_tree(which.create(agent_id))
                    timings.append(_timed_ms(functools.partial(which.capture, agent_id)))
                    which.delete(agent_id)
        finally:
            store.reconcile(set())
    return {
        "runs": num_runs,
        "disk_bytes": limits.disk_bytes,
        "max_inodes": limits.max_inodes,
        "create_ms": _median(create),
        "create_max_ms": round(max(create), 2),
        "unmount_ms": _median(unmount),
        "attach_ms": _median(attach),
        "delete_ms": _median(delete),
        "fresh_image_host_bytes": fresh_bytes,
        "capture_tree_files": NUM_SMALL_FILES + 1,
        "capture_tree_bytes": NUM_SMALL_FILES * SMALL_FILE_BYTES + LARGE_FILE_BYTES,
        "capture_image_ms": _median(capture_image),
        "capture_plain_ms": _median(capture_plain),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="repetitions (median reported)")
    parser.add_argument("--state-dir", type=Path, default=Path("/var/lib/tenon"))
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args(argv)
    result = bench_workspaces(args.runs, args.state_dir)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
