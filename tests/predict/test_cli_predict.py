"""`tenon predict train / eval / curve / bench` on a small synthetic trace."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from typer.testing import CliRunner

from tenon.cli.main import app
from tenon.predict.features import FEATURE_VERSION
from tenon.predict.model import load_model, save_model

from .factories import big_family_trace, write

runner = CliRunner()
SCORE_KEYS = {"mae_mib", "p90_ape_pct", "heavy_precision_pct", "heavy_recall_pct"}


def invoke(*args: str | Path) -> tuple[int, str]:
    """Exit code and output with all whitespace removed (rich wraps lines at any width)."""
    result = runner.invoke(app, ["predict", *map(str, args)])
    if result.exit_code not in (0, 2):  # anything else is an unhandled exception
        raise AssertionError(f"exit {result.exit_code}: {result.output}") from result.exception
    return result.exit_code, "".join(result.output.split())


def squeeze(text: str) -> str:
    return "".join(text.split())


def test_train_then_eval_with_the_model(tmp_path: Path) -> None:
    trace = write(tmp_path, big_family_trace())
    model_path = tmp_path / "model.joblib"
    code, output = invoke("train", trace, "-o", model_path)
    assert code == 0, output
    assert squeeze("12 workflows, 144 actions (8 heavy)") in output
    assert load_model(model_path).train_workflows[0] == "big-0"
    json_path = tmp_path / "out" / "eval.json"
    code, output = invoke("eval", trace, "--model", model_path, "--json", json_path)
    assert code == 0, output
    assert squeeze("in-sample") in output  # the model was trained on these very workflows
    result = json.loads(json_path.read_text())
    assert set(result) == {"predictors", "train_workflows", "test_workflows"}
    assert set(result["predictors"]) == {"static", "history", "forest"}
    assert all(set(figures) == SCORE_KEYS for figures in result["predictors"].values())
    assert (result["train_workflows"], result["test_workflows"]) == (12, 12)


def test_eval_without_a_model_splits_by_workflow_or_folds(tmp_path: Path) -> None:
    trace = write(tmp_path, big_family_trace())
    split_json, folds_json = tmp_path / "split.json", tmp_path / "folds.json"
    code, output = invoke("eval", trace, "--json", split_json)
    assert code == 0, output
    split = json.loads(split_json.read_text())
    assert split["train_workflows"] + split["test_workflows"] == 12
    assert split["test_workflows"] == 3  # 30% of each stratum, rounded: 1 of 4 big, 2 of 8
    code, output = invoke("eval", trace, "--folds", "3", "--json", folds_json)
    assert code == 0, output
    assert json.loads(folds_json.read_text())["test_workflows"] == 12


def test_curve_and_bench_write_json(tmp_path: Path) -> None:
    trace = write(tmp_path, big_family_trace())
    curve_json, bench_json = tmp_path / "curve.json", tmp_path / "bench.json"
    code, output = invoke(
        "curve", trace, "--fractions", "0.5,1", "--folds", "3", "--json", curve_json
    )
    assert code == 0, output
    curve = json.loads(curve_json.read_text())
    assert [p["train_fraction"] for p in curve["points"]] == [0.5, 1.0]
    code, output = invoke("bench", trace, "--repeats", "1", "--json", bench_json)
    assert code == 0, output
    bench = json.loads(bench_json.read_text())
    assert set(bench["predictors"]) == {"static", "history", "forest"}
    assert bench["num_calls"] == 144
    assert bench["predictors"]["forest"]["median_ms"] > 0


def test_errors_name_the_problem_and_exit_2_without_a_traceback(tmp_path: Path) -> None:
    trace = write(tmp_path, big_family_trace())
    code, output = invoke("eval", tmp_path / "missing.jsonl")
    assert code == 2
    assert squeeze("missing.jsonl") in output
    assert squeeze("cannot read trace") in output
    code, output = invoke("eval", trace, "--model", tmp_path / "nope.joblib")
    assert code == 2
    assert squeeze("no such model file") in output
    model_path = tmp_path / "model.joblib"
    invoke("train", trace, "-o", model_path)
    stale = dataclasses.replace(load_model(model_path), feature_version=FEATURE_VERSION + 1)
    save_model(stale, model_path)
    code, output = invoke("bench", trace, "--model", model_path)
    assert code == 2
    assert squeeze(f"feature version {FEATURE_VERSION + 1}") in output
    assert "Traceback" not in output
    code, output = invoke("eval", trace, "--model", model_path, "--folds", "3")
    assert code == 2
    assert squeeze("not both") in output
