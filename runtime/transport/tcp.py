"""Authenticated TCP messages between workers, keepers and peers: the threaded
``FrameServer`` and the ``FrameClient`` over the wire protocol of ``phalanx.runtime.transport.frames``
(re-exported here, so callers import this module only).
"""
from __future__ import annotations

import contextlib
import logging
import socket
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from phalanx.configs.errors import PeerUnreachable, PhalanxError, ServiceStartError
from phalanx.runtime.transport.frames import (DEFAULT_CHUNK_BYTES, DEFAULT_MAX_PAYLOAD,
                                              DEFAULT_TIMEOUT_S, MAX_HEADER_BYTES, Buffer,
                                              FrameInvalid, IncomingPayload, Payload, PeerInfo,
                                              PeerRefused, RemoteError, Sink, check_secret,
                                              client_handshake, error_reply, io_errors,
                                              raise_for_reply, recv_exact_into, recv_header,
                                              register_remote_error, send_frame, server_handshake)

log = logging.getLogger(__name__)


@dataclass
class Request:
    """One received frame; read ``payload`` (``nbytes`` bytes) before replying, or not:
    the server discards what is left."""

    peer: PeerInfo
    header: dict[str, Any]
    payload: IncomingPayload
    # shared by every request of one connection; callables in scope["on_close"] run once
    # the connection ends, however it ends (e.g. releasing what a peer borrowed)
    scope: dict[str, Any] = field(default_factory=dict)


@dataclass
class Reply:
    """What a handler answers. ``on_done`` runs after the payload was sent or failed
    (release views, unpin buffers)."""

    header: dict[str, Any]
    payload: Payload = None
    on_done: Callable[[], None] | None = None


Handler = Callable[[Request], Reply]
GenerationCheck = Callable[[int], bool]


