"""What a rank's set-up collectives returned (those it made before its Session started:
a ``broadcast_object_list`` of a run name, an ``all_gather_object``, a ``broadcast`` of a
seed), kept in the launcher's store so that a rank replacing it later gets the same
answers. A replacement runs its set-up again while the survivors are long past theirs, so
its set-up collectives cannot meet theirs; answered as if alone, an object broadcast left
its receive buffer unset and the replacement failed in ``pickle.loads`` (EOFError), and a
broadcast seed stayed the replacement's own.

Each call is numbered in the order the group saw it (the replacement runs the same
set-up, so its n-th call is the lost rank's n-th) and kept as a JSON record of its
tensors' dtypes and shapes with their raw bytes (inline up to ``INLINE_BYTES``, else a
blob named by its sha256; a rank's records of one scope are one JSON document): no pickle
(what the bytes mean is torch's business, as when gloo carried them), and one copy of a
result every rank got alike (a broadcast, an all-gather) however many ranks keep it.
An object collective's payload (``uint8``: a vocabulary, an index list rank 0 built) is
kept up to ``OBJECT_LIMIT``; other calls up to ``CALL_LIMIT`` (DDP's broadcast of the
model, whose state the snapshot restores anyway, is not kept); ``RANK_LIMIT`` bounds a
rank's whole set-up. A call with no record, or one whose tensors differ from the
record's, is answered as if alone, as before.

An epoch's top (the script's code between ``session.epochs()`` yielding the epoch and its
first step) is kept the same way, numbered from 0 in a scope of its own (``epoch<e>``): a
replacement restored into that epoch runs its top again while the survivors are past it
(``DefaultGroup.answer_epoch_top_locally``), and a ``broadcast_object_list`` there,
answered as if alone, failed the replacement in ``pickle.loads`` as set-up's did. An
epoch's top keeps object payloads up to ``EPOCH_OBJECT_LIMIT`` and other calls up to
``EPOCH_CALL_LIMIT`` (a seed, a count, a flag; not the buffers a DDP forward of an
evaluation broadcasts, which would cost the store each epoch what a snapshot restores
anyway); a rank keeps its newest ``KEPT_EPOCHS`` epochs' records and deletes older ones."""
from __future__ import annotations

import hashlib
import itertools
import json
import logging
from typing import Any, Callable

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
CALL_LIMIT = 1 << 20      # bytes of one call's results kept (other than object payloads)
OBJECT_LIMIT = 64 << 20   # bytes of one object collective's payload kept
RANK_LIMIT = 128 << 20    # bytes kept per rank and group
EPOCH_CALL_LIMIT = 4 << 10        # an epoch top's limits (see the module docstring)
EPOCH_OBJECT_LIMIT = 4 << 20
EPOCH_RANK_LIMIT = 16 << 20
KEPT_EPOCHS = 2
SETUP = "setup"           # the scope of the calls before the Session started
KEY = "phalanx-setup/{group}/{scope}/{rank}"
INLINE_BYTES = 4 << 10    # a result up to this size is kept inside its rank's record
BLOB = "phalanx-setup/blob/{scope}/{digest}"


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors of a collective's result argument (a list, or a list of lists)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_in(item)]
    return []


def _layout(tensors: list[torch.Tensor]) -> list[list[Any]]:
    return [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]


def encode(tensors: list[torch.Tensor]) -> tuple[bytes, str, bytes]:
    """A call's record (its tensors' dtypes and shapes, and its blob's name), the blob's
    name (the sha256 of its bytes) and the blob: the tensors' bytes, concatenated."""
    blob = b"".join(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                    for t in tensors)
    digest = hashlib.sha256(blob).hexdigest()
    return json.dumps({"tensors": _layout(tensors), "blob": digest}).encode(), digest, blob


def decode_into(record: bytes, blob: Callable[[str], bytes | None],
                tensors: list[torch.Tensor]) -> bool:
    """Copy a call's recorded values (``blob(name)`` fetches its bytes) into ``tensors``;
    False (nothing copied) when the record's dtypes and shapes are not theirs or its blob
    is missing or altered."""
    try:
        kept = json.loads(record)
        layout, digest = kept["tensors"], str(kept["blob"])
    except (ValueError, KeyError, TypeError):
        return False
    if layout != _layout(tensors):
        return False
    payload = blob(digest)
    sizes = [t.numel() * t.element_size() for t in tensors]
    if payload is None or sum(sizes) != len(payload) \
            or hashlib.sha256(payload).hexdigest() != digest:
        return False
    offset = 0
    for tensor, size in zip(tensors, sizes):
        raw = torch.frombuffer(bytearray(payload[offset:offset + size]), dtype=torch.uint8)
        tensor.copy_(raw.view(tensor.dtype).reshape(tensor.shape))
        offset += size
    return True


