"""The receiving keeper's side of a replica push (protocol: ``phalanx.runtime.replication.wire``):
answer an offer from the tensors it holds, and store a push, keeping the reused tensors as
references to the snapshots that hold them here (one copy per node:
``phalanx.runtime.keeper.shared_copies``) and checking the header's check and every
received chunk's digest before the replica is kept. Registered on a keeper through its op port
(``ReplicaReceiver.ops``) and called on the keeper's connection threads.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Protocol, Sequence

from phalanx.configs.errors import SnapshotCorrupt, SnapshotNotFound
from phalanx.runtime.transport.frames import IncomingPayload
from phalanx.runtime.replication.wire import (CHUNK_DIGESTS, DIGEST_BYTES, MAX_CHUNK_BYTES,
                                              MIN_CHUNK_BYTES, Range, ReplicaInvalid, chunk_digest,
                                              dedup_candidates, fields_check, iter_chunks,
                                              push_check, push_nbytes, reused_ranges, sent_segments,
                                              tensor_ranges)
from phalanx.runtime.keeper.shm import Held
from phalanx.runtime.keeper.wire import OpHandler, header_int, read_manifest
from phalanx.runtime.transport.tcp import Reply, Request

log = logging.getLogger(__name__)

# How long an offer waits for a local rank to publish its capture of the offered step
# (a capture of a few hundred MB takes 0.1-0.3 s here); past it, the offer answers
# from what is published.
OFFER_SETTLE_S = 1.0

class _Receiving(Protocol):
    """What the receiver needs of a Keeper (phalanx.runtime.keeper.daemon.Keeper)."""

    node: str

    def ready_snapshots(self) -> list[Held]: ...
    def holdings(self) -> dict[int, dict[str, Any]]: ...
    def store_replica(self, rank: int, step: int, manifest: bytes, nbytes: int,
                      fill: Callable[[memoryview], None],
                      shared: Sequence[tuple[int, int, Held, bytes, int]] = ()) -> list[int]: ...
    def settle_local_writes(self, step: int, timeout_s: float) -> None: ...


class TensorIndex:
    """Checksum → where a keeper holds those bytes, over its ready snapshots. Parsed
    manifests are cached per held buffer until that buffer holds another snapshot.
    Thread-safe: connection threads share it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parsed: dict[Held, tuple[bytes, list[tuple[int, int, str]]]] = {}

    def find(self, helds: Sequence[Held],
             wanted: set[tuple[str, int]]) -> dict[tuple[str, int], tuple[Held, bytes, int]]:
        """(checksum, nbytes) → (held, its manifest, offset) for each wanted one held."""
        found: dict[tuple[str, int], tuple[Held, bytes, int]] = {}
        with self._lock:
            live = set(helds)
            for gone in [h for h in self._parsed if h not in live]:
                del self._parsed[gone]
            for held in helds:
                manifest, used = held.manifest, held.used  # read once: fields may change
                cached = self._parsed.get(held)
                if cached is None or cached[0] is not manifest:
                    cached = (manifest, tensor_ranges(manifest, used))
                    self._parsed[held] = cached
                for offset, nbytes, checksum in cached[1]:
                    key = (checksum, nbytes)
                    if key in wanted and key not in found:
                        found[key] = (held, manifest, offset)
        return found


class ReplicaReceiver:
    """Replication's ops on a keeper (``replica_offer``, ``replica_push``), served through the
    keeper's op port (``phalanx.runtime.keeper.wire.OpHandler``), and the index of held
    tensors their dedup reads. One per keeper."""

    def __init__(self) -> None:
        self.tensor_index = TensorIndex()

    def ops(self) -> dict[str, OpHandler]:
        return {"replica_offer": self._offer, "replica_push": self._push}

    def _offer(self, keeper: _Receiving, request: Request) -> Reply:
        h = request.header
        manifest = read_manifest(request, request.payload.remaining)
        return Reply(answer_offer(keeper, self.tensor_index, header_int(h, "rank"), manifest,
                                  header_int(h, "size"), header_int(h, "step", -1)))

    def _push(self, keeper: _Receiving, request: Request) -> Reply:
        h = request.header
        manifest = read_manifest(request, header_int(h, "manifest_nbytes"))
        return Reply(receive_push(keeper, self.tensor_index, header_int(h, "rank"),
                                  header_int(h, "step"), manifest, h, request.payload))


def answer_offer(keeper: _Receiving, index: TensorIndex, rank: int, manifest: bytes,
                 size: int, step: int = -1) -> dict[str, Any]:
    """Reply to replica_offer: the offered tensors this keeper holds, and the steps of
    ``rank`` it holds as replicas (a push of one of those is not needed), with the
    ``check`` the sender verifies (so a rank or manifest changed in flight is noticed)."""
    tensors = tensor_ranges(manifest, size)
    candidates = dedup_candidates(tensors)
    have: list[int] = []
    if candidates:
        # a local rank still capturing ``step`` holds the offered replicated tensors once
        # it publishes: wait for it (briefly) to share them
        keeper.settle_local_writes(step, OFFER_SETTLE_S)
        wanted = {(tensors[i][2], tensors[i][1]) for i in candidates}
        found = index.find(keeper.ready_snapshots(), wanted)
        have = [i for i in candidates if (tensors[i][2], tensors[i][1]) in found]
    held = keeper.holdings().get(rank, {}).get("replica", [])
    return {"have": have, "held": held, "check": fields_check([rank, size, have, held], manifest)}


