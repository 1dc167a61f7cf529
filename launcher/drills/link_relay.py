"""One connection through a ``phalanx.launcher.drills.link_proxy.LinkProxy``: the client's socket, the
target's, and per direction a reader that stamps each chunk with when it may leave (the
proxy's delay) and may flip a bit in it, and a writer that sends it then."""
from __future__ import annotations

import contextlib
import logging
import queue
import socket
import struct
import threading
import time
from typing import Any, Protocol

log = logging.getLogger(__name__)

_EOF = None
_POLL_S = 0.2          # how often a blocked queue put/get looks at the abort flag
_LINGER_RESET = struct.pack("ii", 1, 0)   # SO_LINGER on, 0 s: close() sends RST


class RelayOwner(Protocol):
    """What a relay needs of its proxy (every method thread-safe)."""

    name: str
    target: tuple[str, int]
    chunk_bytes: int
    queue_chunks: int
    connect_timeout_s: float

    def tamper(self, side: str, link: int, offset: int, data: bytes) -> bytes: ...
    def delay_for(self, side: str) -> float: ...
    def count(self, side: str, nbytes: int) -> None: ...
    def start_pipes(self, relay: "Relay") -> bool: ...
    def forget(self, relay: "Relay") -> None: ...


def reset(sock: socket.socket) -> None:
    """Close with RST instead of FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    sock.close()


class Relay:
    """One proxied connection. Its four threads (``open`` runs the forward reader) share
    the sockets; the last one to finish closes them."""

    def __init__(self, proxy: RelayOwner, index: int, client: socket.socket) -> None:
        self.proxy, self.index, self.client = proxy, index, client
        self.upstream: socket.socket | None = None
        self.aborted = threading.Event()
        self._reset = False
        self._lock = threading.Lock()
        self._running = 4
        self.pipes: tuple[_Pipe, _Pipe] = (_Pipe(self, "forward"), _Pipe(self, "backward"))

    def open(self) -> None:
        """Thread: connect to the target, start the other threads, then read forward."""
        try:
            self.upstream = socket.create_connection(self.proxy.target,
                                                     timeout=self.proxy.connect_timeout_s)
            self.upstream.settimeout(None)
        except OSError as exc:
            log.info("link_proxy.connect_failed name=%s target=%s:%d error=%s",
                     self.proxy.name, *self.proxy.target, exc)
            self._alone()
            return
        for sock in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if not self.proxy.start_pipes(self):
            self._alone()
            return
        self.pipes[0].read_loop()

    def _alone(self) -> None:
        """The link ends before its other threads started: reset the client now."""
        with self._lock:
            self._reset, self._running = True, 1
        self.done()

    def ends(self, side: str) -> tuple[socket.socket, socket.socket]:
        assert self.upstream is not None
        return (self.client, self.upstream) if side == "forward" else (self.upstream, self.client)

    def abort(self, hard: bool = False) -> None:
        """Stop both directions now (any thread); ``hard`` closes with RST."""
        with self._lock:
            self._reset = self._reset or hard
        self.aborted.set()
        for sock in (self.client, self.upstream):
            if sock is not None:
                if hard:
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def done(self) -> None:
        """A thread of this link finished; the last one closes the sockets."""
        with self._lock:
            self._running -= 1
            last, hard = self._running == 0, self._reset
        if not last:
            return
        for sock in (self.client, self.upstream):
            if sock is not None:
                reset(sock) if hard else sock.close()
        self.proxy.forget(self)


class _Pipe:
    """One direction of a link: the reader stamps each chunk with when it may leave,
    the writer sends it then (a bounded queue between them)."""

    def __init__(self, link: Relay, side: str) -> None:
        self.link, self.side = link, side
        self.queue: queue.Queue = queue.Queue(maxsize=link.proxy.queue_chunks)

    def read_loop(self) -> None:
        proxy, offset = self.link.proxy, 0
        src, _ = self.link.ends(self.side)
        try:
            while not self.link.aborted.is_set():
                data = src.recv(proxy.chunk_bytes)
                if not data:
                    break
                data = proxy.tamper(self.side, self.link.index, offset, data)
                offset += len(data)
                if not self._put((time.monotonic() + proxy.delay_for(self.side), data)):
                    return
            self._put(_EOF)
        except OSError:
            self.link.abort()
        finally:
            self.link.done()

    def write_loop(self) -> None:
        _, dst = self.link.ends(self.side)
        try:
            while True:
                item = self._get()
                if item is _EOF:
                    with contextlib.suppress(OSError):
                        dst.shutdown(socket.SHUT_WR)   # pass the half-close on
                    return
                due, data = item
                wait = due - time.monotonic()
                if wait > 0 and self.link.aborted.wait(wait):
                    return
                dst.sendall(data)
                self.link.proxy.count(self.side, len(data))
        except (OSError, _Aborted):
            self.link.abort()
        finally:
            self.link.done()

    def _put(self, item: Any) -> bool:
        while not self.link.aborted.is_set():
            try:
                self.queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _get(self) -> Any:
        while True:
            try:
                return self.queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self.link.aborted.is_set():
                    raise _Aborted() from None


class _Aborted(Exception):
    """The link was aborted while a writer waited (never leaves the writer thread)."""
