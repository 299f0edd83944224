"""Tables and plots of a bench run, drawn from its summary and event logs.

`table_markdown` renders the summary's figures; `draw` writes it to `table.md`, where each
workflow's time went to `delays.md` (`replay.delays`), and makes `timeline.png` (per policy:
domain memory and running actions over time, against the budget) and `bars.png`
(makespan, p50 latency and peak memory across policies), like the paper's Figures 9 and 11.
Everything is read back from the run directory, so `tenon report RUN_DIR` redraws a run.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tenon.errors import TraceError
from tenon.replay.delays import WorkflowDelay, delays_markdown, workflow_delays
from tenon.runtime.events import read_events
from tenon.units import format_bytes

logger = logging.getLogger(__name__)

GIB = 1024**3


def load_summary(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "summary.json"
    try:
        summary: dict[str, Any] = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TraceError(f"{path}: not a bench summary ({exc})") from exc
    return summary


def table_markdown(summary: dict[str, Any]) -> str:
    meta = summary.get("meta", {})
    head = (f"{summary['workflows']} workflows, budget {format_bytes(summary['budget_bytes'])}, "
            f"oversubscription {summary['oversubscription']:.2f}x, backend "
            f"{meta.get('backend', '?')}, speed {meta.get('speed', '?')}x")
    lines = [head, *_bounds(summary), "",
             "| policy | completed | makespan (s) | vs bound | safe | p50 latency (s) | "
             "peak memory | OOM kills | timeouts | attempts | failed attempts | "
             "restartable boundaries |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, p in summary["policies"].items():
        share = p.get("restartable_share")  # optional: a summary may lack it
        vs_bound, safe = p.get("vs_bound"), p.get("safe")
        lines.append(
            f"| {name} | {p['completed']}/{summary['workflows']} | {p['makespan_s']:.1f} | "
            f"{'-' if vs_bound is None else f'{vs_bound:.2f}x'} | "
            f"{'-' if safe is None else ('yes' if safe else 'no')} | "
            f"{p['p50_latency_s']:.1f} | {format_bytes(p['peak_memory_bytes'])} | "
            f"{p['oom_events']} | {p['timeouts']} | {p['attempts']} | {p['failed_attempts']} | "
            f"{'-' if share is None else f'{share:.1%}'} |")
    lines += _cost_lines(summary)
    if "best_safe_baseline" in summary:
        best = summary["best_safe_baseline"]
        lines += ["", "Best safe baseline (static-N or reservation, every workflow completed, "
                      f"no OOM kill): {best or 'none'}."]
    if meta.get("interrupted_during"):
        lines += ["", f"Interrupted while running {meta['interrupted_during']}; "
                      "the policies above finished."]
    return "\n".join(lines) + "\n"


def _cost_lines(summary: dict[str, Any]) -> list[str]:
    """What each run cost besides its time: teardowns and rebuilds, and CPU-seconds by
    where they went (optional: older summaries lack them)."""
    runs = [(name, p) for name, p in summary["policies"].items() if "cpu" in p]
    if not runs:
        return []

    def cell(value: float | int | None, fmt: str = "{:.1f}") -> str:
        return "-" if value is None else fmt.format(value)

    lines = ["", "| policy | teardowns | rebuilds | lifecycle (s) | host CPU (s) | sandboxes | "
                 "controller | other | CPU vs floor |", "|---|---|---|---|---|---|---|---|---|"]
    for name, p in runs:
        cpu = p["cpu"]
        lines.append(
            f"| {name} | {cell(p.get('teardowns'), '{}')} | {cell(p.get('rebuilds'), '{}')} | "
            f"{cell(p.get('lifecycle_s'))} | {cell(cpu.get('host_s'))} | "
            f"{cell(cpu.get('sandboxes_s'))} | {cell(cpu.get('controller_s'))} | "
            f"{cell(cpu.get('other_s'))} | {cell(p.get('cpu_vs_floor'), '{:.2f}x')} |")
    return lines


def _bounds(summary: dict[str, Any]) -> list[str]:
    """The yardsticks' lines (each optional: a summary may lack them)."""
    parts = []
    if summary.get("makespan_bound_s") is not None:
        parts.append(f"longest workflow {summary['makespan_bound_s']:.1f} s")
    if summary.get("memory_bound_s") is not None:
        parts.append(f"memory bound {summary['memory_bound_s']:.1f} s (idle sandboxes "
                     f"resident: {summary.get('memory_bound_resident_s', 0.0):.1f} s)")
    if summary.get("floor_makespan_s") is not None:
        parts.append(f"floor (unconstrained) {summary['floor_makespan_s']:.1f} s")
    if not parts:
        return []
    bound = summary.get("bound_s")
    line = "No policy can finish before " + (f"{bound:.1f} s: " if bound else "") + \
        "the largest of " + ", ".join(parts) + "."
    return [line]


