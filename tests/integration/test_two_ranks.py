"""The two-process harness itself (tests/integration/two_ranks.py): results come back per
rank, a rank's failed assertion fails the test with its traceback, and a rank that crashed
or hung fails it naming the rank and its exit code."""
from __future__ import annotations

import os
import time

import pytest

from tests.integration.two_ranks import Rank, on_ranks

pytestmark = pytest.mark.integration


def _echo(rank: Rank, word: str) -> list:
    store = rank.connect()
    rank.meet("echo", store)
    return [rank.rank, word, os.getpid()]


def _assert_on_rank1(rank: Rank) -> None:
    assert rank.rank != 1, "rank 1 disagrees"


def _abort_rank1(rank: Rank) -> None:
    if rank.rank == 1:
        os.abort()


def _hang_rank0(rank: Rank) -> None:
    if rank.rank == 0:
        time.sleep(60)


@pytest.mark.timeout(60)
def test_each_rank_runs_in_its_own_process_and_returns_its_result() -> None:
    (rank0, word0, pid0), (rank1, word1, pid1) = on_ranks(_echo, "hi")
    assert (rank0, rank1, word0, word1) == (0, 1, "hi", "hi")
    assert len({pid0, pid1, os.getpid()}) == 3


@pytest.mark.timeout(60)
def test_a_ranks_failed_assertion_fails_the_test_with_its_traceback() -> None:
    with pytest.raises(AssertionError, match=r"(?s)rank 1 failed in _assert_on_rank1.*"
                                             r"rank 1 disagrees"):
        on_ranks(_assert_on_rank1, await_teardowns=False)


@pytest.mark.timeout(60)
def test_a_crashed_rank_fails_the_test_naming_the_rank_and_exit_code() -> None:
    with pytest.raises(AssertionError, match=r"rank 1 of _abort_rank1 crashed: killed by "
                                             r"SIGABRT \(exit code -6\)"):
        on_ranks(_abort_rank1, await_teardowns=False)


@pytest.mark.timeout(60)
def test_a_rank_past_the_timeout_is_killed_and_named() -> None:
    started = time.monotonic()
    with pytest.raises(AssertionError, match="rank 0 of _hang_rank0 did not finish within"):
        on_ranks(_hang_rank0, timeout_s=1.5, await_teardowns=False)
    assert time.monotonic() - started < 15.0
