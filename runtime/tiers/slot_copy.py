"""Reading one rank's published snapshot out of keeper memory for a tier write: how many
bytes to persist (``payload_size``) and, with 2 slots, a private copy that gives way to
the worker's claim (``copy_unless``, ``Preempted``). Used by the tier persister."""
from __future__ import annotations

import json
import mmap
import threading

from phalanx.configs.errors import SnapshotCorrupt

_STAGE_CHUNK = 64 << 20     # a preempted copy stops within one chunk


class Preempted(Exception):
    """The worker claimed the slot being copied (internal; becomes ``tier_skipped``)."""


def payload_size(manifest: bytes, published: int, rank: int, step: int) -> int:
    """Bytes of ``rank``'s payload at ``step`` to persist: the manifest's ``total_bytes``
    when it records one (a worker may publish its whole, larger slot), else ``published``.
    Raises SnapshotCorrupt when the manifest names another rank or step, or records more
    bytes than were published."""
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


def copy_unless(src: memoryview, preempted: threading.Event, what: str) -> mmap.mmap:
    """A private copy of ``src``, made chunk by chunk; raises Preempted once
    ``preempted`` is set before the last chunk (after it the copy is whole: the claim
    waits for the unpin)."""
    copy = mmap.mmap(-1, src.nbytes)
    try:
        with memoryview(copy) as dst:
            for start in range(0, src.nbytes, _STAGE_CHUNK):
                if preempted.is_set():
                    raise Preempted(f"{what}: the worker claimed the slot mid-copy")
                dst[start:start + _STAGE_CHUNK] = src[start:start + _STAGE_CHUNK]
    except BaseException:
        close_quietly(copy)
        raise
    return copy


def close_quietly(copy: mmap.mmap) -> None:
    try:
        copy.close()
    except BufferError:  # a traceback still holds a view of it: the GC unmaps it
        pass
