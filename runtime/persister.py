"""The tier persister: one background thread per node keeper that copies the keeper's
published snapshots of every N-th step to persistent tiers (disk, S3) and commits them.

Each node persists only its own ranks; the tier's ``COMMIT`` marker for a step appears
once every rank of the job is there, written by whichever node finishes last:

    node A (ranks 0,2)            tier                     node B (ranks 1,3)
    pin/write/unpin 0,2  ──▶  step_5/rank_{0,2}.*
    commit_step(5, all)  ──▶  SnapshotNotFound (rank 1)   ... B still writing ...
                              step_5/rank_{1,3}.*  ◀──    pin/write/unpin 1,3
                              COMMIT               ◀──    commit_step(5, all) succeeds
    retry commit_step    ──▶  COMMIT (rewritten, idempotent) → apply_retention(keep)
"""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from configs.errors import SnapshotCorrupt, SnapshotNotFound, TierUnavailable
from runtime.base import Tier
from runtime.keeper import Keeper

log = logging.getLogger(__name__)

__all__ = ["TierPersister", "payload_size"]
_MAX_BACKOFF_DOUBLINGS = 4  # commit retries wait at most 16 x commit_retry_s


def payload_size(manifest: bytes, published: int, rank: int, step: int) -> int:
    """Bytes of ``rank``'s payload at ``step`` to persist: the manifest's ``total_bytes``
    when it records one (a worker may publish its whole, larger slot), else ``published``.

    Parses the manifest as plain JSON (no torch in the keeper process). Raises
    SnapshotCorrupt when the manifest names another rank or step, or records more bytes
    than were published."""
    try:
        raw = json.loads(manifest)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return published                  # an opaque manifest: the published size is all
    if not isinstance(raw, dict):
        return published
    if raw.get("rank", rank) != rank or raw.get("step", step) != step:
        raise SnapshotCorrupt(f"keeper slot of rank {rank} step {step} holds a manifest of "
                              f"rank {raw.get('rank')!r} step {raw.get('step')!r}")
    total = raw.get("total_bytes")
    if type(total) is not int:
        return published
    if not 0 < total <= published:
        raise SnapshotCorrupt(f"rank {rank} step {step}: manifest records {total} payload "
                              f"bytes but the keeper published {published}")
    return total


@dataclass
class _TierState:
    """What the persister thread knows of one tier; mutated by that thread only."""

    tier: Tier
    every_steps: int
    keep: int
    attempted: int = -1                # newest step tried: persisted, skipped or failed
    persisted: int | None = None
    committed: int | None = None
    pending: int | None = None         # persisted here, marker not yet written
    pending_since: float = 0.0
    next_commit_try: float = 0.0
    commit_tries: int = 0


