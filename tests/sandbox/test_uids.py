"""The sandbox uid allocator: distinct uids, reuse of an agent's previous one, shared across
allocators through their lock files, and the clash check."""

from __future__ import annotations

from pathlib import Path

import pytest

from tenon.errors import SandboxError
from tenon.sandbox.uids import IdRangeAllocator, UidAllocator


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


def make_ranges(tmp_path: Path, num_ranges: int = 3) -> IdRangeAllocator:
    return IdRangeAllocator(1_000_000, num_ranges, lock_dir=tmp_path / "ranges",
                            etc=tmp_path / "etc")


def test_id_ranges_are_disjoint_blocks_of_65536_reused_by_preference(tmp_path):
    ranges = make_ranges(tmp_path)
    held = [ranges.acquire() for _ in range(3)]
    assert held == [1_000_000, 1_065_536, 1_131_072]
    with pytest.raises(SandboxError, match="all 3"):
        ranges.acquire()
    ranges.release(held[1])
    assert ranges.acquire(preferred=1_000_001) == held[1]  # not a range's start: ignored
    ranges.release(held[2])
    assert ranges.acquire(preferred=held[2]) == held[2]  # an agent's previous range back
    assert 1_000_001 not in ranges
    assert held[2] in ranges


def test_id_range_check_covers_every_id_of_every_range(tmp_path):
    etc = tmp_path / "etc" / "etc"
    etc.mkdir(parents=True)
    (etc / "passwd").write_text("svc:x:1100000:1100000::/:/bin/sh\n")  # inside range 1
    (etc / "subuid").write_text("alice:1196607:10\n")  # overlaps the end of range 2
    problems = make_ranges(tmp_path).check()
    assert len(problems) == 2


def test_id_ranges_follow_the_per_sandbox_uids():
    first = IdRangeAllocator()
    uids = UidAllocator()
    assert first.first == uids.first + uids.num_uids
    assert first.check() == []
