"""Per-tensor checksums of snapshot payloads, and the fused copy-and-checksum that fills a
snapshot slot: each worker thread copies a chunk into the slot and hashes it while the chunk
is still in cache, so the bytes cross memory once for the copy and the hash reads them hot.

Algorithms (a checksum is ``"<algo>:<hex>"``):

* ``xxh3`` — XXH3-128 tree: the tensor's n bytes are cut into max(1, ceil(n / 1 MiB))
  leaves, each leaf hashed with XXH3-128, and the 16-byte leaf digests concatenated and
  hashed again with XXH3-128. Leaves are independent, so any number of threads share one
  tensor. Detects bit rot, torn writes and truncation; it is not a cryptographic hash, so the manifest HMAC
  then authenticates the manifest but not the tensor bytes against a deliberate forger.
* ``blake3`` — BLAKE3-256 of the tensor bytes: cryptographic, so with a job secret the
  manifest HMAC authenticates every tensor byte; one tensor per thread.
* ``sha256`` — SHA-256 of the tensor bytes (format version 1 snapshots); one tensor per
  thread.

Measured on the 2-core CI machine (one core: XXH3-128 14-25 GB/s from memory, 43-73 GB/s
in cache; BLAKE3 6-7 GB/s; SHA-256 2 GB/s). An xxh3 leaf with a source to copy goes through
the native kernel (``runtime/snapshot/fused_copy.py``: hash the source hot, stream it to the slot),
which makes the capture 0.95 of the 2-thread memcpy limit end to end at 64 MiB-1 GiB
(``bench/snapshot.py``); the pure-Python loop it replaces (copy a leaf with numpy, then
hash it back) reached 0.70-0.77.
"""
from __future__ import annotations

import hashlib
import itertools
import threading
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple, Sequence

import blake3
import numpy as np
import xxhash

from phalanx.runtime.snapshot import fused_copy

if TYPE_CHECKING:    # only a tensor's own bytes need torch (a keeper hashes buffers)
    import torch

ALGOS = ("xxh3", "blake3", "sha256")
DEFAULT_ALGO = "xxh3"
LEAF_BYTES = 1 << 20
HEX_LEN = {"xxh3": 32, "blake3": 64, "sha256": 64}


class Span(NamedTuple):
    """One tensor's bytes in a payload: its name and absolute [begin, end)."""

    name: str
    begin: int
    end: int


class _Unit(NamedTuple):
    """A piece of work for one thread: a whole tensor, or one xxh3 leaf of it."""

    name: str
    leaf: int            # leaf index for xxh3, 0 otherwise
    begin: int           # absolute offsets in the payload
    end: int


def check_algo(algo: str) -> str:
    """``algo`` itself, or ValueError naming the supported algorithms."""
    if algo not in ALGOS:
        raise ValueError(f"unknown checksum algorithm {algo!r}; use one of {list(ALGOS)}")
    return algo


def _units(spans: Sequence[Span], algos: Mapping[str, str]) -> list[_Unit]:
    """The work, in the order threads take it: largest first (whole-tensor units of
    blake3/sha256 balance that way), payload order among equals (xxh3's full leaves)."""
    out: list[_Unit] = []
    for span in spans:
        if algos[span.name] == "xxh3" and span.end - span.begin > LEAF_BYTES:
            for i, begin in enumerate(range(span.begin, span.end, LEAF_BYTES)):
                out.append(_Unit(span.name, i, begin, min(span.end, begin + LEAF_BYTES)))
        else:
            out.append(_Unit(span.name, 0, span.begin, span.end))
    return sorted(out, key=lambda u: (u.begin - u.end, u.begin))


class _Source(NamedTuple):
    """A CPU tensor's bytes to copy into the payload, from payload offset ``base`` on."""

    array: np.ndarray          # the tensor's bytes (uint8, contiguous)
    base: int
    address: int               # of ``array``'s first byte


class _Target(NamedTuple):
    """The payload being filled and hashed."""

    view: memoryview
    array: np.ndarray          # the same bytes, for numpy copies
    address: int


def _hash_unit(dst: _Target, unit: _Unit, algo: str, src: _Source | None) -> bytes:
    """Digest of one unit (a leaf digest for xxh3), copying it from ``src`` first."""
    if algo == "xxh3":
        if src is None:
            return xxhash.xxh3_128_digest(dst.view[unit.begin:unit.end])
        native = fused_copy.kernel()
        if native is not None:
            return native.copy_digest(dst.address + unit.begin,
                                      src.address + unit.begin - src.base, unit.end - unit.begin)
        _copy(dst, src, unit.begin, unit.end)
        return xxhash.xxh3_128_digest(dst.view[unit.begin:unit.end])
    h = blake3.blake3() if algo == "blake3" else hashlib.sha256()
    for begin in range(unit.begin, unit.end, LEAF_BYTES):
        end = min(unit.end, begin + LEAF_BYTES)
        if src is not None:
            _copy(dst, src, begin, end)
        h.update(dst.view[begin:end])
    return h.digest()


