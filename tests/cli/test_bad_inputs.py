"""Every bad input the CLI accepts is refused with one line naming it, exit 2, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tenon.cli.main import app
from tenon.replay.trace import Action, Memory, Step, Trace, Workflow, make_header, write_trace

MIB = 1 << 20
HUGE_DIGITS = "1" + "0" * 400


def make_workflow(wid: str, *, submit_s: float = 0.0, peak_mib: int = 200) -> Workflow:
    memory = Memory(avg_bytes=peak_mib * MIB // 2, peak_bytes=peak_mib * MIB,
                    resident_after_bytes=0)
    action = Action(command="pytest -x", tool="Bash", action_class="test_runner",
                    duration_s=2.0, memory=memory)
    return Workflow(id=wid, submit_s=submit_s, base_image="tenon-base:bookworm", family="demo",
                    steps=[Step(model_wait_s=1.0, action=action)] * 2)


def write_small_trace(path: Path) -> Path:
    trace = Trace(header=make_header("test"),
                  workflows=[make_workflow("a"), make_workflow("b", submit_s=5.0)])
    return write_trace(trace, path)


def write_trace_with_submit(path: Path, submit_s: str) -> Path:
    """A trace whose second workflow is submitted at `submit_s`, spelled as raw JSON (so
    `Infinity`, which Python's json module reads, can be written)."""
    write_small_trace(path)
    lines = path.read_text().splitlines()
    record = json.loads(lines[2])
    record["submit_s"] = "SUBMIT"
    lines[2] = json.dumps(record).replace('"SUBMIT"', submit_s)
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def paths(tmp_path: Path) -> dict[str, Path]:
    """A valid trace, a run directory and a regular file that no output may be written under."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    return {"trace": write_small_trace(tmp_path / "trace.jsonl"), "out": tmp_path / "run",
            "blocker": blocker, "tmp": tmp_path}


def bench(paths: dict[str, Path], *extra: str) -> list[str]:
    return ["bench", "--trace", str(paths["trace"]), "--backend", "sim",
            "--policies", "tenon", "--out", str(paths["out"]), *extra]


# (id, argv builder, words the error line must contain)
CASES = [
    ("qps-word", lambda p: bench(p, "--qps", "abc"), ["--qps", "'abc'"]),
    ("qps-list-word", lambda p: bench(p, "--qps", "1,abc"), ["--qps", "'abc'"]),
    ("qps-infinite", lambda p: bench(p, "--qps", "inf"), ["--qps", "finite"]),
    ("qps-absurd", lambda p: bench(p, "--qps", "1e9"), ["--qps", "at most"]),
    ("qps-sweep-word", lambda p: bench(p, "--sweep", "qps=1,abc"), ["--qps", "'abc'"]),
    ("qps-list-and-sweep", lambda p: bench(p, "--qps", "1,2", "--sweep", "red_fraction=0.5"),
     ["--qps", "not both"]),
    ("qps-and-qps-sweep", lambda p: bench(p, "--qps", "1", "--sweep", "qps=1,2"),
     ["--qps", "not both"]),
    ("budget-beyond-int64", lambda p: bench(p, "--budget", "99999999999TiB"),
     ["--budget", "64-bit"]),
    ("budget-float-overflow", lambda p: bench(p, "--budget", HUGE_DIGITS + "GiB"),
     ["--budget", "64-bit"]),
    ("budget-zero", lambda p: bench(p, "--budget", "0"), ["--budget"]),
    ("budget-below-largest-action", lambda p: bench(p, "--budget", "1MiB"),
     ["--budget", "largest single action"]),
    ("window-infinite", lambda p: bench(p, "--qps", "1", "--window", "inf"),
     ["--window", "finite"]),
    ("window-word", lambda p: bench(p, "--window", "soon"), ["--window", "'soon'"]),
    ("speed-nan", lambda p: bench(p, "--speed", "nan"), ["--speed", "finite"]),
    ("speed-past-a-week", lambda p: bench(p, "--speed", "1e-9"), ["--speed", "week"]),
    ("workflows-absurd", lambda p: bench(p, "--qps", "1", "--workflows", "1000000"),
     ["--workflows", "100000"]),
    ("backend-unknown", lambda p: bench(p, "--backend", "vm"), ["--backend", "'sim'"]),
    ("predictor-unknown", lambda p: bench(p, "--predictor", "crystal-ball"), ["--predictor"]),
    ("policy-unknown", lambda p: bench(p, "--policies", "tenon,nope"), ["--policies", "'nope'"]),
    ("set-unknown", lambda p: bench(p, "--set", "nope=1"), ["--set nope", "unknown setting"]),
    ("set-infinite", lambda p: bench(p, "--set", "red_fraction=inf"),
     ["--set red_fraction", "finite"]),
    ("sweep-out-of-bounds", lambda p: bench(p, "--sweep", "red_fraction=0.5,7"),
     ["--set red_fraction"]),
    ("bench-out-under-file", lambda p: bench(p)[:-1] + [str(p["blocker"] / "run")],
     ["--out", "a-file"]),
    ("bench-json-under-file", lambda p: bench(p, "--json", str(p["blocker"] / "r.json")),
     ["--json", "not a directory"]),
    ("bench-json-is-dir", lambda p: bench(p, "--json", str(p["tmp"])),
     ["--json", "is a directory"]),
    ("bench-state-dir-file", lambda p: bench(p, "--backend", "process", "--state-dir",
                                             str(p["blocker"])), ["--state-dir"]),
    ("trace-submit-infinite", lambda p: bench(p)[:2] + [
        str(write_trace_with_submit(p["tmp"] / "inf.jsonl", "Infinity"))] + bench(p)[3:],
     ["inf.jsonl:3", "submit_s", "finite"]),
    ("trace-submit-absurd", lambda p: bench(p)[:2] + [
        str(write_trace_with_submit(p["tmp"] / "huge.jsonl", "1e300"))] + bench(p)[3:],
     ["huge.jsonl:3", "submit_s", "604800"]),
    ("trace-submit-past-a-week", lambda p: bench(p)[:2] + [
        str(write_trace_with_submit(p["tmp"] / "week.jsonl", "604800"))] + bench(p)[3:],
     ["week"]),
    ("demo-budget-zero", lambda p: ["demo", "--budget", "0", "--state-dir", str(p["tmp"])],
     ["--budget", "64 MiB"]),
    ("demo-budget-overflow", lambda p: ["demo", "--budget", HUGE_DIGITS], ["--budget", "64-bit"]),
    ("demo-no-agents", lambda p: ["demo", "--agents", "0", "--state-dir", str(p["tmp"])],
     ["--agents"]),
    ("demo-state-dir-file", lambda p: ["demo", "--state-dir", str(p["blocker"])],
     ["--state-dir", "not a directory"]),
    ("import-agentcgroup-output", lambda p: ["import", "agentcgroup", str(p["tmp"]), "-o",
                                             str(p["blocker"] / "t.jsonl")], ["--output"]),
    ("import-miniswe-output", lambda p: ["import", "mini-swe-agent", str(p["tmp"]), "-o",
                                         str(p["blocker"] / "t.jsonl")], ["--output"]),
    ("predict-train-output", lambda p: ["predict", "train", str(p["trace"]), "-o",
                                        str(p["blocker"] / "m.json")], ["--output"]),
    ("predict-eval-json", lambda p: ["predict", "eval", str(p["trace"]), "--json",
                                     str(p["blocker"] / "e.json")], ["--json"]),
    ("predict-curve-json", lambda p: ["predict", "curve", str(p["trace"]), "--json",
                                      str(p["blocker"] / "c.json")], ["--json"]),
    ("predict-bench-json", lambda p: ["predict", "bench", str(p["trace"]), "--json",
                                      str(p["blocker"] / "b.json")], ["--json"]),
    ("predict-heavy-overflow", lambda p: ["predict", "eval", str(p["trace"]), "--heavy",
                                          HUGE_DIGITS + "GiB"], ["--heavy", "64-bit"]),
    ("gate-json", lambda p: ["bench", "gate", "--sandboxes", "2", "--iterations", "1",
                             "--json", str(p["blocker"] / "g.json")], ["--json"]),
    ("lifecycle-no-runs", lambda p: ["bench", "lifecycle", "--runs", "0"], ["--runs"]),
    ("gate-absurd-sandboxes", lambda p: ["bench", "gate", "--sandboxes", "100000000"],
     ["--sandboxes", "process ids"]),
    ("sampling-absurd-sandboxes", lambda p: ["bench", "sampling", "--sandboxes", "100000000"],
     ["--sandboxes", "process ids"]),
    ("demo-absurd-agents", lambda p: ["demo", "--agents", "100000000"],
     ["--agents", "process ids"]),
    ("sampling-forever", lambda p: ["bench", "sampling", "--seconds", "inf"],
     ["--seconds", "finite"]),
    ("image-build-state-dir", lambda p: ["image", "build", "--state-dir", str(p["blocker"])],
     ["--state-dir"]),
    ("serve-budget-word", lambda p: serve(p, "--budget", "lots"), ["--budget", "'lots'"]),
    ("serve-listen-no-port", lambda p: serve(p, "--listen", "localhost"), ["--listen"]),
    ("serve-state-dir-file", lambda p: serve(p, "--state-dir", str(p["blocker"])),
     ["--state-dir", "not a directory"]),
    ("serve-keys-file-missing", lambda p: serve(p, "--api-keys-file", str(p["tmp"] / "no")),
     ["--api-keys-file"]),
    ("serve-keys-file-empty", lambda p: serve(p, "--api-keys-file", str(p["blocker"].with_name(
        "empty"))), ["--api-keys-file", "no key"]),
    ("serve-set-unknown", lambda p: serve(p, "--set", "nope=1"), ["--set nope",
                                                                  "unknown setting"]),
    ("serve-max-file-word", lambda p: serve(p, "--max-file-size", "big"),
     ["--max-file-size"]),
]


def serve(paths: dict[str, Path], *extra: str) -> list[str]:
    """`tenon serve` with a bad input: refused before any runtime opens."""
    (paths["tmp"] / "empty").write_text("# no key here\n")
    args = {"--budget": "1GiB", "--state-dir": str(paths["tmp"] / "serve")}
    for flag, value in zip(extra[::2], extra[1::2], strict=True):
        args[flag] = value
    return ["serve", *[x for pair in args.items() for x in pair]]


@pytest.mark.parametrize(("argv", "words"), [pytest.param(a, w, id=i) for i, a, w in CASES])
def test_bad_input_is_one_line_and_exit_2(paths, argv, words) -> None:
    result = CliRunner().invoke(app, argv(paths))
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), result.exception  # not an uncaught error
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    for word in words:
        assert word in lines[0], lines[0]


def test_a_bad_sweep_point_stops_the_sweep_before_any_point_runs(paths) -> None:
    result = CliRunner().invoke(app, bench(paths, "--sweep", "qps=1,abc"))
    assert result.exit_code == 2
    assert not (paths["out"] / "qps-1").exists()  # the good first point did not run


def test_the_installed_command_prints_one_line_on_stderr(paths) -> None:
    tenon = Path(sys.executable).with_name("tenon")
    done = subprocess.run([str(tenon), *bench(paths, "--qps", "abc")], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.strip() == "error: --qps: expected a number like 16, got 'abc'"


def test_a_good_input_still_runs(paths) -> None:
    """The checks refuse only what is wrong: the same small trace replays with sane values."""
    result = CliRunner().invoke(app, bench(paths, "--qps", "1", "--window", "2s",
                                           "--json", str(paths["tmp"] / "r.json")))
    assert result.exit_code == 0, result.output
    assert json.loads((paths["tmp"] / "r.json").read_text())["policies"]


@pytest.mark.sandbox
def test_serve_on_a_taken_port_is_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    import os
    import socket

    before = set(Path("/sys/fs/cgroup/memory").glob("tenon-*"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "tenon.cli.main", "serve", "--budget", "1GiB",
             "--state-dir", str(tmp_path / "serve"), "--image-dir", "/var/lib/tenon",
             "--listen", f"127.0.0.1:{port}"],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "TENON_API_KEYS": "k"})
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: cannot listen on 127.0.0.1:"), result.stderr
    assert "Traceback" not in result.stderr
    assert set(Path("/sys/fs/cgroup/memory").glob("tenon-*")) <= before, "domain removed"
