"""The freezer's request and its state are two things: a thaw withdraws a freeze that has
not settled (or that dying tasks made look settled-off), on the scripted v2 tree."""

from __future__ import annotations

import pytest

from tenon.errors import HostError
from tenon.host.domain import WorkloadDomain
from tenon.host.fake import FakeCgroupV2Tree


def make_box(tmp_path):
    tree = FakeCgroupV2Tree(tmp_path / "cg")
    domain = WorkloadDomain.open("tenon", layout=tree.layout())
    box = domain.sandbox("a")
    tree.spawn("tenon/a")
    return tree, box


def test_a_thaw_withdraws_a_freeze_that_never_settled(tmp_path):
    tree, box = make_box(tmp_path)
    tree.stall_freezer("tenon/a")
    with pytest.raises(HostError, match="did not reach frozen=True"):
        box.freeze(timeout_s=0.01)
    assert tree.read("tenon/a", "cgroup.freeze").strip() == "1"
    assert not box.is_frozen()  # the state says thawed, the request says frozen
    thawed = box.thaw()
    assert (thawed.frozen, thawed.changed) == (False, True)
    assert tree.read("tenon/a", "cgroup.freeze").strip() == "0"


def test_a_settled_state_with_its_request_is_unchanged(tmp_path):
    tree, box = make_box(tmp_path)
    assert box.thaw().changed is False
    assert box.freeze().changed is True
    assert box.freeze().changed is False
    assert tree.read("tenon/a", "cgroup.freeze").strip() == "1"
    assert box.thaw().changed is True
    assert box.thaw().changed is False
