"""The per-step measure of ``bench/replication.py``: the snapshots' share of a loop."""
from __future__ import annotations

import pytest

from bench.replication import snapshot_share

pytestmark = pytest.mark.unit


def test_a_loop_without_slow_steps_near_captures_has_no_share() -> None:
    assert snapshot_share([0.01] * 50, [10, 30], window=3)["share"] == pytest.approx(0.0)


def test_the_share_is_the_excess_of_the_windows_over_the_plain_mean() -> None:
    steps = [0.01] * 40
    steps[0] = 0.05                    # the first capture (slot allocation) at step 0
    steps[10], steps[11] = 0.02, 0.015  # a capture ends step 10, the next step feels it
    steps[30] = 0.03                   # outside every window: host noise, part of the mean
    got = snapshot_share(steps, [10], window=2)
    plain = (0.01 * 35 + 0.03) / 36     # the 36 steps outside {0} and {10, 11, 12}
    assert got["plain_step_ms"] == pytest.approx(plain * 1e3)
    excess = (0.05 - plain) + (0.02 - plain) + (0.015 - plain) + (0.01 - plain)
    assert got["excess_s"] == pytest.approx(excess)
    assert got["share"] == pytest.approx(excess / sum(steps))
    assert got["captures"] == 1


def test_windows_stop_at_the_end_of_the_loop() -> None:
    got = snapshot_share([0.01] * 9 + [0.02], [9], window=8)
    assert got["excess_s"] == pytest.approx(0.02 - 0.01 + 0.0)   # step 0 is plain-timed


def test_a_capture_every_step_leaves_nothing_to_compare_with() -> None:
    assert snapshot_share([0.01] * 10, list(range(10)), window=2)["share"] is None
