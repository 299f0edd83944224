"""The sandbox uid allocator: distinct uids, reuse of an agent's previous one, shared across
allocators through their lock files, and the clash check."""

from __future__ import annotations

from pathlib import Path

import pytest

from tenon.errors import SandboxError
from tenon.sandbox.uids import UidAllocator


def make_allocator(tmp_path: Path, *, first: int = 200_000, num_uids: int = 4) -> UidAllocator:
    return UidAllocator(first, num_uids, lock_dir=tmp_path / "locks", etc=tmp_path / "etc")


def test_live_uids_are_distinct_and_exhaustion_is_an_error(tmp_path):
    uids = make_allocator(tmp_path)
    held = [uids.acquire() for _ in range(4)]
    assert sorted(held) == [200_000, 200_001, 200_002, 200_003]
    with pytest.raises(SandboxError, match="all 4 sandbox uids"):
        uids.acquire()
    uids.release(held[1])
    assert uids.acquire() == held[1]


def test_preferred_uid_is_reused_when_free(tmp_path):
    uids = make_allocator(tmp_path)
    assert uids.acquire(preferred=200_002) == 200_002
    assert uids.acquire(preferred=200_002) != 200_002  # taken: another one
    assert uids.acquire(preferred=1000) in uids  # outside the range: ignored


def test_release_is_idempotent_and_leaves_no_lock_file(tmp_path):
    uids = make_allocator(tmp_path)
    uid = uids.acquire()
    assert (tmp_path / "locks" / str(uid)).exists()
    uids.release(uid)
    uids.release(uid)
    assert list((tmp_path / "locks").iterdir()) == []
    assert uids.held() == []


def test_allocators_sharing_a_lock_dir_never_hand_out_the_same_uid(tmp_path):
    """Two controllers on one host (here two allocators) see each other's uids."""
    first, second = make_allocator(tmp_path), make_allocator(tmp_path)
    a = first.acquire()
    b = second.acquire(preferred=a)
    assert a != b
    first.release(a)
    assert second.acquire(preferred=a) == a


def test_next_fit_does_not_hand_a_released_uid_straight_back(tmp_path):
    uids = make_allocator(tmp_path)
    a = uids.acquire()
    uids.release(a)
    assert uids.acquire() != a


def test_check_reports_users_groups_and_subordinate_ranges_in_the_range(tmp_path):
    etc = tmp_path / "etc" / "etc"
    etc.mkdir(parents=True)
    (etc / "passwd").write_text("root:x:0:0::/root:/bin/sh\nsvc:x:200001:200001::/:/bin/sh\n")
    (etc / "group").write_text("root:x:0:\n")
    (etc / "subuid").write_text("alice:100000:65536\nbob:199000:2000\n")
    (etc / "subgid").write_text("alice:100000:65536\n")
    problems = make_allocator(tmp_path).check()
    assert len(problems) == 2
    assert "'svc' uses id 200001" in problems[0]
    assert "bob:199000:2000 overlaps" in problems[1]


def test_the_default_range_is_clear_on_this_host():
    assert UidAllocator().check() == []


@pytest.mark.parametrize(("first", "num_uids"), [(1000, 10), (200_000, 0), (2**32 - 5, 10)])
def test_bad_ranges_are_refused(first, num_uids):
    with pytest.raises(ValueError, match="uid range"):
        UidAllocator(first, num_uids)
