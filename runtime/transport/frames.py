"""The wire protocol of phalanx's TCP messages: frames (4-byte big-endian header length,
a JSON object header of at most 1 MiB, then ``header["nbytes"]`` raw payload bytes), the
HMAC handshake, and how errors travel back to a client. Sockets are owned by the caller.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence, Union

import phalanx.configs.errors as _errors
from phalanx.configs.errors import ConfigError, FatalError, PeerUnreachable, PhalanxError

MAX_HEADER_BYTES = 1 << 20
DEFAULT_MAX_PAYLOAD = 64 << 30
DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_TIMEOUT_S = 10.0
NONCE_BYTES = 32
PROTOCOL = 1
_MAC_BYTES = hashlib.sha256().digest_size
_LEN = struct.Struct(">I")

Buffer = Union[bytes, bytearray, memoryview]  # or anything with the buffer protocol (mmap)
Payload = Union[Buffer, list[Buffer], tuple[Buffer, ...], None]
# Given the reply header, returns the buffers (summing to its nbytes) to receive into.
Sink = Callable[[dict], Sequence[memoryview]]


class FrameInvalid(FatalError):
    """A frame broke the protocol: header over 1 MiB or not a JSON object, payload over
    the limit, or a reply that does not fit the caller's buffer."""


class PeerRefused(FatalError):
    """The other end refused the handshake. ``code``: auth, job, generation, malformed,
    server-auth (the server could not prove it holds the secret)."""

    def __init__(self, address: str, reason: str, code: str = "refused") -> None:
        super().__init__(address, reason, code)
        self.address = address
        self.reason = reason
        self.code = code

    def __str__(self) -> str:
        return f"{self.address} refused the connection ({self.code}): {self.reason}"


class RemoteError(FatalError):
    """The peer failed a request with an error that has no local class."""

    def __init__(self, address: str, kind: str, message: str) -> None:
        super().__init__(address, kind, message)
        self.address = address
        self.kind = kind
        self.message = message

    def __str__(self) -> str:
        return f"{self.address} failed the request with {self.kind}: {self.message}"


_REMOTE_ERRORS: dict[str, type[PhalanxError]] = {}


def register_remote_error(cls: type[PhalanxError]) -> type[PhalanxError]:
    """Let a client re-raise ``cls`` when a server's handler raised it (by class name)."""
    _REMOTE_ERRORS[cls.__name__] = cls
    return cls


for _cls in list(vars(_errors).values()) + [FrameInvalid, PeerRefused, RemoteError]:
    if isinstance(_cls, type) and issubclass(_cls, PhalanxError):
        register_remote_error(_cls)


def error_reply(exc: PhalanxError) -> dict[str, Any]:
    """The reply header that carries ``exc`` to the client (constructor args as JSON)."""
    args = [a if isinstance(a, (str, int, float, bool, type(None))) else str(a) for a in exc.args]
    return {"ok": False, "error": type(exc).__name__, "message": str(exc), "args": args}


def raise_for_reply(header: dict[str, Any], where: str) -> None:
    """Raise the error an ``ok: false`` reply carries; registered classes are rebuilt."""
    if header.get("ok") is not False:
        return
    kind, message = str(header.get("error", "error")), str(header.get("message", ""))
    cls, args = _REMOTE_ERRORS.get(kind), header.get("args")
    if cls is not None and isinstance(args, list):
        try:
            exc = cls(*args)
        except TypeError:
            exc = None
        if exc is not None:
            raise exc
    raise RemoteError(where, kind, message)


@contextmanager
def io_errors(where: str, op: str) -> Iterator[None]:
    """Translate socket errors into PeerUnreachable naming ``where`` (host:port) and ``op``."""
    try:
        yield
    except TimeoutError as exc:
        raise PeerUnreachable(f"{where}: {op} timed out") from exc
    except OSError as exc:
        raise PeerUnreachable(f"{where}: {op} failed: {exc}") from exc


def as_parts(payload: Payload) -> list[memoryview]:
    """Flat byte views of a payload: one buffer (bytes, memoryview, mmap, ...) or a list or
    tuple of them. The caller releases the views."""
    if payload is None:
        return []
    items = list(payload) if isinstance(payload, (list, tuple)) else [payload]
    parts = []
    for item in items:
        view = memoryview(item)
        parts.append(view if view.format == "B" and view.ndim == 1 else view.cast("B"))
    return parts


