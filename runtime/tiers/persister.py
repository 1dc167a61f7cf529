"""The tier persister: one background thread per node keeper that copies the keeper's
published snapshots to persistent tiers (disk, S3) and commits them.

Which step a tier persists: ``phalanx.runtime.tiers.cadence.pick_step``.

Each node persists only its own ranks; the tier's ``COMMIT`` marker for a step appears
once every rank of the job is there, written by whichever node finishes last:

    node A (ranks 0,2)            tier                     node B (ranks 1,3)
    pin/write/unpin 0,2  ──▶  step_21/rank_{0,2}.*
    commit_step(21, all) ──▶  SnapshotNotFound (rank 1)   ... B still writing ...
                              step_21/rank_{1,3}.*  ◀──   pin/write/unpin 1,3
                              COMMIT               ◀──    commit_step(21, all) succeeds
    retry commit_step    ──▶  COMMIT (rewritten, idempotent) → apply_retention(keep)

With ``committed`` (the keeper's view of the job's commit point: every rank held by f+1
keepers and, with ``detection.compare_replicas``, digest-agreed) a step's marker waits until
the commit point reaches it, so a tier never commits a step the job has not. The launched
keepers pass it. The keeper's view lags (it reads ``commit`` at its heartbeat), so while a
marker waits the persister asks ``read_committed`` (one etcd read of ``commit``) itself, at
most every ``refresh_s``: per node, only while gated, never per step x rank. When a job
ends the launcher writes the final commit point before closing the keepers; ``close``
reads it once more and writes the markers it allows (waiting up to ``settle_s`` for other
nodes' ranks), so a finished job's last checkpoint committed in memory is committed in
the tier too. Tiers
bound to a run (``run_identity``) commit and delete only that run's steps; at start the
persister removes its ranks' writes that a crash cut short.
"""
from __future__ import annotations

import json
import logging
import re
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence, Union

from phalanx.configs.errors import (SnapshotCorrupt, SnapshotNotFound, SnapshotOfOtherRun,
                                    TierUnavailable)
from phalanx.runtime.base import Tier
from phalanx.runtime.keeper.daemon import Keeper
from phalanx.runtime.keeper.shared_copies import payload_view
from phalanx.runtime.tiers.cadence import pick_step
from phalanx.runtime.tiers.slot_copy import Preempted, close_quietly, copy_unless, payload_size
from phalanx.runtime.snapshot.format import verify_snapshot

log = logging.getLogger(__name__)
JOIN_TIMEOUT_S = 30.0     # how long close() waits for the persister's thread

__all__ = ["TierPersister", "TierSpec", "payload_size", "pick_step"]
_MAX_BACKOFF_DOUBLINGS = 4  # commit retries wait at most 16 x commit_retry_s
_MAX_GATED = 4              # superseded steps whose markers wait for the commit point
_TENSOR_RE = re.compile(r"tensor '([^']*)'")
# (tier, every_steps, keep) or (tier, every_steps, keep, every_s)
TierSpec = Union[tuple[Tier, int, int], tuple[Tier, int, int, float]]


@dataclass
class _TierState:
    """What the persister thread knows of one tier; mutated by that thread only."""

    tier: Tier
    every_steps: int
    keep: int
    every_s: float = 0.0
    attempted: int = 0                 # newest step tried: persisted, skipped or failed
    time_window: int = 0               # wall-clock window of the last attempt (every_s)
    persisted: int | None = None
    committed: int | None = None
    skipped: int = 0                   # steps given up: gone, corrupt or preempted
    pending: int | None = None         # persisted here, marker not yet written
    gated: list[int] = field(default_factory=list)  # superseded, waiting for the commit point
    pending_since: float = 0.0
    next_commit_try: float = 0.0
    commit_tries: int = 0
    commit_alerted: bool = False       # tier_degraded sent for the pending step's commit
    retry_step: int | None = None      # its write failed (tier unavailable): try it again
    retry_at: float = 0.0
    retry_tries: int = 0