def _copy(dst: _Target, src: _Source, begin: int, end: int) -> None:
    np.copyto(dst.array[begin:end], src.array[begin - src.base:end - src.base])


class DigestJob:
    """The checksums of one payload, optionally fused with the copy that fills it.

    Any number of threads call ``work``; each takes the next unit (a tensor, or an xxh3
    leaf) until none is left, so a thread that wakes late simply does less. Threads may
    be started before the destination is known: ``work`` waits for ``start`` (or returns
    at once after ``cancel``). With ``ready``, units go in payload order and each waits
    for ``ready(tensor name)`` (bytes still landing, e.g. device-to-host copies). Call
    ``result`` once every ``work`` call has returned.
    """

    def __init__(self, spans: Sequence[Span], algos: Mapping[str, str],
                 tensors: Mapping[str, torch.Tensor] | None = None,
                 ready: Callable[[str], None] | None = None) -> None:
        for algo in set(algos.values()):
            check_algo(algo)
        self._spans, self._algos, self._tensors = list(spans), dict(algos), tensors
        self._ready = ready
        self._units: list[_Unit] = []      # planned by ``start``, off the caller's thread
        self._next = itertools.count()
        self._gate = threading.Event()
        self._dst: _Target | None = None
        self._sources: dict[str, _Source] = {}
        self._digests: dict[tuple[str, int], bytes] = {}

    def start(self, buf: Any) -> None:
        """Hash ``buf`` (after copying the tensors into it, if the job has tensors)."""
        dst = byte_view(buf)
        self._units = _units(self._spans, self._algos)
        if self._ready is not None:     # follow the bytes as they land
            self._units.sort(key=lambda u: u.begin)
        if self._tensors is not None:
            if dst.readonly:
                raise ValueError("snapshot buffer is read-only")
            self._sources = {span.name: _source(self._tensors[span.name], span.begin)
                             for span in self._spans}
            fused_copy.kernel()           # built or found before the threads need it
        array = np.frombuffer(dst, dtype=np.uint8)
        self._dst = _Target(dst, array, array.ctypes.data if len(dst) else 0)
        self._gate.set()

    def cancel(self) -> None:
        """Release threads waiting in ``work`` without doing anything."""
        self._gate.set()

    def work(self) -> None:
        self._gate.wait()
        dst, units = self._dst, self._units
        if dst is None:
            return
        done = {}
        while (i := next(self._next)) < len(units):
            u = units[i]
            if self._ready is not None:
                self._ready(u.name)
            done[u.name, u.leaf] = _hash_unit(dst, u, self._algos[u.name],
                                              self._sources.get(u.name))
        self._digests.update(done)

    def result(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for span in self._spans:
            algo = self._algos[span.name]
            if algo == "xxh3":
                leaves = max(1, -(-(span.end - span.begin) // LEAF_BYTES))
                root = xxhash.xxh3_128_digest(b"".join(self._digests[span.name, i]
                                                       for i in range(leaves)))
            else:
                root = self._digests[span.name, 0]
            out[span.name] = f"{algo}:{root.hex()}"
        return out


def helpers(job: DigestJob, pool: Executor | None, workers: int) -> list[Future]:
    """``workers - 1`` threads of ``pool`` working on ``job`` (the caller is the last)."""
    if pool is None:
        return []
    return [pool.submit(job.work) for _ in range(max(0, workers - 1))]


def finish(job: DigestJob, futures: Sequence[Future]) -> dict[str, str]:
    """Work on ``job`` on the calling thread, wait for the helpers, return the checksums."""
    try:
        job.work()
    finally:
        for future in futures:
            future.result()
    return job.result()


def digest_spans(buf: Any, spans: Sequence[Span], algos: Mapping[str, str], *,
                 pool: Executor | None = None, workers: int = 1) -> dict[str, str]:
    """``"<algo>:<hex>"`` of each span of ``buf`` (``algos`` maps span name to algorithm);
    with a ``pool``, ``workers`` threads (the caller's among them) hash in parallel."""
    job = DigestJob(spans, algos)
    job.start(buf)
    return finish(job, helpers(job, pool, workers))


def _source(tensor: torch.Tensor, base: int) -> _Source:
    array = _as_bytes(tensor)
    return _Source(array, base, array.ctypes.data if array.size else 0)


def byte_view(buf: Any) -> memoryview:
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    import torch

    flat = t.detach()
    if flat.is_conj() or flat.is_neg():
        flat = flat.resolve_conj().resolve_neg()
    return flat.contiguous().view(-1).view(torch.uint8).numpy()
