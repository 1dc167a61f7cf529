"""The replica push protocol between keepers: the frames, per-chunk digests, which bytes
travel when the receiver already holds some tensors, and the sender's connection
(``ReplicaLink``). The sender is ``phalanx.runtime.replication.pusher``; the receiving keeper's side is
``phalanx.runtime.replication.receiver``, which ``phalanx.runtime.keeper.wire`` dispatches the two ops to.

Two requests per push, on one authenticated connection (``phalanx.runtime.transport.frames``)::

    sender                                           receiver keeper
    replica_offer {rank, step}  + manifest  ───▶  which tensors (by checksum and size)
                                            ◀───  do I hold in ANY ready snapshot?
                                                  {have: [tensor indices], held: [steps]}
    replica_push {rank, step, size, reuse,  ───▶  store_replica(fill):
                  chunk_bytes, digest}              1. copy the ``reuse`` tensors from the
      + manifest                                       held snapshots (pinned, memcpy)
      + chunk 0 = next chunk_bytes of the           2. receive each chunk straight into the
        payload bytes outside ``reuse``                replica's shm view, check its digest
        (header, missing tensors), then its         a mismatch refuses the replica (what was
        8-byte digest; chunk 1 + digest; ...        held stays) and the rest is drained
                                            ◀───  {evicted, held, received, reused}

What is not a chunk travels checked too: a push header carries ``check``, a 128-bit
blake2b over its identity and layout fields (rank, step, size, generation, chunk_bytes,
digest, reuse, manifest_nbytes, nbytes) and the manifest bytes, so a bit flipped in the
header or the manifest refuses the replica (``SnapshotCorrupt``) instead of storing it
under another rank or step or with a damaged manifest. Offer and push replies carry a
``check`` over what the sender acts on (rank, size, have, held; rank, step, held,
evicted), which the sender recomputes from its own request: a mismatch fails the push
(``SnapshotCorrupt``) and it is retried, never acknowledged.

Chunk digests (8 bytes, little-endian) guard the bytes in flight, from the sender's
shm to the receiver's: ``sum64`` (default) is the sum mod 2**64 of each part's 8-byte
little-endian words (a part's last partial word zero-padded); ``crc32`` is zlib's CRC-32
over the parts. Measured on the 2-core CI machine (``bench/replication_throughput.py``,
256 MiB, both keepers in one process): sum64 hashes ~7 GB/s, crc32 ~2 GB/s, about what
loopback TCP moves (~1.8-2 GB/s), so a push ran at 0.87 of raw TCP with sum64 and 0.50
with crc32 on both ends.
sum64 catches any error confined to one 8-byte word (every flipped bit or byte) and
random multi-word damage with probability 1 - 2**-64; it does not catch words swapped
within one chunk, which TCP's in-order delivery does not produce. Neither is a
cryptographic check; the signed manifest's per-tensor checksums are verified on restore.

Dedup trusts the checksum a held snapshot records: a copied tensor is not re-hashed.
Its bytes were checksummed by the worker that wrote them, or arrived digest-checked as a
replica of such a snapshot, and stay pinned (immutable) while copied; every restore
verifies each tensor against the manifest anyway. Only checksums of 128 bits or more
(xxh3, blake3, sha256: an accidental match is ~2**-128) deduplicate; the snapshots come
from this job's own workers, so a deliberately colliding tensor is not in the threat
model here. Tensors under ``MIN_DEDUP_BYTES`` are not worth the lookup.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import socket
import struct
import threading
import zlib
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from phalanx.configs.errors import FatalError, PeerUnreachable, SnapshotCorrupt
from phalanx.runtime.transport.frames import (MAX_HEADER_BYTES, FrameInvalid, client_handshake,
                                              io_errors, raise_for_reply, recv_header,
                                              register_remote_error)

CHUNK_DIGESTS = ("sum64", "crc32")
DIGEST_BYTES = 8
MIN_DEDUP_BYTES = 4096
MIN_CHUNK_BYTES, MAX_CHUNK_BYTES = 4096, 256 << 20
_DEDUP_ALGOS = ("xxh3:", "blake3:", "sha256:")
_WORDS = np.dtype("<u8")
_LEN = struct.Struct(">I")  # phalanx.runtime.transport.frames' header length prefix

Range = tuple[int, int]  # (offset, nbytes) in a payload
# the replica_push header fields ``check`` binds to the manifest (see the module docstring)
PUSH_CHECKED = ("op", "rank", "step", "size", "generation", "chunk_bytes", "digest", "reuse",
                "manifest_nbytes", "nbytes")


@register_remote_error
class ReplicaInvalid(FatalError):
    """A replica push broke the protocol: bad field, size or reuse list."""


# ----- chunk digests --------------------------------------------------------------------

def chunk_digest(parts: Sequence[memoryview], algo: str) -> bytes:
    """The 8-byte digest of one chunk made of ``parts`` (see the module docstring)."""
    if algo == "sum64":
        total = 0
        for part in parts:
            whole = part.nbytes - part.nbytes % 8
            if whole:
                total += int(np.add.reduce(np.frombuffer(part, dtype=_WORDS, count=whole // 8)))
            if whole < part.nbytes:
                total += int.from_bytes(bytes(part[whole:]), "little")
        return (total & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "little")
    if algo == "crc32":
        crc = 0
        for part in parts:
            crc = zlib.crc32(part, crc)
        return crc.to_bytes(8, "little")
    raise ReplicaInvalid(f"unknown chunk digest {algo!r}; use one of {CHUNK_DIGESTS}")


# ----- header, manifest and reply checks ------------------------------------------------

def fields_check(values: Sequence[Any], data: bytes = b"") -> str:
    """128-bit blake2b (hex) over the JSON of ``values`` and ``data``: notices bytes
    changed in flight (not a MAC: the handshake already authenticated the peer)."""
    body = json.dumps(list(values), separators=(",", ":"), sort_keys=True).encode()
    return hashlib.blake2b(body + b"\0" + bytes(data), digest_size=16).hexdigest()


def push_check(header: dict[str, Any], manifest: bytes) -> str:
    """The ``check`` of a replica_push header (with ``nbytes``) and its manifest."""
    return fields_check([header.get(key) for key in PUSH_CHECKED], manifest)


def verify_check(got: Any, values: Sequence[Any], data: bytes, what: str) -> None:
    """SnapshotCorrupt unless ``got`` is the check of ``values`` and ``data``."""
    want = fields_check(values, data)
    if got != want:
        raise SnapshotCorrupt(f"{what}: check {str(got)[:32]!r} differs from {want!r}: its "
                              "header, manifest or reply changed in flight; refused")


# ----- what a push sends ---------------------------------------------------------------

def tensor_ranges(manifest: bytes, size: int) -> list[tuple[int, int, str]]:
    """(offset, nbytes, checksum) of every tensor of a snapshot manifest, in manifest
    order; [] when ``manifest`` is not one (keepers treat manifests as opaque bytes) or
    a tensor lies outside the ``size``-byte payload. Plain JSON: no torch here."""
    try:
        raw = json.loads(manifest)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return []
    tensors = raw.get("tensors") if isinstance(raw, dict) else None
    if not isinstance(tensors, dict):
        return []
    out = []
    for rec in tensors.values():
        if not isinstance(rec, dict):
            return []
        offset, nbytes, checksum = rec.get("offset"), rec.get("nbytes"), rec.get("checksum")
        if not (type(offset) is int and type(nbytes) is int and isinstance(checksum, str)
                and 0 <= offset and 0 <= nbytes and offset + nbytes <= size):
            return []
        out.append((offset, nbytes, checksum))
    return out


def dedup_candidates(tensors: Sequence[tuple[int, int, str]]) -> list[int]:
    """Indices of the tensors worth offering: cryptographic checksum, >= MIN_DEDUP_BYTES."""
    return [i for i, (_, nbytes, checksum) in enumerate(tensors)
            if nbytes >= MIN_DEDUP_BYTES and checksum.startswith(_DEDUP_ALGOS)]


def reused_ranges(tensors: Sequence[tuple[int, int, str]], reuse: Sequence[int]) -> list[Range]:
    """The byte ranges of the ``reuse`` tensors, sorted; ReplicaInvalid if they overlap."""
    ranges = sorted((tensors[i][0], tensors[i][1]) for i in reuse)
    end = 0
    for offset, nbytes in ranges:
        if offset < end:
            raise ReplicaInvalid(f"reused tensor at {offset} overlaps the previous one")
        end = offset + nbytes
    return ranges


def sent_segments(size: int, reused: Sequence[Range]) -> list[Range]:
    """The payload ranges outside ``reused`` (sorted, disjoint): what travels."""
    out, at = [], 0
    for offset, nbytes in reused:
        if offset > at:
            out.append((at, offset - at))
        at = max(at, offset + nbytes)
    if at < size:
        out.append((at, size - at))
    return out


def iter_chunks(segments: Sequence[Range], chunk_bytes: int) -> Iterator[list[Range]]:
    """Split the concatenated ``segments`` into chunks of ``chunk_bytes`` (the last may be
    shorter); each chunk is the list of payload ranges it covers."""
    parts: list[Range] = []
    room = chunk_bytes
    for offset, nbytes in segments:
        while nbytes:
            take = min(room, nbytes)
            parts.append((offset, take))
            offset, nbytes, room = offset + take, nbytes - take, room - take
            if room == 0:
                yield parts
                parts, room = [], chunk_bytes
    if parts:
        yield parts


def push_nbytes(manifest_nbytes: int, segments: Sequence[Range], chunk_bytes: int) -> int:
    """Payload bytes of a replica_push frame: manifest, sent bytes, one digest per chunk."""
    sent = sum(n for _, n in segments)
    return manifest_nbytes + sent + DIGEST_BYTES * -(-sent // chunk_bytes)


# ----- the sender's connection -----------------------------------------------------------

def send_chunk(sock: socket.socket, windows: Sequence[memoryview], digest: bytes) -> None:
    """Send one chunk's parts, then its digest (the seam tests use to corrupt a chunk)."""
    for window in windows:
        sock.sendall(window)
    sock.sendall(digest)


