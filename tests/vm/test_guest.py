"""The test VM is what it claims to be: a pure cgroup v2 hierarchy with every controller
enabled for children, and a kernel that offers sched_ext."""

from __future__ import annotations

from pathlib import Path

import pytest

from tenon.host.layout import detect_layout
from tenon.host.types import CgroupVersion

pytestmark = pytest.mark.vm


def test_the_guest_has_a_pure_v2_hierarchy_with_every_controller_delegated() -> None:
    layout = detect_layout()
    assert layout.version is CgroupVersion.V2
    assert layout.missing == []
    root = Path("/sys/fs/cgroup")
    delegated = set((root / "cgroup.subtree_control").read_text().split())
    assert {"memory", "cpu", "pids", "io"} <= delegated
    assert not Path("/sys/fs/cgroup/memory").exists()  # no v1 hierarchy beside it


def test_the_guest_kernel_offers_sched_ext_and_btf() -> None:
    assert Path("/sys/kernel/sched_ext/state").read_text().strip() in {"disabled", "enabled"}
    assert Path("/sys/kernel/btf/vmlinux").stat().st_size > 0
