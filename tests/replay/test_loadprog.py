"""The load program really allocates its peak and leaves its resident file behind."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tenon.replay.loadprog import LOAD_PROGRAM_SOURCE, RESIDENT_FILE_NAME, load_command

MIB = 1 << 20
# Measure in a fresh process so no earlier child's maxrss counts.
_MEASURE = """
import resource, subprocess, sys
done = subprocess.run(["bash", "-c", sys.argv[1]], capture_output=True, text=True)
print(done.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
print(done.stdout.strip())
"""


def run_load(command: str) -> tuple[int, int, dict]:
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, command],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    first, summary = done.stdout.splitlines()[:2]
    returncode, maxrss_bytes = map(int, first.split())
    return returncode, maxrss_bytes, json.loads(summary)


def test_reaches_peak_and_leaves_resident_file(tmp_path):
    command = load_command(32 * MIB, 64 * MIB, 0.5, 8 * MIB, tmp_dir=str(tmp_path))
    returncode, maxrss_bytes, summary = run_load(command)
    assert returncode == 0
    assert summary["anon_peak_bytes"] == 64 * MIB
    # the interpreter itself adds ~10-20 MiB
    assert 64 * MIB <= maxrss_bytes <= 64 * MIB + 40 * MIB
    assert summary["elapsed_s"] >= 0.5
    assert (tmp_path / RESIDENT_FILE_NAME).stat().st_size == 8 * MIB


def test_levels_account_for_existing_resident(tmp_path):
    (tmp_path / RESIDENT_FILE_NAME).write_bytes(b"x" * (16 * MIB))
    command = load_command(20 * MIB, 48 * MIB, 0.2, 4 * MIB, tmp_dir=str(tmp_path))
    returncode, _, summary = run_load(command)
    assert returncode == 0
    assert summary["anon_peak_bytes"] == 32 * MIB  # 48 MiB total with 16 MiB already resident
    assert (tmp_path / RESIDENT_FILE_NAME).stat().st_size == 4 * MIB


@pytest.mark.parametrize(("avg_fraction", "duration_s"), [(0.5, 10.0), (0.9, 3.0), (0.2, 1.0)])
def test_shape_time_average(avg_fraction, duration_s):
    namespace: dict = {}
    exec(LOAD_PROGRAM_SOURCE.replace("sys.exit(main(sys.argv))", ""), namespace)  # noqa: S102
    level_at = namespace["level_at"]
    peak, avg, num = 1000.0, 1000.0 * avg_fraction, 10_000
    levels = [level_at((i + 0.5) * duration_s / num, duration_s, avg, peak) for i in range(num)]
    assert max(levels) == peak
    assert sum(levels) / num == pytest.approx(avg, rel=0.01)


def test_command_validates():
    with pytest.raises(ValueError, match="peak_bytes"):
        load_command(10, 5, 1.0, 0)
    assert load_command(1, 2, 0.1, 0).startswith("python3 -S -c ")