class FrameServer:
    """A threaded server: one accept thread and one thread per connection (at most
    ``max_connections``; more are refused as busy). ``handler`` runs in the connection's
    thread; a PhalanxError it raises goes back as an error reply the client re-raises.
    ``generation_check(generation) -> bool`` refuses stale clients at the handshake.
    """

    def __init__(self, bind_host: str = "127.0.0.1", port: int = 0, *, secret: bytes,
                 job: str, handler: Handler, generation_check: GenerationCheck | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, idle_timeout_s: float = 600.0,
                 max_connections: int = 64, max_payload: int = DEFAULT_MAX_PAYLOAD,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, name: str = "frames") -> None:
        self._bind = (bind_host, port)
        self._secret = check_secret(secret)
        self._job = job
        self._handler = handler
        self._generation_check = generation_check
        self._timeout_s = timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._max_connections = max_connections
        self._max_payload = max_payload
        self._chunk = chunk_bytes
        self._name = name
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._sock: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._address: tuple[str, int] | None = None

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) actually bound; valid after ``start()``."""
        if self._address is None:
            raise RuntimeError(f"{self._name} server is not started")
        return self._address

    def start(self) -> "FrameServer":
        """Bind and listen on ``bind_host`` only; raises ServiceStartError if bind fails."""
        host, port = self._bind
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(128)
        except OSError as exc:
            sock.close()
            raise ServiceStartError(f"{self._name}: cannot listen on {host}:{port}: {exc}") from exc
        sock.settimeout(0.5)
        self._sock, self._address = sock, sock.getsockname()[:2]
        self._accept_thread = threading.Thread(target=self._accept_loop, daemon=True,
                                               name=f"{self._name}-accept")
        self._accept_thread.start()
        log.info("transport.listening name=%s address=%s:%d", self._name, *self._address)
        return self

    def close(self) -> None:
        """Stop accepting, cut every connection and join every thread (idempotent)."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        self._stopping.set()
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=self._timeout_s)
        with self._lock:
            conns = list(self._conns.items())
        for conn, _ in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for _, thread in conns:
            thread.join(timeout=self._timeout_s + 1.0)
        stuck = [t.name for _, t in conns if t.is_alive()]
        if stuck:
            log.warning("transport.close_stuck name=%s threads=%s", self._name, stuck)
        log.info("transport.closed name=%s connections=%d", self._name, len(conns))

    def __enter__(self) -> "FrameServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept_loop(self) -> None:
        sock = self._sock
        while sock is not None and not self._stopping.is_set():
            try:
                conn, addr = sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if not self._stopping.is_set():
                    log.warning("transport.accept_failed name=%s error=%s", self._name, exc)
                    self._stopping.wait(0.1)
                continue
            self._admit(conn, f"{addr[0]}:{addr[1]}")

    def _admit(self, conn: socket.socket, where: str) -> None:
        with self._lock:
            busy = self._stopping.is_set() or len(self._conns) >= self._max_connections
            if not busy:
                thread = threading.Thread(target=self._serve, args=(conn, where), daemon=True,
                                          name=f"{self._name}-conn-{where}")
                self._conns[conn] = thread
                thread.start()
        if busy:
            log.warning("transport.busy name=%s peer=%s limit=%d", self._name, where,
                        self._max_connections)
            conn.settimeout(1.0)
            with contextlib.suppress(PhalanxError):
                send_frame(conn, {"op": "hello", "ok": False, "code": "busy", "reason":
                                  f"server holds {self._max_connections} connections"}, where=where)
            conn.close()

    def _serve(self, conn: socket.socket, where: str) -> None:
        """Connection thread: handshake, then request/reply until the peer or close() ends it."""
        scope: dict[str, Any] = {}
        try:
            conn.settimeout(self._timeout_s)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer = self._handshake(conn, where)
            while peer is not None and not self._stopping.is_set():
                header = recv_header(conn, where=where, max_payload=self._max_payload,
                                     idle_timeout_s=self._idle_timeout_s)
                if header is None:
                    break
                self._serve_one(conn, where, peer, header, scope)
        except FrameInvalid as exc:
            log.warning("transport.frame_invalid name=%s peer=%s error=%s", self._name, where, exc)
            with contextlib.suppress(PhalanxError):  # "closing": the client must reconnect
                send_frame(conn, {**error_reply(exc), "closing": True}, where=where)
        except PeerUnreachable as exc:
            log.debug("transport.conn_lost name=%s peer=%s error=%s", self._name, where, exc)
        except Exception:  # thread boundary: log, drop this connection, keep serving others
            log.exception("transport.conn_crashed name=%s peer=%s", self._name, where)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()
            for closer in scope.get("on_close", []):
                try:
                    closer()
                except Exception:  # one failed release must not skip the others
                    log.exception("transport.on_close_failed name=%s peer=%s", self._name, where)

    def _serve_one(self, conn: socket.socket, where: str, peer: PeerInfo,
                   header: dict[str, Any], scope: dict[str, Any]) -> None:
        incoming = IncomingPayload(conn, header["nbytes"], where, self._chunk)
        reply = self._dispatch(Request(peer, header, incoming, scope))
        try:
            incoming.drain()
            send_frame(conn, {"ok": True, **reply.header}, reply.payload, where=where,
                       chunk_bytes=self._chunk)
        finally:
            if reply.on_done is not None:
                reply.on_done()

    def _dispatch(self, request: Request) -> Reply:
        op, where = request.header.get("op"), request.peer.address
        try:
            return self._handler(request)
        except PhalanxError as exc:
            log.info("transport.request_failed name=%s peer=%s op=%s error=%s: %s",
                     self._name, where, op, type(exc).__name__, exc)
            return Reply(error_reply(exc))
        except Exception as exc:  # a handler bug answers the client instead of hanging it
            log.exception("transport.handler_crashed name=%s peer=%s op=%s", self._name, where, op)
            return Reply(error_reply(RemoteError(where, type(exc).__name__, str(exc))))

    def _handshake(self, conn: socket.socket, where: str) -> PeerInfo | None:
        peer, code, reason = server_handshake(conn, where, self._secret, self._job,
                                              self._generation_check)
        if peer is None:
            log.warning("transport.refused name=%s peer=%s code=%s reason=%s",
                        self._name, where, code, reason)
        else:
            log.debug("transport.accepted name=%s peer=%s role=%s generation=%d",
                      self._name, where, peer.role, peer.generation)
        return peer


