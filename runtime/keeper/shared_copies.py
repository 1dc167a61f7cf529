"""One copy per node: a replica whose tensors another snapshot on the same keeper already
holds keeps references to those bytes instead of a second copy.

On a data-parallel job every rank's replicated state (DDP parameters, optimizer state) is
the same bytes. A node's keeper holds its own ranks' snapshots and replicas of other
nodes' ranks, so without this it held the same model once per rank it keeps; the
replication offer already found those tensors (``phalanx.runtime.replication.wire``) and
spared the network, but the receiver copied them into the new replica's buffer. Now the
replica's file holds only the bytes no other snapshot here holds (the rest are holes in a
sparse tmpfs file, never allocated) plus ``Ref`` s to where the rest lie::

    replica of rank 1, step 40          rank 0's own slot, step 40 (same keeper)
    ┌──────┬───────────────┬────┐        ┌──────┬───────────────┬────┐
    │ own  │ hole → Ref ───┼────┼──────▶ │      │ w, exp_avg, … │    │
    └──────┴───────────────┴────┘        └──────┴───────────────┴────┘

Rules (the Keeper's lock guards every field; see ``Keeper.store_replica``):
- a replica pins each distinct source once (``Held.ref_pins``); a pinned source is never
  overwritten, and a source that is forgotten stays mapped until its last pin goes;
- a worker's claim that needs a referenced slot makes the replica copy those bytes in
  (``materialize``, on a thread; the claim waits as for any reader), so the worker's new
  step never changes a replica's bytes;
- readers pin the replica and read through its references (``payload_views``); its
  references stay until no reader pins it.
"""
from __future__ import annotations

from typing import Iterable

from phalanx.runtime.keeper.shm import Held, Ref

__all__ = ["locate", "own_ranges", "payload_views", "payload_bytes", "payload_view",
           "copy_refs_in", "shared_bytes"]

_COPY_SLICE = 16 << 20  # memcpy slices, so a large copy does not hold the GIL for long


def locate(held: Held, offset: int, nbytes: int) -> tuple[Held, int] | None:
    """Where bytes [offset, offset + nbytes) of ``held`` lie in memory: (held, offset) if
    it owns them, (source, at) if one reference covers them; None if they straddle a
    reference's edge (references are whole tensors, so a tensor range never does)."""
    for ref in held.refs:
        if ref.offset <= offset and offset + nbytes <= ref.offset + ref.nbytes:
            return ref.source, ref.at + offset - ref.offset
        if ref.offset < offset + nbytes and offset < ref.offset + ref.nbytes:
            return None
    return held, offset


def own_ranges(size: int, refs: Iterable[Ref]) -> list[tuple[int, int]]:
    """(offset, nbytes) of the payload's bytes no reference covers, in order."""
    out, pos = [], 0
    for ref in sorted(refs, key=lambda r: r.offset):
        if ref.offset > pos:
            out.append((pos, ref.offset - pos))
        pos = max(pos, ref.offset + ref.nbytes)
    if pos < size:
        out.append((pos, size - pos))
    return out


def payload_views(held: Held) -> list[memoryview]:
    """The payload of pinned ``held``, in order, as views of its own buffer and of its
    references' sources (no copy). The caller releases every view."""
    if not held.refs:
        return [held.buf.view(held.used)]
    views, pos = [], 0
    for ref in sorted(held.refs, key=lambda r: r.offset):
        if ref.offset > pos:
            views.append(held.buf.view(ref.offset)[pos:])
        views.append(ref.source.buf.view(ref.at + ref.nbytes)[ref.at:])
        pos = ref.offset + ref.nbytes
    if pos < held.used:
        views.append(held.buf.view(held.used)[pos:])
    return views


def payload_bytes(held: Held) -> bytes:
    """A copy of pinned ``held``'s payload (for readers that need one buffer)."""
    views = payload_views(held)
    try:
        return b"".join(views)
    finally:
        for view in views:
            view.release()


def payload_view(held: Held, nbytes: int | None = None) -> memoryview:
    """One view of pinned ``held``'s first ``nbytes`` (all if None): its buffer's own map,
    or a copy for a replica that shares ranges (readers that need one buffer meet such a
    replica only when the rank's own slot of that step is gone). The caller releases it."""
    size = held.used if nbytes is None else nbytes
    return memoryview(payload_bytes(held))[:size] if held.refs else held.buf.view(size)


def copy_refs_in(held: Held, refs: Iterable[Ref]) -> None:
    """Copy these references' ranges into ``held``'s own buffer (their sources pinned, its
    pages for those ranges reserved by the caller)."""
    with held.buf.view(held.used) as dst:
        for ref in refs:
            with ref.source.buf.view(ref.at + ref.nbytes) as src:
                for at in range(0, ref.nbytes, _COPY_SLICE):
                    n = min(_COPY_SLICE, ref.nbytes - at)
                    dst[ref.offset + at:ref.offset + at + n] = src[ref.at + at:ref.at + at + n]


def shared_bytes(helds: Iterable[Held]) -> int:
    """Payload bytes these replicas reference instead of holding."""
    return sum(ref.nbytes for held in helds for ref in held.refs)
