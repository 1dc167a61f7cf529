"""What a rank's set-up collectives returned (those it made before its Session started:
a ``broadcast_object_list`` of a run name, an ``all_gather_object``, a ``broadcast`` of a
seed), kept in the launcher's store so that a rank replacing it later gets the same
answers. A replacement runs its set-up again while the survivors are long past theirs, so
its set-up collectives cannot meet theirs; answered as if alone, an object broadcast left
its receive buffer unset and the replacement failed in ``pickle.loads`` (EOFError), and a
broadcast seed stayed the replacement's own.

Each call is numbered in the order the group saw it (the replacement runs the same
set-up, so its n-th call is the lost rank's n-th) and kept as raw tensor bytes under a
JSON header of dtypes and shapes: no pickle (what the bytes mean is torch's business, as
when gloo carried them). Calls larger than ``CALL_LIMIT`` (DDP's broadcast of the model,
whose state the snapshot restores anyway) and anything past ``RANK_LIMIT`` are not kept;
a call with no record, or one whose tensors differ from the record's, is answered as if
alone, as before."""
from __future__ import annotations

import itertools
import json
import logging
from typing import Any, Callable

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
CALL_LIMIT = 1 << 20      # bytes of one call's results kept
RANK_LIMIT = 4 << 20      # bytes kept per rank and group
KEY = "phalanx-setup/{group}/{rank}/{call}"


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors of a collective's result argument (a list, or a list of lists)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_in(item)]
    return []


def encode(tensors: list[torch.Tensor]) -> bytes:
    """A JSON line of each tensor's dtype and shape, then their bytes."""
    header = json.dumps({"tensors": [[str(t.dtype).removeprefix("torch."), list(t.shape)]
                                     for t in tensors]}).encode()
    return b"\n".join([header, b"".join(t.detach().contiguous().reshape(-1)
                                         .view(torch.uint8).numpy().tobytes()
                                         for t in tensors)])


def decode_into(data: bytes, tensors: list[torch.Tensor]) -> bool:
    """Copy the recorded values into ``tensors``; False (nothing copied) when the record's
    dtypes and shapes are not theirs."""
    header, _, payload = data.partition(b"\n")
    try:
        kept = json.loads(header)["tensors"]
    except (ValueError, KeyError, TypeError):
        return False
    if kept != [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]:
        return False
    sizes = [t.numel() * t.element_size() for t in tensors]
    if sum(sizes) != len(payload):
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
        self._held: dict[int, bytes] = {}
        self._bytes = 0
        self.open = True         # set-up still runs: calls are numbered

    def number(self) -> int | None:
        """The next set-up call's number (None once set-up is over)."""
        return next(self._calls) if self.open else None

    def keep(self, call: int, result: Any) -> None:
        """Call ``call`` completed with ``result`` (its result argument, read now: the
        script may change the tensors later)."""
        tensors = tensors_in(result)
        size = sum(t.numel() * t.element_size() for t in tensors)
        if not tensors:
            return
        if size > CALL_LIMIT or self._bytes + size > RANK_LIMIT:
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
        for call, data in held.items():
            # bytes, not the stubs' str: the binding takes both
            store.set(KEY.format(group=self._group, rank=self._rank, call=call),
                      data)  # type: ignore[arg-type]
        log.info("event=setup_collectives_kept group=%s rank=%d calls=%d bytes=%d",
                 self._group, self._rank, len(held), sum(len(d) for d in held.values()))

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
        return decode_into(store.get(key), tensors)

    def close(self) -> None:
        """Set-up is over on a rank that replayed (nothing to publish)."""
        self.open = False
        self._held = {}
