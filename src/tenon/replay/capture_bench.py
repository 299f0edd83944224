"""What a teardown and a rebuild cost in workspace work, as the tree grows.

For each file count, a persistent root (its own ext4 image, as the runtime keeps them)
gets a workspace in a real repository's shape: `git init`, files at depths 1-8 with
log-normal sizes around 4 KiB (a few of 64-512 KiB), `git add -A && git commit`, its
objects packed as in a clone (`git gc`). Then each
cycle changes one file and runs the runtime's workspace steps: teardown = capture (syncfs
+ the incremental manifest) and the recovery record's commit; rebuild = reading the record,
attaching the root and verifying it (what a rebuild does before the backend materializes).
Wall and CPU (the controller's own plus its children's, such as the tree walker) per step,
p50 and p99. With a backend (`--backend`), the teardown also destroys the agent's sandbox and
the rebuild materializes a new one on the root (until it answers), and each change is written
by a command inside the sandbox.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import resource
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from tenon.host import treewalk
from tenon.host.diskfs import DiskLimits
from tenon.sandbox.base import Sandbox, SandboxBackend, SandboxSpec
from tenon.state.recovery import RecoveryStore
from tenon.state.workspace import WorkspaceStore
from tenon.units import GIB

AGENT = "bench-agent"
_GIT = ["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost",
        "-c", "init.defaultBranch=main", "-c", "gc.auto=0", "-c", "maintenance.auto=false"]


def make_repository(root: Path, num_files: int, seed: int = 1) -> list[Path]:
    """A git repository of `num_files` files under `root` (committed); the files."""
    rng = random.Random(seed)
    dirs = [root]
    files: list[Path] = []
    for i in range(num_files):
        if rng.random() < 0.08 or len(dirs) == 1:
            parent = rng.choice(dirs)
            if len(parent.relative_to(root).parts) < 7:
                child = parent / f"pkg{len(dirs)}"
                child.mkdir(exist_ok=True)
                dirs.append(child)
        size = int(rng.lognormvariate(math.log(4096), 0.8))
        if rng.random() < 0.005:
            size = rng.randint(64 * 1024, 512 * 1024)
        path = rng.choice(dirs) / f"m{i}.py"
        path.write_bytes(rng.randbytes(size // 2).hex().encode()[:size])
        files.append(path)
    subprocess.run([*_GIT, "init", "-q", str(root)], check=True)
    subprocess.run([*_GIT, "-C", str(root), "add", "-A"], check=True)
    subprocess.run([*_GIT, "-C", str(root), "commit", "-q", "-m", "bench"], check=True)
    # As a clone has it: the objects in one pack, not one loose file each.
    subprocess.run([*_GIT, "-C", str(root), "gc", "-q", "--prune=now"], check=True)
    return files


async def _measured(fn: Callable[[], Awaitable[object]]) -> tuple[float, float]:
    """(wall ms, CPU ms of this process and its children) of `await fn()`."""
    def cpu_s() -> float:
        own = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
    wall, cpu = time.perf_counter(), cpu_s()
    await fn()
    return (time.perf_counter() - wall) * 1000, (cpu_s() - cpu) * 1000


def _quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {"p50": round(statistics.median(ordered), 2), "p99": round(p99, 2)}


def bench_size(state_dir: Path, num_files: int, num_runs: int,
               backend: SandboxBackend | None = None,
               image: str = "tenon-base:bookworm") -> dict[str, Any]:
    """Teardown and rebuild figures for one tree size, in a fresh store under `state_dir`;
    with `backend`, each cycle also destroys and materializes a real sandbox on the root, and
    the changed file is written from inside it."""
    return asyncio.run(_bench_size(state_dir, num_files, num_runs, backend, image))


async def _bench_size(state_dir: Path, num_files: int, num_runs: int,
                      backend: SandboxBackend | None, image: str) -> dict[str, Any]:
    store = WorkspaceStore(state_dir, limits=DiskLimits(disk_bytes=8 * GIB,
                                                       max_inodes=max(65536, 4 * num_files)))
    records = RecoveryStore(state_dir / "recovery.sqlite")
    sandbox: Sandbox | None = None
    try:
        root = store.create(AGENT)
        files = make_repository(root / "workspace", num_files)
        if backend is not None:
            await asyncio.to_thread(_hand_to_sandbox_user, root / "workspace")
        records.register(AGENT, "bench", "bench", {})
        manifest = store.capture(AGENT)  # the first capture reads everything
        records.commit_teardown(AGENT, 1, manifest.digest, "bench", "bench", {},
                                manifest=manifest)
        spec = None if backend is None else SandboxSpec(
            sandbox_id=f"bench-{uuid.uuid4().hex[:8]}", image=image, workspace=root)
        if backend is not None and spec is not None:
            sandbox = await backend.materialize(spec)
        await asyncio.sleep(0.1)  # past the racy window: the tree's timestamps are trusted
        rng = random.Random(2)
        out: dict[str, list[float]] = {k: [] for k in ("teardown_wall_ms", "teardown_cpu_ms",
                                                       "rebuild_wall_ms", "rebuild_cpu_ms")}
        hashed: list[int] = []

        async def teardown() -> None:
            nonlocal sandbox
            captured = store.capture(AGENT)
            records.commit_teardown(AGENT, 1, captured.digest, "bench", "bench", {},
                                    manifest=captured)
            if sandbox is not None:
                await sandbox.destroy()
                sandbox = None

        async def rebuild() -> None:
            nonlocal sandbox
            record = records.get(AGENT)
            if record is None or record.manifest_digest is None:
                raise RuntimeError("the bench agent's record has no manifest")
            store.attach(AGENT)
            store.verify(AGENT, record.manifest_digest, record.manifest)
            if backend is not None and spec is not None:
                sandbox = await backend.materialize(spec)

        for _ in range(num_runs):
            changed = rng.choice(files).relative_to(root / "workspace")
            if sandbox is not None:
                done = await sandbox.exec(f"echo '# changed' >> /workspace/{changed}",
                                          timeout_s=30)
                if done.exit_code != 0:
                    raise RuntimeError(f"changing {changed} in the sandbox: {done.output}")
            else:
                with (root / "workspace" / changed).open("a") as f:
                    f.write("# changed\n")
            wall, cpu = await _measured(teardown)
            hashed.append(store.last_scan.num_hashed if store.last_scan else -1)
            out["teardown_wall_ms"].append(wall)
            out["teardown_cpu_ms"].append(cpu)
            wall, cpu = await _measured(rebuild)
            out["rebuild_wall_ms"].append(wall)
            out["rebuild_cpu_ms"].append(cpu)
        entries = len(manifest.entries)
    finally:
        if sandbox is not None:
            await sandbox.destroy()
        records.close()
        store.reconcile(set())
    result: dict[str, Any] = {"files": num_files, "entries": entries, "runs": num_runs,
                              "backend": None if backend is None else backend.name,
                              "files_hashed_per_teardown": max(hashed)}
    for key, values in out.items():
        result[key] = _quantiles(values)
    total = [a + b for a, b in zip(out["teardown_wall_ms"], out["rebuild_wall_ms"],
                                   strict=True)]
    total_cpu = [a + b for a, b in zip(out["teardown_cpu_ms"], out["rebuild_cpu_ms"],
                                       strict=True)]
    result["cycle_wall_ms"] = _quantiles(total)
    result["cycle_cpu_ms"] = _quantiles(total_cpu)
    return result


def _hand_to_sandbox_user(workspace: Path) -> None:
    """The generated tree belongs to the sandbox's default user (uid 1000), as an agent's
    own files do: it writes them from inside."""
    for directory, _dirs, names in os.walk(workspace):
        os.chown(directory, 1000, 1000)
        for name in names:
            os.chown(os.path.join(directory, name), 1000, 1000, follow_symlinks=False)


def bench_capture(sizes: list[int], num_runs: int,
                  state_dir: Path = Path("/var/lib/tenon"),
                  backend: SandboxBackend | None = None) -> dict[str, Any]:
    """`bench_size` for each size, in a temporary directory under `state_dir`."""
    state_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for size in sizes:
        with tempfile.TemporaryDirectory(dir=state_dir, prefix="bench-capture-") as tmp:
            results.append(bench_size(Path(tmp), size, num_runs, backend))
    return {"walker": "c" if treewalk.helper_usable() else "python", "sizes": results}


def table(result: dict[str, Any]) -> str:
    """A readable table of `bench_capture`'s result."""
    head = (f"{'files':>7} {'teardown ms p50/p99':>20} {'rebuild ms p50/p99':>19} "
            f"{'cycle wall p50/p99':>19} {'cycle CPU p50/p99':>18}")
    lines = [f"walker: {result['walker']}", head]
    for row in result["sizes"]:
        cells = [f"{row[k]['p50']:.1f}/{row[k]['p99']:.1f}" for k in
                 ("teardown_wall_ms", "rebuild_wall_ms", "cycle_wall_ms", "cycle_cpu_ms")]
        lines.append(f"{row['files']:>7} {cells[0]:>20} {cells[1]:>19} {cells[2]:>19} "
                     f"{cells[3]:>18}")
    return "\n".join(lines)
