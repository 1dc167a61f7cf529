"""One rank's side of a recovery, mixed into ``Session``: wait for the next generation's
plan, restore from the ladder or heal from live peers, re-form the group, and count
snapshots from the restored step. Runs on the training thread (a failed collective inside
``step()``, or ``start()`` of a replacement rank)."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Sequence

import torch

from phalanx.configs.errors import PhalanxError
from phalanx.runtime.base import KeeperCopy, RestoreSource, per_rank_channel, source_from_json
from phalanx.runtime.consistency.repair import split_sources, try_repair
from phalanx.runtime.consistency.verify import ReplicaVerifier
from phalanx.runtime.context import WorkerContext
from phalanx.runtime.group.collective import Collective, CollectiveAborted
from phalanx.runtime.group.process_group import connect_store_at
from phalanx.runtime.membership.etcd import EtcdMembership
from phalanx.runtime.membership.generation import Fenced, GenerationWatcher
from phalanx.runtime.snapshot.restore import restore
from phalanx.runtime.snapshot.snapshotter import Snapshotter
from phalanx.runtime.snapshot.state_classes import StateClasses, classify
from phalanx.runtime.worker import heal
from phalanx.runtime.worker.drill_hooks import write_memory_map
from phalanx.runtime.worker.keeper_link import KeeperLink
from phalanx.runtime.worker.rejoin import holdings_probe, ladder_sources, restore_rank
from phalanx.runtime.worker.restore_progress import (drill_slow_restore_s, reporting,
                                                     wait_restored)

log = logging.getLogger(__name__)


class Rejoining:
    """The recovery half of ``Session`` (which owns every attribute declared here)."""

    context: WorkerContext
    generation: int
    recoveries: int
    _objects: dict[str, Any]
    _progress: Any
    _collective: Collective | None
    _collective_error: dict[str, Any] | None
    _store_address: tuple[str, int]
    _membership: EtcdMembership | None
    _watcher: GenerationWatcher | None
    _wake: threading.Event
    _keeper: KeeperLink | None
    _rank_keeper: KeeperLink | None
    _snapshotter: Snapshotter | None
    _rank_snapshotter: Snapshotter | None
    _verifier: ReplicaVerifier | None
    _restored: dict[str, Any] | None
    _awaiting_first_step: bool
    _holds_state: bool
    _unmeasured: bool
    _stepped: set[int]
    _agreement: tuple[Any, torch.Tensor] | None

    _declared: dict[str, str]
    _classes: StateClasses | None

    def _state_classes(self) -> StateClasses:
        """The registered state's classes, inferred once (at the first capture or heal)."""
        if self._classes is None:
            ctx = self.context
            self._classes = classify(self._objects, self._declared,
                                     data_parallel=not ctx.standalone_run and ctx.world_size > 1)
        return self._classes

    def _superseded(self, generation: int) -> Callable[[], bool]:
        watcher = self._watcher
        return lambda: watcher is not None and watcher.newer_than(generation)

    def _recover(self, reason: str) -> None:
        """Wait for the next generation's plan, roll back to its restore step, re-form."""
        started = time.perf_counter()
        log.warning("event=collective_aborted rank=%d generation=%d reason=%r", self.context.rank,
                    self.generation, reason)
        # told to the coordinator with the next heartbeat (sent at once): a failed group
        # with no other fault to explain it (a cut link) is a fault of its own
        self._collective_error = {"generation": self.generation, "detail": reason[:2000]}
        self._wake.set()
        assert self._collective is not None and self._watcher is not None
        self._collective.abandon()
        live = self._live_step()
        for snapshotter in (self._snapshotter, self._rank_snapshotter):
            if snapshotter is None:
                continue
            try:
                snapshotter.flush()
            except Exception as exc:  # a publish cut short by the fault; the plan decides
                log.warning("event=snapshot_flush_failed rank=%d error=%r", self.context.rank, exc)
        plan = self._watcher.wait_plan(self.generation, self.context.plan_timeout_s)
        assignment = plan.ranks.get(self.context.rank)
        if assignment is None or assignment.worker != self.context.worker_id:
            raise Fenced(f"rank {self.context.rank} of generation {plan.generation} belongs to "
                         f"{assignment.worker if assignment else 'nobody'}, not "
                         f"{self.context.worker_id}")
        if not plan.heal:
            with reporting(self._membership, plan.generation, self.context.rank,
                           self.context.worker_id, self.context.heartbeat_s):
                self._apply_restore(plan.restore_step, assignment.sources, plan.generation)
        if plan.store is not None and plan.store != self._store_address:
            self._store_address = plan.store      # a standby coordinator took over
            host, port = plan.store
            log.warning("event=store_moved rank=%d store=%s:%d", self.context.rank, host, port)
            self._collective.use_store(
                lambda: connect_store_at(host, port, self.context.group_timeout_s))
        try:
            self._collective.form(plan.generation, world_size=plan.world_size,
                                  should_abort=self._superseded(plan.generation))
        except CollectiveAborted as exc:    # another fault while re-forming: next plan
            self._recover(str(exc))
            return
        self.generation = plan.generation
        try:
            if plan.heal:       # from live peers, after the group formed
                self._heal(plan.restore_step, assignment.sources, plan.generation,
                           plan.world_size, live)
            else:
                self._await_restored(plan.generation, plan.world_size)   # a spare restoring
        except CollectiveAborted as exc:    # another fault while healing: next plan
            self._recover(str(exc))
            return
        self._collective_error = None
        self._awaiting_first_step = True
        self.recoveries += 1
        log.warning("event=rank_rejoined rank=%d generation=%d restore_step=%d seconds=%.3f",
                    self.context.rank, plan.generation, (self._restored or {}).get(
                        "step", plan.restore_step), time.perf_counter() - started)

    def _restore_at_start(self) -> None:
        """The restore the launcher gave this rank (a recovery's spare or restarted worker,
        or ``--resume``), once its group formed: reported while it runs, and in a
        recovery's generation awaited by every rank before the first collective."""
        ctx = self.context
        restore = ctx.extra.get("restore")
        if isinstance(restore, dict):
            sources = [source_from_json(s) for s in restore["sources"]]
            self._holds_state = False
            if restore.get("heal") and self._collective is not None and ctx.generation > 0:
                try:
                    self._heal(int(restore["step"]), sources, ctx.generation, ctx.world_size,
                               -1, drill_slow_restore_s(ctx.drills))
                except CollectiveAborted as exc:   # another fault while healing
                    if self._watcher is None:
                        raise
                    self._recover(str(exc))
                return
            with reporting(self._membership if ctx.generation > 0 else None, ctx.generation,
                           ctx.rank, ctx.worker_id, ctx.heartbeat_s,
                           drill_slow_restore_s(ctx.drills)):
                self._apply_restore(int(restore["step"]), sources, ctx.generation)
        self._await_restored(ctx.generation, ctx.world_size)

    def _await_restored(self, generation: int, world_size: int) -> None:
        """Once a recovery's group formed, before its first collective: wait for the ranks
        still restoring (``phalanx.runtime.worker.restore_progress``)."""
        restored = self._restored or {}
        if generation > 0 and restored.get("generation") == generation:
            wait_restored(self._membership, generation, world_size, self.context.rank,
                          group_timeout_s=self.context.group_timeout_s,
                          heartbeat_s=self.context.heartbeat_s,
                          should_abort=self._superseded(generation))

    def _apply_restore(self, step: int, sources: Sequence[RestoreSource],
                       generation: int) -> None:
        ctx = self.context
        started = time.perf_counter()
        ladder, peers = split_sources(sources)
        result = restore_rank(self._objects, ctx.rank, step, ladder, job=ctx.job,
                              secret=ctx.secret, timeout_s=ctx.group_timeout_s,
                              generation=generation, local_node=ctx.node)
        # silent corruption: the replicated objects from a healthy peer's snapshot
        repaired = try_repair(self._objects, step, peers, job=ctx.job, secret=ctx.secret,
                              timeout_s=ctx.group_timeout_s, generation=generation)
        self._restored = {"generation": generation, "step": step, "source": result.source,
                          "bytes": result.manifest.total_bytes,
                          "seconds": round(time.perf_counter() - started, 4),
                          "refused": [f"{where}: {why}"[:160] for where, why in result.failures]}
        if repaired is not None:
            self._restored.update(source=repaired, own_source=result.source)
        self._after_restore(step, generation)

    def _after_restore(self, step: int, generation: int) -> None:
        """This rank's state is now ``step``'s, in ``generation``: snapshots count from
        there, newer ones (another timeline) are dropped, gradients are cleared (the failed
        step's are garbage; a script that zeroes them after ``optimizer.step()`` would
        otherwise add into them)."""
        ctx = self.context
        self.generation = generation
        self._holds_state = True
        self._stepped.clear()
        self._agreement = None          # started in the old generation's group: dropped
        self._unmeasured = False
        for snapshotter in (self._snapshotter, self._rank_snapshotter):
            if snapshotter is not None:
                snapshotter.set_generation(generation)
                snapshotter.rewind(step)
        if self._keeper is not None:
            self._keeper.drop(ctx.rank, above_step=step)
        if self._rank_keeper is not None:
            self._rank_keeper.drop(per_rank_channel(ctx.rank), above_step=step)
        if self._verifier is not None:
            self._verifier.reset(step, generation)
        for obj in self._objects.values():
            if isinstance(obj, (torch.optim.Optimizer, torch.nn.Module)):
                obj.zero_grad(set_to_none=True)
        if ctx.drills and ctx.run_dir:
            write_memory_map(ctx.run_dir, ctx.rank, ctx.worker_id, generation, self._objects)

    def _live_step(self) -> int:
        """The step this rank's replicated state is at: its completed steps, plus one when
        every registered optimizer already applied the step in flight; -1 when it holds
        no state of this run (a replacement before its restore) or only some optimizers
        applied it."""
        if not self._holds_state:
            return -1
        optimizers = [o for o in self._objects.values() if isinstance(o, torch.optim.Optimizer)]
        stepped = sum(id(o) in self._stepped for o in optimizers)
        if stepped == 0:
            return self._progress.step_index
        return self._progress.step_index + 1 if stepped == len(optimizers) else -1

    def _heal(self, step: int, sources: Sequence[RestoreSource], generation: int,
              world_size: int, live: int, slow_s: float = 0.0) -> None:
        """Heal from live peers (``phalanx.runtime.worker.heal``), once the generation's
        group formed: every rank at the agreed step, per-rank state from its snapshot,
        replicated state from survivors' memory. When no step can be healed at, the plan's
        committed ``step`` is restored from ``sources`` (the ladder) instead."""
        ctx = self.context
        assert self._collective is not None
        started = time.perf_counter()
        classes = self._state_classes()
        channel = per_rank_channel(ctx.rank) if classes.split else ctx.rank
        view = classes.per_rank if classes.split else self._objects
        keepers = [s for s in sources if isinstance(s, KeeperCopy)]
        collective, abort = self._collective, self._superseded(generation)

        def reduce(tensor: torch.Tensor) -> torch.Tensor:
            return collective.all_reduce(tensor, abort)

        def broadcast(tensor: torch.Tensor, src: int) -> None:
            collective.wait(collective.start_broadcast(tensor, src), tensor, abort)

        snapshotter = self._snapshotter if self._snapshotter is not None and \
            self._snapshotter.shares_interval else None     # every_steps: auto, world > 1
        agreed = snapshotter.interval if snapshotter is not None and self._holds_state else 0
        agreement = heal.agree(rank=ctx.rank, world=world_size, live_step=live,
                               replicated=classes.split, reduce=reduce, interval=agreed,
                               group=classes.group,
                               probe=holdings_probe(keepers, channel, job=ctx.job, secret=ctx.secret,
                                                    timeout_s=ctx.group_timeout_s,
                                                    generation=generation))
        done, source = None, ""
        if agreement.step is not None:
            if live != agreement.step:   # its replicated state is replaced from here on: a
                self._holds_state = False   # fault before that ends holds none of it
            with reporting(self._membership, generation, ctx.rank, ctx.worker_id,
                           ctx.heartbeat_s, slow_s):
                try:
                    source = restore(view, channel, agreement.step, ladder_sources(
                        keepers, job=ctx.job, secret=ctx.secret, timeout_s=ctx.group_timeout_s,
                        generation=generation, local_node=ctx.node), ctx.secret, ctx.job).source
                except (PhalanxError, OSError) as exc:
                    log.warning("event=heal_load_failed rank=%d step=%d error=%s", ctx.rank,
                                agreement.step, exc)
            # (not final: the replicated state is still to come; the launcher reports the
            # rank's restore from the final record, with its source, bytes and seconds)
            self._restored = {"generation": generation, "step": agreement.step,
                              "healing": True}
            self._await_restored(generation, world_size)
            done = heal.finish(agreement, rank=ctx.rank, world=world_size, loaded=bool(source),
                               replicated=classes.replicated if classes.split else {},
                               reduce=reduce, broadcast=broadcast)
        if done is None or agreement.step is None:
            log.warning("event=heal_fallback rank=%d generation=%d live=%s restore_step=%d",
                        ctx.rank, generation, list(agreement.live), step)
            with reporting(self._membership, generation, ctx.rank, ctx.worker_id,
                           ctx.heartbeat_s, slow_s):
                self._apply_restore(step, sources, generation)
            self._await_restored(generation, world_size)
            return
        holders, received = done
        self._restored = {"generation": generation, "step": agreement.step, "source": source,
                          "healed": True, "holders": list(holders), "bytes": received,
                          "live": list(agreement.live),
                          "seconds": round(time.perf_counter() - started, 4), "refused": []}
        log.info("event=healed rank=%d generation=%d step=%d source=%r holders=%s "
                 "received_bytes=%d seconds=%.3f", ctx.rank, generation, agreement.step, source,
                 list(holders), received, time.perf_counter() - started)
        self._after_restore(agreement.step, generation)
        if snapshotter is not None and agreement.interval:
            # every rank healed at the same step: the survivors' interval goes on from there
            # (starting again at 1 made a large state's next steps snapshot back to back)
            snapshotter.agree_interval(agreement.interval)
