"""Per-step capture of one rank's state into keeper-owned shared memory.

The training thread pays only for flattening the state and claiming a reused, pre-faulted
slot (plus a non-blocking device-to-host enqueue for CUDA tensors). CPU tensors are copied
into the slot and checksummed chunk by chunk on background threads while the next step's
forward and backward run; whatever would modify a captured tensor in place (the optimizer
step) first waits for that copy (``wait_for_copy``). The manifest and the publish to the
keeper follow on the background thread, which the next capture waits for (double
buffering: one slot being filled while another holds the newest complete step).

A snapshot is published only if no captured tensor was written in place before its copy
was over (``phalanx.runtime.snapshot.copy_check``): one that was is dropped
(``event=snapshot_torn``) and every later capture copies before the loop goes on.
"""
from __future__ import annotations

import logging
import math
import mmap
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait as futures_wait
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple

import torch

from phalanx.runtime.keeper.shm import map_slots, reserve_file
from phalanx.runtime.keeper.wire import KeeperClient, SlotBusy
from phalanx.runtime.snapshot.copy_check import CopyCheck
from phalanx.runtime.snapshot.checksum import DEFAULT_ALGO, DigestJob, check_algo, finish, helpers
from phalanx.runtime.snapshot.format import (SnapshotLayout, landing_job, make_manifest,
                                             plan_layout, start_write, write_into, write_job)
from phalanx.runtime.snapshot.state_tree import flatten_state

log = logging.getLogger(__name__)
AUTO_MAX_INTERVAL = 1000
# A planning margin for what a snapshot costs the training loop beyond what the worker
# measures (effects that outlast the steps after a capture, caches the copies evict, noise
# in the few steps measured). Planned with it at the 3% budget, the snapshots' share of the
# example's 1600-step loops with replication measured 1.0-2.1% on the 2-core CI machine
# (`bench/replication.py`, per step).
UNSEEN_COST = 1.5
# Steps after a capture whose time counts as the snapshot's cost: the background publish,
# the keepers' and the holders' work land there. Measured on the 2-core CI machine with the
# example MLP (8.5 ms steps): the next step took 6-9 ms longer, the one after 1-3 ms, the
# ones after that no longer than any step; for a 64 KiB state the snapshot's threads (stall
# + background publish + replica pushes) measured only half of that.
AFTER_STEPS = 2
MARK_BYTES = 64 << 20            # CUDA copies between two checksum-ready events


@dataclass(frozen=True)
class SnapshotPolicy:
    every_steps: int | str = 1          # an interval, or "auto"
    overhead_budget: float = 0.03
    # the tiers' every_steps: a window of one of them with no capture yet makes its first
    # step due whatever the interval, so a long auto interval never starves a tier
    windows: tuple[int, ...] = ()


