"""The benchmarks' timing: alternating blocks and ratios paired per round."""

from __future__ import annotations

import statistics
import time

import pytest

from egraft.testing.timing import alternating_blocks, medians_ms, paired_ratio


def test_paired_ratio_cancels_drift_between_rounds():
    # a takes 1.5x b's time. The host slows down 3x in round 3, between b's block and a's: one
    # round's ratio is off, the median of the rounds' ratios is not; the ratio of the overall
    # medians (a's slow blocks now outnumber its fast ones) is 4.5.
    speed_a, speed_b = [1, 1, 3, 3, 3], [1, 1, 1, 3, 3]
    times = {"a": [[1.5e-3 * s] * 4 for s in speed_a], "b": [[1.0e-3 * s] * 4 for s in speed_b]}
    assert paired_ratio(times, "a", "b") == pytest.approx(1.5)
    medians = medians_ms(times)
    assert medians["a"] / medians["b"] == pytest.approx(4.5)


def test_alternating_blocks_time_every_call_in_rounds():
    def sleeper(seconds):
        return lambda: time.sleep(seconds)

    times = alternating_blocks({"slow": sleeper(0.004), "fast": sleeper(0.002)}, budget_s=0.3, rounds=4, gap_s=0.0)
    assert [len(blocks) for blocks in times.values()] == [4, 4]
    assert len({len(block) for blocks in times.values() for block in blocks}) == 1  # one block size
    assert all(t >= 0.002 for blocks in times.values() for block in blocks for t in block)
    assert 1.3 < paired_ratio(times, "slow", "fast") < 2.2
    assert statistics.median(t for block in times["slow"] for t in block) >= 0.004
