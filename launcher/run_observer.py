"""What the launcher records about a run as it goes, for reports, plots and goodput:
progress samples (slowest and furthest rank, the snapshot stall so far), the end of
start-up (``first_step``: every rank completed a step) and, per recovery, where each
rank's state came from (own keeper, a replica, a tier), how many bytes and how fast."""
from __future__ import annotations

import time
from typing import Callable, Mapping

from phalanx.launcher.events import EventLog
from phalanx.runtime.base import MemberRecord

PROGRESS_EVERY_S = 0.5


class RunObserver:
    """Owned by the launcher's main thread; ``poll`` once per monitor poll.
    ``replica_holders(generation)`` says which nodes held replicas (not own copies) of
    each rank before that generation's recovery."""

    def __init__(self, events: EventLog,
                 replica_holders: Callable[[int], Mapping[int, list[str]]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._events = events
        self._replica_holders = replica_holders
        self._clock = clock
        self._next_progress = 0.0
        self._last: tuple[int, int, int] | None = None
        self._reported: set[tuple[str, int]] = set()
        self._trained = False                        # every rank completed its first step
        self._stalls: dict[str, tuple[int, float]] = {}   # worker -> (rank, stall_s so far)

    def poll(self, members: Mapping[str, MemberRecord], current: set[str]) -> None:
        """``current``: the worker ids that hold a rank now (a dead worker's record lingers
        in etcd until its lease ends)."""
        ranks = [m for m in members.values() if m.rank >= 0 and m.worker_id in current]
        for record in ranks:
            self._restored(record)
            self._stalled(record)
        if not self._trained and ranks and len(ranks) == len(current) \
                and all(m.step >= 1 for m in ranks):   # the end of start-up (goodput)
            self._trained = True
            self._events.emit("first_step", step=min(m.step for m in ranks),
                              generation=max(m.generation for m in ranks))
        now = self._clock()
        if not ranks or now < self._next_progress:
            return
        self._next_progress = now + PROGRESS_EVERY_S
        sample = (min(m.step for m in ranks), max(m.step for m in ranks),
                  max(m.generation for m in ranks))
        if sample != self._last:
            self._last = sample
            stall = self._stall_s()
            self._events.emit("progress", min_step=sample[0], max_step=sample[1],
                              generation=sample[2],
                              **({} if stall is None else {"snapshot_stall_s": stall}))

    def _stalled(self, record: MemberRecord) -> None:
        snapshot = record.extra.get("snapshot")
        stall = snapshot.get("stall_s") if isinstance(snapshot, dict) else None
        if isinstance(stall, (int, float)):
            self._stalls[record.worker_id] = (record.rank, float(stall))

    def _stall_s(self) -> float | None:
        """The job's snapshot stall so far: per rank, the stalls of every worker that held it,
        summed; the most of any rank (the others wait for it at the next collective). None
        while no rank reported one."""
        if not self._stalls:
            return None
        per_rank: dict[int, float] = {}
        for rank, stall in self._stalls.values():
            per_rank[rank] = per_rank.get(rank, 0.0) + stall
        return round(max(per_rank.values()), 6)

    def _restored(self, record: MemberRecord) -> None:
        restored = record.extra.get("restored")
        if not isinstance(restored, dict) or restored.get("healing"):
            return      # (a heal's record before the survivors' state arrived: not final)
        key = (record.worker_id, int(restored.get("generation", -1)))
        if key in self._reported:
            return
        self._reported.add(key)
        source = str(restored.get("source", ""))
        seconds = float(restored.get("seconds") or 0.0)
        nbytes = int(restored.get("bytes") or 0)
        self._events.emit(
            "rank_restored", rank=record.rank, worker=record.worker_id, node=record.node,
            generation=key[1], step=restored.get("step"), source=source,
            source_kind=source_kind(source, record.rank, self._replica_holders(key[1])),
            bytes=nbytes, seconds=seconds,
            gb_per_s=round(nbytes / seconds / 1e9, 3) if seconds > 0 else None,
            refused=restored.get("refused") or [])


def source_kind(source: str, rank: int, replica_holders: Mapping[int, list[str]]) -> str:
    """"keeper node1" -> own or replica (was node1 one of the rank's replica holders?);
    "tier disk" -> disk; "tier s3" -> s3."""
    kind, _, name = source.partition(" ")
    if kind == "tier":
        return name
    if kind == "keeper":
        return "replica" if name in replica_holders.get(rank, []) else "own"
    return kind or "unknown"
