"""The commit computation at scale: 10,000 ranks on 1,250 keepers (issue 21, item 5)."""
from __future__ import annotations

import time

import pytest

from phalanx.runtime.commit import KeeperReport, committed_step

pytestmark = pytest.mark.unit

NODES, PER_NODE = 1250, 8


def reports_at(step: int, lagging_rank: int | None = None) -> dict[str, KeeperReport]:
    """Rank r on node r mod N, its replica on node r+1 mod N; each keeper holds three local
    steps and two replica steps of each rank, as a real keeper reports them. The lagging
    rank's replica holds one step less."""
    local: dict[int, dict[int, tuple[int, ...]]] = {n: {} for n in range(NODES)}
    held: dict[int, dict[int, tuple[int, ...]]] = {n: {} for n in range(NODES)}
    for rank in range(NODES * PER_NODE):
        local[rank % NODES][rank] = (step - 2, step - 1, step)
        newest = step - 1 if rank == lagging_rank else step
        held[(rank + 1) % NODES][rank] = (newest - 1, newest)
    return {f"node{n}": KeeperReport(f"node{n}", ("10.0.0.1", 40000 + n), local[n], held[n])
            for n in range(NODES)}


@pytest.mark.timeout(60)
def test_ten_thousand_ranks_on_1250_keepers_commit_in_well_under_a_poll() -> None:
    ranks = list(range(NODES * PER_NODE))
    reports, lagging = reports_at(1000), reports_at(1000, lagging_rank=9999)
    assert committed_step(reports, ranks, factor=1) == 1000
    assert committed_step(lagging, ranks, factor=1) == 999
    assert committed_step(reports, ranks, factor=2) == -1     # one replica each
    started = time.perf_counter()
    committed_step(reports, ranks, factor=1)
    elapsed = time.perf_counter() - started
    # the launcher reads the reports every 0.5 s; a loop over every report per rank took
    # 4.5 s here (O(ranks x keepers)), one pass over what the keepers hold takes ~0.07 s
    assert elapsed < 1.0, f"committed_step took {elapsed:.2f} s for {len(ranks)} ranks"