class SetupRecord:
    """One group's set-up calls on one rank: kept as they complete, written to the store
    when the Session starts (``publish``), or replayed to a replacement (``replay``); then
    the same for each epoch's top (``begin``)."""

    def __init__(self, store: Callable[[], dist.Store], group: str, rank: int) -> None:
        self._store = store
        self._group = group
        self._rank = rank
        self._scope = SETUP
        self._calls = itertools.count()
        self._held: dict[int, tuple[bytes, str, bytes]] = {}
        self._bytes = 0
        self._written: dict[str, list[str]] = {}     # epoch scope -> keys this rank wrote
        self._replaying: tuple[str, dict[str, Any]] | None = None   # the records read
        self.open = True         # set-up still runs: calls are numbered

    def number(self) -> int | None:
        """The next recorded call's number (None outside set-up and epoch tops)."""
        return next(self._calls) if self.open else None

    @property
    def scope(self) -> str:
        """What the calls numbered now belong to: ``setup`` or ``epoch<e>``."""
        return self._scope

    def begin(self, scope: str) -> None:
        """Number (and keep) calls afresh under ``scope`` (``epoch<e>``: an epoch's top
        starts); what the previous scope kept is published first."""
        self.publish()
        self._scope, self._calls = scope, itertools.count()
        self._held, self._bytes, self._replaying = {}, 0, None
        self.open = True

    def close(self) -> None:
        """Stop numbering without publishing (a replayed epoch top is over)."""
        self.open = False
        self._held, self._bytes, self._replaying = {}, 0, None

    def keep(self, call: int, result: Any) -> None:
        """Call ``call`` completed with ``result`` (its result argument, read now: the
        script may change the tensors later)."""
        tensors = tensors_in(result)
        if not tensors:
            return
        size = sum(t.numel() * t.element_size() for t in tensors)
        objects = all(t.dtype == torch.uint8 for t in tensors)
        limits = (OBJECT_LIMIT, CALL_LIMIT, RANK_LIMIT) if self._scope == SETUP else (
            EPOCH_OBJECT_LIMIT, EPOCH_CALL_LIMIT, EPOCH_RANK_LIMIT)
        if size > limits[0 if objects else 1] or self._bytes + size > limits[2]:
            log.info("event=setup_collective_not_kept group=%s rank=%d call=%d bytes=%d",
                     self._group, self._rank, call, size)
            return
        self._held[call] = encode(tensors)
        self._bytes += size

    def publish(self) -> None:
        """Set-up (or an epoch's top) is over: write the kept calls to the store (once)."""
        if not self.open:
            return
        self.open = False
        held, self._held = self._held, {}
        if not held:
            return
        store, scope = self._store(), self._scope
        # one key per rank and scope: its calls' records, with results up to INLINE_BYTES
        # inside (an evaluation's per-batch loss all-reduce, a count); larger results as
        # blobs shared by every rank that got the same (a broadcast object)
        records: dict[str, dict[str, str]] = {}
        blobs: dict[str, bytes] = {}
        for call, (record, digest, blob) in held.items():
            records[str(call)] = {"record": record.decode()}
            if len(blob) <= INLINE_BYTES:
                records[str(call)]["inline"] = blob.hex()
            else:
                blobs[digest] = blob
        written = []
        # bytes, not the stubs' str: the binding takes both
        for digest, blob in blobs.items():
            key = BLOB.format(scope=scope, digest=digest)
            if not store.check([key]):          # another rank kept the same result
                store.set(key, blob)  # type: ignore[arg-type]
                written.append(key)
        key = KEY.format(group=self._group, scope=scope, rank=self._rank)
        store.set(key, json.dumps(records).encode())  # type: ignore[arg-type]
        written.append(key)
        log.info("event=setup_collectives_kept group=%s scope=%s rank=%d calls=%d bytes=%d",
                 self._group, scope, self._rank, len(held),
                 sum(len(b) for _, _, b in held.values()))
        if scope != SETUP:
            self._written.setdefault(scope, []).extend(written)
            self._drop_old_epochs(store)

    def _drop_old_epochs(self, store: dist.Store) -> None:
        """Delete what this rank wrote for epochs older than its newest ``KEPT_EPOCHS``."""
        scopes = sorted(self._written, key=lambda s: int(s.removeprefix("epoch")))
        for scope in scopes[:-KEPT_EPOCHS]:
            for key in self._written.pop(scope):
                try:
                    store.delete_key(key)
                except RuntimeError as exc:     # the store went away: nothing to keep tidy
                    log.info("event=setup_record_not_deleted key=%s error=%s", key, exc)

    def replay(self, call: int | None, result: Any) -> bool:
        """Fill ``result`` with what the lost rank's call ``call`` returned; False when
        nothing fits (no record: answer as if alone)."""
        tensors = tensors_in(result)
        if call is None or not tensors:
            return False
        scope = self._scope
        if self._replaying is None or self._replaying[0] != scope:
            key = KEY.format(group=self._group, scope=scope, rank=self._rank)
            store = self._store()
            try:
                found = json.loads(store.get(key)) if store.check([key]) else {}
            except ValueError:
                found = {}
            self._replaying = (scope, found if isinstance(found, dict) else {})
        kept = self._replaying[1].get(str(call))
        if not isinstance(kept, dict) or not isinstance(kept.get("record"), str):
            return False
        inline = kept.get("inline")

        def blob(digest: str) -> bytes | None:
            if isinstance(inline, str):
                try:
                    return bytes.fromhex(inline)
                except ValueError:
                    return None
            store, name = self._store(), BLOB.format(scope=scope, digest=digest)
            return store.get(name) if store.check([name]) else None

        return decode_into(kept["record"].encode(), blob, tensors)
