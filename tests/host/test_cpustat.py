from __future__ import annotations

import os
from pathlib import Path

import pytest

from tenon.errors import HostError
from tenon.host.cpustat import host_busy_seconds
from tenon.replay.cpu import CpuMark, cpu_spent


def test_busy_time_counts_every_field_but_idle_and_iowait(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    #                user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  100 20 30 5000 700 4 5 6 0 0\ncpu0 50 10 15 2500 350 2 2 3 0 0\n")
    assert host_busy_seconds(stat) == pytest.approx(165 / os.sysconf("SC_CLK_TCK"))


@pytest.mark.parametrize("text", ["cpu0 1 2 3 4 5 6 7 8\n", "cpu  1 2 x 4 5 6 7 8\n", "cpu 1 2\n"])
def test_a_stat_line_the_kernel_would_not_write_is_refused(tmp_path: Path, text: str) -> None:
    stat = tmp_path / "stat"
    stat.write_text(text)
    with pytest.raises(HostError, match="stat"):
        host_busy_seconds(stat)


def test_the_real_host_is_busy_and_the_rest_is_what_sandboxes_and_controller_did_not_use(
) -> None:
    before = CpuMark.now()
    sum(i * i for i in range(2_000_000))  # this process is the controller
    after = CpuMark.now()
    spent = cpu_spent(before, after, sandboxes_s=0.0)
    assert spent["controller_s"] > 0.0
    assert spent["host_s"] >= spent["controller_s"] * 0.5  # ticks are coarser than rusage
    split = cpu_spent(CpuMark(10.0, 1.0), CpuMark(20.0, 3.0), sandboxes_s=5.0)
    assert split == {"host_s": 10.0, "sandboxes_s": 5.0, "controller_s": 2.0, "other_s": 3.0}