def _series(events: list[dict[str, Any]]) -> tuple[list[float], list[float], list[int]]:
    samples = [e for e in events if e.get("kind") == "sample"]
    return ([e["t"] for e in samples], [e["usage_bytes"] / GIB for e in samples],
            [e["running"] for e in samples])


def draw(run_dir: Path) -> list[Path]:
    """Write table.md, timeline.png and bars.png into `run_dir`; the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = load_summary(run_dir)
    table = run_dir / "table.md"
    table.write_text(table_markdown(summary))
    names = list(summary["policies"])
    if not names:
        return [table]
    budget_gib = summary["budget_bytes"] / GIB

    splits: dict[str, list[WorkflowDelay] | None] = {}
    fig, axes = plt.subplots(len(names), 1, figsize=(10, 2.4 * len(names)), sharex=True,
                             squeeze=False)
    for ax, name in zip(axes[:, 0], names, strict=True):
        logs = [run_dir / name / f for f in ("events.jsonl", "events.jsonl.gz")]
        log = next((p for p in logs if p.exists()), None)
        events = read_events(log) if log is not None else []
        times, usage, running = _series(events)
        if events:
            splits[name] = workflow_delays(events)
        ax.plot(times, usage, color="tab:blue", lw=1, label="memory (GiB)")
        ax.axhline(budget_gib, color="tab:red", ls="--", lw=1, label="budget")
        ax.set_ylabel("GiB")
        ax.set_ylim(0, budget_gib * 1.15)
        twin = ax.twinx()
        twin.step(times, running, color="tab:green", lw=0.8, where="post", label="running")
        twin.set_ylabel("running")
        p = summary["policies"][name]
        ax.set_title(f"{name}: makespan {p['makespan_s']:.0f} s, {p['oom_events']} OOM kills, "
                     f"{p['completed']}/{summary['workflows']} completed", fontsize=9)
    axes[0, 0].legend(loc="upper right", fontsize=7)
    axes[-1, 0].set_xlabel("time (s)")
    fig.tight_layout()
    delays = run_dir / "delays.md"
    delays.write_text(delays_markdown(splits))
    timeline = run_dir / "timeline.png"
    fig.savefig(timeline, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    figures = [("makespan_s", "makespan (s)", 1.0), ("p50_latency_s", "p50 latency (s)", 1.0),
               ("peak_memory_bytes", "peak memory (GiB)", 1 / GIB)]
    for ax, (key, label, scale) in zip(axes, figures, strict=True):
        values = [summary["policies"][n][key] * scale for n in names]
        colors = ["tab:orange" if n.startswith("tenon") else "tab:gray" for n in names]
        ax.bar(names, values, color=colors)
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", rotation=30, labelsize=8)
        if key == "peak_memory_bytes":
            ax.axhline(budget_gib, color="tab:red", ls="--", lw=1)
        if key == "makespan_s" and summary.get("makespan_bound_s") is not None:
            ax.axhline(summary["makespan_bound_s"], color="tab:green", ls="--", lw=1)
    fig.tight_layout()
    bars = run_dir / "bars.png"
    fig.savefig(bars, dpi=110)
    plt.close(fig)
    return [table, delays, timeline, bars]
