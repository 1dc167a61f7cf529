"""Notices a lost node within milliseconds instead of Ray's health-check window.

The launcher holds one idle, authenticated TCP connection to every node's keeper. A keeper
lives as long as its node, so when that connection ends the watch asks two questions, each
answered at once by the kernel: does the keeper's port still accept (no: the keeper process
is gone), and does the node's raylet port still accept (no: the node is gone). Both refused
is a lost node, stamped with the moment the connection ended. A keeper that refuses on a
node whose raylet still accepts is a lost keeper (``keepers_gone``: the launcher starts
another, then ``rewatch``). A machine that vanished without closing its sockets (power
lost, link cut) is found by its keeper's etcd lease lapsing: the launcher then asks
``silent`` whether the node's keeper and raylet still accept connections.
"""
from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from typing import Callable, Mapping

from phalanx.configs.errors import PhalanxError
from phalanx.runtime.base import node_name
from phalanx.runtime.transport.frames import client_handshake

log = logging.getLogger(__name__)
ROLE = "node-watch"
PROBE_TIMEOUT_S = 0.5
# A keeper that answered a probe but could not be watched again is looked at again soon: a
# dying process's listening socket can still complete a connect for a few milliseconds
# after its connections were reset. The delay doubles from FIRST_RETRY_S up to RETRY_S.
FIRST_RETRY_S = 0.01
RETRY_S = 1.0


