"""The deadlines of a recovery, decided purely: how long a new generation may take to
re-form its group before the job fails naming the ranks that never joined, and what a fault
means once some rank has already returned from its entrypoint (it cannot join a re-formed
group); and one tier's listing of its checkpoints on its own thread, so a tier that never
answers cannot hold a plan. The coordinator and the job's poll loop act on these answers."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, AbstractSet, Mapping, Sequence

from phalanx.configs.errors import FatalError
from phalanx.launcher.coordination.retry import RecoveryStalled
from phalanx.recovery.base import FaultReport
from phalanx.runtime.base import MemberRecord

# Past recovery.group_timeout_s (when every survivor's group formation has timed out), how
# long the launcher still waits for the member records that say the ranks joined: a few
# heartbeats of etcd lag and the survivors' own restore from their keeper.
REJOIN_MARGIN_S = 5.0
# More when the plan starts fresh worker processes (no warm spare): each imports torch and
# the entrypoint first (2.5-13 s measured on a loaded 2-core machine), outside any timeout.
FRESH_WORKER_START_S = 30.0
# One listing of a tier's checkpoints while planning (an S3 endpoint that accepts
# connections and never answers would otherwise hold the plan for botocore's minutes).
TIER_INVENTORY_MAX_S = 10.0


class GroupNotReformed(RecoveryStalled):
    """A recovery's new generation did not re-form its group within its bound: some rank
    never joined (a spare still restoring, a survivor outside ``session.step()``)."""


class FaultAfterFinish(FatalError):
    """A rank failed after another rank had returned from its entrypoint: a finished rank
    cannot join a re-formed group, so the fault cannot be recovered in place."""


@dataclass(frozen=True)
class Laggard:
    """A rank of a new generation that has not joined it, and why (for the message)."""

    rank: int
    worker_id: str
    why: str


def rejoin_bound_s(group_timeout_s: float, heartbeat_s: float,
                   fresh_workers: bool = False) -> float:
    """How long after its plan is published a generation may take to re-form: the
    survivors' group timeout, then a margin for their records to say so (and for fresh
    worker processes to start, when the plan has any)."""
    start = FRESH_WORKER_START_S if fresh_workers else 0.0
    return group_timeout_s + REJOIN_MARGIN_S + 2 * heartbeat_s + start


def tier_inventory_bound_s(group_timeout_s: float) -> float:
    """How long planning waits for every tier's list of checkpoints."""
    return min(TIER_INVENTORY_MAX_S, group_timeout_s)


def laggards(generation: int, workers: Mapping[int, str], members: Mapping[str, MemberRecord],
             finished: AbstractSet[int]) -> list[Laggard]:
    """The ranks of ``generation`` (rank → its worker in the plan) that have not joined it:
    finished, never registered, still in an older generation, or whose group for it failed."""
    behind = []
    for rank, worker in sorted(workers.items()):
        record = members.get(worker)
        if rank in finished:
            why = "had returned from its entrypoint (a finished rank cannot join a new group)"
        elif record is None:
            why = "never joined: a spare or restarted worker still starting or restoring its state"
        elif record.generation < generation:
            why = f"was still in generation {record.generation} at step {record.step}, " \
                  f"{_doing(record)}"
        elif _failed_in(record, generation):
            detail = str(record.extra["collective_error"].get("detail", ""))[:200]
            why = f"saw generation {generation}'s group fail to form: {detail}"
        else:
            continue
        behind.append(Laggard(rank, worker, why))
    return behind


def _doing(record: MemberRecord) -> str:
    busy = record.extra.get("busy")
    if busy:
        return f"in a session.busy({busy!r}) block"
    if record.extra.get("in_step", True):
        return "inside session.step() without reaching a collective"
    return ("outside session.step() doing no collective (an evaluation, a save, a sleep): "
            "it notices a new generation only at its next session.step() or collective")


def _failed_in(record: MemberRecord, generation: int) -> bool:
    error = record.extra.get("collective_error")
    return isinstance(error, dict) and error.get("generation") == generation


def not_reformed(generation: int, bound_s: float, group_timeout_s: float,
                 behind: Sequence[Laggard]) -> GroupNotReformed:
    """The error that fails a job whose generation did not re-form within ``bound_s``."""
    ranks = "; ".join(f"rank {lag.rank} (worker {lag.worker_id}) {lag.why}" for lag in behind)
    return GroupNotReformed(
        f"recovery to generation {generation} did not re-form the process group within "
        f"{bound_s:g} s (recovery.group_timeout_s={group_timeout_s:g} + margin): "
        f"{ranks or 'no rank reported its first step'}; raise recovery.group_timeout_s above "
        "the slowest restore and reach session.step() or a collective at least that often "
        "in phases without collectives, then resume with `phalanx launch --resume latest`")


def unfinished_faults(faults: Sequence[FaultReport],
                      finished: AbstractSet[int]) -> list[FaultReport]:
    """``faults`` less those that only concern ranks that already finished (their work
    is done and their results kept)."""
    return [f for f in faults if not f.ranks or not set(f.ranks) <= finished]


def fault_after_finish(faults: Sequence[FaultReport], finished: Mapping[int, int]
                       ) -> FaultAfterFinish:
    """The error for ``faults`` that struck while the ranks in ``finished`` (rank → the
    step it returned at) had already returned."""
    root = min(faults, key=lambda f: f.observed_at)
    done = ", ".join(f"{rank} (step {step})" for rank, step in sorted(finished.items()))
    return FaultAfterFinish(
        f"{root.kind.value} of rank(s) {list(root.ranks)} ({root.evidence[:200]}) after "
        f"rank(s) {done} had returned from their entrypoint: a finished rank cannot join a "
        "re-formed group, so phalanx cannot recover in place; their results are kept in "
        "the run directory. Make every rank run the same number of steps, or resume from "
        "the last checkpoint with `phalanx launch --resume latest`")


class TierListing:
    """One tier's ``committed_steps()`` on its own daemon thread (``start()``), so a tier
    that never answers cannot hold the plan; the thread ends with its client's timeouts."""

    def __init__(self, tier: Any) -> None:
        self.tier = tier
        self.steps: list[int] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._list, daemon=True,
                                       name=f"phalanx-tier-inventory-{tier.name}")

    def start(self) -> "TierListing":
        self.thread.start()
        return self

    def _list(self) -> None:
        try:
            self.steps = list(self.tier.committed_steps())
        except Exception as exc:  # the thread's boundary: reported by the coordinator
            self.error = exc
