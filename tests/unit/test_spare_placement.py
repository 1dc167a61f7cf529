"""Where the pool puts warm spares: on the nodes running the fewest ranks and spares."""
from __future__ import annotations

from phalanx.spares.pool import Spare, SparePool, least_used


def test_a_spare_goes_to_the_node_running_the_fewest_ranks() -> None:
    # 4 ranks round robin on 3 nodes: node 0 runs ranks 0 and 3
    assert least_used([0, 1, 2], [0, 1, 2, 0]) == 1
    assert least_used([0, 1, 2], [0, 1, 2, 0, 1]) == 2       # node 1 holds a spare now
    assert least_used([0, 1], [0, 1, 0, 1]) == 0             # equals: the lowest index
    assert least_used([2], [0, 1, 2, 0]) == 2                # only the live nodes count
    assert least_used([0, 1], []) == 0


class _Recording(SparePool):
    """The pool's placement without Ray: ``_add`` records the node instead of starting an
    actor."""

    def _add(self, node: int) -> Spare:
        spare = Spare(f"spare{self._serial}", node, None, None)
        self._serial += 1
        self._spares[spare.spare_id] = spare
        return spare


def _pool(count: int, rank_nodes: list[int]) -> _Recording:
    return _Recording(count, "examples/train_mlp.py:main", 1, "", 0.25, str, "job",
                      rank_nodes=lambda: rank_nodes)


def test_the_pool_starts_and_refills_spares_on_the_least_used_nodes() -> None:
    ranks = [0, 1, 2, 0]      # 4 ranks on 3 nodes
    pool = _pool(2, ranks).start([0, 1, 2])
    assert sorted(s.node for s in pool._spares.values()) == [1, 2]   # never on node 0
    pool._spares.pop("spare0")            # the spare on node 1 was promoted
    ranks[1] = 1                           # into rank 1 (its node is now node 1 again)
    pool.refill([0, 1, 2])
    assert sorted(s.node for s in pool._spares.values()) == [1, 2]
    # node 1 and 2 lost: the refill goes to the one live node
    pool._spares.clear()
    pool.refill([0])
    assert [s.node for s in pool._spares.values()] == [0, 0]