class ReplicaLink:
    """One authenticated connection to a holder keeper, used by its sender thread only.
    ``abort`` (any thread) shuts it down so a blocked send or receive returns at once;
    an aborted or failed link is never reused."""

    def __init__(self, address: tuple[str, int], secret: bytes, job: str, generation: int,
                 timeout_s: float) -> None:
        self.address, self.generation = address, generation
        self.where = f"{address[0]}:{address[1]}"
        self._secret, self._job, self._timeout_s = secret, job, timeout_s
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.dead = False

    def open(self) -> None:
        """Connect and authenticate; PeerUnreachable or PeerRefused."""
        with io_errors(self.where, "connect"):
            sock = socket.create_connection(self.address, timeout=self._timeout_s)
        with self._lock:
            self._sock, dead = sock, self.dead
        if dead:
            self.close()
            raise PeerUnreachable(f"{self.where}: connection aborted")
        with io_errors(self.where, "handshake"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client_handshake(sock, self.where, self._secret, self._job, "replicator",
                         self.generation)

    def abort(self) -> None:
        """Shut the socket down from any thread (never blocks: callers hold locks)."""
        with self._lock:
            self.dead = True
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self._lock:
            self.dead = True
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def call(self, header: dict[str, Any], payload: bytes = b"") -> dict[str, Any]:
        """One request with a small payload; the reply header (remote errors raised)."""
        sock = self._live()
        self._send_header(sock, header, len(payload))
        with io_errors(self.where, f"send op={header['op']}"):
            sock.sendall(payload)
        return self._reply(sock, header["op"], self._timeout_s)

    def push(self, header: dict[str, Any], manifest: bytes, view: memoryview,
             segments: Sequence[Range], algo: str, check: Callable[[], None],
             first_timeout_s: float) -> dict[str, Any]:
        """Stream a replica_push frame (its header ``check`` added): manifest, then each
        chunk of ``segments`` of ``view`` followed by its digest (computed just before it
        is sent)."""
        sock, chunk_bytes = self._live(), header["chunk_bytes"]
        nbytes = push_nbytes(len(manifest), segments, chunk_bytes)
        header = {**header, "nbytes": nbytes}
        header["check"] = push_check(header, manifest)
        self._send_header(sock, header, nbytes)
        with io_errors(self.where, "send replica"):
            sock.sendall(manifest)
            sock.settimeout(first_timeout_s)  # the receiver may allocate its buffer first
            for parts in iter_chunks(segments, chunk_bytes):
                check()
                windows = [view[offset:offset + n] for offset, n in parts]
                try:
                    send_chunk(sock, windows, chunk_digest(windows, algo))
                finally:
                    for window in windows:
                        window.release()
                sock.settimeout(self._timeout_s)
        return self._reply(sock, "replica_push", self._timeout_s)

    def _live(self) -> socket.socket:
        with self._lock:
            sock = self._sock
        if sock is None or self.dead:
            raise PeerUnreachable(f"{self.where}: connection aborted")
        return sock

    def _send_header(self, sock: socket.socket, header: dict[str, Any], nbytes: int) -> None:
        body = json.dumps({**header, "nbytes": nbytes}, separators=(",", ":")).encode()
        if len(body) > MAX_HEADER_BYTES:
            raise FrameInvalid(f"{self.where}: header of {len(body)} bytes exceeds "
                               f"{MAX_HEADER_BYTES}")
        with io_errors(self.where, f"send op={header['op']}"):
            sock.settimeout(self._timeout_s)
            sock.sendall(_LEN.pack(len(body)) + body)

    def _reply(self, sock: socket.socket, op: str, timeout_s: float) -> dict[str, Any]:
        sock.settimeout(timeout_s)
        reply = recv_header(sock, where=self.where, max_payload=0)
        if reply is None:
            raise PeerUnreachable(f"{self.where}: connection closed before the reply to op={op}")
        raise_for_reply(reply, self.where)
        return reply
