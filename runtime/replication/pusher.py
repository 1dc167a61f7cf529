"""Replication: push every local rank's newest published snapshot from this node's keeper
to the keepers that hold its replicas, asynchronously to training. The protocol (offer,
dedup, chunk digests, the receiving side) is ``phalanx.runtime.replication.wire``.

    this node's keeper             Replicator                        holder keepers
    ┌───────────────────┐ publish  ┌──────────────────────────┐
    │ rank 0: s7 s8     │ ───────▶ │ sender "b": one push at   │ ──▶ b  (ranks 0, 1)
    │ rank 1: s8 (s9 …) │          │ a time, the NEWEST step   │
    └───────────────────┘          │ b does not hold yet       │
          ▲  pin(on_claim)         │ sender "c"                │ ──▶ c  (rank 1)
          └─────────────────────── └──────────────────────────┘

Bounded by construction: no queue. A sender picks, per rank, the newest local step its
holder lacks, so steps published during a push are skipped, not queued; it streams
from the pinned shm mapping (no copy); memory is one 8-byte digest per chunk. The pin
gives way to the worker: a ``claim`` that needs the slot shuts the push's socket down
(the push fails as ``preempted`` and the sender moves to the newer step), so a slow or
frozen holder never blocks training; a keeper with ``slots >= 3`` lets one push span
two snapshot intervals instead of one. Every socket call has ``timeout_s``; a failing
holder is retried with exponential backoff (up to ``max_backoff_s``) while the others go
on in their own threads. A publish wakes the senders at once (``Keeper.on_publish``);
``poll_s`` is only a safety net.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from phalanx.configs.errors import PhalanxError, SnapshotNotFound
from phalanx.runtime.transport.frames import check_secret
from phalanx.runtime.keeper.daemon import Keeper
from phalanx.runtime.keeper.shared_copies import payload_view
from phalanx.runtime.replication.wire import (CHUNK_DIGESTS, MAX_CHUNK_BYTES, MIN_CHUNK_BYTES,
                                              ReplicaInvalid, ReplicaLink, dedup_candidates,
                                              push_nbytes, reused_ranges, sent_segments,
                                              tensor_ranges, verify_check)

log = logging.getLogger(__name__)

__all__ = ["Replicator"]

# A receiver allocates a new replica buffer (fallocate) at >= ~0.1 GB/s on a loaded
# 2-core machine before the first chunk is read (as phalanx.runtime.keeper.wire allows for alloc).
_ALLOC_BYTES_PER_S = 100e6
_FIRST_BACKOFF_S = 0.05
# Below this size a snapshot is pushed without an offer: the offer's round trip (and the
# holder's index lookup) costs more than sending the bytes over loopback (~2 GB/s here).
OFFER_MIN_BYTES = 256 << 10


class _Preempted(Exception):
    """The worker claimed the slot being pushed (never leaves the sender thread)."""


@dataclass(frozen=True)
class _Plan:
    """One generation's targets: rank → holders, holder → its ranks, holder → address."""

    generation: int
    holders: Mapping[int, tuple[str, ...]]
    ranks: Mapping[str, tuple[int, ...]]
    addresses: Mapping[str, tuple[str, int]]


