"""What a rank's set-up collectives returned (those it made before its Session started:
a ``broadcast_object_list`` of a run name, an ``all_gather_object``, a ``broadcast`` of a
seed), kept in the launcher's store so that a rank replacing it later gets the same
answers. A replacement runs its set-up again while the survivors are long past theirs, so
its set-up collectives cannot meet theirs; answered as if alone, an object broadcast left
its receive buffer unset and the replacement failed in ``pickle.loads`` (EOFError), and a
broadcast seed stayed the replacement's own.

Each call is numbered in the order the group saw it (the replacement runs the same
set-up, so its n-th call is the lost rank's n-th) and kept as a JSON record of its
tensors' dtypes and shapes naming a blob of their raw bytes by its sha256: no pickle
(what the bytes mean is torch's business, as when gloo carried them), and one copy of a
result every rank got alike (a broadcast, an all-gather) however many ranks keep it.
An object collective's payload (``uint8``: a vocabulary, an index list rank 0 built) is
kept up to ``OBJECT_LIMIT``; other calls up to ``CALL_LIMIT`` (DDP's broadcast of the
model, whose state the snapshot restores anyway, is not kept); ``RANK_LIMIT`` bounds a
rank's whole set-up. A call with no record, or one whose tensors differ from the
record's, is answered as if alone, as before."""
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
KEY = "phalanx-setup/{group}/{rank}/{call}"
BLOB = "phalanx-setup/blob/{digest}"


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
    when the Session starts (``publish``), or replayed to a replacement (``replay``)."""

    def __init__(self, store: Callable[[], dist.Store], group: str, rank: int) -> None:
        self._store = store
        self._group = group
        self._rank = rank
        self._calls = itertools.count()
        self._held: dict[int, tuple[bytes, str, bytes]] = {}
        self._bytes = 0
        self.open = True         # set-up still runs: calls are numbered

    def number(self) -> int | None:
        """The next set-up call's number (None once set-up is over)."""
        return next(self._calls) if self.open else None

    def keep(self, call: int, result: Any) -> None:
        """Call ``call`` completed with ``result`` (its result argument, read now: the
        script may change the tensors later)."""
        tensors = tensors_in(result)
        if not tensors:
            return
        size = sum(t.numel() * t.element_size() for t in tensors)
        objects = all(t.dtype == torch.uint8 for t in tensors)
        if size > (OBJECT_LIMIT if objects else CALL_LIMIT) or self._bytes + size > RANK_LIMIT:
            log.info("event=setup_collective_not_kept group=%s rank=%d call=%d bytes=%d",
                     self._group, self._rank, call, size)
            return
        self._held[call] = encode(tensors)
        self._bytes += size

    def publish(self) -> None:
        """Set-up is over: write the kept calls to the store (once)."""
        if not self.open:
            return
        self.open = False
        held, self._held = self._held, {}
        if not held:
            return
        store = self._store()
        blobs = {digest: blob for _, digest, blob in held.values()}
        # bytes, not the stubs' str: the binding takes both
        for digest, blob in blobs.items():
            key = BLOB.format(digest=digest)
            if not store.check([key]):          # another rank kept the same result
                store.set(key, blob)  # type: ignore[arg-type]
        for call, (record, _, _) in held.items():
            store.set(KEY.format(group=self._group, rank=self._rank, call=call),
                      record)  # type: ignore[arg-type]
        log.info("event=setup_collectives_kept group=%s rank=%d calls=%d bytes=%d",
                 self._group, self._rank, len(held), sum(len(b) for b in blobs.values()))

    def replay(self, call: int | None, result: Any) -> bool:
        """Fill ``result`` with what the lost rank's call ``call`` returned; False when
        nothing fits (no record: answer as if alone)."""
        tensors = tensors_in(result)
        if call is None or not tensors:
            return False
        key = KEY.format(group=self._group, rank=self._rank, call=call)
        store = self._store()
        if not store.check([key]):
            return False

        def blob(digest: str) -> bytes | None:
            name = BLOB.format(digest=digest)
            return store.get(name) if store.check([name]) else None

        return decode_into(store.get(key), blob, tensors)