class TierPersister:
    """Watches ``keeper.holdings()`` and persists every local rank's snapshot of each step
    that is a multiple of a tier's ``every_steps`` and newer than the last one tried there.

    ``tiers`` holds (tier, every_steps, keep); ``world_ranks`` every rank of the job (the
    commit needs all of them), ``local_ranks`` the ranks whose snapshots this keeper holds.
    Only the newest due step is persisted; an older due step the poll missed is skipped.
    A slot stays pinned while its bytes go to a tier, so a worker whose next ``claim``
    needs that slot waits (up to the keeper's ``claim_wait_s``): with tiers slower than a
    training step, run the keeper with ``slots >= 3``.

    Retention runs only on the persister that holds the job's lowest rank, so the tier is
    scanned once per commit instead of once per node (and nodes never race deleting).

    Failures never leave the thread: a tier error (TierUnavailable, OSError) emits
    ``tier_degraded`` and that step is skipped for that tier; a step the keeper no longer
    holds emits ``tier_skipped``. ``on_event`` (called from the persister thread) gets
    ``tier_persisted``, ``tier_committed``, ``tier_commit_abandoned``, ``tier_retention``,
    ``tier_degraded``, ``tier_skipped`` and ``persister_error`` dicts; it must not block.
    """

    def __init__(self, keeper: Keeper, tiers: Sequence[tuple[Tier, int, int]],
                 world_ranks: Sequence[int], local_ranks: Sequence[int], *,
                 poll_s: float = 0.1, on_event: Callable[[dict], None] | None = None,
                 commit_retry_s: float = 1.0, commit_wait_s: float = 600.0,
                 join_timeout_s: float = 30.0) -> None:
        """Raises ValueError for bad tiers or ranks. Does no I/O."""
        self._world = sorted(set(int(r) for r in world_ranks))
        self._local = sorted(set(int(r) for r in local_ranks))
        if not self._local or not set(self._local) <= set(self._world):
            raise ValueError(f"local_ranks {self._local} must be a non-empty subset of "
                             f"world_ranks {self._world}")
        names = [tier.name for tier, _, _ in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be distinct, got {names}")
        for tier, every, keep in tiers:
            if every < 1 or keep < 1:
                raise ValueError(f"tier {tier.name}: every_steps {every} and keep {keep} "
                                 "must be >= 1")
        if poll_s <= 0 or commit_retry_s < 0 or commit_wait_s <= 0 or join_timeout_s <= 0:
            raise ValueError("poll_s, commit_wait_s and join_timeout_s must be positive, "
                             "commit_retry_s non-negative")
        self._keeper = keeper
        self._states = [_TierState(tier, every, keep) for tier, every, keep in tiers]
        self._poll_s, self._on_event = poll_s, on_event
        self._commit_retry_s, self._commit_wait_s = commit_retry_s, commit_wait_s
        self._join_timeout_s = join_timeout_s
        self._retains = self._world[0] in self._local
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ----- lifecycle -----------------------------------------------------------------

    def start(self) -> "TierPersister":
        """Start the persister thread. Raises RuntimeError when started twice."""
        if self._thread is not None:
            raise RuntimeError("TierPersister.start() called twice")
        self._thread = threading.Thread(target=self._run, name=f"persister-{self._keeper.node}",
                                        daemon=True)
        self._thread.start()
        log.info("persister.started node=%s ranks=%s tiers=%s", self._keeper.node, self._local,
                 [f"{s.tier.name}:{s.every_steps}:{s.keep}" for s in self._states])
        return self

    def close(self) -> None:
        """Stop after the rank being written and join the thread (up to join_timeout_s;
        a tier call still blocked after that is left to its own timeouts). Idempotent."""
        self._stop.set()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        thread.join(self._join_timeout_s)
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

    # ----- the thread ----------------------------------------------------------------

    def _run(self) -> None:
        """Thread boundary: every failure becomes an event, never an exception."""
        while not self._stop.is_set():
            try:
                self._tick()
            except Exception as exc:  # noqa: BLE001 - thread boundary: report, keep going
                log.exception("persister_error node=%s", self._keeper.node)
                self._emit({"event": "persister_error", "error": f"{type(exc).__name__}: {exc}"})
            self._stop.wait(self._poll_s)

    def _tick(self) -> None:
        ready = self._ready_steps(self._keeper.holdings())
        for state in self._states:
            if self._stop.is_set():
                return
            self._try_commit(state)
            due = [s for s in ready if s % state.every_steps == 0 and s > state.attempted]
            if due:
                self._persist(state, max(due))
                self._try_commit(state)

    def set_local_ranks(self, ranks: Sequence[int]) -> None:
        """The ranks whose snapshots this keeper now holds (after a rank moved node)."""
        self._local = sorted(set(int(r) for r in ranks))

    def _ready_steps(self, holdings: dict[int, dict[str, Any]]) -> set[int]:
        """Steps every local rank holds as a published local snapshot."""
        steps: set[int] | None = None
        for rank in self._local:
            held = set(holdings.get(rank, {}).get("local", []))
            steps = held if steps is None else steps & held
        return steps or set()

    def _persist(self, state: _TierState, step: int) -> None:
        name = state.tier.name
        state.attempted = step
        started = time.monotonic()
        written = 0
        try:
            for rank in self._local:
                if self._stop.is_set():
                    return
                written += self._write_rank(state.tier, rank, step)
        except (SnapshotNotFound, SnapshotCorrupt) as exc:
            self._emit({"event": "tier_skipped", "tier": name, "step": step, "reason": str(exc)},
                       logging.WARNING)
            return
        except (TierUnavailable, OSError) as exc:
            self._degraded(state, step, exc)
            return
        with self._lock:
            state.persisted = step
        self._emit({"event": "tier_persisted", "tier": name, "step": step,
                    "ranks": list(self._local), "bytes": written,
                    "seconds": round(time.monotonic() - started, 6)})
        if state.pending is not None:
            self._emit({"event": "tier_commit_abandoned", "tier": name, "step": state.pending,
                        "reason": f"superseded by step {step}"}, logging.WARNING)
        state.pending, state.pending_since = step, time.monotonic()
        state.next_commit_try, state.commit_tries = 0.0, 0

    def _write_rank(self, tier: Tier, rank: int, step: int) -> int:
        """Pin (rank, step), hand the tier a read-only view of the slot, unpin.
        Returns payload bytes; raises SnapshotNotFound when the keeper no longer holds it."""
        _, held = self._keeper.pin(rank, step)
        try:
            size = payload_size(held.manifest, held.used, rank, step)
            try:
                view = held.buf.view(size)
            except ValueError as exc:     # the keeper closed and unmapped the slot
                raise SnapshotNotFound(f"keeper {self._keeper.node}: rank {rank} step "
                                       f"{step} is no longer mapped") from exc
            readonly = view.toreadonly()
            try:
                tier.write_rank(step, rank, readonly, held.manifest)
            finally:
                readonly.release()
                view.release()
        finally:
            self._keeper.unpin(held)
        return size

    def _try_commit(self, state: _TierState) -> None:
        """Write the pending step's marker once every rank of the job is in the tier. A
        missing rank (another node still writing) is retried after commit_retry_s, doubling
        up to 16x (each try lists the step: keep S3 LISTs per node few), until
        commit_wait_s passes or a newer persisted step supersedes it."""
        step, now = state.pending, time.monotonic()
        if step is None or now < state.next_commit_try:
            return
        name = state.tier.name
        try:
            state.tier.commit_step(step, self._world)
        except SnapshotNotFound as exc:
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
        except (TierUnavailable, OSError) as exc:
            state.pending = None
            self._degraded(state, step, exc)
            return
        state.pending = None
        self._emit({"event": "tier_committed", "tier": name, "step": step})
        if self._retains:
            self._retain(state, step)
        with self._lock:
            state.committed = step

    def _retain(self, state: _TierState, step: int) -> None:
        try:
            deleted = state.tier.apply_retention(state.keep)
        except (TierUnavailable, OSError) as exc:
            self._degraded(state, step, exc)
            return
        if deleted:
            self._emit({"event": "tier_retention", "tier": state.tier.name, "keep": state.keep,
                        "deleted": deleted})

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