def refuses(address: tuple[str, int], timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """True when nothing listens at ``address`` any more (connection refused or reset);
    a port that accepts, or does not answer in ``timeout_s``, is not taken as gone."""
    try:
        with socket.create_connection(address, timeout=timeout_s):
            return False
    except (ConnectionRefusedError, ConnectionResetError):
        return True
    except OSError:  # timeout, unreachable network: no proof the process is gone
        return False


def answers(address: tuple[str, int], timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """True when something accepts a connection at ``address`` within ``timeout_s``."""
    try:
        with socket.create_connection(address, timeout=timeout_s):
            return True
    except OSError:
        return False


class NodeWatch:
    """Owned by the launcher's main thread: ``start``, then ``drain`` each poll, ``close``.

    ``keepers`` maps node index → keeper (host, port); ``raylets`` maps node index → raylet
    (host, port). ``generation`` gives the generation a reconnect authenticates with.
    """

    def __init__(self, keepers: Mapping[int, tuple[str, int]],
                 raylets: Mapping[int, tuple[str, int]], secret: bytes, job: str,
                 generation: Callable[[], int], clock: Callable[[], float] = time.monotonic,
                 timeout_s: float = 5.0) -> None:
        self._keepers = dict(keepers)
        self._raylets = dict(raylets)
        self._secret, self._job = secret, job
        self._generation = generation
        self._clock = clock
        self._timeout_s = timeout_s
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._lost: list[tuple[int, float]] = []
        self._keepers_lost: list[tuple[int, float]] = []
        self._rewatch: list[tuple[int, tuple[str, int]]] = []   # for the watch thread
        self._stopping = threading.Event()
        self._retry: dict[int, tuple[float, float]] = {}   # node → (next look, ended at)
        self._delay: dict[int, float] = {}
        self._thread: threading.Thread | None = None

    @property
    def watched(self) -> list[int]:
        return sorted(key.data for key in self._selector.get_map().values()
                      if key.data is not None)

    def start(self) -> "NodeWatch":
        for node in sorted(self._keepers):
            if node in self._raylets:
                self._watch(node)
        self._thread = threading.Thread(target=self._loop, daemon=True, name="node-watch")
        self._thread.start()
        return self

    def drain(self) -> list[tuple[int, float]]:
        """(node index, when its keeper connection ended) of each node found gone since the
        last call."""
        with self._lock:
            lost, self._lost = self._lost, []
        return lost

    def keepers_gone(self) -> list[tuple[int, float]]:
        """(node index, when) of each keeper found gone on a live node since the last call."""
        with self._lock:
            gone, self._keepers_lost = self._keepers_lost, []
        return gone

    def silent(self, node: int) -> bool:
        """Neither ``node``'s keeper nor its raylet accepts a connection (up to two probes of
        ``PROBE_TIMEOUT_S``): asked when the node's etcd lease lapsed, since a dead host or a
        cut link closes no socket and so never ends the watched connection. A node this
        watch does not know is not called silent."""
        keeper, raylet = self._keepers.get(node), self._raylets.get(node)
        if keeper is None or raylet is None:
            return False
        return not answers(keeper) and not answers(raylet)

    def rewatch(self, node: int, address: tuple[str, int]) -> None:
        """Watch ``node``'s new keeper at ``address`` (its old one is gone); the watch
        thread opens the connection."""
        with self._lock:
            self._rewatch.append((node, address))
        with contextlib.suppress(OSError):
            self._wake_w.send(b"r")

    def close(self) -> None:
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(timeout=PROBE_TIMEOUT_S * 4 + 1)
        for key in list(self._selector.get_map().values()):
            with contextlib.suppress(OSError):
                key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()
        self._wake_w.close()

    def _watch(self, node: int) -> bool:
        """Open and authenticate a connection to ``node``'s keeper; False when it refuses."""
        host, port = self._keepers[node]
        where = f"{host}:{port}"
        try:
            sock = socket.create_connection((host, port), timeout=self._timeout_s)
        except OSError as exc:
            log.info("event=node_watch_unavailable node=%s keeper=%s error=%s",
                     node_name(node), where, exc)
            return False
        try:
            client_handshake(sock, where, self._secret, self._job, ROLE, self._generation())
        except (PhalanxError, OSError) as exc:
            sock.close()
            log.info("event=node_watch_unavailable node=%s keeper=%s error=%s",
                     node_name(node), where, exc)
            return False
        sock.setblocking(False)
        self._selector.register(sock, selectors.EVENT_READ, node)
        return True

    def _loop(self) -> None:
        while not self._stopping.is_set():
            for node, (due, ended) in list(self._retry.items()):
                if self._clock() >= due:
                    del self._retry[node]
                    self._ended(node, ended)
            soonest = min((due for due, _ in self._retry.values()), default=None)
            wait = 1.0 if soonest is None else max(0.0, min(1.0, soonest - self._clock()))
            for key, _ in self._selector.select(timeout=wait):
                if key.data is None and not self._stopping.is_set():
                    self._take_rewatch()
                if key.data is None or self._stopping.is_set():
                    continue
                sock: socket.socket = key.fileobj  # type: ignore[assignment]
                try:
                    data = sock.recv(1)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if data:   # the keeper never speaks first on this connection
                    continue
                ended = self._clock()
                self._selector.unregister(sock)
                sock.close()
                self._ended(key.data, ended)

    def _ended(self, node: int, ended: float) -> None:
        """The connection to ``node``'s keeper ended at ``ended``: find out why."""
        if not refuses(self._keepers[node]):
            if self._watch(node):
                self._delay.pop(node, None)
            else:           # answered a probe, not a watch: look again soon
                delay = min(RETRY_S, self._delay.get(node, FIRST_RETRY_S / 2) * 2)
                self._delay[node] = delay
                self._retry[node] = (self._clock() + delay, ended)
            return
        if not refuses(self._raylets[node]):
            log.warning("event=keeper_process_gone node=%s raylet=alive", node_name(node))
            with self._lock:
                self._keepers_lost.append((node, ended))
            return
        log.warning("event=node_gone node=%s seconds_to_classify=%.3f", node_name(node),
                    self._clock() - ended)
        with self._lock:
            self._lost.append((node, ended))

    def _take_rewatch(self) -> None:
        """On the watch thread: drain the wake-up byte(s), watch the keepers ``rewatch``
        named."""
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_r.recv(64)
        with self._lock:
            pending, self._rewatch = self._rewatch, []
        for node, address in pending:
            self._keepers[node] = address
            self._retry.pop(node, None)
            self._delay.pop(node, None)
            if not self._watch(node):
                self._retry[node] = (self._clock() + RETRY_S, self._clock())
