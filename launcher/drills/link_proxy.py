"""A TCP proxy for drills whose link can be changed while it runs: it forwards connections
from a loopback port to a target and can delay, bit-flip, refuse or reset the traffic. The
mechanism behind the ``slow_link``, ``corrupt_payload`` and ``s3_outage`` faults."""
from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from phalanx.configs.errors import ServiceStartError
from phalanx.launcher.drills.link_relay import Relay, reset

log = logging.getLogger(__name__)

__all__ = ["LinkProxy", "DIRECTIONS"]

# "forward": client -> target (what the proxied service receives); "backward": its replies
DIRECTIONS = ("forward", "backward", "both")
_REBIND_WAIT_S = 3.0   # how long accept() tries to bind the same port again


@dataclass
class _Corruption:
    """Bit flips still to make in one direction (under the proxy's lock)."""

    remaining: int
    skip: int | None         # bytes still to pass untouched before the first flip
    min_chunk_bytes: int
    mask: int


class LinkProxy:
    """Forwards every connection to ``host:port`` (0: a free port) to ``target``, with one
    reader and one writer thread per direction and a queue of at most ``queue_chunks``
    received chunks between them (``chunk_bytes`` each at most).

    ``set_delay``: each chunk leaves ``delay_s`` after it arrived (latency: chunks still
    pipeline, so throughput stays up to queue_chunks * chunk_bytes / delay_s). ``corrupt``:
    one bit flipped in each of the next chunks. ``refuse``: the port stops listening (new
    connections get ECONNREFUSED) and open connections are reset; ``accept`` (or the
    ``for_s`` timer) listens on the same port again. Every method is thread-safe; the
    constructor does no I/O. Raises ServiceStartError when the port cannot be bound.
    """

    def __init__(self, target: tuple[str, int], *, host: str = "127.0.0.1", port: int = 0,
                 name: str = "link", chunk_bytes: int = 64 << 10, queue_chunks: int = 64,
                 connect_timeout_s: float = 5.0) -> None:
        if chunk_bytes < 1 or queue_chunks < 1 or connect_timeout_s <= 0:
            raise ValueError("chunk_bytes, queue_chunks and connect_timeout_s must be positive")
        self.target = (str(target[0]), int(target[1]))
        self.name, self._host, self._port = name, host, port
        self.chunk_bytes, self.queue_chunks = chunk_bytes, queue_chunks
        self.connect_timeout_s = connect_timeout_s
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._links: set[Relay] = set()
        self._ids = itertools.count(1)
        self._delay = {"forward": 0.0, "backward": 0.0}
        self._corruption: dict[str, _Corruption] = {}
        self._reopen: threading.Timer | None = None
        self._started = self._closed = False
        self._stats = {"connections": 0, "refused_periods": 0, "resets": 0,
                       "bytes_forward": 0, "bytes_backward": 0, "chunks_corrupted": 0}
        self._flips: list[dict[str, Any]] = []

    # ----- lifecycle ---------------------------------------------------------------------

    def start(self) -> "LinkProxy":
        """Listen and serve. Raises RuntimeError when started twice, ServiceStartError."""
        with self._lock:
            if self._started:
                raise RuntimeError(f"link proxy {self.name} started twice")
            self._started = True
            self._listen()
        log.info("link_proxy.started name=%s address=%s:%d target=%s:%d", self.name,
                 *self.address, *self.target)
        return self

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) clients connect to; the same after refuse/accept."""
        if not self._started:
            raise RuntimeError(f"link proxy {self.name} is not started")
        return self._host, self._port

    def close(self) -> None:
        """Stop listening, reset every connection, join the threads. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._reopen is not None:
                self._reopen.cancel()
            self._stop_listening()
            links, threads = list(self._links), list(self._threads)
        for link in links:
            link.abort(hard=True)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(2.0)
        log.info("link_proxy.closed name=%s stats=%s", self.name, self.stats())

    def __enter__(self) -> "LinkProxy":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- live behaviour ------------------------------------------------------------------

    @property
    def delay_s(self) -> float:
        """The delay now added to forward chunks."""
        with self._lock:
            return self._delay["forward"]

    @delay_s.setter
    def delay_s(self, seconds: float) -> None:
        self.set_delay(seconds, "forward")

    def set_delay(self, seconds: float, direction: str = "forward") -> None:
        """Delay each chunk received from now on by ``seconds`` in ``direction`` ("forward",
        "backward" or "both"; the other direction is set to 0 unless "both")."""
        if seconds < 0:
            raise ValueError(f"delay {seconds} s is negative")
        sides = _sides(direction)
        with self._lock:
            self._delay = {side: (float(seconds) if side in sides else 0.0)
                           for side in self._delay}
        log.info("link_proxy.delay name=%s delay_s=%.3f direction=%s", self.name, seconds,
                 direction)

    def corrupt(self, count: int = 1, direction: str = "forward", *,
                skip_bytes: int | None = None, min_chunk_bytes: int = 0, bit: int = 4) -> None:
        """Flip bit ``bit`` of one byte in each of the next ``count`` chunks (as received,
        up to chunk_bytes) in ``direction``: the middle byte of a chunk of at least
        ``min_chunk_bytes``; with ``skip_bytes``, first the byte that follows the next
        ``skip_bytes`` bytes (counted over every connection in that direction), then the
        middle of later chunks."""
        if count < 0 or (skip_bytes is not None and skip_bytes < 0) or not 0 <= bit < 8:
            raise ValueError("count and skip_bytes must be >= 0, bit in 0..7")
        with self._lock:
            for side in _sides(direction):
                self._corruption[side] = _Corruption(count, skip_bytes, min_chunk_bytes,
                                                     1 << bit)
        log.info("link_proxy.corrupt name=%s count=%d direction=%s skip_bytes=%s", self.name,
                 count, direction, skip_bytes)

    def refuse(self, for_s: float | None = None) -> None:
        """Close the listening port (connects get ECONNREFUSED) and reset every open
        connection; listen again on the same port after ``for_s`` (None: at ``accept``)."""
        with self._lock:
            if self._closed or not self._started:
                raise RuntimeError(f"link proxy {self.name} is not running")
            if self._reopen is not None:
                self._reopen.cancel()
                self._reopen = None
            if self._listener is not None:
                self._stats["refused_periods"] += 1
            self._stop_listening()
            links = list(self._links)
            self._stats["resets"] += len(links)
            if for_s is not None:
                self._reopen = threading.Timer(for_s, self._reopen_quietly)
                self._reopen.name, self._reopen.daemon = f"link-{self.name}-reopen", True
                self._reopen.start()
        for link in links:
            link.abort(hard=True)
        log.info("link_proxy.refusing name=%s port=%d for_s=%s reset=%d", self.name,
                 self._port, for_s, len(links))

    def accept(self) -> None:
        """Listen on the same port again (no-op when listening or closed). Raises
        ServiceStartError when another socket took the port meanwhile."""
        with self._lock:
            if self._reopen is not None and self._reopen is not threading.current_thread():
                self._reopen.cancel()
            self._reopen = None
            if self._closed or self._listener is not None:
                return
            self._listen()
        log.info("link_proxy.accepting name=%s port=%d", self.name, self._port)

    @property
    def refusing(self) -> bool:
        with self._lock:
            return self._started and not self._closed and self._listener is None

    def stats(self) -> dict[str, Any]:
        """Counters (connections, bytes_forward, bytes_backward, chunks_corrupted, resets,
        refused_periods) and ``flips``: each flipped bit's direction, connection, offset."""
        with self._lock:
            return {**self._stats, "flips": [dict(f) for f in self._flips]}

    # ----- internals ---------------------------------------------------------------------

    def _listen(self) -> None:
        """Called with the lock held: bind (the same port once known), listen, serve."""
        deadline = time.monotonic() + (_REBIND_WAIT_S if self._port else 0.0)
        while True:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((self._host, self._port))
                sock.listen(128)
                break
            except OSError as exc:
                sock.close()
                if exc.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                    raise ServiceStartError(f"link proxy {self.name}: cannot listen on "
                                            f"{self._host}:{self._port}: {exc}") from exc
                time.sleep(0.05)
        self._listener, self._port = sock, sock.getsockname()[1]
        self._spawn(self._accept_loop, f"link-{self.name}-accept", sock)

    def _stop_listening(self) -> None:
        """Called with the lock held: close the listening socket (wakes its accept)."""
        sock, self._listener = self._listener, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _reopen_quietly(self) -> None:
        try:
            self.accept()
        except ServiceStartError:  # timer thread boundary: log it, the drill reports it
            log.exception("link_proxy.reopen_failed name=%s port=%d", self.name, self._port)

    def _spawn(self, fn: Any, name: str, *args: Any) -> threading.Thread:
        """Start a daemon thread (called with the lock held), forgetting finished ones."""
        thread = threading.Thread(target=fn, args=args, name=name, daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()
        return thread

    def _accept_loop(self, listener: socket.socket) -> None:
        """Thread: accept until ``listener`` closes; each connection opens in a thread."""
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return               # closed by refuse/close
            with self._lock:
                if self._closed or self._listener is not listener:
                    reset(client)
                    return
                link = Relay(self, next(self._ids), client)
                self._links.add(link)
                self._stats["connections"] += 1
                self._spawn(link.open, f"link-{self.name}-{link.index}-open")

    # ----- called by the relays' threads (phalanx.launcher.drills.link_relay) ---------------------------

    def delay_for(self, side: str) -> float:
        with self._lock:
            return self._delay[side]

    def tamper(self, side: str, link: int, offset: int, data: bytes) -> bytes:
        """``data`` (received at stream ``offset``) with a bit flipped when one is due."""
        with self._lock:
            plan = self._corruption.get(side)
            if plan is None or plan.remaining <= 0:
                return data
            if plan.skip is not None:
                if plan.skip >= len(data):
                    plan.skip -= len(data)
                    return data
                at, plan.skip = plan.skip, None
            elif len(data) < plan.min_chunk_bytes:
                return data
            else:
                at = len(data) // 2
            plan.remaining -= 1
            self._stats["chunks_corrupted"] += 1
            self._flips.append({"direction": side, "connection": link, "offset": offset + at})
        changed = bytearray(data)
        changed[at] ^= plan.mask
        log.info("link_proxy.flipped name=%s direction=%s connection=%d offset=%d", self.name,
                 side, link, offset + at)
        return bytes(changed)

    def count(self, side: str, nbytes: int) -> None:
        with self._lock:
            self._stats[f"bytes_{side}"] += nbytes

    def start_pipes(self, link: Relay) -> bool:
        """Start a link's writers and backward reader; False once the proxy closed."""
        with self._lock:
            if self._closed:
                return False
            for pipe in link.pipes:
                self._spawn(pipe.write_loop, f"link-{self.name}-{link.index}-{pipe.side}-w")
            self._spawn(link.pipes[1].read_loop, f"link-{self.name}-{link.index}-backward-r")
            return True

    def forget(self, link: Relay) -> None:
        with self._lock:
            self._links.discard(link)


def _sides(direction: str) -> tuple[str, ...]:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction {direction!r} is not one of {DIRECTIONS}")
    return ("forward", "backward") if direction == "both" else (direction,)
