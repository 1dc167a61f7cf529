"""The node keeper (memory daemon): owns the shared-memory snapshot slots of its node's
ranks and replicas of other nodes' ranks, and serves them over ``phalanx.runtime.transport.tcp``.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

from phalanx.configs.errors import ConfigError, PeerUnreachable, SnapshotNotFound, StaleGeneration
from phalanx.runtime.base import is_channel
from phalanx.runtime.keeper.memory_plan import (MemoryPlan, MemoryPlanExceeded, fix_hint,
                                                job_bytes_held, plan_shortfall)
from phalanx.runtime.keeper.wire import (KeeperClient, KeeperRequestInvalid, OpHandler, SlotBusy,
                                         handle)
from phalanx.runtime.keeper.shared_copies import (copy_refs_in, locate, own_ranges,
                                                  shared_bytes)
from phalanx.runtime.keeper.shm import (Held, RankSlots, Ref, ShmBuffer, check_capacity,
                                        memory_plan, owned_names, pick_slot, remove_stale,
                                        shm_prefix, validate_name)
from phalanx.runtime.transport.tcp import DEFAULT_MAX_PAYLOAD, FrameServer, Reply, Request

log = logging.getLogger(__name__)

_WRITE_OPS = frozenset({"alloc", "claim", "publish", "put_replica", "drop"})
# A buffer that held nothing this long gives its pages back (``Keeper._reclaim``): longer
# than the gap between the snapshots of a job that takes one every step or every few.
RELEASE_AFTER_S = 5.0
__all__ = ["Keeper", "KeeperClient", "KeeperRequestInvalid", "SlotBusy", "memory_plan",
           "check_capacity", "owned_names"]


class Keeper:
    """One per node. Thread-safe: its FrameServer's connection threads call the ops below.

    Slot protocol for a local rank: ``alloc`` (files, once per layout) → ``claim`` (the
    keeper picks a slot that is neither the newest ready step, nor pinned by a reader, nor
    ``protect_step``; it is unpublished at once) → the worker writes it through its own
    mmap → ``publish``. A worker that dies before ``publish`` leaves the slot unpublished,
    so it is never served. ``generation_check(g) -> bool`` fences every write op.

    A replica push pins the slot it streams with ``on_claim``: such a pin gives way to the
    worker, so a claim that finds no other slot preempts the push instead of waiting.
    """

    def __init__(self, node: str, job: str, secret: bytes, shm_dir: str = "/dev/shm",
                 slots: int = 2, bind_host: str = "127.0.0.1",
                 generation_check: Callable[[int], bool] | None = None, *, port: int = 0,
                 replica_keep: int = 2, timeout_s: float = 10.0, claim_wait_s: float = 5.0,
                 max_payload: int = DEFAULT_MAX_PAYLOAD,
                 ops: Mapping[str, OpHandler] | None = None, plan: MemoryPlan | None = None,
                 allow_unprotected: bool = False,
                 on_event: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.node = validate_name(node, "keeper.node")
        self.job = validate_name(job, "job.name", allow_dash=True)
        if slots < 2 or replica_keep < 1:
            raise ValueError(f"need slots >= 2 and replica_keep >= 1, got {slots}, {replica_keep}")
        self.shm_dir, self.slots, self.replica_keep = shm_dir, slots, replica_keep
        self.prefix = shm_prefix(job, node)
        self._generation_check = generation_check
        self._plan, self._allow_unprotected = plan, allow_unprotected
        # once the job trained past a recovery its plan held at its first snapshots: a
        # shortage now (another tenant filled the tmpfs) degrades with an alert, it does
        # not fail a job that was protected (plan_proven)
        self._plan_proven = False
        self._unprotected: set[int] = set()    # ranks already alerted for
        self._on_event = on_event
        self._claim_wait_s = claim_wait_s
        self._cond = threading.Condition()
        self._alloc_lock = threading.Lock()
        self._local: dict[int, RankSlots] = {}
        self._replicas: dict[int, list[Held]] = {}
        self._free: list[ShmBuffer] = []
        self._seq = itertools.count()
        self._closed = False
        self._push_s: dict[tuple[int, str], float] = {}     # (rank, holder) -> last push
        self._tier_s: dict[int, float] = {}     # rank -> tier writes since its last claim
        self._committed = -1              # the job's committed step, as last read from etcd
        self._commit_read = -1            # the last value read (``_committed`` never goes back)
        # ranks whose slots (own) or replicas this keeper no longer needs since a new
        # placement, -> the committed step then: released once a newer step commits
        self._departed: dict[tuple[str, int], int] = {}
        self._publish_listeners: list[Callable[[], None]] = []
        self._sharing: set[int] = set()         # ranks whose replicas shared bytes here
        self._ops = dict(ops or {})       # served through the op port (e.g. replication's)
        # every registered op is fenced unless it says otherwise (``wire.Unfenced``)
        self._write_ops = _WRITE_OPS | {name for name, op in self._ops.items()
                                        if getattr(op, "fenced", True)}
        self._server = FrameServer(bind_host, port, secret=secret, job=job, handler=self._handle,
                                   generation_check=generation_check, timeout_s=timeout_s,
                                   max_payload=max_payload, name=f"keeper-{node}")

    @property
    def address(self) -> tuple[str, int]:
        return self._server.address

    def start(self) -> "Keeper":
        """Remove files a killed predecessor left, then serve.

        Raises ConfigError (no shm_dir) or ServiceStartError (cannot listen)."""
        if not os.path.isdir(self.shm_dir):
            raise ConfigError("snapshot.shm_dir", f"{self.shm_dir} is not a directory",
                              "point snapshot.shm_dir at a tmpfs such as /dev/shm")
        stale = remove_stale(self.shm_dir, self.prefix)
        if stale:
            log.warning("keeper.stale_files_removed node=%s count=%d", self.node, len(stale))
        self._server.start()
        log.info("keeper.started node=%s job=%s address=%s:%d shm_dir=%s slots=%d",
                 self.node, self.job, *self.address, self.shm_dir, self.slots)
        return self

    def close(self) -> None:
        """Stop serving (joins every connection thread), then unmap and unlink every file."""
        self._server.close()
        with self._cond:
            self._closed = True
            held = [h for t in self._local.values() for h in t.slots + t.retired]
            held += [h for lst in self._replicas.values() for h in lst]
            # (and what they reference: a source forgotten before is mapped still)
            seen, todo = {id(h) for h in held}, list(held)
            while todo:
                for ref in todo.pop().refs:
                    if id(ref.source) not in seen:
                        seen.add(id(ref.source))
                        held.append(ref.source)
                        todo.append(ref.source)
            buffers = [h.buf for h in held] + self._free
            self._local, self._replicas, self._free = {}, {}, []
        for buf in buffers:
            buf.close()
        log.info("keeper.closed node=%s files=%d", self.node, len(buffers))

    def __enter__(self) -> "Keeper":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- local slots -------------------------------------------------------------------

    def alloc(self, rank: int, nbytes: int, *, releasable: bool = True) -> list[str]:
        """Paths of ``slots`` files of ``nbytes`` each for ``rank`` (idempotent per size).
        ``releasable=False``: the writer pins its maps (CUDA), so their pages stay even
        when they hold no step worth keeping (``_reclaim``).

        A new size (or a layout with a file gone) makes a new layout version; the old
        layout's newest ready step is served until a new slot is published. Raises ConfigError(snapshot.shm_dir) before
        creating any file when shm_dir or MemAvailable cannot hold the ``slots`` files.
        """
        if nbytes <= 0:
            raise KeeperRequestInvalid(f"alloc size must be positive, got {nbytes}")
        with self._alloc_lock:
            with self._cond:
                self._departed.pop(("local", rank), None)   # the rank is (back) on this node
                table = self._local.get(rank)
                # a layout whose file someone unlinked (a clean-up of a predecessor's
                # files racing with this alloc) is replaced, never handed out
                if table is not None and table.slot_nbytes == nbytes \
                        and all(os.path.exists(h.buf.path) for h in table.slots):
                    table.releasable = table.releasable and releasable
                    return [h.buf.path for h in table.slots]
                version = table.version + 1 if table else 0
            self._check_room(rank, nbytes)
            bufs: list[ShmBuffer] = []
            try:
                for i in range(self.slots):
                    path = os.path.join(self.shm_dir, f"{self.prefix}r{rank}-v{version}-s{i}")
                    # the worker allocates a slot's pages as it first writes it (reserve_file):
                    # a job whose snapshots are far apart never touches its spare slots
                    bufs.append(ShmBuffer.create(path, nbytes, allocate=False))
            except BaseException as exc:
                for buf in bufs:
                    buf.close()
                if isinstance(exc, ConfigError):             # the tmpfs filled up meanwhile
                    self._refused(rank, nbytes, exc)
                raise
            with self._cond:
                self._refuse_if_closed(bufs)
                new = RankSlots(version, nbytes, [Held(b, rank) for b in bufs],
                                releasable=releasable)
                if table is not None:
                    new.retired = self._retire_layout(table)
                self._local[rank] = new
                self._cond.notify_all()
        log.info("keeper.alloc node=%s rank=%d nbytes=%d version=%d", self.node, rank, nbytes,
                 version)
        if rank in self._unprotected and self._plan_proven:   # room again: protected again
            self._unprotected.discard(rank)
            if self._on_event is not None:
                self._on_event({"event": "snapshot_protected", "rank": rank,
                                "rank_bytes": nbytes, "shm_dir": self.shm_dir})
        return [b.path for b in bufs]

    def _check_room(self, rank: int, nbytes: int) -> None:
        """Raise ConfigError before any file exists when ``shm_dir`` or RAM (tmpfs pages
        cannot be reclaimed) lacks room for ``rank``'s ``slots`` files of ``nbytes``.

        With a ``plan`` (the job's, from its config), the measured ``nbytes`` is first
        checked against the whole plan (every rank's slots and replicas on every node
        sharing ``shm_dir``): short of it, ``MemoryPlanExceeded`` is raised, or with
        ``allow_unprotected`` a ``snapshot_unprotected`` event is sent and the slots are
        made if they fit. Without a plan only this rank's slots are counted. Called by
        ``alloc`` under ``_alloc_lock``.
        """
        if self._plan is not None and not self._plan_proven:
            self._check_plan(self._plan, rank, nbytes)
        need = memory_plan(nbytes, 1, self.slots, 0, 0)
        try:
            check_capacity(
                need, self.shm_dir,
                what=f"keeper {self.node}: rank {rank}'s snapshots ({self.slots} slots x "
                     f"{nbytes} bytes in {self.shm_dir})",
                hint=f"point `snapshot.shm_dir` at a larger tmpfs than {self.shm_dir}, "
                     f"snapshot a smaller state, use fewer `snapshot.slots` (now "
                     f"{self.slots}), or set `snapshot.rank_size_mb` so the launcher refuses "
                     "before start")
        except ConfigError as exc:
            log.warning("keeper.alloc_refused node=%s rank=%d nbytes=%d slots=%d need=%d",
                        self.node, rank, nbytes, self.slots, need)
            self._refused(rank, nbytes, exc)
            raise

    def plan_proven(self) -> None:
        """The job recovered, so its memory plan held at its first snapshots: from now on a
        rank without room (a promoted spare while the tmpfs is full) gets a
        ``snapshot_unprotected`` alert and skips its snapshots until there is room,
        instead of failing the job. Called by the keeper actor at generation > 0."""
        self._plan_proven = True

    def _refused(self, rank: int, nbytes: int, exc: ConfigError) -> None:
        """A refused allocation: ``MemoryPlanExceeded`` while the job's plan is unproven
        (and not ``allow_unprotected``); else one ``snapshot_unprotected`` alert per rank
        and the plain ``ConfigError`` (the worker trains on, asking again next snapshot)."""
        if self._plan is None:
            return
        if not self._plan_proven and not self._allow_unprotected:
            raise MemoryPlanExceeded(exc.key, exc.problem, fix_hint(self.shm_dir)) from None
        if self._on_event is not None and rank not in self._unprotected:
            self._unprotected.add(rank)
            self._on_event({"event": "snapshot_unprotected", "rank": rank, "rank_bytes": nbytes,
                            "shm_dir": self.shm_dir,
                            "reason": f"{exc.problem}; rank {rank} trains on without snapshots "
                                      "on this node until there is room"})

    def _check_plan(self, plan: MemoryPlan, rank: int, nbytes: int) -> None:
        """The job's whole memory plan at ``rank``'s measured snapshot size (see
        ``_check_room``)."""
        short = plan_shortfall(plan, nbytes, self.shm_dir, job_bytes_held(self.shm_dir, self.job))
        if short is None:
            return
        measured = f"keeper {self.node}: rank {rank}'s first snapshot measured {nbytes} bytes"
        log.warning("keeper.plan_exceeded node=%s rank=%d nbytes=%d allowed=%s reason=%s",
                    self.node, rank, nbytes, self._allow_unprotected, short)
        if not self._allow_unprotected:
            raise MemoryPlanExceeded("snapshot.shm_dir", f"{measured}; {short}",
                                     fix_hint(self.shm_dir))
        if self._on_event is not None and rank not in self._unprotected:
            self._unprotected.add(rank)
            self._on_event({"event": "snapshot_unprotected", "rank": rank, "rank_bytes": nbytes,
                            "plan_bytes": plan.tmpfs_bytes(nbytes), "shm_dir": self.shm_dir,
                            "reason": f"{measured}; {short}; training on with degraded "
                                      "protection (snapshot.allow_unprotected)"})

    def _retire_layout(self, table: RankSlots) -> list[Held]:
        ready = [h for h in table.slots + table.retired if h.state == "ready"]
        keep = max(ready, key=lambda h: h.step, default=None)
        for held in table.slots + table.retired:
            if held is not keep:
                self._doom(held)
        return [keep] if keep is not None else []

    def claim(self, rank: int, protect_step: int | None = None, *,
              wait: bool = True) -> tuple[int, str]:
        """(slot index, path) the worker writes its next snapshot into.

        Waits up to ``claim_wait_s`` for readers of the candidate slots (not at all without
        ``wait``), then raises SlotBusy; KeeperRequestInvalid if ``rank`` has no slots.
        """
        deadline = time.monotonic() + (self._claim_wait_s if wait else 0.0)
        with self._cond:
            while True:
                table = self._table(rank)
                index = pick_slot(table, protect_step)
                if index is not None:
                    break
                if not wait:
                    raise SlotBusy(f"keeper {self.node}: no free slot for rank {rank} now")
                victim = pick_slot(table, protect_step, preempt=True)
                if victim is not None:
                    self._preempt(table.slots[victim])
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SlotBusy(f"keeper {self.node}: no free slot for rank {rank} "
                                   f"(readers or protect_step={protect_step} hold them)")
                self._cond.wait(left)
            held = table.slots[index]
            held.state, held.step, held.manifest, held.used = "writing", -1, b"", 0
            held.buf.in_use()
        return index, held.buf.path

    def _preempt(self, held: Held) -> None:
        """Called with the lock held: ask every yielding reader of ``held`` to stop (once)."""
        callbacks, held.yielding = held.yielding, []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # a reader's bug must not fail the worker's claim
                log.exception("keeper.preempt_failed node=%s rank=%d step=%d", self.node,
                              held.rank, held.step)
        log.debug("keeper.preempted node=%s rank=%d step=%d readers=%d", self.node, held.rank,
                  held.step, len(callbacks))

    def publish(self, rank: int, step: int, slot: int, manifest: bytes, nbytes: int, *,
                notify: bool = True) -> None:
        """Record that claimed ``slot`` now holds ``rank``'s snapshot of ``step``
        (``nbytes`` payload bytes). A ready slot with the same step is superseded. With
        ``notify=False`` the caller calls ``notify_published`` itself (the wire handler
        does, once its reply is sent: a woken sender must not delay the worker's reply)."""
        with self._cond:
            table = self._table(rank)
            if not 0 <= slot < len(table.slots) or table.slots[slot].state != "writing":
                raise KeeperRequestInvalid(f"keeper {self.node}: rank {rank} slot {slot} was "
                                           f"not claimed; call claim() before writing")
            held = table.slots[slot]
            if not 0 < nbytes <= held.buf.nbytes:
                raise KeeperRequestInvalid(f"rank {rank}: {nbytes} bytes do not fit the "
                                           f"{held.buf.nbytes}-byte slot")
            for other in table.slots:
                if other.state == "ready" and other.step == step:
                    other.state = "empty"
            held.state, held.step, held.manifest, held.used = "ready", step, manifest, nbytes
            for old in table.retired:
                self._doom(old)
            table.retired = []
            self._reclaim()
            self._cond.notify_all()
        if notify:
            self.notify_published()
        log.debug("keeper.published node=%s rank=%d step=%d slot=%d nbytes=%d",
                  self.node, rank, step, slot, nbytes)

    def _refuse_if_closed(self, bufs: list[ShmBuffer]) -> None:
        """Called with the lock held by a request that outlived close(): drop its files."""
        if self._closed:
            for buf in bufs:
                buf.close()
            raise PeerUnreachable(f"keeper {self.node} is closed")

    def _table(self, rank: int) -> RankSlots:
        table = self._local.get(rank)
        if table is None:
            raise KeeperRequestInvalid(f"keeper {self.node}: rank {rank} has no slots; "
                                       f"call alloc() first")
        return table

    # ----- replicas ----------------------------------------------------------------------

    def put_replica(self, rank: int, step: int, manifest: bytes,
                    payload: bytes | bytearray | memoryview) -> list[int]:
        """Store a copy of another node's ``rank`` at ``step``; returns evicted steps."""
        source = memoryview(payload).cast("B")

        def copy(view: memoryview) -> None:
            view[:] = source

        try:
            return self.store_replica(rank, step, manifest, source.nbytes, copy)
        finally:
            source.release()

    def store_replica(self, rank: int, step: int, manifest: bytes, nbytes: int,
                      fill: Callable[[memoryview], None],
                      shared: Sequence[tuple[int, int, Held, bytes, int]] = ()) -> list[int]:
        """Like ``put_replica``, but ``fill`` writes the payload into the shm view itself
        (the TCP handler receives straight from the socket). The newest ``replica_keep``
        steps stay; a failed ``fill`` leaves what was held untouched.

        ``shared``: (offset, nbytes, held, its manifest, at) for ranges of the payload that
        ``held`` (a ready snapshot here, published with that manifest) holds at ``at``: they
        are kept as references, not copied, and ``fill`` must leave them alone
        (``phalanx.runtime.keeper.shared_copies``). SnapshotNotFound if one left memory."""
        if nbytes <= 0:
            raise KeeperRequestInvalid(f"replica of rank {rank} step {step} is empty")
        if shared:
            return self._store_thin(rank, step, manifest, nbytes, fill, shared)
        buf = self._take_free(nbytes)
        if buf is not None:
            try:
                buf.reserve()       # (its pages were released if it lay idle)
            except BaseException:
                with self._cond:
                    self._keep_free(buf)
                raise
        else:
            buf = ShmBuffer.create(
                os.path.join(self.shm_dir, f"{self.prefix}x{next(self._seq)}"), nbytes)
        view = buf.view(nbytes)
        try:
            fill(view)
        except BaseException:
            view.release()
            with self._cond:
                self._keep_free(buf)
            raise
        view.release()
        return self._keep_replica(Held(buf, rank, "ready", step, manifest, nbytes))

    def _store_thin(self, rank: int, step: int, manifest: bytes, nbytes: int,
                    fill: Callable[[memoryview], None],
                    shared: Sequence[tuple[int, int, Held, bytes, int]]) -> list[int]:
        """``store_replica`` of a replica whose ``shared`` ranges stay references: a new
        sparse file whose other ranges alone get pages."""
        buf = ShmBuffer.create(
            os.path.join(self.shm_dir, f"{self.prefix}x{next(self._seq)}"), nbytes,
            allocate=False)
        thin = Held(buf, rank, "writing", step, manifest, nbytes)
        try:
            with self._cond:
                thin.refs = self._pin_sources(rank, step, shared)
            buf.reserve_ranges(own_ranges(nbytes, thin.refs))
            with buf.view(nbytes) as view:
                fill(view)
        except BaseException:
            with self._cond:
                self._release_refs(thin)
            buf.close()
            raise
        thin.state = "ready"
        return self._keep_replica(thin)

    def _pin_sources(self, rank: int, step: int,
                     shared: Sequence[tuple[int, int, Held, bytes, int]]) -> tuple[Ref, ...]:
        """Called with the lock held: the references of a new replica, each distinct source
        pinned once (non-yielding until the replica is stored: ``_keep_replica``)."""
        refs: list[Ref] = []
        for offset, nbytes, held, manifest, at in shared:
            where = (locate(held, at, nbytes) if held.state == "ready" and not held.doomed
                     and held.manifest is manifest else None)
            if where is None:
                self._unpin_sources(refs, None)
                raise SnapshotNotFound(
                    f"keeper {self.node}: a tensor reused by rank {rank} step {step} left "
                    "memory during the push; offer again")
            source, source_at = where
            if all(ref.source is not source for ref in refs):
                source.pins += 1
                source.ref_pins += 1
            refs.append(Ref(offset, nbytes, source, source_at))
        return tuple(refs)

    def _release_refs(self, held: Held) -> None:
        """Called with the lock held: let go of ``held``'s references."""
        refs, held.refs = held.refs, ()
        self._unpin_sources(refs, held)

    def _unpin_sources(self, refs: Sequence[Ref], thin: Held | None) -> None:
        """Called with the lock held: release each distinct source's reference pin (and
        ``thin``'s claim callback on it); a doomed source goes once unpinned."""
        for source in {id(r.source): r.source for r in refs}.values():
            source.pins -= 1
            source.ref_pins -= 1
            source.yielding = [c for c in source.yielding
                               if not (isinstance(c, _Materializer) and c.thin is thin)]
            if source.doomed and source.pins == 0:
                self._close_held(source)
        if refs:
            self._cond.notify_all()

    def _close_held(self, held: Held) -> None:
        """Called with the lock held: unmap ``held`` (its last pin is gone)."""
        self._release_refs(held)
        held.buf.close()

    def _keep_replica(self, new: Held) -> list[int]:
        """Keep a stored replica, evicting the same step and what retention drops."""
        rank, step = new.rank, new.step
        with self._cond:
            if self._closed:
                self._release_refs(new)
            self._refuse_if_closed([new.buf])
            for source in {id(r.source): r.source for r in new.refs}.values():
                materialize = _Materializer(self, new, source)
                source.yielding.append(materialize)
                if source.doomed:   # (a forgotten replica still held a tensor)
                    materialize()
            held = self._replicas.setdefault(rank, [])
            for old in [h for h in held if h.step == step]:
                held.remove(old)
                self._evict(old)
            held.append(new)
            held.sort(key=lambda h: h.step)
            evicted = held[:-self.replica_keep]
            del held[:-self.replica_keep]
            for old in evicted:
                self._evict(old)
            self._reclaim()
        shared = shared_bytes([new])
        log.debug("keeper.replica_stored node=%s rank=%d step=%d nbytes=%d shared=%d "
                  "evicted=%s", self.node, rank, step, new.used, shared,
                  [h.step for h in evicted])
        if shared and rank not in self._sharing:
            self._sharing.add(rank)     # told once per rank: the job's events stay few
            log.info("keeper.replica_shared node=%s rank=%d step=%d shared=%d of %d", self.node,
                     rank, step, shared, new.used)
            if self._on_event is not None:
                self._on_event({"event": "replica_shared", "rank": rank, "step": step,
                                "shared_bytes": shared, "rank_bytes": new.used})
        return [h.step for h in evicted]

    def _materialize(self, thin: Held, source: Held) -> None:
        """A claim needs ``source``, a slot ``thin`` references, or ``source`` was forgotten
        (``_Materializer``, a thread): copy the bytes ``thin`` shares with it in, then let
        go of ``source`` once no reader of ``thin`` reads through it. Its other references
        stay. A copy that fails (tmpfs full) forgets the replica instead; a replica
        forgotten meanwhile needs no copy: it keeps its references until its last reader
        goes (``_close_held``)."""
        refs = [r for r in thin.refs if r.source is source]
        failed: Exception | None = None
        try:
            thin.buf.reserve_ranges([(r.offset, r.nbytes) for r in refs])
            copy_refs_in(thin, refs)
        except Exception as exc:  # noqa: BLE001 - thread boundary
            failed = exc
        with self._cond:
            if failed is not None and not thin.doomed:
                log.warning("keeper.materialize_failed node=%s rank=%d step=%d error=%s",
                            self.node, thin.rank, thin.step, failed)
                listed = self._replicas.get(thin.rank, [])
                if thin in listed:
                    listed.remove(thin)
                self._doom(thin)
            # its readers (not other replicas' references to its own bytes, nor the copies
            # in flight) may read through the references
            while (thin.pins - thin.ref_pins - thin.copying > 0 and not thin.doomed
                   and not self._closed):
                self._cond.wait(1.0)
            if not thin.doomed:
                thin.refs = tuple(r for r in thin.refs if r.source is not source)
                self._unpin_sources(refs, thin)
            thin.copying -= 1
            thin.pins -= 1
            if thin.doomed and thin.pins == 0:
                self._close_held(thin)
            self._cond.notify_all()
        if failed is None:
            log.debug("keeper.materialized node=%s rank=%d step=%d from_rank=%d bytes=%d",
                      self.node, thin.rank, thin.step, source.rank,
                      sum(r.nbytes for r in refs))

    def _take_free(self, nbytes: int) -> ShmBuffer | None:
        with self._cond:
            for i, buf in enumerate(self._free):
                if buf.nbytes == nbytes:
                    buf.in_use()
                    return self._free.pop(i)
        return None

    def _evict(self, held: Held) -> None:
        """Called with the lock held: recycle an unread replica buffer, doom a read one."""
        held.state = "empty"
        if held.pins:
            self._doom(held)
        else:
            self._release_refs(held)
            self._keep_free(held.buf)

    def _keep_free(self, buf: ShmBuffer) -> None:
        """Called with the lock held: keep ``buf`` for the next put_replica of its size (at
        most one per replicated rank; the oldest beyond that is closed); its pages go once
        it lay idle ``RELEASE_AFTER_S`` (``_reclaim``)."""
        if self._closed:
            buf.close()
            return
        self._free.append(buf)
        self._trim_free()

    # ----- reading, retention, accounting ------------------------------------------------

    def pin(self, rank: int, step: int | None = None, *,
            on_claim: Callable[[], None] | None = None) -> tuple[str, Held]:
        """(source, held) of ``rank`` at ``step`` (newest if None), pinned against reuse
        until ``unpin``; local copies win over replicas. Raises SnapshotNotFound.

        With ``on_claim`` the pin gives way to the worker: a claim that needs this slot
        calls ``on_claim()`` once, under the keeper's lock (it must only signal, e.g. shut
        a socket down), and waits for the ``unpin(held, on_claim)`` that follows."""
        with self._cond:
            table = self._local.get(rank)
            found = [("local", h) for h in (table.slots + table.retired if table else [])
                     if h.state == "ready"]
            found += [("replica", h) for h in self._replicas.get(rank, []) if h.state == "ready"]
            want = max((h.step for _, h in found), default=None) if step is None else step
            for source, held in found:
                if held.step == want:
                    held.pins += 1
                    if on_claim is not None:
                        held.yielding.append(on_claim)
                    return source, held
            holds = self.holdings().get(rank, {})
        where = "any step" if step is None else f"step {step}"
        raise SnapshotNotFound(f"keeper {self.node}: no snapshot of rank {rank} at {where}; "
                               f"it holds local {holds.get('local', [])}, "
                               f"replica {holds.get('replica', [])}")

    def unpin(self, held: Held, on_claim: Callable[[], None] | None = None) -> None:
        """Release one pin (``on_claim``: the callback that pin was taken with)."""
        with self._cond:
            held.pins -= 1
            for i, callback in enumerate(held.yielding):
                if callback is on_claim:
                    del held.yielding[i]
                    break
            if held.doomed and held.pins == 0:
                self._close_held(held)
            self._cond.notify_all()

    def ready_snapshots(self) -> list[Held]:
        """Every ready full snapshot held (what replicas may share), newest step first, and
        of one step replicas first (never claimed by a worker, so the better source to
        share), then local slots. Per-rank channels are left out: their slots turn over
        every step, so a replica sharing a few of their bytes (an RNG state equal on every
        rank) would have to copy itself whole at the next step (measured: every replica of
        the transformer bench did). Read fields only under the lock (``store_replica``
        checks them again)."""
        with self._cond:
            replicas = [h for rank, lst in self._replicas.items() if not is_channel(rank)
                        for h in lst if h.state == "ready"]
            local = [h for rank, t in self._local.items() if not is_channel(rank)
                     for h in t.slots + t.retired if h.state == "ready"]
            # newest first: an older local slot is the one the worker's next claim needs
            return sorted(replicas + local, key=lambda h: -h.step)

    def settle_local_writes(self, step: int, timeout_s: float) -> None:
        """Wait (up to ``timeout_s``) until no local rank that holds a slot claimed for
        writing has published only steps older than ``step``: a peer's replica of ``step``
        on offer most likely shares that rank's capture of it in flight. (A claimed slot
        alone says little: the worker claims its next slot as soon as it publishes.)"""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                behind = [rank for rank, table in self._local.items()
                          if not is_channel(rank)
                          and any(h.state == "writing" for h in table.slots)
                          and max((h.step for h in table.slots if h.state == "ready"),
                                  default=-1) < step]
                left = deadline - time.monotonic()
                if not behind or left <= 0:
                    return
                self._cond.wait(left)

    def _doom(self, held: Held) -> None:
        """Called with the lock held: forget ``held``; its file goes now, its map when unread."""
        held.state, held.doomed = "empty", True
        held.buf.unlink()
        if held.pins == 0:
            self._close_held(held)
        # replicas sharing its bytes copy them in, so its memory goes with its readers
        for materialize in [c for c in held.yielding if isinstance(c, _Materializer)]:
            materialize()

    def drop(self, rank: int | None, below_step: int | None = None,
             above_step: int | None = None) -> dict[str, list[int]]:
        """Forget steps < ``below_step`` and > ``above_step`` (after a rollback) of one rank,
        or of every rank if None. Local slot files stay allocated for reuse."""
        def gone(h: Held) -> bool:
            return (h.state == "ready" and (rank is None or h.rank == rank)
                    and ((below_step is not None and h.step < below_step)
                         or (above_step is not None and h.step > above_step)))

        dropped: dict[str, list[int]] = {"local": [], "replica": []}
        with self._cond:
            for held in [h for t in self._local.values() for h in t.slots + t.retired]:
                if gone(held):
                    dropped["local"].append(held.step)
                    held.state = "empty"
            for lst in self._replicas.values():
                for held in [h for h in lst if gone(h)]:
                    dropped["replica"].append(held.step)
                    lst.remove(held)
                    self._evict(held)
            self._cond.notify_all()
        dropped = {kind: sorted(steps) for kind, steps in dropped.items()}
        log.info("keeper.dropped node=%s rank=%s below=%s above=%s local=%s replica=%s",
                 self.node, rank, below_step, above_step, dropped["local"], dropped["replica"])
        return dropped

    def on_publish(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (it must not block) after every publish of a local rank."""
        with self._cond:
            self._publish_listeners.append(callback)

    def notify_published(self) -> None:
        with self._cond:
            listeners = list(self._publish_listeners)
        for listener in listeners:
            try:
                listener()
            except Exception:  # a listener's bug must not fail the worker's publish
                log.exception("keeper.publish_listener_failed node=%s", self.node)

    def remove_publish_listener(self, callback: Callable[[], None]) -> None:
        with self._cond:
            if callback in self._publish_listeners:
                self._publish_listeners.remove(callback)

    def record_push(self, rank: int, holder: str, seconds: float) -> None:
        """The replicator pushed ``rank``'s newest snapshot to ``holder`` in ``seconds``."""
        with self._cond:
            self._push_s[rank, holder] = seconds

    def replication_cost(self, rank: int) -> float:
        """Seconds the last push of ``rank``'s snapshot took, summed over its holders: what
        a snapshot costs the machine beyond its capture (``snapshot.every_steps: auto``)."""
        with self._cond:
            return sum(s for (r, _), s in self._push_s.items() if r == rank)

    def record_tier_work(self, rank: int, seconds: float) -> None:
        """A tier wrote ``rank``'s snapshot in ``seconds``."""
        with self._cond:
            self._tier_s[rank] = self._tier_s.get(rank, 0.0) + seconds

    def take_tier_work(self, rank: int) -> float:
        """Seconds tiers spent writing ``rank``'s snapshots since the last call: told once,
        at a claim, so the writer counts every write once (``snapshot.every_steps: auto``)."""
        with self._cond:
            return self._tier_s.pop(rank, 0.0)

    def note_committed(self, step: int) -> None:
        """The job's committed step (read from etcd by the reporter); it only moves on.
        Releases what ``retarget`` marked once a step newer than the mark commits, and the
        memory of snapshots older than the commit point (``_reclaim``)."""
        with self._cond:
            self._committed = max(self._committed, step)
            self._commit_read = step
            self._reclaim()
        self._release_departed()

    def _reclaim(self) -> None:
        """Called with the lock held: forget every full snapshot (local slot or replica)
        older than the job's commit point that is neither its rank's newest here nor being
        read, and give back the pages of every buffer that held nothing for
        ``RELEASE_AFTER_S``. No recovery restores such a step: the ladder restores the
        committed step or falls to a tier (``recovery.planner``), and a corruption cap never
        goes below the commit point, which only moves past steps whose replicas agreed. So
        between snapshots far apart (``every_steps: auto``) a rank holds the memory of one
        step here, and of two while a new one commits, instead of every slot's and replica
        buffer's worth for the whole run; a buffer reused at once (snapshots every step)
        keeps its pages. The floor is the older of the newest commit point seen and the last
        one read (one that went back forgets nothing newer than it). Per-rank channels
        keep their steps (heals read them); a writer that pinned its maps for CUDA keeps
        its pages."""
        floor = min(self._committed, self._commit_read)
        forgot: list[tuple[str, int, int]] = []
        now = time.monotonic()
        for rank, table in self._local.items():
            if is_channel(rank) or not table.releasable:
                continue
            ready = [h for h in table.slots if h.state == "ready"]
            newest = max(ready, key=lambda h: h.step, default=None)
            for held in ready:
                if held is not newest and held.step < floor and held.pins == 0:
                    forgot.append(("local", rank, held.step))
                    held.state, held.step, held.manifest, held.used = "empty", -1, b"", 0
            for held in table.slots:
                if held.state == "empty" and held.pins == 0:
                    held.buf.release_if_idle(now, RELEASE_AFTER_S)
        for rank, lst in self._replicas.items():
            if is_channel(rank):
                continue
            # (pins that are other replicas' references keep only the map, not the step)
            for held in [h for h in lst[:-1] if h.step < floor and h.pins == h.ref_pins]:
                forgot.append(("replica", rank, held.step))
                lst.remove(held)
                self._evict(held)
        for buf in self._free:
            buf.release_if_idle(now, RELEASE_AFTER_S)
        if forgot:
            log.debug("keeper.forgot node=%s floor=%d steps=%s", self.node, floor, forgot)

    def retarget(self, local_ranks: Iterable[int], replica_ranks: Iterable[int]) -> None:
        """A new generation's placement (the launcher's thread, through the keeper actor):
        ``local_ranks`` now live on this node, ``replica_ranks`` are the ranks it holds
        replicas of. The slots of a rank that left and the replicas of a rank it no longer
        holds are marked, and released (files unlinked, maps closed once unread) once the
        job's committed step is newer than this call's and than every step held of them
        here: the rank's new owners then hold a newer committed step, and no restore goes
        back past it."""
        local, replicas = set(local_ranks), set(replica_ranks)
        with self._cond:
            for kind, held, wanted in (("local", self._local, local),
                                       ("replica", self._replicas, replicas)):
                for rank in held:
                    if rank in wanted:
                        self._departed.pop((kind, rank), None)
                    else:
                        self._departed.setdefault((kind, rank), self._committed)
            marked = sorted(self._departed)
        log.info("keeper.retargeted node=%s local=%s replicas=%s departed=%s", self.node,
                 sorted(local), sorted(replicas), marked)
        self._release_departed()

    def _release_departed(self) -> None:
        """Unlink the slots and replicas ``retarget`` marked, once a newer step committed
        (see ``retarget``)."""
        with self._cond:
            freed: list[tuple[str, int, int]] = []
            for kind, rank in list(self._departed):
                if kind == "local":
                    table = self._local.get(rank)
                    held = table.slots + table.retired if table is not None else []
                else:
                    held = self._replicas.get(rank, [])
                newest = max((h.step for h in held if h.state == "ready"), default=-1)
                if self._committed <= max(newest, self._departed[kind, rank]):
                    continue    # a restore may still need what is held here
                del self._departed[kind, rank]
                (self._local if kind == "local" else self._replicas).pop(rank, None)
                for h in held:
                    self._doom(h)
                freed.append((kind, rank, len(held)))
            if freed:
                self._trim_free()
                self._cond.notify_all()
        for kind, rank, files in freed:
            log.info("keeper.released node=%s kind=%s rank=%d files=%d committed=%d", self.node,
                     kind, rank, files, self._committed)

    def _trim_free(self) -> None:
        """Called with the lock held: keep at most one recycled buffer per replicated rank
        (none once no rank is replicated here)."""
        extra = max(0, len(self._free) - len(self._replicas))
        for old in self._free[:extra]:
            old.close()
        del self._free[:extra]

    def committed_step(self) -> int:
        """The newest committed step this keeper has heard of; -1 before the first."""
        with self._cond:
            return self._committed

    def holdings(self) -> dict[int, dict[str, Any]]:
        """Per rank: ready local steps, replica steps, and whether a slot is being written."""
        with self._cond:
            out: dict[int, dict[str, Any]] = {}
            for rank, table in self._local.items():
                held = table.slots + table.retired
                out[rank] = {"local": sorted(h.step for h in held if h.state == "ready"),
                             "replica": [], "writing": any(h.state == "writing" for h in held)}
            for rank, lst in self._replicas.items():
                entry = out.setdefault(rank, {"local": [], "replica": [], "writing": False})
                entry["replica"] = sorted(h.step for h in lst)
            return out

    def snapshot_files(self, rank: int) -> list[dict[str, Any]]:
        """Where ``rank``'s ready snapshots live (step, own or replica, shm path, bytes,
        and ``middle``: the file and offset that hold its middle payload byte, another
        snapshot's for a replica that shares it): what a storage drill damages in place."""
        with self._cond:
            table = self._local.get(rank)
            own = [("own", h) for h in (table.slots + table.retired if table else [])
                   if h.state == "ready"]
            held = own + [("replica", h) for h in self._replicas.get(rank, [])]
            out = []
            for kind, h in held:
                nbytes = h.used or h.buf.nbytes
                where, at = locate(h, nbytes // 2, 1) or (h, nbytes // 2)
                if where.doomed:            # (its file is gone: only its map is left)
                    where, at = h, nbytes // 2
                out.append({"step": h.step, "kind": kind, "path": h.buf.path, "nbytes": nbytes,
                            "middle": [where.buf.path, at]})
            return out

    def stats(self) -> dict[str, int]:
        """Bytes and files held: local slots (all layouts), replicas, recycled buffers (their
        sizes), ``shared_bytes`` (replica bytes kept as references to another snapshot
        here, not as a second copy) and ``resident_bytes``: the tmpfs pages all of them
        hold now (``_reclaim`` gives back those of buffers that hold nothing)."""
        with self._cond:
            local = [h.buf for t in self._local.values() for h in t.slots + t.retired]
            replica = [h.buf for lst in self._replicas.values() for h in lst]
            return {"local_bytes": sum(b.nbytes for b in local),
                    "replica_bytes": sum(b.nbytes for b in replica),
                    "shared_bytes": shared_bytes(h for lst in self._replicas.values()
                                                 for h in lst),
                    "free_bytes": sum(b.nbytes for b in self._free),
                    "resident_bytes": sum(b.resident() for b in local + replica + self._free),
                    "files": len(local) + len(replica) + len(self._free),
                    "ranks_local": len(self._local), "ranks_replica": len(self._replicas)}

    # ----- wire ----------------------------------------------------------------------------

    def _handle(self, request: Request) -> Reply:
        """Connection threads call this: fence write ops, then run the op table."""
        header = request.header
        if header.get("op") in self._write_ops and self._generation_check is not None:
            generation = header.get("generation", request.peer.generation)
            if type(generation) is not int or not self._generation_check(generation):
                raise StaleGeneration(f"keeper {self.node}: op={header.get('op')} from "
                                      f"generation {generation} is fenced")
        return handle(self, request, self._ops)


class _Materializer:
    """The claim callback of a replica's pin on one source it references: called under the
    keeper's lock when a worker's claim needs that slot (or the source is forgotten), it
    starts the copy of the bytes shared with that source into the replica
    (``Keeper._materialize``) and returns at once."""

    def __init__(self, keeper: Keeper, thin: Held, source: Held) -> None:
        self.keeper, self.thin, self.source = keeper, thin, source

    def __call__(self) -> None:
        thin, source = self.thin, self.source
        if thin.doomed or all(r.source is not source for r in thin.refs):
            return      # (a forgotten replica lets go of its references with its last reader)
        source.yielding = [c for c in source.yielding if c is not self]   # called once
        thin.copying += 1
        thin.pins += 1          # the copy's own pin: the replica stays mapped meanwhile
        threading.Thread(target=self.keeper._materialize, args=(thin, source), daemon=True,
                         name=f"materialize-{self.keeper.node}-{thin.rank}").start()
