"""One rank's side of cross-replica verification (``detection.compare_replicas``): digests
of its replicated state as its snapshots are published, one small all-reduce per snapshot
step that tells every rank the same outcome, and the newest *verified* step, which the
rank's keeper must keep until a newer one is verified.

Timeline of one rank, snapshots every N steps (the same steps on every rank):

    boundary b-N: capture(b-N) ... start reduce[ digest(b-2N) ]
    boundary b:   collect reduce -> verified = b-2N (agreed) or diverged at b-2N
                  capture(b): its slot claim protects `verified`
                  start reduce[ digest(b-N) ]     (known: capture(b) waited for its publish)

With ``every_steps: auto`` the ranks also meet at the interval agreements between snapshot
steps (every ``AGREE_EVERY_STEPS``); there they collect the comparison in flight and offer
the last capture's digest again (``offer``), so b-N is verified within an agreement or two
of its capture instead of at b:

    agreement a (b-N < a < b): collect reduce; start reduce[ digest(b-N) ] (zeros until
                  this rank's publish of b-N computed it: outcome unknown, offered again)

A verified step is set before the claim that would evict it (it is then the second newest
snapshot), and stays protected until a newer one is verified; after a divergence it is
frozen until a rollback, so every rank's keeper holds the step the launcher rolls back to.

Replicas that never agreed (unseeded initialisation: no rollback can fix it) are named by
the ranks themselves in the job's first generation, where every rank is an original process
and has read the same outcomes: a divergence there before any agreement raises
``ReplicasNeverAgreed`` on every rank at the same step (with ``auto``, step 2: the
comparison of step 0 started at the measuring capture). The launcher, which polls member
records, once missed it: a 30-step job finished on a loaded CI machine before the launcher
had read any rank's record. Later
generations hold replacements whose own history starts empty: there the launcher, which
sees every rank's verified step, decides (``ReplicaCheck``).
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from pathlib import Path
from typing import AbstractSet, Any, Callable, Mapping, Sequence

import torch

from phalanx.configs.errors import ConfigError, ReplicasNeverAgreed
from phalanx.configs.loader import load_config_text
from phalanx.runtime.context import WorkerContext
from phalanx.runtime.snapshot.spec_names import escape_segment
from phalanx.runtime.snapshot.zero import is_zero
from phalanx.runtime.consistency.digest import (Agreement, ReplicaStatus, agreement_vector,
                                                group_slot, never_agreed_message,
                                                read_agreement, replica_digest)

log = logging.getLogger(__name__)
RECENT = 4           # (step, digest) pairs a member record carries
KEPT = 16            # digests a rank remembers for the comparisons still to come


def replicated_names(ctx: WorkerContext) -> tuple[str, ...]:
    """``detection.replicated_state`` of the run this worker belongs to (its run
    directory's ``config.yaml``, which the worker's context carries); () when the job does
    not compare replicas, or runs standalone or with one rank."""
    if ctx.standalone_run or ctx.world_size < 2 or not ctx.run_dir:
        return ()
    path = Path(ctx.run_dir) / "config.yaml"
    try:
        text = ctx.config_yaml or path.read_text(encoding="utf-8")
        cfg = load_config_text(text, source=str(path))
    except (OSError, ConfigError) as exc:
        log.warning("event=replica_check_off rank=%d reason=%r", ctx.rank, str(exc)[:200])
        return ()
    detection = cfg.detection
    return tuple(detection.replicated_state) if detection.compare_replicas else ()


def compared_names(objects: Mapping[str, Any], names: Sequence[str]) -> tuple[str, ...]:
    """``names`` less the objects no two ranks hold alike by construction: a
    ZeroRedundancyOptimizer (each rank holds its own partition's state,
    ``runtime.snapshot.zero``), whatever ``detection.replicated_state`` lists."""
    left_out = [name for name in names if is_zero(objects.get(name))]
    if left_out:
        log.info("event=replica_check_skips names=%s reason=sharded_optimizer", left_out)
    return tuple(name for name in names if name not in left_out)


def per_rank_tensors(objects: Mapping[str, Any], names: Sequence[str]) -> frozenset[str]:
    """Snapshot tensor names of the buffers of the ``names`` objects that are modules (as
    ``flatten_state`` names them: ``<object>/<state_dict key>``): per-rank state inside a
    replicated object."""
    found: set[str] = set()
    for name in names:
        module = objects.get(name)
        if not isinstance(module, torch.nn.Module):
            continue
        keys = set(module.state_dict(keep_vars=True))
        found.update(f"{escape_segment(name)}/{escape_segment(key)}"
                     for key, _ in module.named_buffers() if key in keys)
    return frozenset(found)


class ReplicaVerifier:
    """Owned by the Session: ``collect``/``start``/``note_capture``/``reset`` run on the
    training thread, ``published`` on the snapshot publishing thread, ``status`` on the
    heartbeat thread. ``snapshotter`` needs ``protect_step`` and ``on_published``."""

    def __init__(self, names: Sequence[str], world_size: int, generation: int,
                 snapshotter: Any, per_rank: AbstractSet[str] = frozenset(),
                 group: Callable[[], Sequence[int]] = tuple) -> None:
        self.names = tuple(names)
        self.per_rank = frozenset(per_rank)
        self._group = group         # the rank's replica group (read at each comparison)
        self._compared: tuple[int, ...] = ()
        self._world_size = world_size
        self._generation = generation
        self._snapshotter = snapshotter
        self._lock = threading.Lock()
        self._digests: dict[int, str] = {}
        self._recent: deque[tuple[int, str]] = deque(maxlen=RECENT)
        self._verified = -1
        self._diverged: tuple[int, str, int] | None = None
        self._pending: tuple[Any, torch.Tensor] | None = None
        self._previous: int | None = None        # the last capture of this generation
        snapshotter.on_published = self.published

    # -- publishing thread -----------------------------------------------------------
    def published(self, step: int, sums: Mapping[str, str], spec: Mapping[str, Any]) -> None:
        digest = replica_digest(sums, spec, self.names, self.per_rank)
        if digest is None:
            return
        with self._lock:
            self._digests[step] = digest
            for old in sorted(self._digests)[:-KEPT]:
                del self._digests[old]
            self._recent.append((step, digest))

    # -- training thread -------------------------------------------------------------
    def collect(self, wait: Callable[[Any, torch.Tensor], torch.Tensor]) -> Agreement | None:
        """Read the comparison started at the previous snapshot step (before this step's
        capture claims a slot); raises what ``wait`` raises (``CollectiveAborted``), and
        ``ReplicasNeverAgreed`` for a divergence before any agreement in the job's first
        generation (every rank reads the same outcome, so every rank raises)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        outcome = read_agreement(wait(*pending).tolist(), self._world_size, self._world_size)
        if outcome.state == "agreed" and self._diverged is None \
                and outcome.step > self._verified:
            self._verified = outcome.step
            self._snapshotter.protect_step = outcome.step
        elif outcome.state == "diverged" and self._diverged is None:
            with self._lock:
                mine = self._digests.get(outcome.step, "")
                self._diverged = (outcome.step, mine, self._generation)
            log.error("event=replicas_diverged step=%d digest=%s verified=%d generation=%d",
                      outcome.step, mine, self._verified, self._generation)
            # generation 0: no rollback yet (each fences a newer one), every rank an original
            if self._generation == 0 and self._verified < 0:
                raise ReplicasNeverAgreed(never_agreed_message(self.names, outcome.step))
        return outcome

    def collect_finished(self, wait: Callable[[Any, torch.Tensor], torch.Tensor]) -> None:
        """At the session's end: read the comparison in flight when every rank already
        completed it (started at the last snapshot step, it mostly has), so the final
        member record carries the newest verified step and the job's last commit is not a
        comparison behind; never waits for a peer (one may have left)."""
        pending = self._pending
        if pending is None or pending[0] is None or not pending[0].is_completed():
            return
        self.collect(wait)

    def start(self, step: int, begin: Callable[[torch.Tensor], Any]) -> None:
        """After the capture of ``step``: compare the previous capture's digest (every
        rank starts this at the same snapshot steps, so the collectives line up)."""
        previous, self._previous = self._previous, step
        self._compare(previous, begin)

    def offer(self, begin: Callable[[torch.Tensor], Any]) -> None:
        """At an interval agreement between snapshot steps (``every_steps: auto``): compare
        the last capture's digest (again), so the newest snapshot is verified an agreement
        or two after its capture and not only at the next capture, an interval of maybe
        hundreds of steps later (the commit point, and with it the tiers' commits, waited
        for that). Before this rank's publish computed the digest it offers zeros: the
        outcome is then unknown and the next agreement offers it again. Every rank offers
        at the same steps, so the collectives line up; a step already verified only
        agrees again."""
        self._compare(self._previous, begin)

    def _compare(self, step: int | None, begin: Callable[[torch.Tensor], Any]) -> None:
        """Start the comparison of ``step``'s digest (zeros when there is none yet)."""
        with self._lock:
            digest = None if step is None else self._digests.get(step)
        self._compared = tuple(self._group())
        vector = torch.tensor(agreement_vector(step, digest, self._world_size,
                                               group_slot(self._compared)), dtype=torch.int64)
        self._pending = (begin(vector), vector)

    def note_capture(self, step: int) -> None:
        """A capture outside the snapshot-step rhythm (the first one of a process)."""
        self._previous = step

    def reset(self, step: int, generation: int) -> None:
        """After a rollback to ``step``: comparisons start afresh in ``generation``; the
        verified step stays (still held: a rollback drops only newer steps) unless the
        rollback went below it."""
        self._pending, self._previous, self._generation = None, None, generation
        with self._lock:
            self._diverged = None
            for old in [s for s in self._digests if s > step]:
                del self._digests[old]
            kept = [pair for pair in self._recent if pair[0] <= step]
            self._recent.clear()
            self._recent.extend(kept)
        if step < self._verified:
            self._verified = -1
            self._snapshotter.protect_step = None

    @property
    def diverged(self) -> bool:
        return self._diverged is not None

    def status(self) -> ReplicaStatus:
        with self._lock:
            return ReplicaStatus(self._verified, tuple(self._recent), self._diverged,
                                 self._compared)
