"""The execution loop's sampling on real process sandboxes: nothing of theirs stays open."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tenon.replay.sampling_bench import bench_sampling
from tenon.sandbox import launcher

pytestmark = [pytest.mark.sandbox, pytest.mark.cgroups]
STATE_DIR = Path("/var/lib/tenon")


def _need_real_sandboxes() -> None:
    if os.geteuid() != 0:
        pytest.skip("real sandboxes need root")
    if problems := launcher.check():
        pytest.skip(problems[0])
    if not (STATE_DIR / "images").exists():
        pytest.skip("base image missing: run `tenon image build`")


def _open_cgroup_files(domain_prefix: str) -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor listdir itself used, closed by now
            continue
        if target.startswith("/sys/fs/cgroup/") and f"/{domain_prefix}" in target:
            found.append(target)
    return found


async def test_sampled_sandboxes_leave_no_descriptor_open_once_destroyed() -> None:
    _need_real_sandboxes()
    result = await bench_sampling(num_sandboxes=4, seconds=0.3, state_dir=STATE_DIR)
    assert result["ticks"] >= 2  # every sandbox was sampled, so its files were kept open
    assert _open_cgroup_files("tenon-bench-") == []