def send_frame(sock: socket.socket, header: dict[str, Any], payload: Payload = None, *,
               where: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
    """Send one frame; ``header["nbytes"]`` is set to the payload size (reserved key).

    The payload goes out in ``chunk_bytes`` slices of the caller's buffers (no join).
    Raises FrameInvalid (header too large) or PeerUnreachable.
    """
    parts = as_parts(payload)
    try:
        nbytes = sum(p.nbytes for p in parts)
        body = json.dumps({**header, "nbytes": nbytes}, separators=(",", ":")).encode()
        if len(body) > MAX_HEADER_BYTES:
            raise FrameInvalid(f"{where}: header of {len(body)} bytes exceeds {MAX_HEADER_BYTES}")
        with io_errors(where, f"send op={header.get('op', '-')}"):
            sock.sendall(_LEN.pack(len(body)) + body)
            for part in parts:
                for start in range(0, part.nbytes, chunk_bytes):
                    with part[start:start + chunk_bytes] as chunk:
                        sock.sendall(chunk)
    finally:
        for part in parts:
            part.release()


def recv_exact_into(sock: socket.socket, view: memoryview, *, where: str, op: str,
                    chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
    """Fill ``view`` from the socket; a peer that closes early raises PeerUnreachable."""
    got, total = 0, view.nbytes
    with io_errors(where, op):
        while got < total:
            with view[got:got + min(chunk_bytes, total - got)] as window:
                n = sock.recv_into(window)
            if n == 0:
                raise PeerUnreachable(f"{where}: connection closed during {op} "
                                      f"after {got} of {total} bytes")
            got += n


def recv_header(sock: socket.socket, *, where: str, max_payload: int,
                idle_timeout_s: float | None = None) -> dict[str, Any] | None:
    """Receive one frame header; None if the peer closed cleanly between frames.

    Sizes are checked before anything is allocated: a header over MAX_HEADER_BYTES or an
    ``nbytes`` over ``max_payload`` raises FrameInvalid. ``idle_timeout_s`` applies to the
    wait for the first byte only.
    """
    prefix = bytearray(_LEN.size)
    io_timeout = sock.gettimeout()
    if idle_timeout_s is not None:
        sock.settimeout(idle_timeout_s)
    with io_errors(where, "recv header"):
        first = sock.recv_into(prefix)
    sock.settimeout(io_timeout)
    if first == 0:
        return None
    with memoryview(prefix) as rest:
        recv_exact_into(sock, rest[first:], where=where, op="recv header")
    (length,) = _LEN.unpack(prefix)
    if length > MAX_HEADER_BYTES:
        raise FrameInvalid(f"{where}: header of {length} bytes exceeds {MAX_HEADER_BYTES}")
    body = bytearray(length)
    with memoryview(body) as view:
        recv_exact_into(sock, view, where=where, op="recv header")
    try:
        header = json.loads(body.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise FrameInvalid(f"{where}: header is not UTF-8 JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise FrameInvalid(f"{where}: header is a {type(header).__name__}, not an object")
    nbytes = header.get("nbytes", 0)
    if type(nbytes) is not int or nbytes < 0:
        raise FrameInvalid(f"{where}: nbytes {nbytes!r} is not a non-negative integer")
    if nbytes > max_payload:
        raise FrameInvalid(f"{where}: payload of {nbytes} bytes exceeds the limit {max_payload}")
    header.setdefault("nbytes", 0)
    return header


class IncomingPayload:
    """The payload after a received header, read in order by the one thread that owns
    the connection: ``recv_into`` a caller's buffer (e.g. an mmap) or ``read``."""

    def __init__(self, sock: socket.socket, nbytes: int, where: str,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.nbytes = nbytes
        self.remaining = nbytes
        self._sock = sock
        self._where = where
        self._chunk = chunk_bytes

    def recv_into(self, view: memoryview) -> None:
        """Fill all of ``view`` with the next ``len(view)`` payload bytes."""
        if view.nbytes > self.remaining:
            raise FrameInvalid(f"{self._where}: asked for {view.nbytes} payload bytes, "
                               f"{self.remaining} remain")
        recv_exact_into(self._sock, view, where=self._where, op="recv payload",
                        chunk_bytes=self._chunk)
        self.remaining -= view.nbytes

    def read(self, nbytes: int | None = None) -> bytearray:
        """The next ``nbytes`` (default: all remaining) payload bytes in a new buffer."""
        buf = bytearray(self.remaining if nbytes is None else nbytes)
        with memoryview(buf) as view:
            self.recv_into(view)
        return buf

    def drain(self) -> None:
        """Discard what the handler did not read, so the next frame starts in sync."""
        scratch = bytearray(min(self.remaining, self._chunk))
        with memoryview(scratch) as view:
            while self.remaining:
                with view[:min(self.remaining, len(scratch))] as window:
                    self.recv_into(window)


@dataclass(frozen=True)
class PeerInfo:
    """Who is on the other end of an authenticated connection (from its handshake)."""

    job: str
    role: str
    generation: int
    address: str


def check_secret(secret: bytes) -> bytes:
    """The job secret as bytes; ConfigError if it is empty."""
    if not isinstance(secret, (bytes, bytearray)) or not secret:
        raise ConfigError("security.secret_file", "the job secret is empty",
                          "write a random secret (e.g. 32 bytes) into the secret file")
    return bytes(secret)


def client_mac(secret: bytes, nonce: bytes, job: str, role: str, generation: int) -> bytes:
    """HMAC-SHA256 a client sends: over a label, the server's nonce, job, role, generation."""
    fields = b"\0".join([job.encode(), role.encode(), str(generation).encode()])
    return hmac.new(secret, b"phalanx-client\0" + nonce + fields, hashlib.sha256).digest()


def server_mac(secret: bytes, cnonce: bytes, job: str) -> bytes:
    """HMAC-SHA256 a server returns to prove it holds the secret too (mutual auth)."""
    return hmac.new(secret, b"phalanx-server\0" + cnonce + job.encode(), hashlib.sha256).digest()


def _hex(value: Any, nbytes: int) -> bytes | None:
    """``value`` decoded from hex if it is a string of exactly ``nbytes`` bytes, else None."""
    if not isinstance(value, str) or len(value) != 2 * nbytes:
        return None
    try:
        return bytes.fromhex(value)
    except ValueError:
        return None


def server_handshake(sock: socket.socket, where: str, secret: bytes, job: str,
                     generation_check: Callable[[int], bool] | None,
                     ) -> tuple[PeerInfo | None, str, str]:
    """Server side: send a nonce, check the client's answer, reply ok or refused.

    Returns (peer, "", "") when accepted, (None, code, reason) when refused, and
    (None, "closed", ...) when the client left first.
    """
    nonce = os.urandom(NONCE_BYTES)
    send_frame(sock, {"op": "hello", "ok": True, "proto": PROTOCOL, "nonce": nonce.hex()},
               where=where)
    auth = recv_header(sock, where=where, max_payload=0)
    if auth is None:
        return None, "closed", "the client closed the connection during the handshake"
    peer, code, reason = _verify(auth, nonce, where, secret, job, generation_check)
    if peer is None:
        send_frame(sock, {"ok": False, "code": code, "reason": reason}, where=where)
        return None, code, reason
    cnonce = _hex(auth["cnonce"], NONCE_BYTES) or b""
    send_frame(sock, {"ok": True, "mac": server_mac(secret, cnonce, job).hex()}, where=where)
    return peer, "", ""


def _verify(auth: dict[str, Any], nonce: bytes, where: str, secret: bytes, served_job: str,
            generation_check: Callable[[int], bool] | None) -> tuple[PeerInfo | None, str, str]:
    job, role, gen = auth.get("job"), auth.get("role"), auth.get("generation")
    mac, cnonce = _hex(auth.get("mac"), _MAC_BYTES), _hex(auth.get("cnonce"), NONCE_BYTES)
    if not (isinstance(job, str) and isinstance(role, str) and type(gen) is int
            and mac and cnonce):
        return None, "malformed", "the handshake needs job, role, generation, mac, cnonce"
    if not hmac.compare_digest(mac, client_mac(secret, nonce, job, role, gen)):
        return None, "auth", "authentication failed: the job secret differs"
    if job != served_job:
        return None, "job", f"job {job!r} is not served here"
    if generation_check is not None and not generation_check(gen):
        return None, "generation", f"generation {gen} is stale"
    return PeerInfo(job, role, gen, where), "", ""


def client_handshake(sock: socket.socket, where: str, secret: bytes, job: str, role: str,
                     generation: int) -> None:
    """Client side: answer the server's nonce and check its proof.

    Raises PeerRefused (refused, or the server lacks the secret) or PeerUnreachable
    (closed, timed out, or busy: too many connections, which may pass).
    """
    hello = recv_header(sock, where=where, max_payload=0)
    if hello is None:
        raise PeerUnreachable(f"{where}: closed the connection before the handshake")
    if hello.get("ok") is False and hello.get("code") == "busy":
        raise PeerUnreachable(f"{where}: handshake refused: {hello.get('reason')}")
    nonce = _hex(hello.get("nonce"), NONCE_BYTES)
    if hello.get("ok") is not True or nonce is None or hello.get("proto") != PROTOCOL:
        raise PeerRefused(where, f"unexpected hello {hello!r}", "malformed")
    cnonce = os.urandom(NONCE_BYTES)
    mac = client_mac(secret, nonce, job, role, generation)
    send_frame(sock, {"op": "auth", "job": job, "role": role, "generation": generation,
                      "mac": mac.hex(), "cnonce": cnonce.hex()}, where=where)
    answer = recv_header(sock, where=where, max_payload=0)
    if answer is None:
        raise PeerUnreachable(f"{where}: closed the connection during the handshake")
    if answer.get("ok") is not True:
        raise PeerRefused(where, str(answer.get("reason", answer.get("message", ""))),
                          str(answer.get("code", answer.get("error", "refused"))))
    proof = _hex(answer.get("mac"), _MAC_BYTES)
    if proof is None or not hmac.compare_digest(proof, server_mac(secret, cnonce, job)):
        raise PeerRefused(where, "the server could not prove it holds the job secret",
                          "server-auth")
