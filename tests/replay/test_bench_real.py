"""The replay bench on the real process backend: Ctrl-C cleans up and keeps partial results."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tenon.sandbox import launcher

pytestmark = [pytest.mark.sandbox, pytest.mark.cgroups, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO / "bench" / "traces" / "agentcgroup-haiku.jsonl"


def _need_real_sandboxes() -> None:
    if os.geteuid() != 0:
        pytest.skip("real sandboxes need root")
    if problems := launcher.check():
        pytest.skip(problems[0])
    if not Path("/var/lib/tenon/images").exists():
        pytest.skip("base image missing: run `tenon image build`")


def _domains() -> set[str]:
    return {Path(p).name for p in glob.glob("/sys/fs/cgroup/*/tenon-*")}


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a non-interactive shell's `&` does


@pytest.mark.parametrize(
    ("signum", "preexec"),
    [(signal.SIGINT, None), (signal.SIGINT, _ignore_sigint), (signal.SIGTERM, None)],
    ids=["ctrl-c", "sigint-inherited-ignored", "sigterm"],
)
def test_interrupt_removes_sandboxes_and_cgroups_and_keeps_partial_results(
    tmp_path: Path, signum: signal.Signals, preexec: Any
) -> None:
    _need_real_sandboxes()
    before = _domains()
    out = tmp_path / "run"
    tenon = Path(sys.executable).parent / "tenon"
    cmd = [str(tenon), "bench", "--trace", str(TRACE), "--budget", "2GiB", "--backend",
           "process", "--speed", "20", "--qps", "6", "--window", "1s", "--policies",
           "eager,tenon", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            cwd=REPO, start_new_session=True, preexec_fn=preexec)
    try:
        deadline = time.monotonic() + 120
        # interrupt once eager has finished and tenon's sandboxes are running (a fixed sleep
        # after its event log appeared sometimes let tenon finish first)
        events = out / "tenon" / "events.jsonl"
        while time.monotonic() < deadline and not (
            events.exists() and '"action_start"' in events.read_text()
        ):
            time.sleep(0.2)
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        os.kill(proc.pid, signum)
        output = proc.communicate(timeout=120)[0].decode()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, output
    assert "interrupted" in output
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["policies"]) == ["eager"]  # the finished policy is kept
    assert summary["meta"]["interrupted_during"] == "tenon"
    # every cgroup the bench made is gone (rmdir succeeds only once its processes are)
    assert _domains() <= before
