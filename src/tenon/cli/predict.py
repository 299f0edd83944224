"""`tenon predict`: train, evaluate and time the memory-demand predictors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from tenon.cli.errors import fail, require_writable_file, write_text
from tenon.errors import ConfigError, TenonError
from tenon.units import MIB, parse_size

if TYPE_CHECKING:
    from tenon.predict.episodes import Episode
    from tenon.predict.evaluate import Evaluation

predict_app = typer.Typer(
    no_args_is_help=True, help="Train, evaluate and time the memory-demand predictors."
)
console = Console()

Traces = Annotated[list[Path], typer.Argument(help="Trace files (tenon-trace JSONL).")]
JsonOut = Annotated[Path | None, typer.Option("--json", help="Write results here.")]
Heavy = Annotated[str, typer.Option("--heavy", help="Heavy action: measured peak above this size.")]
Seed = Annotated[int, typer.Option(help="Seed of the workflow split or folds.")]


def _fail(exc: Exception) -> NoReturn:
    fail(exc)


def _check_outputs(*paths: tuple[Path | None, str]) -> None:
    """Refuse an unwritable output path before any training or evaluation starts."""
    for path, what in paths:
        if path is not None:
            require_writable_file(path, what=what)


def _episodes(traces: list[Path]) -> list[Episode]:
    from tenon.replay.predictors import episodes_from_traces
    from tenon.replay.trace import load_trace

    episodes = episodes_from_traces(load_trace(path) for path in traces)
    if not episodes:
        raise ConfigError("the traces hold no workflows")
    return episodes


def _write_json(result: dict[str, Any], json_path: Path | None) -> None:
    if json_path is None:
        return
    try:
        write_text(json_path, json.dumps(result, indent=2) + "\n", what="--json")
    except TenonError as exc:
        _fail(exc)
    console.print(f"wrote {json_path}")


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _print_evaluation(title: str, evaluation: Evaluation) -> None:
    table = Table(
        "predictor",
        "MAE MiB",
        "avg MAE",
        "P90 APE %",
        "heavy P %",
        "heavy R %",
        "flagged/heavy",
        title=title,
    )
    for name, s in evaluation.scores.items():
        table.add_row(
            name,
            f"{s.mae_mib:.2f}",
            f"{s.avg_mae_mib:.2f}",
            f"{s.p90_ape_pct:.1f}",
            _pct(s.heavy_precision_pct),
            _pct(s.heavy_recall_pct),
            f"{s.num_flagged} / {s.num_heavy}",
        )
    console.print(table)
    some = next(iter(evaluation.scores.values()))
    console.print(
        f"peak MAE, avg MAE; P90 of |error| / max(measured peak, 16 MiB); heavy precision and "
        f"recall. {evaluation.train_workflows} training workflows, "
        f"{evaluation.test_workflows} test workflows ({some.num_actions} actions)"
    )


@predict_app.command("train")
def train_cmd(
    traces: Traces,
    output: Annotated[Path, typer.Option("--output", "-o", help="Model file to write.")],
    heavy: Heavy = "1024MiB",
) -> None:
    """Fit static, history and forest on every workflow of TRACES; save them as one model."""
    from tenon.predict.model import save_model, train_model

    try:
        _check_outputs((output, "--output"))
        episodes = _episodes(traces)
        model = train_model(episodes, heavy_peak_bytes=parse_size(heavy, what="--heavy"))
        save_model(model, output)
    except TenonError as exc:
        _fail(exc)
    num_actions = sum(len(e.actions) for e in episodes)
    num_heavy = sum(m.peak_bytes > model.heavy_peak_bytes for e in episodes for m in e.actions)
    classifier = "with" if model.forest.classifier is not None else "without (no heavy action)"
    console.print(
        f"{len(episodes)} workflows, {num_actions} actions ({num_heavy} heavy) -> {output}; "
        f"forest of {model.forest.config.num_trees} trees {classifier} a heavy classifier"
    )


@predict_app.command("eval")
def eval_cmd(
    traces: Traces,
    model_path: Annotated[
        Path | None, typer.Option("--model", help="Evaluate this model on every workflow.")
    ] = None,
    folds: Annotated[
        int | None, typer.Option(help="k-fold cross-validation instead of one split.")
    ] = None,
    test_fraction: Annotated[float, typer.Option(help="Share of workflows held out.")] = 0.3,
    seed: Seed = 0,
    heavy: Heavy = "1024MiB",
    json_path: JsonOut = None,
) -> None:
    """Replay held-out workflows causally and score every predictor's peak prediction.

    With --model, its predictors are replayed on every workflow of TRACES (they should be
    new to the model). Without, the predictors are trained on a workflow-level split of
    TRACES (or k folds with --folds) and tested on the workflows left out.
    """
    from tenon.predict.evaluate import evaluate_folds, evaluate_model, evaluate_split
    from tenon.predict.model import load_model

    try:
        if model_path is not None and folds is not None:
            raise ConfigError("give --model or --folds, not both")
        _check_outputs((json_path, "--json"))
        episodes = _episodes(traces)
        if model_path is not None:
            model = load_model(model_path)
            seen = set(model.train_workflows) & {e.workflow_id for e in episodes}
            if seen:
                console.print(
                    f"[yellow]warning:[/yellow] {len(seen)} of {len(episodes)} workflows were "
                    "in the model's training set; their scores are in-sample"
                )
            evaluation = evaluate_model(model, episodes)
            title = f"model {model_path}"
        else:
            heavy_peak_bytes = parse_size(heavy, what="--heavy")
            if folds is not None:
                evaluation = evaluate_folds(
                    episodes, heavy_peak_bytes=heavy_peak_bytes, num_folds=folds, seed=seed
                )
                title = f"{folds}-fold cross-validation by workflow, seed {seed}"
            else:
                evaluation = evaluate_split(
                    episodes,
                    heavy_peak_bytes=heavy_peak_bytes,
                    test_fraction=test_fraction,
                    seed=seed,
                )
                title = f"held-out workflows ({test_fraction:.0%}), seed {seed}"
    except TenonError as exc:
        _fail(exc)
    _print_evaluation(title, evaluation)
    _write_json(evaluation.as_json(), json_path)


@predict_app.command("curve")
def curve_cmd(
    traces: Traces,
    fractions: Annotated[
        str, typer.Option(help="Comma-separated shares of each fold's training workflows.")
    ] = "0.25,0.5,0.75,1",
    folds: Annotated[int, typer.Option(help="Cross-validation folds.")] = 5,
    seed: Seed = 0,
    heavy: Heavy = "1024MiB",
    json_path: JsonOut = None,
) -> None:
    """Learning curve: k-fold scores with less training data per fold."""
    from tenon.predict.evaluate import learning_curve

    try:
        _check_outputs((json_path, "--json"))
        try:
            shares = [float(f) for f in fractions.split(",") if f.strip()]
        except ValueError:
            raise ConfigError(
                f"--fractions: expected numbers like 0.5,1, got {fractions!r}"
            ) from None
        points = learning_curve(
            _episodes(traces),
            heavy_peak_bytes=parse_size(heavy, what="--heavy"),
            fractions=shares,
            num_folds=folds,
            seed=seed,
        )
    except TenonError as exc:
        _fail(exc)
    for fraction, evaluation in points:
        _print_evaluation(f"{fraction:.0%} of each fold's training workflows", evaluation)
    result = {
        "folds": folds,
        "seed": seed,
        "points": [{"train_fraction": f, **e.as_json()} for f, e in points],
    }
    _write_json(result, json_path)


@predict_app.command("bench")
def bench_cmd(
    traces: Traces,
    model_path: Annotated[
        Path | None, typer.Option("--model", help="Model to time (default: train on TRACES).")
    ] = None,
    repeats: Annotated[int, typer.Option(help="Passes over every action.")] = 3,
    json_path: JsonOut = None,
) -> None:
    """Per-action inference latency of each predictor: median and p99 of one predict()."""
    from tenon.predict.latency import time_predictions
    from tenon.predict.model import DEFAULT_HEAVY_PEAK_BYTES, load_model, train_model

    try:
        _check_outputs((json_path, "--json"))
        episodes = _episodes(traces)
        if model_path is not None:
            model = load_model(model_path)
        else:
            model = train_model(episodes, heavy_peak_bytes=DEFAULT_HEAVY_PEAK_BYTES)
        latencies = {
            name: time_predictions(predictor, episodes, repeats=repeats)
            for name, predictor in model.predictors().items()
        }
    except TenonError as exc:
        _fail(exc)
    table = Table("predictor", "median (ms)", "p99 (ms)", "calls")
    for name, latency in latencies.items():
        table.add_row(
            name, f"{latency.median_ms:.3f}", f"{latency.p99_ms:.3f}", str(latency.num_calls)
        )
    console.print(table)
    result = {
        "predictors": {
            name: {"median_ms": lat.median_ms, "p99_ms": lat.p99_ms}
            for name, lat in latencies.items()
        },
        "num_calls": next(iter(latencies.values())).num_calls,
        "num_trees": model.forest.config.num_trees,
        "model": str(model_path) if model_path else "trained on the given traces",
        "heavy_mib": model.heavy_peak_bytes // MIB,
    }
    _write_json(result, json_path)
