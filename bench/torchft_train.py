#!/usr/bin/env python
"""One torchft replica group of ``bench/vs_torchrun.py`` (one rank): the twin of
``bench/torchrun_train.py`` on torchft 0.2.0 — the same model, data and optimizer, wrapped in
torchft's ``DistributedDataParallel`` and ``OptimizerWrapper`` under its ``Manager`` on its
reconfigurable ``ProcessGroupGloo``. ``bench/torchft_run.py`` starts the Lighthouse and one
such process per replica group, and restarts a replica group's process that died.

    python bench/torchft_train.py --replica 0 --replicas 2 --job mlp \\
        --job-args '{"steps": 100}' --progress DIR      # TORCHFT_LIGHTHOUSE=http://...

Settings a torchft user of this job would pick (torchft's ``train_ddp.py`` example):
``min_replica_size=1`` (survivors keep training while a group restarts), asynchronous
quorum, the HTTP checkpoint transport to heal a restarted group from a live one, and
``init_sync=False`` (every replica builds the same seeded model, as in the torchrun twin).
Replica group ``r`` trains on the batches of data rank ``r`` at torchft's committed step, so a
fault-free run computes what the torchrun twin computes. At start (attempt 0) every group
waits until all groups built their Manager, so the first quorum holds them all.

Each process appends JSON lines to ``<progress>/rank<replica>.jsonl`` as the torchrun twin
does: ``start`` (pid, attempt, seconds since exec), ``joined`` (Manager and model built),
``healed`` (torchft loaded a live peer's state: seconds), ``step`` (committed step index,
``n`` the replica groups that took part), ``done`` (parameter sha256). The attempt comes
from ``BENCH_TORCHFT_ATTEMPT`` (set by ``bench/torchft_run.py``).

torchft 0.2.0's ``DistributedDataParallel`` comm hook fails on the fault itself: when the
all-reduce fails (the peer was killed: gloo's "Connection reset by peer") its managed
future is never set and the hook's ``assert fut._fut`` kills the survivor too, and after
an error the next buckets get a plain future without ``_fut``. ``HealingDDP`` keeps torchft's
wrapper and fixes only its hook: it hands back the bucket unreduced, the Manager has
recorded the error, and ``should_commit`` discards the step, as torchft intends.

Exit codes: 0 done; 3 a restarted group found no live peer to heal from (the others had
finished), so it would train alone from step 0: not restarted again.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

STARTED = time.time()
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed import TCPStore  # noqa: E402
from torchft import DistributedDataParallel, Manager, ProcessGroupGloo  # noqa: E402
from torchft.optim import OptimizerWrapper  # noqa: E402

from bench.torchrun_train import Job, progress_recorder  # noqa: E402
import train_mlp  # noqa: E402  (bench.torchrun_train put examples/ on the path)

EXIT_NO_PEER = 3
TIMEOUT = timedelta(seconds=10)   # collectives, should_commit, checkpoint HTTP
QUORUM_TIMEOUT = timedelta(seconds=60)
READY_TIMEOUT_S = 120.0


class HealingDDP(DistributedDataParallel):
    """torchft's DDP with a comm hook that survives a failed all-reduce (see above)."""

    @staticmethod
    def _comm_hook(state, bucket):  # type: ignore[no-untyped-def]
        # unannotated: DDP compares the annotations with dist.GradBucket, and this module's
        # are strings (``from __future__ import annotations``)
        work = state.allreduce(bucket.buffer())
        reduced = work.wait()     # False: the Manager recorded the error; the step is dropped
        inner = getattr(work.get_future(), "_fut", None)
        if reduced and inner is not None:
            return inner
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done


class CommitTrackingOptimizer(OptimizerWrapper):
    """torchft's OptimizerWrapper that also remembers whether the last step committed (the
    wrapper steps the optimizer only then; the scheduler and the progress record follow)."""

    committed = False

    def step(self, closure: object | None = None) -> None:
        assert closure is None, "optimizers that use closures are not supported"
        self.committed = self.manager.should_commit()
        if self.committed:
            self.optim.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--replicas", type=int, required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--job-args", default="{}")
    parser.add_argument("--progress", type=Path, required=True)
    args = parser.parse_args()

    torch.set_num_threads(1)   # as the torchrun twin and phalanx's job.torch_threads default
    replica = args.replica
    attempt = int(os.environ.get("BENCH_TORCHFT_ATTEMPT", "0"))
    record = progress_recorder(args.progress, replica, attempt, STARTED)
    # one rank per replica group: the group's own store, this process its master
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(timeout=TIMEOUT), load_state_dict=None,
                      state_dict=None, min_replica_size=1, store_addr="127.0.0.1",
                      store_port=store.port, rank=0, world_size=1,
                      replica_id=f"bench_{replica}", hostname="127.0.0.1", init_sync=False,
                      timeout=TIMEOUT, quorum_timeout=QUORUM_TIMEOUT)
    job = Job(args.job, json.loads(args.job_args),
              wrap=lambda module: HealingDDP(manager, module))
    optimizer = CommitTrackingOptimizer(manager, job.optimizer)
    manager.register_state_dict_fn("job", _loader(job, record), lambda: _state(job))
    if attempt == 0:
        _wait_ready(args.progress, replica, args.replicas)
    record("joined")

    healed_from: int | None = None
    while manager.current_step() < job.steps:
        step = manager.current_step()
        optimizer.zero_grad(set_to_none=False)      # starts torchft's quorum
        job.loss(replica, step).backward()          # all-reduce through the Manager
        optimizer.step()                            # heals first when behind, then commits
        if not optimizer.committed:
            continue
        if job.scheduler is not None:
            job.scheduler.step()
        if job.sleep_s:
            time.sleep(job.sleep_s)
        done = manager.current_step() - 1
        if healed_from is None:
            healed_from = done
            if attempt > 0 and done == 0:
                record("no_peer", step=done)
                manager.shutdown(wait=False)
                sys.exit(EXIT_NO_PEER)
        record("step", step=done, n=manager.num_participants())
    record("done", hash=train_mlp.parameter_hash(job.model), step=manager.current_step())
    manager.shutdown(wait=False)


def _state(job: Job) -> dict[str, Any]:
    return {"model": job.model.state_dict(), "optim": job.optimizer.state_dict(),
            "scheduler": job.scheduler.state_dict() if job.scheduler else None}


def _loader(job: Job, record: Any) -> Any:
    """The state dict function torchft calls (main thread, in ``should_commit``) with a
    live peer's state when this group heals."""
    def load(state: dict[str, Any]) -> None:
        began = time.time()
        model: nn.Module = job.model
        model.load_state_dict(state["model"])
        job.optimizer.load_state_dict(state["optim"])
        if job.scheduler is not None:
            job.scheduler.load_state_dict(state["scheduler"])
        record("healed", seconds=time.time() - began)
    return load


def _wait_ready(progress: Path, replica: int, replicas: int) -> None:
    """Every group's Manager heartbeats before any asks for the first quorum, so the
    Lighthouse waits for all of them instead of starting with whichever came first."""
    (progress / f"ready{replica}").touch()
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not all((progress / f"ready{r}").exists() for r in range(replicas)):
        if time.monotonic() > deadline:
            raise SystemExit(f"replica {replica}: the other replica groups did not start "
                             f"within {READY_TIMEOUT_S:.0f} s (see their output in the "
                             "bench's torchft.log)")
        time.sleep(0.01)


if __name__ == "__main__":
    main()