class FrameClient:
    """One authenticated connection to a FrameServer, opened on first use and reopened
    after any failure (never retried blindly). Requests are serialized, so one client
    may be shared by threads. Raises PeerUnreachable (naming host:port and the operation),
    PeerRefused, FrameInvalid, or the error class the server's handler raised.
    """

    def __init__(self, host: str, port: int, secret: bytes, job: str, role: str,
                 timeout_s: float = DEFAULT_TIMEOUT_S, *, generation: int = 0,
                 max_payload: int = DEFAULT_MAX_PAYLOAD,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.host, self.port = host, port
        self._secret = check_secret(secret)
        self._job, self._role = job, role
        self._timeout_s = timeout_s
        self._generation = generation
        self._max_payload = max_payload
        self._chunk = chunk_bytes
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._pending: str | None = None   # the op of a ``send`` whose reply is unread
        self._outcome: dict[str, Any] | BaseException | None = None   # its reply, once read

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def generation(self) -> int:
        return self._generation

    @generation.setter
    def generation(self, value: int) -> None:
        """A new generation reconnects, so the server checks it at the handshake."""
        with self._lock:
            if value != self._generation:
                self._generation = value
                self._drop()

    def connect(self) -> None:
        """Open and authenticate the connection now (otherwise done by the first request)."""
        with self._lock:
            self._ensure()

    def request(self, header: dict[str, Any], payload: Payload = None, *,
                reply_timeout_s: float | None = None) -> tuple[dict[str, Any], bytearray | None]:
        """Send one frame, return the reply header and payload (None if it has none)."""
        return self._exchange(header, payload, None, reply_timeout_s)

    def request_into(self, header: dict[str, Any], dest: Buffer | Sink, payload: Payload = None,
                     *, reply_timeout_s: float | None = None) -> dict[str, Any]:
        """Like ``request`` but the reply payload lands in ``dest`` (a writable buffer such
        as an mmap, filled from its start) or in the buffers a Sink returns for the reply
        header. FrameInvalid if it does not fit (the connection is then dropped)."""
        made: list[memoryview] = []

        def fit(reply: dict[str, Any]) -> list[memoryview]:
            whole = memoryview(dest).cast("B")  # type: ignore[arg-type]
            made.append(whole)
            if reply["nbytes"] > whole.nbytes:
                raise FrameInvalid(f"{self.address}: reply of {reply['nbytes']} bytes does not "
                                   f"fit the destination of {whole.nbytes} bytes")
            made.append(whole[:reply["nbytes"]])
            return made[1:]

        try:
            reply, _ = self._exchange(header, payload, dest if callable(dest) else fit,
                                      reply_timeout_s)
        finally:
            for view in reversed(made):
                view.release()
        return reply

    def send(self, header: dict[str, Any], payload: Payload = None) -> None:
        """Send one frame without waiting for its reply (one such frame at a time): the
        reply is read by ``collect``, or before the next request's frame goes out, so the
        connection never holds an unread reply when a new frame is sent."""
        with self._lock:
            self._read_pending()
            sock = self._ensure()
            try:
                send_frame(sock, header, payload, where=self.address, chunk_bytes=self._chunk)
            except BaseException:
                self._drop()
                raise
            self._pending, self._outcome = header.get("op", "-"), None

    def collect(self) -> dict[str, Any] | None:
        """The reply header of the last ``send``, its payload dropped (waits for it; raises
        its error, or PeerUnreachable when the connection ended first); None when nothing
        was sent since the last ``collect``."""
        with self._lock:
            self._read_pending()
            outcome, self._outcome = self._outcome, None
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def _read_pending(self) -> None:
        """With the lock held: read the reply a ``send`` is owed into ``_outcome``."""
        op, self._pending = self._pending, None
        if op is None:
            return
        sock, where = self._sock, self.address
        try:
            if sock is None:
                raise PeerUnreachable(f"{where}: connection closed before the reply to op={op}")
            reply, _ = self._read_reply(sock, op, None)     # (a payload is read and dropped)
        except BaseException as exc:
            self._drop()
            self._outcome = exc
            return
        try:
            raise_for_reply(reply, where)
        except BaseException as exc:   # the stream is whole: only the op failed
            self._outcome = exc
            return
        self._outcome = reply

    def close(self) -> None:
        with self._lock:
            self._drop()

    def __enter__(self) -> "FrameClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _exchange(self, header: dict[str, Any], payload: Payload, sink: Sink | None,
                  reply_timeout_s: float | None) -> tuple[dict[str, Any], bytearray | None]:
        op, where = header.get("op", "-"), self.address
        with self._lock:
            self._read_pending()
            sock = self._ensure()
            try:
                send_frame(sock, header, payload, where=where, chunk_bytes=self._chunk)
                sock.settimeout(reply_timeout_s or self._timeout_s)
                reply, data = self._read_reply(sock, op, sink)
            except BaseException:
                self._drop()  # the stream may be mid-frame: never reuse it
                raise
        raise_for_reply(reply, where)
        return reply, data

    def _read_reply(self, sock: socket.socket, op: str, sink: Sink | None
                    ) -> tuple[dict[str, Any], bytearray | None]:
        """With the lock held: the reply header to ``op`` and its payload (into ``sink``);
        raises what breaks the stream (the caller drops the connection), not the op's own
        error (``raise_for_reply``)."""
        where = self.address
        reply = recv_header(sock, where=where, max_payload=self._max_payload)
        sock.settimeout(self._timeout_s)
        if reply is None:
            raise PeerUnreachable(f"{where}: connection closed before the reply to op={op}")
        data = None
        if reply.get("ok") is not False:
            data = self._receive(sock, reply, sink, op)
        elif reply["nbytes"]:
            raise FrameInvalid(f"{where}: error reply to op={op} carries a payload")
        if reply.get("closing"):
            self._drop()
        return reply, data

    def _receive(self, sock: socket.socket, reply: dict[str, Any], sink: Sink | None,
                 op: str) -> bytearray | None:
        nbytes, where = reply["nbytes"], self.address
        if sink is None:
            if nbytes == 0:
                return None
            buf = bytearray(nbytes)
            with memoryview(buf) as view:
                recv_exact_into(sock, view, where=where, op=f"recv payload op={op}",
                                chunk_bytes=self._chunk)
            return buf
        views = list(sink(reply))
        if sum(v.nbytes for v in views) != nbytes:
            raise FrameInvalid(f"{where}: reply to op={op} carries {nbytes} bytes but the "
                               f"destination buffers take {sum(v.nbytes for v in views)}")
        for view in views:
            recv_exact_into(sock, view, where=where, op=f"recv payload op={op}",
                            chunk_bytes=self._chunk)
        return None

    def _ensure(self) -> socket.socket:
        if self._sock is not None and not _still_open(self._sock):
            self._drop()
        if self._sock is None:
            self._sock = self._open()
        return self._sock

    def _open(self) -> socket.socket:
        with io_errors(self.address, "connect"):
            sock = socket.create_connection((self.host, self.port), timeout=self._timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client_handshake(sock, self.address, self._secret, self._job, self._role,
                             self._generation)
        except BaseException:
            sock.close()
            raise
        return sock

    def _drop(self) -> None:
        if self._pending is not None:
            self._outcome = PeerUnreachable(f"{self.address}: connection closed before the "
                                            f"reply to op={self._pending}")
            self._pending = None
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


def _still_open(sock: socket.socket) -> bool:
    """False if the server closed this idle connection (EOF or junk waiting to be read)."""
    timeout = sock.gettimeout()
    try:
        sock.setblocking(False)
        waiting = sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            sock.settimeout(timeout)
    return not waiting


__all__ = [
    "MAX_HEADER_BYTES", "DEFAULT_MAX_PAYLOAD", "DEFAULT_CHUNK_BYTES", "DEFAULT_TIMEOUT_S",
    "PeerRefused", "FrameInvalid", "RemoteError", "PeerInfo", "Request",
    "Reply", "Handler", "GenerationCheck", "Sink", "Payload", "FrameServer", "FrameClient",
    "IncomingPayload", "register_remote_error", "send_frame", "recv_header", "recv_exact_into",
]
