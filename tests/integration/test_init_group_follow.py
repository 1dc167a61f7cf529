"""A replacement whose script calls ``init_process_group()`` while a second fault fences a
newer generation must not wait out the group timeout for peers that moved on (the
``spare_exhausted`` drill hit it once deaths were noticed one by one: its first spare
waited 30 s in generation 1's barrier, then failed the job). A joining rank leaves the
group unformed and its Session follows the newer plan; any other rank fails at once."""
from __future__ import annotations

import time
from typing import Callable

import pytest
import torch.distributed as dist

from phalanx.runtime.context import WorkerContext
from phalanx.runtime.group.collective import Collective, CollectiveAborted
from phalanx.runtime.group.default_group import _form_or_follow, take_job_watch
from phalanx.runtime.membership.etcd import EtcdMembership, job_prefix
from phalanx.runtime.membership.generation import GENERATION_KEY

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
GROUP_TIMEOUT_S = 30.0


def _context(endpoint: str, joining: bool, job: str) -> WorkerContext:
    restore = {"step": 20, "sources": [], "joins_survivors": joining}
    return WorkerContext(job=job, rank=1, world_size=2, worker_id="spare0", generation=1,
                         etcd_endpoints=(endpoint,), group_timeout_s=GROUP_TIMEOUT_S,
                         extra={"restore": restore})


@pytest.mark.parametrize("joining", [True, False])
def test_a_newer_generation_ends_the_init_barrier_at_once(
        etcd_endpoint: str, store: Callable[[], dist.Store], joining: bool) -> None:
    job = f"follow-{joining}"
    ctx = _context(etcd_endpoint, joining, job)
    fencer = EtcdMembership([etcd_endpoint], job_prefix(ctx.etcd_prefix, job)).connect()
    try:
        fencer.put(GENERATION_KEY, b"2")          # rank 0 never comes: generation 2 exists
        collective = Collective(store, ctx.rank, ctx.world_size, GROUP_TIMEOUT_S)
        started = time.monotonic()
        if joining:
            _form_or_follow(ctx, collective, joining=True)
        else:
            with pytest.raises(CollectiveAborted, match="newer generation"):
                _form_or_follow(ctx, collective, joining=False)
        assert time.monotonic() - started < GROUP_TIMEOUT_S / 3
        assert collective.generation == -1 and collective.group is None
        # the Session takes over the etcd client and watcher the barrier opened
        watch = take_job_watch(ctx)
        assert watch is not None and watch[1].latest == 2
        watch[1].close()
        watch[0].close()
    finally:
        fencer.close()