class _CopyMarks:
    """CUDA events along one capture's device-to-host copies: one after every
    ``MARK_BYTES`` of copies and one at the end (an event per tensor would cost the training
    thread a record call per tensor), so checksums start on the first tensors while later
    ones are still in flight."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self._events: dict[str, Any] = {}
        self._open: list[str] = []
        self._bytes = 0
        self._last: Any = None

    def add(self, name: str, nbytes: int) -> None:
        self._open.append(name)
        self._bytes += nbytes
        if self._bytes >= MARK_BYTES:
            self._record()

    def close(self) -> Any:
        """Record the final event (after every copy) and return it."""
        return self._record()

    def wait(self, name: str) -> None:
        event = self._events.get(name)
        if event is not None:
            event.synchronize()

    def wait_all(self) -> None:
        if self._last is not None:
            self._last.synchronize()

    def _record(self) -> Any:
        event = torch.cuda.Event()
        event.record(self.stream)
        for name in self._open:
            self._events[name] = event
        self._open, self._bytes, self._last = [], 0, event
        return event


class _Work(NamedTuple):
    """What one capture hands its publishing thread."""

    job: DigestJob
    helpers: list[Future]
    tensors: Mapping[str, torch.Tensor]
    claimed: tuple[int, memoryview] | None     # CUDA: claimed on the training thread
    marks: _CopyMarks | None
    check: CopyCheck


@dataclass
class SnapshotStats:
    captures: int = 0              # published, counted by the publishing thread
    last_step: int = -1            # the step last published
    last_capture_step: int = -1    # the step last captured (the training thread's view)
    committed_step: int = -1       # the job's committed step, as the keeper said at a claim
    last_stall_s: float = 0.0
    stall_s: float = 0.0           # every capture's training stall, summed
    last_background_s: float = 0.0
    interval: int = 1
    bytes: int = 0
    torn: int = 0                  # captures dropped: a tensor was written during the copy
    synchronous: bool = False      # captures copy before the loop goes on (after a tear)


class _IntervalController:
    """Picks the snapshot interval: fixed, or ``auto`` — the most frequent interval whose
    cost per snapshot times ``UNSEEN_COST`` stays within the overhead budget of the time of
    a step no snapshot touched. A snapshot's cost is the larger of what its threads took
    (training stall + background publish + the keeper's replica pushes and tier writes:
    ``observe_work``)
    and what the loop felt (the stall + how much longer than a plain step the
    ``AFTER_STEPS`` steps after the capture took: ``observe_capture`` then
    ``observe_step``). Only the training thread calls ``observe_capture``/``observe_step``.
    """

    def __init__(self, policy: SnapshotPolicy) -> None:
        self._fixed = policy.every_steps if isinstance(policy.every_steps, int) else None
        self._budget = policy.overhead_budget
        self._plain_s = 0.0         # steps outside the windows after captures
        self._work_s = 0.0
        self._felt_s = 0.0
        self._felt_n = 0            # windows measured
        self._stall_s = 0.0
        self._window: list[float] | None = None   # times of the steps after the last capture

    def observe_step(self, seconds: float) -> None:
        window = self._window
        if window is None:
            self._plain_s = _average(self._plain_s, seconds, 0.2)
            return
        window.append(seconds)
        if len(window) == AFTER_STEPS:
            self._window = None
            if self._plain_s > 0:
                # averaged signed: step-time noise cancels out (clipping each sample at 0
                # first made noise alone look like a cost, and stretched the interval)
                felt = self._stall_s + sum(window) - AFTER_STEPS * self._plain_s
                self._felt_s = _average(self._felt_s, felt, 0.3) if self._felt_n else felt
                self._felt_n += 1

    def observe_capture(self, stall: float | None) -> None:
        """A capture stalled the loop ``stall`` seconds (None: a first capture, which
        allocated the slots and says nothing about the steady cost)."""
        self._window = None if stall is None else []
        self._stall_s = stall or 0.0

    def observe_work(self, seconds: float) -> None:
        self._work_s = _average(self._work_s, seconds, 0.3)

    @property
    def auto(self) -> bool:
        return self._fixed is None

    @property
    def cost_s(self) -> float:
        return max(self._work_s, self._felt_s, 0.0)

    def describe(self) -> str:
        return (f"work_s={self._work_s:.4f} felt_s={self._felt_s:.4f} "
                f"step_s={self._plain_s:.4f}")

    @property
    def measured(self) -> bool:
        """Whether a snapshot's steady cost and a plain step's time are known (the first
        capture, which allocated the slots, says nothing about either; the steps in the
        window after a capture are no plain steps: at the job's start they carry that
        capture's pushes and the keepers' first page faults, 1.6 s and 0.6 s on the
        bench's transformer against 0.21 s: planned with them, the interval was 28 steps
        where the steady state asks for 233)."""
        return self._plain_s > 0 and self.cost_s > 0

    @property
    def interval(self) -> int:
        if self._fixed is not None:
            return self._fixed
        if not self.measured:
            return 1
        wanted = math.ceil(self.cost_s * UNSEEN_COST / (self._budget * self._plain_s))
        return max(1, min(AUTO_MAX_INTERVAL, wanted))


def _average(mean: float, sample: float, weight: float) -> float:
    """An exponential moving average, which a first sample (mean 0) starts."""
    return sample if mean == 0 else (1 - weight) * mean + weight * sample


class Snapshotter:
    """Owned by the Session on the training thread; one background thread publishes.

    ``capture`` raises what the keeper raises (``PeerUnreachable``, ``SlotBusy``,
    ``ConfigError`` when shared memory is too small); background errors surface on the
    next ``capture`` or ``flush``.
    """

    def __init__(self, client: KeeperClient, *, job: str, rank: int, generation: int,
                 secret: bytes | None, policy: SnapshotPolicy,
                 checksum_algo: str = DEFAULT_ALGO, checksum_workers: int = 0,
                 inline: bool = False) -> None:
        self._client = client
        # a small CPU state (the per-rank channel: kilobytes) is copied and hashed on the
        # training thread and its publish is sent without waiting for the reply, which
        # names the next slot (read at the next capture): two keeper round trips and two
        # thread hand-offs per step cost more than the work (see Session._capture_per_rank)
        self._inline = inline
        self._sent = False                  # a publish whose reply is unread
        self._next_claim: tuple[int, str] | None = None   # the slot that reply claimed
        self._deferred: Exception | None = None           # its error, for flush
        self._job, self._rank, self._generation = job, rank, generation
        self._secret = secret
        self._algo = check_algo(checksum_algo)
        # copy + checksum threads: as many as torch's intra-op threads (the caller's share
        # of the machine), the publishing thread among them
        self._workers = checksum_workers or max(1, torch.get_num_threads())
        self._helpers = ThreadPoolExecutor(self._workers - 1, thread_name_prefix=
                                           "phalanx-checksum") if self._workers > 1 else None
        self._control = _IntervalController(policy)
        self._windows = tuple(w for w in policy.windows if w > 0)
        self._logged_interval = 1
        self._layout: SnapshotLayout | None = None
        self._maps: dict[str, mmap.mmap] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="phalanx-snapshot")
        self._pending: Future | None = None
        self._cuda_stream: Any = None
        self._cuda_event: Any = None
        self._last_capture_step = -1
        self._agreed: int | None = None    # the job-wide auto interval, set by the Session
        self._measure_next = False         # see measure_next
        self._cold = True                  # the next step is no steady step (observe_step)
        self._copied = threading.Event()
        self._copied.set()
        self._check: CopyCheck | None = None     # the last capture's, until judged
        self._lock = threading.Lock()
        self.stats = SnapshotStats()
        # cross-replica verification (phalanx.runtime.consistency.verify): the step the keeper must not
        # overwrite, and a callback (step, checksums, tree spec) after each publish
        self.protect_step: int | None = None
        self.on_published: Callable[[int, Mapping[str, str], dict], None] | None = None

    def set_generation(self, generation: int) -> None:
        self._forget_sent()         # (the client reconnects: that reply is gone)
        self._generation = generation
        self._client.generation = generation

    def skip(self, step: int) -> None:
        """Count ``step`` as snapshotted though its keeper is gone (every rank keeps
        snapshotting the same steps); a publish still in flight is waited for and its error
        dropped."""
        self._settle()
        self._measure_next = False
        self._last_capture_step = self.stats.last_capture_step = step

    def use_client(self, client: KeeperClient) -> None:
        """Snapshot through ``client`` (a keeper that replaced a lost one) from now on: the
        next capture allocates its slots there."""
        self._settle()
        client.generation = self._generation
        self._client = client
        for mapping in self._maps.values():
            _close_map(mapping)
        self._maps, self._layout = {}, None

    def _settle(self) -> None:
        self._judge()
        self._forget_sent()
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result()
            except Exception as exc:  # a publish to the lost keeper: that snapshot is gone
                log.info("event=snapshot_dropped rank=%d error=%r", self._rank, exc)

    @property
    def has_captured(self) -> bool:
        return self._last_capture_step >= 0

    def rewind(self, step: int) -> None:
        """After a rollback to ``step``: the next capture is counted from there (and a
        job-wide auto interval starts again at 1, as it does on a fresh replacement)."""
        self._last_capture_step = step
        self._measure_next = False
        self._cold = True
        if self._agreed is not None:
            self._agreed = 1

    @property
    def auto(self) -> bool:
        return self._control.auto

    @property
    def wanted_interval(self) -> int:
        """The interval this rank's own measurements ask for; 0 while it has measured none
        (``Session._agree_interval``: it then leaves the choice to ranks that have)."""
        return self._control.interval if self._control.measured else 0

    @property
    def shares_interval(self) -> bool:
        return self._agreed is not None

    @property
    def interval(self) -> int:
        """The interval in force: the one every rank agreed on, or this rank's own."""
        return self._control.interval if self._agreed is None else self._agreed

    def agree_interval(self, interval: int) -> None:
        """Snapshot every ``interval`` steps, as every rank agreed, instead of this rank's
        own choice: every rank must snapshot the same steps, or no step would be complete
        in a tier or committed across ranks."""
        self._agreed = max(1, min(AUTO_MAX_INTERVAL, int(interval)))
        self.stats.interval = self._agreed

    def measure_next(self) -> None:
        """Snapshot the next step whatever the interval (the job's first capture allocated
        the slots and measured nothing; the next one measures what a snapshot costs)."""
        self._measure_next = True

    def due(self, step: int) -> bool:
        """Whether ``step`` is snapshotted: the interval in force has passed since the last
        capture, or ``step`` opens a tier window (``SnapshotPolicy.windows``) the last
        capture is not in, or ``measure_next`` asked for it. These depend only on steps
        and on what every rank did at the same step, so every rank picks the same ones."""
        if self._measure_next:
            return True
        interval = self._control.interval if self._agreed is None else self._agreed
        last = self._last_capture_step
        return step - last >= interval or any(step // w > last // w for w in self._windows)

    def observe_step(self, seconds: float) -> None:
        """The time of a completed step, except the first one of a process or after a
        restore: lazy allocations, DDP's first bucket rebuild, a group just formed. On the
        bench's transformer that step took 1.75 s against 0.21 s, and the auto interval
        planned with it asked for 28 steps where the steady state asks for 233: an extra
        268 MiB snapshot per rank a few seconds into the run."""
        if self._cold:
            self._cold = False
            return
        self._control.observe_step(seconds)

    def capture(self, step: int, objects: Mapping[str, Any]) -> float:
        """Snapshot the state after ``step`` completed steps; returns the training stall (s)."""
        started = time.perf_counter()
        self._measure_next = False      # taken, or skipped if this raises (see skip)
        self.flush()
        tensors, spec = flatten_state(objects)
        check = CopyCheck(tensors)
        fresh = self._layout is None or not self._layout.matches(tensors)
        layout = self._layout_for(tensors)
        if any(t.is_cuda for t in tensors.values()):
            # device-to-host copies enqueued on a side stream into a claimed slot, with
            # events along them so that checksums can follow the bytes as they land
            slot, buf = self._claim(layout)
            marks = _CopyMarks(self._stream())
            write_into(buf, layout, tensors, non_blocking=True, stream=marks.stream,
                       after=marks.add)
            self._cuda_event = marks.close()
            job = landing_job(layout, algo=self._algo, ready=marks.wait)
            claimed: tuple[int, memoryview] | None = (slot, buf)
        else:  # claim, copy and checksums run on background threads; see wait_for_copy
            self._copied.clear()
            job = write_job(layout, tensors, algo=self._algo)
            claimed, marks = None, None
        # the helper threads wake while the publishing thread claims the slot (CPU)
        work = _Work(job, helpers(job, self._helpers, self._workers), tensors, claimed, marks,
                     check)
        self._check = check
        stall = time.perf_counter() - started
        # a capture that allocated the slots (page faults, file creation) says nothing about
        # the steady cost the auto interval is for
        if self._inline and claimed is None:
            self._publish(step, layout, spec, work, None)
            stall = time.perf_counter() - started
        else:
            self._pending = self._pool.submit(self._publish, step, layout, spec, work,
                                              None if fresh else stall)
        if self.stats.synchronous:      # a capture tore before: copy before going on
            self.wait_for_copy()
            stall = time.perf_counter() - started
        self._control.observe_capture(None if fresh else stall)
        self._last_capture_step = self.stats.last_capture_step = step
        self.stats.last_stall_s = stall
        self.stats.stall_s += stall
        return stall

    def wait_for_copy(self) -> None:
        """Block until the last capture's bytes are copied out of the live tensors (CPU), or
        make the current CUDA stream wait for the device-to-host copy. Called before anything
        modifies captured tensors in place: an optimizer step, a forward that updates buffers
        (BatchNorm statistics), the next capture."""
        if not self._copied.is_set():
            self._copied.wait()
        if self._cuda_event is not None:
            torch.cuda.current_stream().wait_event(self._cuda_event)
        self._judge()

    def judge_if_copied(self) -> None:
        """At a step boundary (training thread): if the last capture's copy is over, judge
        it now, so that a loop with no fence publishes without waiting for the next one."""
        check = self._check
        if check is None:
            return
        event = self._cuda_event
        if (event.query() if event is not None else self._copied.is_set()):
            self._judge()

    def _judge(self) -> None:
        """Training thread, where no op it started before the copy ended is still running
        (it waited for the copy, or is about to block until the publish is over)."""
        check, self._check = self._check, None
        if check is not None:
            check.judge()

    def wait_published(self) -> None:
        """Block until the last capture is published or has failed (its error is kept for
        ``flush``): the keeper then holds every snapshot this rank will give it until the
        next capture (a drill gate, ``phalanx.runtime.worker.drill_hooks``)."""
        self._judge()
        try:
            self._collect_sent()
        except Exception as exc:
            self._deferred = exc
        pending = self._pending
        if pending is not None:
            futures_wait([pending])

    def flush(self) -> None:
        """Wait until the last capture is published; re-raises its error."""
        self._judge()
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            raise deferred
        self._collect_sent()
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _collect_sent(self) -> None:
        """Inline: read the reply to the publish last sent (raises its error); it names
        the slot the keeper claimed for the next capture."""
        if self._sent:
            self._sent = False
            self._next_claim = self._client.collect_publish()

    def _forget_sent(self) -> None:
        """The client is replaced or reconnects: a reply still owed and the slot it named
        are given up (the keeper claims a slot afresh at the next capture)."""
        self._sent, self._next_claim, self._deferred = False, None, None

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._pool.shutdown(wait=True)
            if self._helpers is not None:
                self._helpers.shutdown(wait=True)
            for mapping in self._maps.values():
                _close_map(mapping)
            self._maps.clear()

    # -- internals ---------------------------------------------------------------------
    def _layout_for(self, tensors: Mapping[str, torch.Tensor]) -> SnapshotLayout:
        if self._layout is not None and self._layout.matches(tensors):
            return self._layout
        layout = plan_layout(tensors)
        cuda = any(t.is_cuda for t in tensors.values())
        maps = map_slots(lambda: self._client.alloc(self._rank, layout.total_bytes,
                                                    releasable=not cuda),
                         layout.total_bytes, _map, _close_map)   # (a file gone: alloc again)
        for mapping in self._maps.values():
            _close_map(mapping)
        self._maps, paths = maps, list(maps)
        if cuda:
            for mapping in self._maps.values():
                _pin(mapping, layout.total_bytes)
        self._layout = layout
        self.stats.bytes = layout.total_bytes
        log.info("event=snapshot_layout rank=%d bytes=%d tensors=%d slots=%d", self._rank,
                 layout.total_bytes, len(layout.entries), len(paths))
        return layout

    def _claim(self, layout: SnapshotLayout) -> tuple[int, memoryview]:
        self._collect_sent()
        claimed, self._next_claim = self._next_claim, None
        if claimed is not None and claimed[1] in self._maps:    # (not another layout's)
            self.stats.committed_step = self._client.committed
            return claimed[0], self._writable(claimed[1], layout)
        protect = self.protect_step
        try:
            slot, path = self._client.claim(self._rank, protect)
        except SlotBusy:
            if protect is None:
                raise
            # a reader pins the only other slot: overwrite the protected step rather than
            # fail the step (a rollback to it then falls back to an older source)
            log.warning("event=protected_slot_given_up rank=%d step=%d", self._rank, protect)
            slot, path = self._client.claim(self._rank)
        self.stats.committed_step = self._client.committed
        return slot, self._writable(path, layout)

    def _writable(self, path: str, layout: SnapshotLayout) -> memoryview:
        """The claimed slot's map, its pages allocated first: the keeper gives back the
        pages of a slot whose step is older than the commit point, and writing into such a
        slot with the tmpfs full would be a SIGBUS, where this is a ConfigError."""
        reserve_file(path, layout.total_bytes)
        return memoryview(self._maps[path])[:layout.total_bytes]

    def _publish(self, step: int, layout: SnapshotLayout, spec: dict, work: _Work,
                 stall: float | None) -> None:
        started = time.perf_counter()
        if work.claimed is None:     # CPU: each chunk hashed right after it is copied
            try:
                try:
                    slot, buf = self._claim(layout)
                    start_write(work.job, buf, layout, work.tensors)
                finally:
                    work.job.cancel()      # no-op once started; else frees the helpers
                sums = finish(work.job, work.helpers)
            finally:
                self._copied.set()
        else:                        # CUDA: each tensor hashed once its bytes landed
            slot, buf = work.claimed
            work.job.start(buf)
            sums = finish(work.job, work.helpers)
            assert work.marks is not None
            work.marks.wait_all()
        inline = self._inline and work.claimed is None     # (CPU, on the training thread)
        if inline:
            work.check.judge()      # copied on the training thread: nothing ran since
        verdict_from = time.perf_counter()
        if self._torn(step, work.check):
            return
        # the wait for the copy's verdict (until the training thread's next fence) is idle
        # time, not a cost of the snapshot: it made a 51 KB snapshot look like 65 ms
        waited = time.perf_counter() - verdict_from
        manifest = make_manifest(layout, sums, job=self._job, rank=self._rank, step=step,
                                 generation=self._generation, tree_spec=spec,
                                 created_at=time.time())
        if self._secret:
            manifest = manifest.sign(self._secret)
        if inline:
            self._client.send_publish(self._rank, step, slot, manifest.to_json(),
                                      layout.total_bytes)
            self._sent = True
        else:
            self._client.publish(self._rank, step, slot, manifest.to_json(),
                                 layout.total_bytes)
        if self.on_published is not None:
            self.on_published(step, sums, spec)
        background = time.perf_counter() - started - waited
        if stall is not None:   # + the keeper's pushes of the previous snapshot, tier writes
            self._control.observe_work(stall + background + self._client.replication_s
                                       + self._client.tier_s)
        with self._lock:
            self.stats.captures += 1
            self.stats.last_step = step
            self.stats.last_background_s = background
            wanted = self._control.interval
            if self._agreed is None:
                self.stats.interval = wanted
        if wanted != self._logged_interval and self._control.auto:
            self._logged_interval = wanted
            log.info("event=snapshot_interval rank=%d step=%d wanted=%d %s", self._rank, step,
                     wanted, self._control.describe())

    def _torn(self, step: int, check: CopyCheck) -> bool:
        """Publishing thread: whether the capture of ``step`` saw a write during its copy;
        such a snapshot is dropped (never published as ``step``: the keeper keeps the older
        one) and later captures copy before the training loop goes on."""
        changed = check.wait()
        if not changed:
            return False
        with self._lock:
            self.stats.torn += 1
            first = not self.stats.synchronous
            self.stats.synchronous = True
        log.warning("event=snapshot_torn rank=%d step=%d tensors=%s written=%d action=dropped "
                    "fix='write registered tensors only inside step() after optimizer.step() "
                    "(or register the optimizer doing it); see docs/porting.md'", self._rank,
                    step, ",".join(changed[:5]), len(changed))
        if first:
            log.warning("event=snapshot_synchronous rank=%d step=%d reason=torn", self._rank,
                        step)
        return True

    def _stream(self) -> Any:
        if self._cuda_stream is None:
            self._cuda_stream = torch.cuda.Stream()
        return self._cuda_stream


def _map(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        # not populated: the keeper leaves a slot's pages unallocated until it is written
        # (``_writable``), and populating would allocate them
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED,
                         prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def _pin(mapping: mmap.mmap, size: int) -> None:
    """Register the mapping with CUDA so device-to-host copies run at pinned speed."""
    import ctypes

    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    result = torch.cuda.cudart().cudaHostRegister(address, size, 0)
    if int(result) != 0:
        log.warning("event=cuda_host_register_failed code=%s bytes=%d", result, size)


def _close_map(mapping: mmap.mmap) -> None:
    try:
        mapping.close()
    except BufferError:  # a view is still alive; the GC unmaps it later
        pass
