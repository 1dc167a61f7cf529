"""The training script's handle on phalanx: registered state, the step boundary, the
collective of the current generation, membership and recovery of one rank.

    session = phalanx.Session()
    session.register(model=model, optimizer=opt)
    session.extras["seen"] = 0             # initial values before start(), which may restore
    with session:
        while session.step_index < steps:
            with session.step():
                ...  # forward, backward, session.all_reduce(grad), optimizer.step()
                session.extras["seen"] += batch_size   # inside the step: in its snapshot

A failed collective inside a step (a peer died or hung) ends that step: the session waits
for the next generation's plan, rolls its state back to the plan's restore step and
returns from ``step()``; ``step_index`` then says which step to run.
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import random
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from phalanx.configs.errors import (ConfigError, LeaseLost, MembershipUnavailable,
                                    PeerUnreachable, ReplicasNeverAgreed, StaleGeneration)
from phalanx.runtime.base import FINISHED_PREFIX, MemberRecord, per_rank_channel
from phalanx.runtime.group.collective import Collective, CollectiveAborted
from phalanx.runtime.group.default_group import (default_group, process_collective,
                                                  take_job_watch)
from phalanx.runtime.context import WorkerContext
from phalanx.runtime.logs import ReplayMarker, bind_fields
from phalanx.runtime.membership.generation import GenerationWatcher
from phalanx.runtime.worker.accumulation import AccumulationGuard
from phalanx.runtime.worker.activity import Activity
from phalanx.runtime.worker.data import LoaderPosition
from phalanx.runtime.worker.heartbeat import Heartbeat
from phalanx.runtime.worker.member_relay import MemberRelay
from phalanx.runtime.worker.keeper_link import KeeperLink, keeper_address, no_room
from phalanx.runtime.keeper.wire import KeeperClient
from phalanx.runtime.membership.etcd import EtcdMembership
from phalanx.runtime.worker.drill_hooks import (gate_reason, hold_at_gate, raise_on_sigusr1,
                                               signals_deferred, write_memory_map)
from phalanx.runtime.worker.recovering import Rejoining
from phalanx.runtime.consistency.digest import REPLICAS_EXTRA
from phalanx.runtime.consistency.verify import (ReplicaVerifier, compared_names,
                                                per_rank_tensors, replicated_names)
from phalanx.runtime.snapshot.snapshotter import SnapshotPolicy, Snapshotter
from phalanx.runtime.snapshot.state_classes import BuffersOf, GroupsOf, ParamsOf, StateClasses
from phalanx.runtime.snapshot.state_tree import (RNGState, assign_in_place, flatten_state,
                                                  object_kind)

log = logging.getLogger(__name__)
# ``every_steps: auto``: the ranks also agree on the interval every this many steps (one
# all_reduce of world_size integers, started then and collected this many steps later)
AGREE_EVERY_STEPS = 16
# ``every_steps: auto``: the interval while no rank has measured a snapshot's cost (the
# ranks then agree at every step, so the first measurement ends it a step or two later)
UNMEASURED_INTERVAL = AGREE_EVERY_STEPS
_final: dict[str, str] = {}      # the last closed session's state digest (the worker reports it)


def state_digest(objects: dict[str, Any]) -> str:
    """sha256 of the registered state (tensors' bytes in name order, then the tree of plain
    values; the session's own RNG capture left out: Python's ``random`` is unseeded in
    most scripts): equal on two runs exactly when what they registered is."""
    tensors, specs = flatten_state({n: o for n, o in objects.items() if n != "__rng__"})
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous().reshape(-1)   # 0-dim too
        digest.update(name.encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    digest.update(json.dumps(specs, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def _rng_mark() -> tuple:
    """What moves when torch's CPU generator, numpy's global one or Python's ``random``
    draws (the RNG a Session captures, less CUDA's): compared, not stored in a snapshot."""
    _, keys, pos, _, _ = np.random.get_state(legacy=True)
    words = random.getstate()[1]
    return torch.get_rng_state(), int(pos), int(keys[0]), words[-1], words[0]


def _same_rng(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and a[1:] == b[1:]


def last_state_digest() -> str | None:
    """The state digest of the last Session this process closed, or None."""
    return _final.get("state_digest")


class _Progress:
    """The session's own state inside every snapshot: which step runs next, and the
    script's extras (plain values read and written through ``Session.extras``)."""

    def __init__(self) -> None:
        self.step_index = 0
        self.epoch = 0                  # the pass of ``Session.epochs`` running now
        self.extras: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return {"step_index": self.step_index, "epoch": self.epoch, "extras": dict(self.extras)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Roll back to ``state``: the extras dict keeps its identity and ends up holding
        exactly the captured keys; a dict, list or same-shaped tensor value is refilled in
        place (references the script holds see the restored content)."""
        self.step_index = int(state["step_index"])
        self.epoch = int(state.get("epoch", 0))   # snapshots older than epochs hold none
        restored = state.get("extras", {})  # snapshots older than extras hold none
        for key in [k for k in self.extras if k not in restored]:
            del self.extras[key]
        for key, value in restored.items():
            self.extras[key] = (assign_in_place(self.extras[key], value)
                                if key in self.extras else value)


class Session(Rejoining):
    """One rank's participation in a phalanx job; used from the training thread.

    Training state is captured at every snapshot and rolled back by a recovery:
    ``register()``-ed objects with ``state_dict()``/``load_state_dict()``, the RNGs, and
    ``extras``, a dict the script reads and writes for plain values (an epoch counter, a
    data cursor, a best loss). An extra may be a JSON value (None, bool, int, float, str,
    and lists, tuples and dicts of those with str or int keys), a tensor or a numeric
    numpy array; whatever ``extras`` holds when a snapshot is taken is what a restore of
    that step brings back (keys added since are removed). Set initial values before
    ``start()`` (a replacement rank's ``start()`` restores them; a tensor restored without
    an initial value to copy into comes back on the CPU) and update them inside
    ``step()``: the snapshot taken as a step ends holds the extras as they are then. Store
    a new tensor rather than changing one in place during the next step: a snapshot copies
    tensors in the background while that step runs (a snapshot that saw such a write is
    dropped, ``event=snapshot_torn``, and later ones copy before the loop goes on; see
    docs/porting.md, "What the loop must not do"). An unsupported value raises TypeError
    naming its key (``__phalanx__/extras/<key>``) at the next snapshot. Gradients carried
    from one ``step()`` into the next are refused (``StateNotCapturable``): accumulate
    inside one step.

    ``start()`` restores the rank's state when it replaces a lost rank, joins the
    generation's group and etcd; raises ``PeerUnreachable``, ``MembershipUnavailable`` or
    ``SnapshotNotFound``. A heartbeat thread reports progress every ``heartbeat_s``.

    Hang detection judges a rank only while it is inside ``step()``, against the job's
    observed step times (a step several times longer than the recent ones, or than
    ``detection.stall_timeout_s`` when steps are short, is a hang). Work outside ``step()``
    (an evaluation pass, a save) is never taken for a hang; long work inside a step, or
    work that should say so explicitly, goes in ``with session.busy("evaluation"):``.
    """

    def __init__(self, context: WorkerContext | None = None, capture_rng: bool = True) -> None:
        self.context = context or WorkerContext.from_env()
        self._progress = _Progress()
        self._objects: dict[str, Any] = {"__phalanx__": self._progress}
        if capture_rng:
            self._objects["__rng__"] = RNGState()
        self.generation = self.context.generation
        self.recoveries = 0
        self._keeper: KeeperLink | None = None
        self._snapshotter: Snapshotter | None = None
        # per-rank state every step, when some state is replicated (see _state_classes)
        self._rank_keeper: KeeperLink | None = None
        self._rank_snapshotter: Snapshotter | None = None
        # the RNG, step and epoch of the last per-rank capture (see _recapture_between_steps)
        self._captured_rng: tuple | None = None
        self._captured_at: tuple[int, int] | None = None
        self._recaptured_step = -2
        self._declared: dict[str, str] = {}
        self._classes: StateClasses | None = None
        self._stepped: set[int] = set()    # optimizers that applied the step in flight
        self._holds_state = True           # False: a replacement until its restore
        self._grad_guard = AccumulationGuard(self.context.rank)
        self._collective: Collective | None = None
        self._collective_error: dict[str, Any] | None = None
        self._store_address = (self.context.master_addr, self.context.master_port)
        self._membership: EtcdMembership | None = None
        self._watcher: GenerationWatcher | None = None
        self._heartbeat: Heartbeat | None = None
        self._members: MemberRelay | None = None     # the rank's record, via its keeper
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._activity = Activity(self.context.heartbeat_s / 2, self._wake.set)
        self._first_step_at = 0.0
        self._restored: dict[str, Any] | None = None   # the last restore: step, source, bytes
        self._awaiting_first_step = False
        self._started = False
        self._agreement: tuple[Any, torch.Tensor] | None = None   # see _agree_interval
        self._unmeasured = False        # the last agreement found no rank measured
        self._verifier: ReplicaVerifier | None = None    # detection.compare_replicas
        self._replays = ReplayMarker()     # steps at or below the highest done: replays
        self._in_epochs = False            # the script iterates ``epochs()``
        # while a restored epoch's top runs again: the per-rank state to set back where the
        # restored pass resumes (see _enter_restored_top); None otherwise
        self._top_state: dict[str, tuple[Any, Any]] | None = None
        self._batch_in_hand = False     # a registered loader fetched the next step's batch
        # until the first capture: each loader's position and the RNG just before that
        # loader's last fetch (see _before_fetch)
        self._fetched_from: dict[LoaderPosition, dict[str, Any]] = {}
        self._rng_before_fetch: dict[str, Any] | None = None
        self._keeping_top = False       # an epoch's top runs: its collectives are kept

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> "Session":
        if self._started:
            return self
        ctx = self.context
        # every record this process logs names the rank and the live generation
        bind_fields(rank=ctx.rank, generation=lambda: self.generation)
        log.info("event=session_start rank=%d generation=%d", ctx.rank, ctx.generation)
        torch.set_num_threads(ctx.torch_threads)
        watch = take_job_watch(ctx)     # the script's init_process_group() may hold them
        if watch is not None:
            self._membership, self._watcher = watch
        if ctx.keeper_port:
            self._start_snapshots()
        if ctx.drills:
            raise_on_sigusr1()
        if isinstance(ctx.extra.get("restore"), dict) or ctx.generation > 0:
            self._awaiting_first_step = True   # restored, or started afresh by a recovery
        if not ctx.standalone_run:
            # the process's collective: the script's init_process_group() may have formed it
            # (before this restore, too: either way the group forms before the restore)
            self._collective = process_collective(ctx)
            try:
                if self._collective.generation < 0:
                    self._collective.form(ctx.generation,
                                          should_abort=self._superseded(ctx.generation))
            except CollectiveAborted as exc:  # e.g. a second node died while this rank started
                if self._watcher is None:
                    raise
                self._recover(str(exc))       # restored as the next plan says
            self._attach_default_group()
        if self.generation == ctx.generation:
            self._restore_at_start()
        if self._membership is not None:
            self._members = MemberRelay(self._membership, ctx.worker_id, self._member_keeper)
            self._members.join(self._record(), ctx.lease_ttl_s)
            self._heartbeat = Heartbeat(
                self._members, ctx.rank, ctx.worker_id, self._record, self._beat_state,
                lambda: self.generation, ctx.heartbeat_s, ctx.lease_ttl_s, self._stop,
                self._wake).start()
        if ctx.drills and ctx.run_dir:   # registered tensors' addresses, for corrupt_params
            write_memory_map(ctx.run_dir, ctx.rank, ctx.worker_id, self.generation, self._objects)
        self._started = True
        return self

    def _attach_default_group(self) -> None:
        """From now on a failed collective on the default group (the script's DDP, its
        ``dist.all_reduce``) completes as a no-op and rolls the step back, and a joining
        rank's set-up collectives are over."""
        collective = self._collective
        assert collective is not None
        watcher = self._watcher
        collective.superseded = lambda: watcher is not None and watcher.newer_than(
            self.generation)
        collective.absorb_faults = watcher is not None
        if watcher is not None:
            watcher.subscribe(collective.generation_announced)
        group = default_group()
        if group is not None:
            group.started()

    def _group_fault(self) -> str | None:
        """Why the default group failed in this generation, or None."""
        return None if self._collective is None else self._collective.fault

    def _before_optimizer_step(self) -> None:
        """An optimizer step waits for the snapshot copy and never applies gradients
        whose reduction failed (DDP's buckets in flight when a peer died)."""
        self._wait_for_copies()
        fault = self._group_fault()
        if fault is not None:
            raise CollectiveAborted(f"optimizer step refused: {fault}")

    def _start_snapshots(self) -> None:
        ctx = self.context
        client = self._open_keeper(ctx.keeper_host, ctx.keeper_port)
        self._keeper = KeeperLink(client, self._open_keeper,
                                  lambda: keeper_address(self._membership, ctx.node))
        every: int | str = "auto" if ctx.snapshot_every == "auto" else int(ctx.snapshot_every)
        self._snapshotter = Snapshotter(
            client, job=ctx.job, rank=ctx.rank, generation=ctx.generation,
            secret=ctx.secret, policy=SnapshotPolicy(every, ctx.overhead_budget, tuple(ctx.tier_windows)),
            checksum_algo=ctx.checksum)
        if self._snapshotter.auto and not ctx.standalone_run and ctx.world_size > 1:
            self._snapshotter.agree_interval(1)     # see _agree_interval
        names = compared_names(self._objects, replicated_names(ctx))
        if names:
            self._verifier = ReplicaVerifier(names, ctx.world_size, ctx.generation,
                                             self._snapshotter,
                                             per_rank_tensors(self._objects, names),
                                             lambda: self._state_classes().group)
        for obj in self._objects.values():
            self._hook_optimizer(obj)

    def _member_keeper(self) -> KeeperClient | None:
        """A client of the node keeper that relays the rank's member record: the one etcd
        names (a replacement, once it reported), else the one the rank was started with;
        None without one.
        Beats are tiny and local: a keeper that does not answer within a third of the lease
        TTL is taken for gone (the rank then holds its own lease)."""
        ctx = self.context
        if not ctx.keeper_port:
            return None
        address = keeper_address(self._membership, ctx.node) or (ctx.keeper_host,
                                                                  ctx.keeper_port)
        return self._open_keeper(*address, timeout_s=max(0.5, ctx.lease_ttl_s / 3))

    def _open_keeper(self, host: str, port: int, timeout_s: float | None = None) -> KeeperClient:
        ctx = self.context
        return KeeperClient(host, port, ctx.secret or b"", ctx.job,
                            timeout_s=timeout_s or ctx.group_timeout_s, generation=self.generation)

    def _capture(self, snapshotter: Snapshotter) -> None:
        """Snapshot the current step; skipped while the node's keeper is gone (it is being
        replaced: ``phalanx.runtime.worker.keeper_link``)."""
        assert self._keeper is not None
        self._keeper.capture(snapshotter, self._progress.step_index, self._objects)
        # gradients are no snapshot state: refuse them accumulated across this boundary
        self._grad_guard.arm(self._progress.step_index, self._objects)

    def declare(self, **kinds: str) -> None:
        """Declare registered state's class where it cannot be inferred
        (``session.declare(model="replicated")`` for a module whose gradients the script
        all-reduces itself; ``"per_rank"`` to keep an inferred one out of the heal); see
        ``phalanx.runtime.snapshot.state_classes``. Before the first step."""
        if self._classes is not None:
            raise RuntimeError("declare() state classes before the first step")
        self._declared.update(kinds)

    def _close_snapshotter(self, snapshotter: Snapshotter) -> None:
        """Publish the last capture and close; a last snapshot the keeper could not take
        (it died under the publish, or its tmpfs filled up) is logged, not raised: the
        training it would have protected is over."""
        try:
            snapshotter.close()
        except (PeerUnreachable, ConfigError) as exc:
            if isinstance(exc, ConfigError) and not no_room(exc):
                raise
            log.warning("event=last_snapshot_lost rank=%d error=%s", self.rank, exc)

    def _capture_per_rank(self) -> None:
        """Every step, when some state is replicated: the per-rank state alone (kilobytes)
        into the rank's per-rank channel of its keeper, what a heal restores it from."""
        if self._keeper is None or not self._state_classes().split:
            return
        if self._rank_snapshotter is None:
            ctx = self.context
            client = self._open_keeper(ctx.keeper_host, ctx.keeper_port)
            self._rank_keeper = KeeperLink(client, self._open_keeper,
                                           lambda: keeper_address(self._membership, ctx.node))
            self._rank_snapshotter = Snapshotter(
                client, job=ctx.job, rank=per_rank_channel(ctx.rank), generation=self.generation,
                secret=ctx.secret, policy=SnapshotPolicy(1, ctx.overhead_budget),
                checksum_algo=ctx.checksum, checksum_workers=1, inline=True)
        assert self._rank_keeper is not None
        # copied into the keeper's slot and its publish sent before the next step runs (no
        # round trip waited for: the keeper's reply is read at the next capture): a rank
        # killed right after this step still leaves its state of this step behind, so the
        # survivors heal at their step instead of falling back to the committed one
        self._rank_keeper.capture(self._rank_snapshotter, self._progress.step_index,
                                  self._state_classes().per_rank)
        if "__rng__" in self._objects:
            self._captured_rng = _rng_mark()
            self._captured_at = (self._progress.step_index, self._progress.epoch)

    def _recapture_between_steps(self) -> None:
        """Before the next batch of the same pass: work the script ran between two steps
        (an evaluation every N steps with dropout or noise, a random draw) moved the RNG
        after the last step's per-rank capture. The per-rank state is captured again for
        the same step, so a replacement restored at it goes on from the RNG the lost rank
        had here, as the run without the fault does; before, it went on from the RNG of
        the step's end, without the evaluation's draws (other dropout masks: other
        parameters than torchrun's). An epoch's top is left to the epoch-top records; a
        loop with no registered loader keeps the step's end (its batch may be drawn
        before ``session.step()``, after this point)."""
        if self._captured_rng is None or self._rank_snapshotter is None \
                or self._captured_at != (self._progress.step_index, self._progress.epoch) \
                or _same_rng(self._captured_rng, _rng_mark()):
            return
        step = self._progress.step_index
        # one INFO line per run of steps that draw between them (a script drawing between
        # every two steps logs its first only)
        level = logging.DEBUG if self._recaptured_step == step - 1 else logging.INFO
        self._recaptured_step = step
        log.log(level, "event=per_rank_recaptured rank=%d step=%d reason=rng_moved_between_steps",
                self.rank, step)
        try:
            self._capture_per_rank()
        except StaleGeneration as exc:  # the keeper already serves a newer generation
            self._recover(f"snapshot fenced: {exc}")

    def _hook_optimizer(self, obj: Any) -> None:
        """Snapshots copy the live tensors in the background while the next step's forward
        and backward run: an optimizer step, and the forward of a module that updates
        buffers in place (BatchNorm statistics), first wait for that copy to finish."""
        if isinstance(obj, torch.optim.Optimizer):
            if not getattr(obj, "_phalanx_hooked", False):
                obj.register_step_pre_hook(lambda *_: self._before_optimizer_step())
                obj.register_step_post_hook(lambda opt, *_: self._stepped.add(id(opt)))
                obj._phalanx_hooked = True   # type: ignore[attr-defined]
            return
        if self._snapshotter is None:
            return
        if isinstance(obj, torch.nn.Module) and any(True for _ in obj.buffers()):
            obj.register_forward_pre_hook(lambda *_: self._wait_for_copies())

    def _wait_for_copies(self) -> None:
        for snapshotter in (self._snapshotter, self._rank_snapshotter):
            if snapshotter is not None:
                snapshotter.wait_for_copy()

    def close(self) -> None:
        """Publish the last snapshot, wait for abandoned groups' teardown, leave membership
        and stop the heartbeat; the current group is dropped with the process (never
        destroyed here: that can block on a dead peer)."""
        if self._verifier is not None and self._collective is not None:
            try:
                self._verifier.collect_finished(self._wait_reduce)
            except CollectiveAborted as exc:
                log.info("event=replica_check_final_skipped rank=%d error=%s", self.rank, exc)
            except ReplicasNeverAgreed as exc:      # the session is over: said, not raised
                log.error("event=replicas_never_agreed rank=%d error=%s", self.rank, exc)
        if self._collective is not None:   # nothing rolls back after the session
            self._collective.absorb_faults = False
            # torn down before "finished": no peer exits (the launcher ends the job once
            # every rank finished) while this process is in a group's destructor. The
            # heartbeat goes on meanwhile and says so: a group to a powered-off peer took
            # 6.6 s, and a record left at an older step in a step was once taken for a hang
            with self._activity.busy("finishing"):
                if not self._collective.wait_released(self.context.group_timeout_s):
                    log.warning("event=group_teardown_slow rank=%d seconds=%.1f", self.rank,
                                self.context.group_timeout_s)
        self._stop.set()
        self._wake.set()
        if self._started:
            _final["state_digest"] = state_digest(self._objects)
        self._grad_guard.disarm()
        if self._snapshotter is not None:
            self._close_snapshotter(self._snapshotter)
            self._snapshotter = None
        if self._keeper is not None:
            self._keeper.close()
            self._keeper = None
        if self._rank_snapshotter is not None:
            self._close_snapshotter(self._rank_snapshotter)
            self._rank_snapshotter = None
        if self._rank_keeper is not None:
            self._rank_keeper.close()
            self._rank_keeper = None
        if self._heartbeat is not None:
            self._heartbeat.join(self.context.heartbeat_s * 4)
            self._heartbeat = None
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None
        if self._membership is not None:
            try:
                # a plain key that outlives our record: "left on purpose", not a lost lease
                self._membership.put(f"{FINISHED_PREFIX}{self.context.worker_id}",
                                     str(self._progress.step_index).encode())
                if self._members is not None:
                    self._members.update(self._record(state="finished"), urgent=True)
            except (MembershipUnavailable, LeaseLost) as exc:
                log.warning("event=final_progress_lost rank=%d error=%s", self.rank, exc)
            if self._members is not None:
                self._members.close()
                self._members = None
            self._membership.close()
            self._membership = None
        bind_fields(rank=self.rank, generation=self.generation)   # the last, not the session
        self._started = False

    def __enter__(self) -> "Session":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- identity ---------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.context.rank

    @property
    def world_size(self) -> int:
        return self.context.world_size

    @property
    def step_index(self) -> int:
        """The step the loop should run next (it moves back after a recovery)."""
        return self._progress.step_index

    @property
    def group(self) -> dist.ProcessGroup | None:
        return None if self._collective is None else self._collective.group

    @property
    def committed_step(self) -> int:
        """The newest step committed job-wide (every rank's snapshot of it held by
        ``replication.factor + 1`` keepers) that this worker has heard of: its keeper passes
        it on at every snapshot, so it lags by up to a snapshot interval plus a heartbeat.
        -1 before the first commit, or without snapshots."""
        stats = self.snapshot_stats
        return -1 if stats is None else stats.committed_step

    @property
    def snapshot_stats(self) -> Any:
        """Counters of the snapshotter (captures, last stall, interval), or None."""
        return None if self._snapshotter is None else self._snapshotter.stats

    @property
    def extras(self) -> dict[str, Any]:
        """The script's plain-value state (see the class docstring): read and assign keys
        (``session.extras["epoch"] = epoch``); captured at each snapshot, restored (same
        dict object) after a recovery or a restart from a snapshot."""
        return self._progress.extras

    # -- state and steps ---------------------------------------------------------------
    def register(self, **objects: Any) -> None:
        """Register training state by name: anything with ``state_dict()``/``load_state_dict()``
        (model, optimizer, scheduler, sampler), a ``torch.Generator``, ``phalanx.RNGState()``.
        A plain value (JSON value, tensor, numpy array, numpy ``Generator`` or
        ``RandomState``) becomes ``extras[name]``: update it
        there (``session.extras[name] = v``), since rebinding a local name is invisible to
        the session; a registered dict, list or tensor is also refilled in place on restore.
        Raises ValueError for a name already registered, already an extra, or reserved."""
        for name, obj in objects.items():
            if name in self._objects or name in self.extras or name.startswith("__"):
                raise ValueError(f"state {name!r} is already registered or reserved")
            if isinstance(obj, DataLoader):    # its position: phalanx.runtime.worker.data
                obj = LoaderPosition(obj, self._before_batch,
                                     lambda: self._progress.epoch if self._in_epochs else None,
                                     self._before_fetch)
            if object_kind(obj) == "value":
                self.extras[name] = obj
                continue
            self._objects[name] = obj
            self._hook_optimizer(obj)

    def epochs(self, count: int) -> Iterator[int]:
        """``for epoch in session.epochs(n):`` in place of ``range(n)``: yields the epochs
        still to run, from the restored one after a restart, and re-enters an earlier
        epoch when a recovery rolled the state back into it (a registered DataLoader then
        resumes that epoch at the restored batch). The epoch is part of every snapshot."""
        if not self._started:
            self.start()
        self._in_epochs = True
        try:
            while self._progress.epoch < count:
                epoch = self._progress.epoch
                if self._restored_pass_waiting():
                    self._enter_restored_top()
                else:
                    self._epoch_top_kept(epoch)
                yield epoch
                self._drop_restored_top()
                tail = self._restored_tail()
                if tail is not None:      # the body's end ran as the restored epoch's tail
                    self._progress.epoch = tail + 1
                elif self._progress.epoch == epoch:   # else a restore moved it: re-enter
                    self._progress.epoch = epoch + 1
                # A collective of the epoch's tail (its evaluation all-reduce) that failed
                # recovers here, before the next epoch's body: the restored step precedes
                # that tail, so this rank re-enters the restored epoch from its top, as the
                # replacement does, and both run its tail again together. (Noticed later,
                # in the next epoch's peek at a batch, the restore had nowhere to go: the
                # peek raised StopIteration.)
                self._recover_if_faulted()
        finally:
            self._in_epochs = False
            self._drop_restored_top()

    def _restored_pass_waiting(self) -> bool:
        """A registered loader holds a restore its loop has not resumed yet."""
        return any(isinstance(obj, LoaderPosition) and obj.pending is not None
                   for obj in self._objects.values())

    def _enter_restored_top(self) -> None:
        """``epochs()`` enters an epoch this rank was restored into: its top (the code
        before the batch loop) runs again here only, on a replacement that joined mid-epoch
        or on every rank re-entering the epoch whose evaluation a peer died in; the ranks
        beside it ran it before the fault. Until the restored pass of its loader resumes
        (its first batch, or its end when the restored step was the epoch's last) the
        default group answers its collectives locally, and what it changes of the per-rank
        state (the RNGs an evaluation's loader draws from, a scheduler stepped at the
        epoch's start, the learning rate) is set back then to the restored values, which
        already hold the top's effects (``_leave_restored_top``). Without this a
        replacement's ``dist.barrier()`` at the top met the survivors' first gradient
        all-reduce and the job failed at the group timeout; an evaluation at the top drew
        the RNG once more on the replacement and the run ended with other parameters."""
        self._epoch_top_on_group(True)
        log.info("event=restored_epoch_top epoch=%d rank=%d", self._progress.epoch,
                 self.context.rank)
        kept: dict[str, Any] = {}
        for name, obj in self._state_classes().per_rank.items():
            if isinstance(obj, torch.optim.Optimizer):
                kept[name] = GroupsOf(obj)        # its hyperparameters, not its tensors
            elif not isinstance(obj, (LoaderPosition, _Progress, ParamsOf, BuffersOf,
                                      torch.nn.Module)):
                kept[name] = obj
        self._top_state = {name: (obj, copy.deepcopy(obj.state_dict()))
                           for name, obj in kept.items()}

    def _leave_restored_top(self) -> None:
        """The restored pass resumes (its first batch, or its end): see above."""
        state = self._top_state
        self._drop_restored_top()
        if state:
            for obj, saved in state.values():
                obj.load_state_dict(saved)
            log.info("event=restored_epoch_top_undone names=%s rank=%d", sorted(state),
                     self.context.rank)

    def _drop_restored_top(self) -> None:
        """End a restored epoch's top (if one runs) without setting anything back."""
        if self._top_state is not None:
            self._top_state = None
            self._epoch_top_on_group(False)

    def _epoch_top_on_group(self, active: bool) -> None:
        group = default_group()
        if group is not None and group.fault_tolerant:
            group.answer_epoch_top_locally(active, self._progress.epoch)

    def _epoch_top_kept(self, epoch: int | None) -> None:
        """An epoch's top begins here (``epoch``) or ends (None, at its first step): its
        collectives' results are kept for a rank restored into the epoch later, whose top
        then returns them (``SetupRecord``)."""
        self._keeping_top = epoch is not None
        group = default_group()
        if group is not None and group.fault_tolerant and not group.answering_locally:
            group.epoch_top(epoch)

    def _before_batch(self) -> None:
        """Before a registered loader's next batch: the restored pass is running, so a
        restored epoch's top is over; then ``_recover_if_faulted``."""
        if self._top_state is not None and not self._restored_pass_waiting():
            self._leave_restored_top()
        recoveries = self.recoveries
        self._recover_if_faulted()
        if self.recoveries == recoveries and not self._batch_in_hand:
            self._recapture_between_steps()
        self._batch_in_hand = True      # until the step that takes it starts

    def _before_fetch(self, position: LoaderPosition) -> None:
        """Just before a registered loader fetches a batch, while the first capture is to
        come: its position and the RNG then, which that capture reports
        (``_as_before_fetch``). Nothing once it is taken, or in a session without snapshots."""
        snapshotter = self._snapshotter
        if self._started and (snapshotter is None or snapshotter.has_captured):
            return
        self._fetched_from[position] = position.state_dict()
        rng = self._objects.get("__rng__")
        if rng is not None:
            self._rng_before_fetch = rng.state_dict()

    @contextmanager
    def _as_before_fetch(self) -> Iterator[None]:
        """The first capture is taken inside the first step, with its batch fetched: the
        loaders' positions and the RNG are captured as they were before that fetch, as
        every later capture (a step's end) finds them. Captured as they were after it, a
        rollback to that step (a rank lost in the first step of the job, or in a
        replacement's first step) redid it on the next batch: every rank skipped one,
        and the run ended with other parameters than without the fault."""
        positions = list(self._fetched_from) if self._batch_in_hand else []
        rng = self._objects.get("__rng__")
        after: tuple[Any, dict[str, Any]] | None = None    # the RNG and its live state
        if positions and rng is not None and self._rng_before_fetch is not None:
            after = (rng, rng.state_dict())
            rng.load_state_dict(self._rng_before_fetch)
        for position in positions:
            position.reported = self._fetched_from[position]
        try:
            yield
        finally:
            for position in positions:
                position.reported = None
            if after is not None:
                after[0].load_state_dict(after[1])
            self._fetched_from.clear()
            self._rng_before_fetch = None

    def _restored_tail(self) -> int | None:
        """The restored epoch whose tail the epoch body just ran, if a restore moved a
        registered loader's live loop into a pass of that earlier epoch (``tail_of``)."""
        tail = None
        for obj in self._objects.values():
            if isinstance(obj, LoaderPosition) and obj.tail_of is not None:
                tail, obj.tail_of = obj.tail_of, None
        return tail

    @property
    def epoch(self) -> int:
        """The epoch ``epochs()`` is in (restored with the state)."""
        return self._progress.epoch

    def _recover_if_faulted(self) -> None:
        """Before a registered loader's next batch: a collective that failed outside a
        step (an evaluation pass) rolls back now, before the batch is fetched; so does a
        new generation that began while this rank did no collective: it joins at this step
        boundary, while the others' group formation still waits for it."""
        fault = self._group_fault()
        if fault is None and (newer := self._newer_generation()) is not None:
            fault = f"generation {newer} began while this rank ran no collective"
        if fault is not None and self._watcher is not None:
            self._recover(fault)

    def _newer_generation(self) -> int | None:
        """A generation announced after this rank's, while its group saw no fault."""
        watcher = self._watcher
        if self._collective is None or watcher is None or self._group_fault() is not None \
                or not watcher.newer_than(self.generation):
            return None
        return watcher.latest

    def _refuse_step_if_faulted(self) -> None:
        """At a step's start, with the batch a registered loader handed out for it before
        this rank noticed a newer generation: the step runs on that batch with its
        collectives refused (no-op results, the optimizer step refused) and recovers at its
        end, as a step a peer died in does. Recovering here ran the step on that batch as
        the restored step, since the restored pass of the loader starts at its next fetch:
        a rank of one DDP group, training apart from another group (its steps ahead), took
        a batch of the pass it left, then one more batch than its peer, and their
        all-reduces met other calls until the group timeout."""
        if (newer := self._newer_generation()) is not None:
            assert self._collective is not None
            self._collective.mark_fault(
                f"generation {newer} began after this step's batch was fetched")

    @contextmanager
    def step(self) -> Iterator[int]:
        """Wrap one training step; yields the step index being run. A collective failure in
        the step is recovered from here (the step's effects are rolled back). The rank's
        member record tells the stall detector whether it is inside a step and how long
        its last completed step took."""
        index, recoveries = self._progress.step_index, self.recoveries
        if self._top_state is not None:      # a step is never part of an epoch's top
            self._leave_restored_top()
        if self._keeping_top:
            self._epoch_top_kept(None)
        started = time.perf_counter()
        self._activity.enter_step()
        completed = False
        try:
            with self._run_step() as step:
                yield step
            completed = (self.recoveries == recoveries
                         and self._progress.step_index == index + 1)
        finally:
            self._activity.leave_step(time.perf_counter() - started if completed else None)

    @contextmanager
    def busy(self, reason: str = "busy") -> Iterator[None]:
        """Mark this rank busy for the block (an evaluation pass, a save, a long step), so
        hang detection does not take it for hung however long the block runs; ``reason``
        is shown in its member record (``extra.busy``). A rank frozen or dead while busy is
        still found by its lapsed lease or its actor's death. Nestable; published at once
        (one write per block entered, so keep it to long work)."""
        with self._activity.busy(reason):
            yield

    @contextmanager
    def _run_step(self) -> Iterator[int]:
        if not self._started:
            self.start()
        snapshotter = self._snapshotter
        self._stepped.clear()
        if snapshotter is not None and not snapshotter.has_captured:
            with self._as_before_fetch():
                self._capture(snapshotter)  # the initial state
                if snapshotter.shares_interval and self.generation == 0 \
                        and self._progress.step_index == 0:
                    # the job's start, the same step on every rank: the next step's
                    # snapshot measures, then UNMEASURED_INTERVAL holds until an agreement
                    # carries it
                    snapshotter.measure_next()
                    snapshotter.agree_interval(UNMEASURED_INTERVAL)
                    self._unmeasured = True
                self._capture_per_rank()
            if self._verifier is not None:
                self._verifier.note_capture(self._progress.step_index)
        if self._batch_in_hand:         # fetched before a fault this rank notices now
            self._refuse_step_if_faulted()
        else:
            self._recover_if_faulted()  # a failed collective or a new generation since
        self._batch_in_hand = False
        if self._progress.step_index in self.context.drill_gates:
            self._hold_at_gate(self._progress.step_index)
        started = time.perf_counter()
        try:
            yield self._progress.step_index
        except CollectiveAborted as exc:
            self._recover(str(exc))
            return
        except Exception as exc:   # a step that used a failed collective's no-op result
            fault = self._group_fault()
            if fault is None:
                raise
            log.warning("event=step_failed_after_fault rank=%d error=%r", self.rank, exc)
            self._recover(fault)
            return
        if (fault := self._group_fault()) is not None:   # a DDP bucket failed: roll back
            self._recover(fault)
            return
        if snapshotter is not None:     # a loop with no fence publishes now, not later
            snapshotter.judge_if_copied()
            if self._rank_snapshotter is not None:
                self._rank_snapshotter.judge_if_copied()
        seconds = time.perf_counter() - started
        self._activity.completing(seconds)
        self._progress.step_index += 1
        self._stepped.clear()           # (their step is now the completed one)
        self._log_step(self._progress.step_index - 1, seconds)
        if self._awaiting_first_step:  # the first step of a new generation: report it now
            self._awaiting_first_step = False
            self._first_step_at = time.time()
            self._wake.set()
        if snapshotter is not None:
            snapshotter.observe_step(time.perf_counter() - started)
            try:
                self._capture_per_rank()
            except StaleGeneration as exc:  # the keeper already serves a newer generation
                self._recover(f"snapshot fenced: {exc}")
                return
            step = self._progress.step_index
            due = snapshotter.due(step)
            if due:
                if not self._compare_replicas(collect=True):
                    return
                try:
                    self._capture(snapshotter)
                except StaleGeneration as exc:  # the keeper already serves a newer generation
                    self._recover(f"snapshot fenced: {exc}")
                    return
                if not self._compare_replicas(collect=False):
                    return
            if snapshotter.shares_interval and (due or step % AGREE_EVERY_STEPS == 0
                                                or self._unmeasured):
                # the comparison in flight, read at the same steps as the interval (not only
                # at the next snapshot, maybe hundreds of steps on), and the last capture's
                # offered again: replicas that never agreed are named a step after the
                # measuring one, and the newest snapshot is verified (commits) this soon
                if not due and not (self._compare_replicas(collect=True)
                                    and self._compare_replicas(collect=False, offer=True)):
                    return
                self._agree_interval(snapshotter)

    def _hold_at_gate(self, step: int) -> None:
        """A drill's fault is due at ``step``: held before it runs until the launcher fired
        it (``phalanx.runtime.worker.drill_hooks.hold_at_gate``), once this rank's last
        snapshot is in its keeper. Busy meanwhile, so the wait is never taken for a hang."""
        membership, watcher = self._membership, self._watcher
        if membership is None:
            return
        with signals_deferred():
            for snapshotter in (self._snapshotter, self._rank_snapshotter):
                if snapshotter is not None:
                    snapshotter.wait_published()
        generation = self.generation
        with self._activity.busy(gate_reason(step)):
            released = hold_at_gate(membership, step, lambda: watcher is not None
                                    and watcher.newer_than(generation))
        log.info("event=drill_gate step=%d released=%s", step, released)

    def _log_step(self, step: int, seconds: float) -> None:
        """One line per completed step: DEBUG, or INFO with ``replay=true`` for a step at or
        below the highest this process completed (redone after a rollback)."""
        if self._replays.mark(step):
            log.info("event=step_done step=%d seconds=%.4f replay=true", step, seconds)
        else:
            log.debug("event=step_done step=%d seconds=%.4f", step, seconds)

    def _compare_replicas(self, collect: bool, offer: bool = False) -> bool:
        """``detection.compare_replicas`` at a snapshot step (``phalanx.runtime.consistency.verify``):
        collect the previous comparison before the capture (its verified step is what the
        capture's slot claim protects), start the next one after it; at an interval
        agreement between snapshot steps (``offer``) start one of the last capture. False
        when a failed collective made this rank recover instead; raises
        ``ReplicasNeverAgreed`` (every rank, at the same step) for ranks that never agreed."""
        verifier = self._verifier
        if verifier is None:
            return True
        try:
            if offer:
                verifier.offer(self._start_reduce)
            elif not collect:
                verifier.start(self._progress.step_index, self._start_reduce)
            elif (found := verifier.collect(self._wait_reduce)) and found.state == "diverged":
                self._wake.set()        # the launcher learns it at once, not next heartbeat
        except CollectiveAborted as exc:
            self._recover(str(exc))
            return False
        return True

    def _agree_interval(self, snapshotter: Snapshotter) -> None:
        """``every_steps: auto`` in a multi-rank job: at each snapshot step and every
        ``AGREE_EVERY_STEPS`` steps (the same steps on every rank, by induction from step 0
        and from every restore step) the ranks take the largest interval any of them
        wants, in one all_reduce of world_size integers on the session's own group, so
        every rank snapshots the same steps. The all_reduce started at one such step is
        collected at the next (long done by then, so no rank waits for a slower one); its
        interval applies from there on every rank. Agreeing between snapshots too lets
        what the first snapshots measured (their pushes, their tier writes) stretch the
        interval within a few dozen steps, not one long interval later.

        A rank that has measured no snapshot yet asks for 0: the ranks that have decide
        (a replacement takes the survivors' interval). When none has, the interval is
        ``UNMEASURED_INTERVAL`` and the ranks agree at every step until one has (the
        same steps on every rank: the condition is the agreement's own result). At the
        job's start the initial snapshot allocates and the next step's measures
        (``measure_next``): the interval is then known a few steps later, with no third
        full snapshot (the interval of 1 and the agreement's lag of one collection took
        one back to back before, 268 MB on the bench's transformer)."""
        pending, self._agreement = self._agreement, None
        try:
            if pending is not None:
                work, agreed = pending
                largest = int(self._wait_reduce(work, agreed).max())
                self._unmeasured = largest == 0
                snapshotter.agree_interval(largest or UNMEASURED_INTERVAL)
            wanted = torch.zeros(self.world_size, dtype=torch.int64)
            wanted[self.rank] = snapshotter.wanted_interval
            self._agreement = (self._start_reduce(wanted), wanted)
        except CollectiveAborted as exc:
            self._recover(str(exc))

    def _start_reduce(self, tensor: torch.Tensor) -> Any:
        if self._collective is None:      # standalone (or a test's reducer): at once
            self.all_reduce(tensor)
            return None
        return self._collective.start_all_reduce(tensor)

    def _wait_reduce(self, work: Any, tensor: torch.Tensor) -> torch.Tensor:
        if work is None or self._collective is None:
            return tensor
        watcher, generation = self._watcher, self.generation
        return self._collective.wait(
            work, tensor, lambda: watcher is not None and watcher.newer_than(generation))

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` in place over every rank of the current generation; raises
        ``CollectiveAborted`` (handled by ``step()``) when a peer fails."""
        if self._collective is None:
            return tensor
        watcher = self._watcher
        generation = self.generation
        return self._collective.all_reduce(
            tensor, lambda: watcher is not None and watcher.newer_than(generation))

    # -- progress ----------------------------------------------------------------------
    def _record(self, state: str = "running") -> MemberRecord:
        ctx = self.context
        return MemberRecord(worker_id=ctx.worker_id, rank=ctx.rank, node=ctx.node,
                            step=self._progress.step_index, generation=self.generation,
                            pid=os.getpid(), extra={"state": state, "time": time.time(),
                                                    "first_step_at": self._first_step_at,
                                                    "collective_error": self._collective_error,
                                                    "restored": self._restored,
                                                    **self._replica_extra(),
                                                    **self._snapshot_extra(),
                                                    **self._activity.extra()})

    def _replica_extra(self) -> dict[str, Any]:
        verifier = self._verifier
        return {} if verifier is None else {REPLICAS_EXTRA: verifier.status().to_extra()}

    def _snapshot_extra(self) -> dict[str, Any]:
        """The snapshots' cost so far (the launcher's metrics): the interval in force, the
        training thread's summed capture stall, the captures published, (when any) the
        ones dropped as torn (``event=snapshot_torn``) and each registered object's state
        class (``phalanx status``). Changes at most once per capture, so it adds no
        heartbeat writes."""
        snapshotter = self._snapshotter
        if snapshotter is None:
            return {}
        stats = snapshotter.stats
        info: dict[str, Any] = {"every_steps": snapshotter.interval,
                                "stall_s": round(stats.stall_s, 6),
                                "captures": stats.captures}
        if stats.torn:          # snapshots dropped as torn; later ones copied synchronously
            info["torn"] = stats.torn
        if self._classes is not None:   # known from the first capture on
            info["classes"] = dict(self._classes.kinds)
            if self._classes.group:     # replicated over some ranks only (HSDP)
                info["replica_group"] = list(self._classes.group)
        return {"snapshot": info}

    def _beat_state(self) -> tuple:
        """What a heartbeat writes when it changed since the last one."""
        return (self._progress.step_index, self.generation, self._first_step_at,
                self._collective_error, self._replica_extra(), self._snapshot_extra(),
                self._activity.extra())

