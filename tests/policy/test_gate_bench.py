"""`bench_gate_detail`: the slow tail of the gate benchmark comes with what explains it."""

import gc

import pytest

from tenon.replay.gate_bench import bench_gate, bench_gate_detail


@pytest.fixture
def gc_every_allocation():
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    yield
    gc.set_threshold(*thresholds)


def test_collections_during_timed_decisions_are_counted_and_timed(gc_every_allocation) -> None:
    result = bench_gate_detail(20, 4)
    assert result["gc_gen0_during_decisions"] + result["gc_gen1_during_decisions"] > 0
    assert result["gc_ms_during_decisions"] > 0
    assert result["decide_ms_max_without_gc"] == 0.0  # every timed decision collected


def test_detail_extends_the_summary_with_the_tail() -> None:
    gc.collect()
    result = bench_gate_detail(30, 6)
    assert result["sandboxes"] == 30
    assert 0 < result["decide_ms_p50"] <= result["decide_ms_p99"] <= result["decide_ms_max"]
    assert result["decide_ms_max_without_gc"] <= result["decide_ms_max"]
    assert 0 <= result["decide_cpu_ms_p50"] <= result["decide_cpu_ms_p99"]
    assert set(bench_gate(30, 6)) == {"sandboxes", "decide_ms_p50", "decide_ms_p99"}


def test_bench_rejects_an_empty_run() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        bench_gate_detail(0, 5)
