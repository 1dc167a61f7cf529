"""An in-memory fake of the ``Tier`` port for unit tests, with a failure switch.

It follows the same contract suite as the disk and S3 tiers; ``fail_writes`` makes every
write, commit and check raise ``TierUnavailable`` (a full or unreachable tier).
"""
from __future__ import annotations

import logging
import threading
import time

from phalanx.configs.errors import SnapshotNotFound, TierUnavailable
from phalanx.runtime.tiers.disk import (as_byte_view, normalize_ranks, rank_file_names,
                                        retention_victims, step_dir_name)

log = logging.getLogger(__name__)


class MemoryTier:
    """Tier held in a dict; thread-safe. Payloads are copied on write (the caller may reuse
    its buffer). Set ``fail_writes`` at any time to simulate a full tier."""

    name = "memory"

    def __init__(self, job: str = "job", *, fail_writes: bool = False) -> None:
        self.job = job
        self.fail_writes = fail_writes
        self._lock = threading.Lock()
        self._objects: dict[tuple[int, int], tuple[bytes, bytes]] = {}
        self._commits: dict[int, dict[str, object]] = {}

    def _refuse_if_failing(self, what: str) -> None:
        if self.fail_writes:
            raise TierUnavailable(f"tier memory: {what} refused (fail_writes is set: simulated "
                                  "full tier)")

    def write_rank(self, step: int, rank: int, payload: memoryview | bytes, manifest: bytes) -> None:
        step_dir_name(step)
        rank_file_names(rank)
        self._refuse_if_failing(f"write of step {step} rank {rank}")
        data = (as_byte_view(payload).tobytes(), bytes(manifest))
        with self._lock:
            self._objects[(step, rank)] = data

    def commit_step(self, step: int, ranks: list[int]) -> None:
        """Raises SnapshotNotFound naming a missing rank, TierUnavailable when failing."""
        wanted = normalize_ranks(ranks)
        self._refuse_if_failing(f"commit of step {step}")
        with self._lock:
            for rank in wanted:
                if (step, rank) not in self._objects:
                    raise SnapshotNotFound(f"tier memory: cannot commit step {step}: rank {rank} "
                                           "has no payload")
            self._commits[step] = {"step": step, "ranks": wanted, "written_at": time.time()}
        log.debug("tier_commit tier=memory step=%d ranks=%d", step, len(wanted))

    def read_rank(self, step: int, rank: int) -> tuple[bytes, bytes]:
        with self._lock:
            found = self._objects.get((step, rank))
        if found is None:
            raise SnapshotNotFound(f"tier memory: step {step} rank {rank} not found")
        return found

    def committed_steps(self) -> list[int]:
        with self._lock:
            return sorted(self._commits)

    def _all_steps(self) -> set[int]:
        with self._lock:
            return {step for step, _ in self._objects} | set(self._commits)

    def delete_step(self, step: int) -> None:
        with self._lock:
            self._commits.pop(step, None)
            for key in [k for k in self._objects if k[0] == step]:
                del self._objects[key]

    def apply_retention(self, keep: int) -> list[int]:
        victims = retention_victims(self._all_steps(), self.committed_steps(), keep)
        for step in victims:
            self.delete_step(step)
        return victims

    def check(self) -> None:
        self._refuse_if_failing("check")
