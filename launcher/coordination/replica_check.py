"""The launcher's side of cross-replica verification (``detection.compare_replicas``): reads
the replica status each rank publishes in its member record (``phalanx.runtime.consistency.digest``)
and turns a divergence that every rank of the current generation reports into one
``SilentCorruption`` signal, carrying each rank's digest of the diverged step for the
majority vote that names the corrupted rank(s)."""
from __future__ import annotations

import logging
from typing import Iterable, Mapping

from phalanx.configs.errors import ReplicasNeverAgreed
from phalanx.recovery.detection import SilentCorruption
from phalanx.runtime.base import MemberRecord, Rank, Step
from phalanx.runtime.consistency.digest import ReplicaStatus, never_agreed_message

log = logging.getLogger(__name__)


def corruption_signal(records: Iterable[MemberRecord], world_size: int,
                      now: float) -> SilentCorruption | None:
    """A ``SilentCorruption`` when the current ``records`` (one per rank) all report a
    divergence at the same step in the generation they run in; None otherwise (no rank
    compares, some rank has not found it yet, or they disagree on where: wait a poll)."""
    found: dict[int, tuple[ReplicaStatus, int]] = {}
    for record in records:
        status = ReplicaStatus.from_extra(record.extra)
        if status is not None and record.rank >= 0:
            found[record.rank] = (status, record.generation)
    if len(found) < world_size:
        return None
    diverged = {rank: (s.diverged, generation) for rank, (s, generation) in found.items()}
    if any(d is None or d[2] != generation for d, generation in diverged.values()):
        return None
    places = {(d[0], d[2]) for d, _ in diverged.values() if d is not None}
    if len(places) != 1:
        return None
    step, generation = places.pop()
    digests = tuple(sorted((Rank(rank), d[1]) for rank, (d, _) in diverged.items() if d is not None))
    verified = max(s.verified for s, _ in found.values())
    return SilentCorruption(Step(step), Step(verified), digests, generation, now,
                            replica_groups({rank: s.group for rank, (s, _) in found.items()}))


def replica_groups(groups: Mapping[int, tuple[int, ...]]) -> tuple[tuple[Rank, ...], ...]:
    """The replica groups the ranks compared their digests within (each rank's published
    group; () for every rank: the ranks that published () form one group), sorted; () when
    every rank compared with every rank."""
    found: dict[tuple[int, ...], list[int]] = {}
    for rank, group in groups.items():
        found.setdefault(tuple(sorted(group)) if group else (), []).append(rank)
    if set(found) == {()}:
        return ()
    return tuple(sorted(tuple(Rank(r) for r in sorted(ranks)) for ranks in found.values()))


class ReplicaCheck:
    """Owned by the launcher's ``Monitor`` (main thread): each divergence is signalled once.
    A divergence before any step of the job ever agreed is no corruption: the ranks never
    held the same state, and ``poll`` raises ``ReplicasNeverAgreed`` naming that cause."""

    def __init__(self, names: Iterable[str] = ("model", "optimizer")) -> None:
        self._reported: set[tuple[int, int]] = set()     # (generation, step)
        self._names = list(names)
        self._agreed = False              # some step of this job agreed on every rank

    def poll(self, records: Iterable[MemberRecord], world_size: int,
             now: float) -> SilentCorruption | None:
        """Raises ``ReplicasNeverAgreed`` (fatal) for a divergence before any agreement."""
        records = list(records)
        self._agreed = self._agreed or any(
            status is not None and status.verified >= 0
            for status in (ReplicaStatus.from_extra(r.extra) for r in records if r.rank >= 0))
        signal = corruption_signal(records, world_size, now)
        if signal is None or (signal.generation, signal.step) in self._reported:
            return None
        if not self._agreed:
            raise ReplicasNeverAgreed(never_agreed_message(self._names, signal.step))
        self._reported.add((signal.generation, signal.step))
        log.error("event=sdc_signal step=%d verified=%d generation=%d digests=%s", signal.step,
                  signal.verified_step, signal.generation, dict(signal.digests))
        return signal