class TierPersister:
    """Watches ``keeper.holdings()`` and persists every local rank's snapshot of the steps
    ``pick_step`` chooses. ``tiers`` holds (tier, every_steps, keep[, every_s]);
    ``world_ranks`` every rank of the job (the commit needs them all), ``local_ranks``
    those this keeper holds. Payloads are verified against their manifest's checksums
    first: a mismatch writes nothing of that step here, so it never commits.

    With ``slots >= 3`` the tier reads the pinned slot itself (a worker's claim always
    finds another slot). With 2 slots the slot is copied out under a pin that gives way to
    the worker, as a replica push does, and the copy (one rank's payload of keeper memory)
    is written unpinned: a claim mid-copy skips that step for that tier, and a slow tier
    never stalls training. Retention runs only where the job's lowest rank is held.

    Failures never leave the thread: a tier error (TierUnavailable, OSError) emits
    ``tier_degraded`` once per step, and the write (or the commit) is tried again after
    ``commit_retry_s``, doubling up to 16x, while the keeper still holds the step and no
    newer window's step is due, so persistence rides out an endpoint outage; a step no
    longer held, with a bad checksum or whose copy was preempted emits ``tier_skipped``
    (``rank``, ``cause``, and the bad ``tensor``).
    ``on_event`` (called from the persister thread; must not block) also gets
    ``tier_persisted``, ``tier_committed`` (with ``commit``, the job's commit point it
    passed, when gated), ``tier_commit_abandoned``, ``tier_retention``
    and ``persister_error`` dicts.
    """

    def __init__(self, keeper: Keeper, tiers: Sequence[TierSpec],
                 world_ranks: Sequence[int], local_ranks: Sequence[int], *,
                 poll_s: float = 0.1, on_event: Callable[[dict], None] | None = None,
                 commit_retry_s: float = 1.0, commit_wait_s: float = 600.0,
                 join_timeout_s: float = JOIN_TIMEOUT_S,
                 wall_clock: Callable[[], float] = time.time,
                 may_write: Callable[[], bool] | None = None,
                 committed: Callable[[], int] | None = None,
                 read_committed: Callable[[], int] | None = None,
                 refresh_s: float = 0.25, settle_s: float = 0.0) -> None:
        """Raises ValueError for bad tiers or ranks. Does no I/O. ``may_write``: asked
        before each round of writes (a fenced keeper must write nothing); ``committed``:
        the job's commit point, which a step's marker waits for (None: no wait);
        ``read_committed``: a fresh read of it, asked (persister thread) at most every
        ``refresh_s`` while a marker waits, and once more at close; ``settle_s``: how
        long ``close`` lets a marker the commit point allows wait for other nodes' ranks."""
        self._may_write = may_write
        self._committed = committed
        self._read_committed = read_committed
        self._fresh_commit = -1
        self._next_refresh = 0.0
        if refresh_s <= 0 or settle_s < 0:
            raise ValueError(f"refresh_s {refresh_s} must be positive, settle_s {settle_s} "
                             "non-negative")
        self._refresh_s, self._settle_s = refresh_s, settle_s
        self._world = sorted(set(int(r) for r in world_ranks))
        self.set_local_ranks(local_ranks)
        if not self._local or not set(self._local) <= set(self._world):
            raise ValueError(f"local_ranks {self._local} must be a non-empty subset of "
                             f"world_ranks {self._world}")
        names = [spec[0].name for spec in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be distinct, got {names}")
        if poll_s <= 0 or commit_retry_s < 0 or commit_wait_s <= 0 or join_timeout_s <= 0:
            raise ValueError("poll_s, commit_wait_s and join_timeout_s must be positive, "
                             "commit_retry_s non-negative")
        self._keeper, self._wall_clock = keeper, wall_clock
        self._stage = keeper.slots < 3
        self._states = [self._tier_state(*spec) for spec in tiers]
        self._poll_s, self._on_event = poll_s, on_event
        self._commit_retry_s, self._commit_wait_s = commit_retry_s, commit_wait_s
        self._join_timeout_s = join_timeout_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _tier_state(self, tier: Tier, every: int, keep: int, every_s: float = 0.0) -> _TierState:
        if every < 0 or keep < 1 or not every_s >= 0:
            raise ValueError(f"tier {tier.name}: every_steps {every} must be >= 0 (0: every "
                             f"snapshot), keep {keep} >= 1, every_s {every_s} >= 0")
        state = _TierState(tier, every, keep, float(every_s))
        state.time_window = self._time_window(state)
        return state

    # ----- lifecycle -----------------------------------------------------------------

    def start(self) -> "TierPersister":
        """Start the persister thread. Raises RuntimeError when started twice."""
        if self._thread is not None:
            raise RuntimeError("TierPersister.start() called twice")
        self._thread = threading.Thread(target=self._run, name=f"persister-{self._keeper.node}",
                                        daemon=True)
        self._thread.start()
        log.info("persister.started node=%s ranks=%s staged=%s tiers=%s", self._keeper.node,
                 self._local, self._stage,
                 [f"{s.tier.name}:{s.every_steps or 'auto'}:{s.keep}:{s.every_s:g}"
                  for s in self._states])
        return self

    def close(self) -> None:
        """Stop after the rank being written, write the markers the final commit point
        allows (``settle_s``), and join the thread (up to join_timeout_s; a tier call still
        blocked after that is left to its own timeouts). Idempotent."""
        self._stop.set()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        thread.join(self._join_timeout_s)
        self._thread = None     # a second close (the keeper's, after settle_tiers) is a no-op
        if thread.is_alive():
            log.warning("persister.close_timeout node=%s timeout_s=%.1f", self._keeper.node,
                        self._join_timeout_s)
        else:
            log.info("persister.closed node=%s persisted=%s committed=%s", self._keeper.node,
                     self.last_persisted(), self.last_committed())

    def __enter__(self) -> "TierPersister":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def last_persisted(self) -> dict[str, int]:
        """Tier name → newest step whose local ranks this persister wrote there."""
        with self._lock:
            return {s.tier.name: s.persisted for s in self._states if s.persisted is not None}

    def last_committed(self) -> dict[str, int]:
        """Tier name → newest step this persister saw committed (retention applied after)."""
        with self._lock:
            return {s.tier.name: s.committed for s in self._states if s.committed is not None}

    def skipped(self) -> dict[str, int]:
        """Tier name → steps skipped there (gone, corrupt or preempted)."""
        with self._lock:
            return {s.tier.name: s.skipped for s in self._states}

    def set_local_ranks(self, ranks: Sequence[int]) -> None:
        """The ranks whose snapshots this keeper now holds (after a rank moved node); the
        node that now holds the lowest rank takes over retention."""
        local = sorted(set(int(r) for r in ranks))
        self._local, self._retains = local, self._world[0] in local

    # ----- the thread ----------------------------------------------------------------

    def _run(self) -> None:
        """Thread boundary: every failure becomes an event, never an exception."""
        self._clean_abandoned()
        while not self._stop.is_set():
            self._guarded(self._tick)
            self._stop.wait(self._poll_s)
        self._guarded(self._settle)

    def _guarded(self, work: Callable[[], None]) -> None:
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - thread boundary: report, keep going
            log.exception("persister_error node=%s", self._keeper.node)
            self._emit({"event": "persister_error", "error": f"{type(exc).__name__}: {exc}"})

    def _settle(self) -> None:
        """At close: one fresh read of the commit point (the launcher writes the final one
        before the keepers close), then the markers at or below it are written, a step
        whose other ranks another node still writes waiting up to ``settle_s``; a marker
        past the final commit point is left uncommitted (logged)."""
        if self._settle_s <= 0 or (self._may_write is not None and not self._may_write()):
            return
        deadline = time.monotonic() + self._settle_s
        self._refresh(force=True)
        while True:
            for state in self._states:
                state.next_commit_try = 0.0
                self._try_commit(state)
            if not self._completing() or time.monotonic() >= deadline:
                break
            time.sleep(self._poll_s)
        for state in self._states:
            if state.pending is not None or state.gated:
                log.info("persister.unsettled node=%s tier=%s pending=%s gated=%s commit=%d",
                         self._keeper.node, state.tier.name, state.pending, state.gated,
                         self._commit_point())

    def _completing(self) -> bool:
        """A pending marker the commit point allows waits for other nodes' ranks."""
        return any(s.pending is not None and not self._gated(s.pending) for s in self._states)

    def _clean_abandoned(self) -> None:
        """Remove this node's ranks' writes a crash cut short (this run's, uncommitted)."""
        for state in self._states:
            clean = getattr(state.tier, "clean_abandoned", None)
            if clean is None or (self._may_write is not None and not self._may_write()):
                continue
            try:
                removed = clean(list(self._local))
            except (TierUnavailable, OSError) as exc:
                self._degraded(state, 0, exc)
                continue
            if removed:
                self._emit({"event": "tier_cleaned", "tier": state.tier.name,
                            "removed": [list(pair) for pair in removed]})

    def _tick(self) -> None:
        if self._may_write is not None and not self._may_write():
            return
        self._refresh()
        ready = self._ready_steps(self._keeper.holdings())
        for state in self._states:
            if self._stop.is_set():
                return
            self._try_commit(state)
            time_due = state.every_s > 0 and self._time_window(state) > state.time_window
            step = pick_step(ready, state.attempted, state.every_steps, time_due)
            if step is None:
                step = self._due_retry(state, ready)
            if step is not None:
                self._persist(state, step)
                self._try_commit(state)

    def _due_retry(self, state: _TierState, ready: set[int]) -> int | None:
        """The step whose write failed, once its retry is due and while it is held."""
        step = state.retry_step
        if step is None or time.monotonic() < state.retry_at:
            return None
        if step not in ready:            # the keeper moved on: the next window persists
            log.info("tier_retry_dropped node=%s tier=%s step=%d tries=%d", self._keeper.node,
                     state.tier.name, step, state.retry_tries)
            state.retry_step, state.retry_tries = None, 0
            return None
        return step

    def _time_window(self, state: _TierState) -> int:
        return int(self._wall_clock() // state.every_s) if state.every_s > 0 else 0

    def _ready_steps(self, holdings: dict[int, dict[str, Any]]) -> set[int]:
        """Steps every local rank holds as a published local snapshot."""
        steps: set[int] | None = None
        for rank in self._local:
            held = set(holdings.get(rank, {}).get("local", []))
            steps = held if steps is None else steps & held
        return steps or set()

    def _persist(self, state: _TierState, step: int) -> None:
        name, ranks = state.tier.name, list(self._local)
        state.attempted = max(state.attempted, step)
        state.time_window = self._time_window(state)
        if state.retry_step != step:     # a newer step supersedes a failed one
            state.retry_step, state.retry_tries = None, 0
        started = time.monotonic()
        written = 0
        for rank in ranks:
            if self._stop.is_set():
                return
            began = time.monotonic()
            try:
                written += self._write_rank(state.tier, rank, step)
            except (SnapshotNotFound, SnapshotCorrupt, Preempted) as exc:
                self._skipped(state, step, rank, exc)
                return
            except (TierUnavailable, OSError) as exc:
                self._write_failed(state, step, exc)
                return
            # what persisting cost beyond the capture: snapshot.every_steps: auto counts it
            self._keeper.record_tier_work(rank, time.monotonic() - began)
        state.retry_step, state.retry_tries = None, 0
        with self._lock:
            state.persisted = step
        self._emit({"event": "tier_persisted", "tier": name, "step": step, "ranks": ranks,
                    "bytes": written, "seconds": round(time.monotonic() - started, 6)})
        if state.pending is not None and self._gated(state.pending):
            state.gated = [*state.gated, state.pending][-_MAX_GATED:]   # its marker still may
        elif state.pending is not None:
            self._emit({"event": "tier_commit_abandoned", "tier": name, "step": state.pending,
                        "reason": f"superseded by step {step}"}, logging.WARNING)
        state.pending, state.pending_since = step, time.monotonic()
        state.next_commit_try, state.commit_tries, state.commit_alerted = 0.0, 0, False

    def _write_rank(self, tier: Tier, rank: int, step: int) -> int:
        """Verify ``rank``'s payload at ``step`` against its manifest, then write it.
        Returns payload bytes; raises SnapshotNotFound (no longer held), SnapshotCorrupt
        (checksums), Preempted (2 slots: the worker claimed it) or what the tier raises."""
        with self._payload(rank, step) as (view, manifest):
            verify_snapshot(view, manifest, secret=None,
                            source=f"keeper {self._keeper.node} rank {rank} step {step}")
            tier.write_rank(step, rank, view, manifest)
            return view.nbytes

    @contextmanager
    def _payload(self, rank: int, step: int) -> Iterator[tuple[memoryview, bytes]]:
        """A read-only view of the payload and its manifest: the pinned slot itself, or
        (2 slots) a private copy made under a pin that gives way to the worker's claim."""
        preempted = threading.Event()
        on_claim = preempted.set if self._stage else None  # the keeper's lock is held
        _, held = self._keeper.pin(rank, step, on_claim=on_claim)
        try:
            manifest = held.manifest
            size = payload_size(manifest, held.used, rank, step)
            try:
                slot = payload_view(held, size)
            except ValueError as exc:     # the keeper closed and unmapped the slot
                raise SnapshotNotFound(f"keeper {self._keeper.node}: rank {rank} step "
                                       f"{step} is no longer mapped") from exc
            with slot, slot.toreadonly() as view:
                if not self._stage:
                    yield view, manifest
                    return
                copy = copy_unless(view, preempted, f"rank {rank} step {step}")
        finally:
            self._keeper.unpin(held, on_claim)
        try:
            with memoryview(copy) as whole, whole.toreadonly() as view:
                yield view, manifest
        finally:
            close_quietly(copy)

    def _try_commit(self, state: _TierState) -> None:
        """Write the pending step's marker once every rank of the job is in the tier. A
        missing rank (another node still writing) or an unavailable tier (one
        ``tier_degraded``) is retried after commit_retry_s, doubling up to 16x (each try
        lists the step: keep S3 LISTs per node few), until commit_wait_s passes or a
        newer persisted step supersedes it."""
        self._commit_gated(state)
        step, now = state.pending, time.monotonic()
        if step is None or now < state.next_commit_try or self._gated(step):
            return                       # gated: asked again at the next poll, no backoff
        name = state.tier.name
        try:
            state.tier.commit_step(step, self._world)
        except (SnapshotNotFound, TierUnavailable, OSError) as exc:
            alert = isinstance(exc, SnapshotOfOtherRun) or not isinstance(exc, SnapshotNotFound)
            if alert and not state.commit_alerted:
                state.commit_alerted = True
                self._degraded(state, step, exc)
            if now - state.pending_since < self._commit_wait_s:
                backoff = 2 ** min(state.commit_tries, _MAX_BACKOFF_DOUBLINGS)
                state.next_commit_try = now + self._commit_retry_s * backoff
                state.commit_tries += 1
                return
            state.pending = None
            self._emit({"event": "tier_commit_abandoned", "tier": name, "step": step,
                        "reason": f"not complete after {self._commit_wait_s:.0f}s: {exc}"},
                       logging.WARNING)
            return
        state.pending = None
        self._emit({"event": "tier_committed", "tier": name, "step": step, **self._seen()})
        if self._retains:
            self._retain(state, step)
        with self._lock:
            state.committed = step

    def _gated(self, step: int) -> bool:
        """Whether ``step`` is past the job's commit point (its marker must wait)."""
        return self._committed is not None and step > self._commit_point()

    def _seen(self) -> dict[str, int]:
        """A tier_committed event's ``commit``: the job's commit point the marker passed."""
        return {} if self._committed is None else {"commit": self._commit_point()}

    def _commit_point(self) -> int:
        if self._committed is None:
            return -1
        return max(self._committed(), self._fresh_commit)

    def _refresh(self, force: bool = False) -> None:
        """Read the commit point afresh (``read_committed``) while a marker waits for it,
        at most every ``refresh_s`` (``force``: now): the keeper's view lags a heartbeat."""
        if self._read_committed is None or self._committed is None:
            return
        now = time.monotonic()
        if not force and now < self._next_refresh:
            return
        if not any(s.gated or (s.pending is not None and self._gated(s.pending))
                   for s in self._states):
            return
        self._next_refresh = now + self._refresh_s
        self._fresh_commit = max(self._fresh_commit, int(self._read_committed()))

    def _commit_gated(self, state: _TierState) -> None:
        """Markers of superseded steps that only waited for the job's commit point: each
        is written once the point reaches it, or dropped when a rank's files are missing
        (another node persisted another step of that window)."""
        for step in [s for s in state.gated if not self._gated(s)]:
            state.gated.remove(step)
            try:
                state.tier.commit_step(step, self._world)
            except (SnapshotNotFound, TierUnavailable, OSError) as exc:
                self._emit({"event": "tier_commit_abandoned", "tier": state.tier.name,
                            "step": step, "reason": f"{type(exc).__name__}: {exc}"},
                           logging.WARNING)
                continue
            self._emit({"event": "tier_committed", "tier": state.tier.name, "step": step,
                        **self._seen()})
            if self._retains:
                self._retain(state, step)
            with self._lock:
                state.committed = max(step, state.committed or step)

    def _retain(self, state: _TierState, step: int) -> None:
        try:
            deleted = state.tier.apply_retention(state.keep)
        except (TierUnavailable, OSError) as exc:
            self._degraded(state, step, exc)
            return
        if deleted:
            self._emit({"event": "tier_retention", "tier": state.tier.name, "keep": state.keep,
                        "deleted": deleted})

    def _skipped(self, state: _TierState, step: int, rank: int, exc: Exception) -> None:
        causes: dict[type[Exception], str] = {SnapshotNotFound: "gone", SnapshotCorrupt: "corrupt",
                                              SnapshotOfOtherRun: "other_run"}
        cause = causes.get(type(exc), "preempted")
        event = {"event": "tier_skipped", "tier": state.tier.name, "step": step, "rank": rank,
                 "cause": cause, "reason": str(exc)}
        bad = _TENSOR_RE.search(str(exc)) if cause == "corrupt" else None
        if bad is not None:
            event["tensor"] = bad.group(1)
        with self._lock:
            state.skipped += 1
        self._emit(event, logging.ERROR if cause == "corrupt" else logging.WARNING)

    def _write_failed(self, state: _TierState, step: int, exc: BaseException) -> None:
        """A tier error writing ``step``: alert once per step, retry it after a backoff."""
        if state.retry_step == step:
            log.info("tier_retry_failed node=%s tier=%s step=%d tries=%d error=%s",
                     self._keeper.node, state.tier.name, step, state.retry_tries, exc)
        else:
            self._degraded(state, step, exc)
        backoff = 2 ** min(state.retry_tries, _MAX_BACKOFF_DOUBLINGS)
        state.retry_step, state.retry_tries = step, state.retry_tries + 1
        state.retry_at = time.monotonic() + self._commit_retry_s * backoff

    def _degraded(self, state: _TierState, step: int, exc: BaseException) -> None:
        self._emit({"event": "tier_degraded", "tier": state.tier.name, "step": step,
                    "error": f"{type(exc).__name__}: {exc}"}, logging.WARNING)

    def _emit(self, event: dict[str, Any], level: int = logging.INFO) -> None:
        fields = " ".join(f"{k}={_log_value(v)}" for k, v in event.items() if k != "event")
        log.log(level, "%s node=%s %s", event["event"], self._keeper.node, fields)
        if self._on_event is None:
            return
        try:
            self._on_event(dict(event))
        except Exception:  # noqa: BLE001 - a listener's bug must not stop persisting
            log.exception("persister.on_event_failed event=%s", event["event"])


def _log_value(value: Any) -> str:
    """One token per key=value field: strings quoted, lists without spaces."""
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, list):
        return json.dumps(value, separators=(",", ":"))
    return str(value)