class Replicator:
    """Pushes this node's local ranks to their holder keepers: one sender thread per
    holder node (started by ``start``), targets set by ``set_targets`` at any time.

    ``on_event(dict)`` is called from sender threads and must not block; events are
    ``replica_pushed`` {rank, step, target, bytes_sent, bytes_saved, seconds} and
    ``replica_failed`` {rank, step, target, error, preempted}. ``bytes_sent`` counts the
    payload bytes of the offer and push frames; ``bytes_saved`` the tensor bytes the
    holder copied from snapshots it already held. Nothing raises out of a sender.
    """

    def __init__(self, keeper: Keeper, node: str, *, secret: bytes, job: str,
                 timeout_s: float = 10.0, chunk_bytes: int = 4 << 20, poll_s: float = 1.0,
                 on_event: Callable[[dict], None] | None = None, digest: str = "sum64",
                 max_backoff_s: float = 5.0) -> None:
        """Raises ValueError for bad sizes or times, ConfigError for an empty secret."""
        if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes {chunk_bytes} must lie in [{MIN_CHUNK_BYTES}, "
                             f"{MAX_CHUNK_BYTES}]")
        if timeout_s <= 0 or poll_s <= 0 or max_backoff_s <= 0:
            raise ValueError("timeout_s, poll_s and max_backoff_s must be positive")
        if digest not in CHUNK_DIGESTS:
            raise ValueError(f"digest {digest!r} is not one of {CHUNK_DIGESTS}")
        self.keeper, self.node, self.job = keeper, node, job
        self._secret = check_secret(secret)
        self.timeout_s, self.chunk_bytes, self.poll_s = timeout_s, chunk_bytes, poll_s
        self.digest, self.max_backoff_s = digest, max_backoff_s
        self._on_event = on_event
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._started = False
        self._plan = _Plan(0, {}, {}, {})
        self._targets: dict[str, _Sender] = {}
        self._retired: list[_Sender] = []
        self._totals = dict.fromkeys(("pushes", "failures", "preempted", "bytes_sent",
                                      "bytes_saved"), 0)
        keeper.on_publish(self._wake_senders)   # push at once; poll_s is only a safety net

    # ----- lifecycle --------------------------------------------------------------------

    def start(self) -> "Replicator":
        """Start one sender thread per target (and for targets set later)."""
        with self._lock:
            if self._started:
                raise RuntimeError("Replicator.start() called twice")
            self._started = True
            for sender in self._targets.values():
                sender.thread.start()
        log.info("replication.started node=%s targets=%s", self.node, sorted(self._targets))
        return self

    def close(self) -> None:
        """Abort pushes in flight, close every connection, join the senders. Idempotent."""
        self._stop.set()
        self.keeper.remove_publish_listener(self._wake_senders)
        with self._lock:
            senders = list(self._targets.values()) + self._retired
            self._retired = []
        for sender in senders:
            sender.interrupt()
        for sender in senders:
            if sender.thread.is_alive():
                sender.thread.join(self.timeout_s + 1.0)
                if sender.thread.is_alive():
                    log.warning("replication.close_stuck node=%s target=%s", self.node,
                                sender.target)
        log.info("replication.closed node=%s totals=%s", self.node, self.stats())

    def __enter__(self) -> "Replicator":
        return self.start()

    def _wake_senders(self) -> None:
        with self._lock:
            senders = list(self._targets.values())
        for sender in senders:
            sender.wake.set()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- placement ----------------------------------------------------------------------

    def set_targets(self, generation: int, holders: Mapping[int, Sequence[str]],
                    addresses: Mapping[str, tuple[str, int]]) -> None:
        """Replicate local rank r to ``holders[r]`` (node → keeper address in ``addresses``)
        from now on, stamping ``generation`` on every request. Senders of nodes no longer
        needed stop and close their connections; acknowledgements of (rank, holder)
        pairs that remain are kept. Raises ValueError for a holder that is this node or
        has no address."""
        plan = _make_plan(self.node, generation, holders, addresses)
        with self._lock:
            self._plan = plan
            for target in [t for t in self._targets if t not in plan.ranks]:
                retiring = self._targets.pop(target)
                retiring.interrupt()
                self._retired = [s for s in self._retired if s.thread.is_alive()] + [retiring]
            for target, ranks in plan.ranks.items():
                sender = self._targets.get(target)
                if sender is None:
                    sender = self._targets[target] = _Sender(self, target)
                    if self._started and not self._stop.is_set():
                        sender.thread.start()
                sender.held = {r: s for r, s in sender.held.items() if r in ranks}
                sender.wake.set()
        log.info("replication.targets node=%s generation=%d targets=%s", self.node, generation,
                 {t: list(r) for t, r in plan.ranks.items()})

    def replicated(self) -> dict[int, dict[str, list[int]]]:
        """Per local rank, per current holder node: the steps it acknowledged holding."""
        with self._lock:
            return {rank: {node: sorted(self._targets[node].held.get(rank, ()))
                           for node in nodes}
                    for rank, nodes in self._plan.holders.items()}

    def replicated_steps(self, rank: int) -> set[int]:
        """Steps of ``rank`` that every current holder acknowledged (empty if none)."""
        with self._lock:
            nodes = self._plan.holders.get(rank, ())
            held = [set(self._targets[node].held.get(rank, ())) for node in nodes]
        return set.intersection(*held) if held else set()

    def stats(self) -> dict[str, int]:
        """Totals since start: pushes, failures, preempted, bytes_sent, bytes_saved."""
        with self._lock:
            return dict(self._totals)

    # ----- for the senders ----------------------------------------------------------------

    def _view(self, sender: "_Sender") -> tuple[int, tuple[str, int], tuple[int, ...]] | None:
        """What ``sender`` pushes now, or None once it is retired or closed."""
        with self._lock:
            plan, target = self._plan, sender.target
            if self._stop.is_set() or self._targets.get(target) is not sender:
                return None
            return plan.generation, plan.addresses[target], plan.ranks[target]

    def _record(self, event: dict[str, Any]) -> None:
        with self._lock:
            if event["event"] == "replica_pushed":
                self._totals["pushes"] += 1
                self._totals["bytes_sent"] += event["bytes_sent"]
                self._totals["bytes_saved"] += event["bytes_saved"]
            else:
                self._totals["preempted" if event["preempted"] else "failures"] += 1
        if self._on_event is not None:
            try:
                self._on_event(dict(event))
            except Exception:  # the callback's bug must not stop replication
                log.exception("replication.on_event_failed event=%s", event["event"])