def receive_push(keeper: _Receiving, index: TensorIndex, rank: int, step: int,
                 manifest: bytes, header: dict[str, Any],
                 payload: IncomingPayload) -> dict[str, Any]:
    """Store the replica a replica_push frame carries (``manifest`` already read).

    Raises ReplicaInvalid (fields, sizes), SnapshotNotFound (a reused tensor is no
    longer held: offer again) or SnapshotCorrupt (the header's check or a chunk digest
    differs: changed in flight); then the keeper keeps what it held and the server
    drains the rest of the frame. The reply's ``check`` binds what the sender records."""
    try:
        reply = _store_push(keeper, index, rank, step, manifest, header, payload)
    except SnapshotCorrupt as exc:
        log.warning("replica.refused node=%s rank=%d step=%d error=%s", keeper.node, rank,
                    step, exc)
        raise
    return {**reply, "check": fields_check([rank, step, reply["held"], reply["evicted"]])}


def _store_push(keeper: _Receiving, index: TensorIndex, rank: int, step: int, manifest: bytes,
                header: dict[str, Any], payload: IncomingPayload) -> dict[str, Any]:
    if header.get("check") != push_check(header, manifest):
        raise SnapshotCorrupt(f"replica push of rank {rank} step {step}: the header's check "
                              f"{str(header.get('check'))[:32]!r} does not match its fields "
                              "and manifest: changed in flight; the replica is refused")
    size, chunk_bytes, algo = header.get("size"), header.get("chunk_bytes"), header.get("digest")
    reuse = header.get("reuse", [])
    if type(size) is not int or size <= 0:
        raise ReplicaInvalid(f"replica size {size!r} must be a positive integer")
    if type(chunk_bytes) is not int or not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ReplicaInvalid(f"chunk_bytes {chunk_bytes!r} must lie in "
                             f"[{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}]")
    if algo not in CHUNK_DIGESTS:
        raise ReplicaInvalid(f"unknown chunk digest {algo!r}; use one of {CHUNK_DIGESTS}")
    tensors = tensor_ranges(manifest, size) if reuse else []
    allowed = set(dedup_candidates(tensors))
    if not (isinstance(reuse, list) and all(type(i) is int and i in allowed for i in reuse)
            and reuse == sorted(set(reuse))):
        raise ReplicaInvalid("reuse must list distinct, ascending indices of offered tensors")
    segments = sent_segments(size, reused_ranges(tensors, reuse))
    expected = push_nbytes(len(manifest), segments, chunk_bytes)
    if payload.nbytes != expected:
        raise ReplicaInvalid(f"replica push of rank {rank} step {step} carries "
                             f"{payload.nbytes} bytes, the layout needs {expected}")
    shared = _resolve(keeper, index, rank, step, [tensors[i] for i in reuse])

    def fill(view: memoryview) -> None:
        for index, parts in enumerate(iter_chunks(segments, chunk_bytes)):
            receive_chunk(payload, view, parts, algo, index)

    # the reused tensors stay where this keeper already holds them (one copy per node)
    evicted = keeper.store_replica(rank, step, manifest, size, fill, shared)
    held_steps = keeper.holdings().get(rank, {}).get("replica", [])
    return {"evicted": evicted, "held": held_steps, "received": size - sum(c[1] for c in shared),
            "reused": sum(c[1] for c in shared)}


def _resolve(keeper: _Receiving, index: TensorIndex, rank: int, step: int,
             reused: list[tuple[int, int, str]]) -> list[tuple[int, int, Held, bytes, int]]:
    if not reused:
        return []
    found = index.find(keeper.ready_snapshots(),
                                     {(checksum, nbytes) for _, nbytes, checksum in reused})
    out = []
    for offset, nbytes, checksum in reused:
        source = found.get((checksum, nbytes))
        if source is None:
            raise SnapshotNotFound(f"keeper {keeper.node}: tensor {checksum} ({nbytes} bytes) "
                                   f"of rank {rank} step {step} is no longer held; offer again")
        held, manifest, src = source
        out.append((offset, nbytes, held, manifest, src))
    return out


def receive_chunk(payload: IncomingPayload, view: memoryview, parts: Sequence[Range],
                  algo: str, index: int) -> None:
    """Receive one chunk's parts into ``view`` and its digest; SnapshotCorrupt if the
    digest differs from the bytes received. (Called on the keeper's connection thread.)"""
    windows = [view[offset:offset + nbytes] for offset, nbytes in parts]
    try:
        for window in windows:
            payload.recv_into(window)
        trailer = bytearray(DIGEST_BYTES)
        with memoryview(trailer) as tview:
            payload.recv_into(tview)
        got = chunk_digest(windows, algo)
    finally:
        for window in windows:
            window.release()
    if got != bytes(trailer):
        raise SnapshotCorrupt(f"replica chunk {index} at payload offset {parts[0][0]} failed "
                              f"its {algo} digest (sent {bytes(trailer).hex()}, received bytes "
                              f"give {got.hex()}): corrupted in flight; the replica is refused")