def _make_plan(node: str, generation: int, holders: Mapping[int, Sequence[str]],
               addresses: Mapping[str, tuple[str, int]]) -> _Plan:
    if type(generation) is not int or generation < 0:
        raise ValueError(f"generation must be a non-negative int, got {generation!r}")
    normal = {int(rank): tuple(dict.fromkeys(nodes)) for rank, nodes in sorted(holders.items())}
    ranks: dict[str, list[int]] = {}
    for rank, nodes in normal.items():
        for target in nodes:
            if target == node:
                raise ValueError(f"rank {rank} lists this node {node!r} as its own holder")
            if target not in addresses:
                raise ValueError(f"holder {target!r} of rank {rank} has no keeper address")
            ranks.setdefault(target, []).append(rank)
    return _Plan(generation, normal, {t: tuple(r) for t, r in ranks.items()},
                 {t: (str(addresses[t][0]), int(addresses[t][1])) for t in ranks})


class _Sender:
    """The thread pushing to one holder node; ``held`` (rank → acknowledged steps) is
    read and written under the Replicator's lock."""

    def __init__(self, owner: Replicator, target: str) -> None:
        self.owner, self.target = owner, target
        self.held: dict[int, set[int]] = {}
        self.wake = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"replicate-{owner.node}-to-{target}")
        self._link: ReplicaLink | None = None
        self._link_lock = threading.Lock()
        self._failures = 0
        self._retry_at = 0.0
        self._next = 0

    def interrupt(self) -> None:
        """Abort the push in flight and wake the thread (any thread)."""
        with self._link_lock:
            if self._link is not None:
                self._link.abort()
        self.wake.set()

    def _run(self) -> None:
        """Thread boundary: every failure becomes an event or a log line, never a raise."""
        try:
            while True:
                view = self.owner._view(self)
                if view is None:
                    break
                try:
                    busy = self._tick(*view)
                except Exception:  # noqa: BLE001 - thread boundary
                    log.exception("replication.sender_crashed node=%s target=%s",
                                  self.owner.node, self.target)
                    self._back_off()
                    busy = False
                if not busy:
                    retry_in = self._retry_at - time.monotonic()
                    self.wake.wait(min(self.owner.poll_s, retry_in) if retry_in > 0
                                   else self.owner.poll_s)
                    self.wake.clear()
        finally:
            self._set_link(None)

    def _tick(self, generation: int, address: tuple[str, int], ranks: tuple[int, ...]) -> bool:
        """One push if a rank has a step this holder lacks; False when idle or backing off."""
        if time.monotonic() < self._retry_at:
            return False
        job = self._next_job(ranks)
        if job is None:
            return False
        rank, step = job
        link = self._link
        if link is None or link.dead or link.generation != generation or link.address != address:
            link = ReplicaLink(address, self.owner._secret, self.owner.job, generation,
                               self.owner.timeout_s)
            self._set_link(link)
            try:
                link.open()
                self._sync(link, ranks)
            except PhalanxError as exc:
                self._set_link(None)
                self._failed(rank, step, exc, preempted=False)
                return True
        self._push(link, generation, rank, step)
        return True

    def _sync(self, link: ReplicaLink, ranks: tuple[int, ...]) -> None:
        """On a new connection (new generation, holder restarted, after a failure), learn
        which steps of our ranks the holder holds: a rollback or restart may have
        dropped some, and a step it already holds is not pushed again."""
        listed = link.call({"op": "list"}).get("ranks")
        if not isinstance(listed, dict):
            raise ReplicaInvalid(f"{link.where}: malformed list reply")
        with self.owner._lock:
            for rank in ranks:
                steps = listed.get(str(rank), {}).get("replica", [])
                self.held[rank] = {s for s in steps if type(s) is int}

    def _next_job(self, ranks: tuple[int, ...]) -> tuple[int, int] | None:
        """The next rank (round robin) whose newest local step the holder lacks."""
        holdings = self.owner.keeper.holdings()
        for k in range(len(ranks)):
            rank = ranks[(self._next + k) % len(ranks)]
            local = holdings.get(rank, {}).get("local")
            if not local:
                continue
            step = max(local)
            with self.owner._lock:
                known = step in self.held.get(rank, ())
            if not known:
                self._next = (self._next + k + 1) % len(ranks)
                return rank, step
        return None

    def _push(self, link: ReplicaLink, generation: int, rank: int, step: int) -> None:
        keeper, preempted = self.owner.keeper, threading.Event()

        def on_claim() -> None:  # the keeper's lock is held: only signal
            preempted.set()
            link.abort()

        def check() -> None:
            if preempted.is_set():
                raise _Preempted()

        started = time.monotonic()
        try:
            _, held = keeper.pin(rank, step, on_claim=on_claim)
        except SnapshotNotFound:
            return  # superseded since holdings(): the next tick takes the newer step
        try:
            with payload_view(held) as view:
                result = self._stream(link, generation, rank, step, held.manifest, view, check)
        except (_Preempted, PhalanxError) as exc:
            self._set_link(None)
            self._failed(rank, step, exc, preempted=preempted.is_set())
            return
        finally:
            keeper.unpin(held, on_claim)
        self._failures, self._retry_at = 0, 0.0
        sent, saved, held_steps = result
        with self.owner._lock:
            self.held[rank] = set(held_steps)
        if sent is None:
            log.debug("replication.already_held node=%s target=%s rank=%d step=%d",
                      self.owner.node, self.target, rank, step)
            return
        seconds = time.monotonic() - started
        keeper.record_push(rank, self.target, seconds)
        log.debug("replication.pushed node=%s target=%s rank=%d step=%d sent=%d saved=%d "
                  "seconds=%.3f", self.owner.node, self.target, rank, step, sent, saved, seconds)
        self.owner._record({"event": "replica_pushed", "rank": rank, "step": step,
                            "target": self.target, "bytes_sent": sent, "bytes_saved": saved,
                            "seconds": seconds})

    def _stream(self, link: ReplicaLink, generation: int, rank: int, step: int, manifest: bytes,
                view: memoryview, check: Callable[[], None],
                ) -> tuple[int | None, int, list[int]]:
        """Offer, then push what the holder lacks: (bytes sent or None when the holder
        already held the step, bytes saved, the holder's steps of ``rank``)."""
        size = view.nbytes
        base = {"rank": rank, "step": step, "size": size, "generation": generation}
        if size < OFFER_MIN_BYTES:      # the round trip would cost more than it could save
            return self._send(link, base, manifest, view, [(0, size)], [], check, [])
        offer = link.call({"op": "replica_offer", **base}, manifest)
        have, held_steps = offer.get("have"), offer.get("held")
        verify_check(offer.get("check"), [rank, size, have, held_steps], manifest,
                     f"{link.where}: replica_offer of rank {rank} step {step}")
        tensors = tensor_ranges(manifest, size)
        candidates = set(dedup_candidates(tensors))
        if not (isinstance(have, list) and all(type(i) is int and i in candidates for i in have)
                and isinstance(held_steps, list)):
            raise ReplicaInvalid(f"{link.where}: malformed replica_offer reply {offer!r:.200}")
        if step in held_steps:
            return None, size, held_steps
        reuse = sorted(set(have))
        reused = reused_ranges(tensors, reuse)
        return self._send(link, base, manifest, view, sent_segments(size, reused), reuse,
                          check, reused, offered=len(manifest))

    def _send(self, link: ReplicaLink, base: dict[str, Any], manifest: bytes,
              view: memoryview, segments: list, reuse: list[int], check: Callable[[], None],
              reused: list, offered: int = 0) -> tuple[int, int, list[int]]:
        header = {"op": "replica_push", **base, "manifest_nbytes": len(manifest),
                  "chunk_bytes": self.owner.chunk_bytes, "digest": self.owner.digest,
                  "reuse": reuse}
        first_timeout = self.owner.timeout_s + 4 * base["size"] / _ALLOC_BYTES_PER_S
        check()
        reply = link.push(header, manifest, view, segments, self.owner.digest, check,
                          first_timeout)
        held: Any = reply.get("held")     # the keeper's wire value, covered by its check
        verify_check(reply.get("check"), [base["rank"], base["step"], held, reply.get("evicted")],
                     b"", f"{link.where}: replica_push of rank {base['rank']} step {base['step']}")
        sent = offered + push_nbytes(len(manifest), segments, self.owner.chunk_bytes)
        return sent, sum(n for _, n in reused), list(held)

    def _failed(self, rank: int, step: int, exc: BaseException, *, preempted: bool) -> None:
        if self.owner._view(self) is None:  # retired or closing: the abort was ours
            log.debug("replication.push_abandoned node=%s target=%s rank=%d step=%d",
                      self.owner.node, self.target, rank, step)
            return
        if preempted:
            error = "preempted: the worker claimed the slot being pushed"
        else:
            error = f"{type(exc).__name__}: {exc}"
            self._back_off()
            log.warning("replication.push_failed node=%s target=%s rank=%d step=%d "
                        "retry_in_s=%.2f error=%s", self.owner.node, self.target, rank, step,
                        self._retry_at - time.monotonic(), error)
        self.owner._record({"event": "replica_failed", "rank": rank, "step": step,
                            "target": self.target, "error": error, "preempted": preempted})

    def _back_off(self) -> None:
        self._failures += 1
        delay = min(self.owner.max_backoff_s, _FIRST_BACKOFF_S * 2 ** (self._failures - 1))
        self._retry_at = time.monotonic() + delay

    def _set_link(self, link: ReplicaLink | None) -> None:
        with self._link_lock:
            old, self._link = self._link, link
        if old is not None and old is not link:
            old.close()
