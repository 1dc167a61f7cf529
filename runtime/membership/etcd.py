"""The etcd adapter of the ``Membership`` port: the only module that imports ``etcd3``.

Every grpc/etcd3 error is translated here to ``MembershipUnavailable`` or ``LeaseLost``.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import time
from typing import Any, Callable, Iterator, Mapping, TypedDict, TypeVar

import etcd3
import etcd3.events
import etcd3.exceptions
import etcd3.utils
import grpc

from phalanx.configs.errors import ConfigError, LeaseLost, MembershipUnavailable
from phalanx.configs.schema import EtcdConfig
from phalanx.runtime.base import (MEMBERS, KeyValue, MemberRecord, WatchEvent, encode_member,
                                  read_table)

log = logging.getLogger(__name__)
_T = TypeVar("_T")

_VENDOR_ERRORS = (grpc.RpcError, etcd3.exceptions.Etcd3Exception)
_KEEPALIVE_JOIN_S = 2.0
_RETRY_FIRST_S = 0.1      # first retry of a failed lease refresh (then doubling to ttl/3)
# A prefix read's page: 1,000 keys of up to ~4 KB stay under gRPC's 4 MiB reply limit.
LIST_PAGE_KEYS = 1000
# A private subchannel pool per client: grpc otherwise shares one connection (and its
# reconnect backoff) between every channel to the same address, so a fresh client made
# just after an etcd restart fails at once. Short backoff: reconnect within ~1 s of etcd
# coming back, instead of grpc's default growth to 120 s. Keepalive pings (10 s, within
# etcd's 5 s minimum) detect a silent peer under a long-lived watch.
_GRPC_OPTIONS = [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]


def job_prefix(prefix: str, job: str) -> str:
    """The key prefix of one job: ``job_prefix("/phalanx", "demo") == "/phalanx/demo/"``."""
    return f"{prefix}/{job}/"


def client_fields(cfg: EtcdConfig) -> dict[str, str]:
    """The TLS and auth settings of ``cfg`` as plain strings (file paths and the user name,
    never the password itself), for a worker's context or the run's ``job.json``; turn
    them into ``EtcdMembership`` arguments with ``client_options``."""
    return {"ca_file": cfg.tls.ca_file, "cert_file": cfg.tls.cert_file,
            "key_file": cfg.tls.key_file, "user": cfg.user, "password_file": cfg.password_file}


class EtcdClientOptions(TypedDict):
    """The TLS and auth keyword arguments of ``EtcdMembership``, as ``client_options``
    returns them."""

    ca_file: str
    cert_file: str
    key_file: str
    user: str
    password: str


def client_options(ca_file: str = "", cert_file: str = "", key_file: str = "", user: str = "",
                   password_file: str = "") -> EtcdClientOptions:
    """``EtcdMembership`` keyword arguments from ``client_fields``: the TLS files, the user
    and the password read from ``password_file``. Raises ConfigError when it cannot be
    read."""
    password = ""
    if password_file:
        try:
            with open(password_file, encoding="utf-8") as handle:
                password = handle.read().strip()
        except OSError as exc:
            raise ConfigError("etcd.password_file", f"{password_file} cannot be read: "
                              f"{exc.strerror or exc}",
                              "point it at a readable file holding the etcd password") from None
    return {"ca_file": ca_file, "cert_file": cert_file, "key_file": key_file, "user": user,
            "password": password}


def _split_endpoint(endpoint: str) -> tuple[str, int]:
    hostport = endpoint.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"etcd endpoint {endpoint!r} is not host:port")
    return host.strip("[]"), int(port)


def _describe(exc: BaseException) -> str:
    """``CODE: details`` of a grpc error, also when etcd3 re-raised it as its own type."""
    for err in (exc, exc.__cause__, exc.__context__):
        if isinstance(err, grpc.RpcError) and hasattr(err, "code"):
            return f"{err.code().name}: {err.details()}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


_FAILOVER_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def _unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the etcd member did not answer (another member may)."""
    if isinstance(exc, (etcd3.exceptions.ConnectionFailedError,
                        etcd3.exceptions.ConnectionTimeoutError)):
        return True
    return any(isinstance(err, grpc.RpcError) and hasattr(err, "code")
               and err.code() in _FAILOVER_CODES
               for err in (exc, exc.__cause__, exc.__context__))


def _lease_not_found(exc: BaseException) -> bool:
    return (isinstance(exc, grpc.RpcError) and hasattr(exc, "code")
            and exc.code() == grpc.StatusCode.NOT_FOUND)


class EtcdMembership:
    """``phalanx.runtime.base.Membership`` on an etcd v3 cluster.

    Keys are relative to ``job_prefix`` (``/phalanx/<job>/``); so are the keys of the
    returned ``KeyValue`` and ``WatchEvent``. The constructor does no I/O: the first call
    (or ``connect()``) connects to the first endpoint that answers. Watch callbacks run
    on etcd3's watcher thread; the lease is refreshed by a daemon thread at ``ttl / 3``.
    Every call may raise ``MembershipUnavailable``; ``update`` raises ``LeaseLost`` once
    etcd says our lease is gone (not while etcd is merely unreachable: see
    ``lease_silent_s``); ``join`` again to get a new one.

    With several endpoints (members of one etcd cluster), a call that finds its member
    unreachable raises ``MembershipUnavailable`` and drops the connection: the next call
    connects to the next member that answers (the failed one is tried last), the lease
    keepalive and every watch carry on there (``_fail_over``).
    """

    def __init__(self, endpoints: list[str], job_prefix: str, *, timeout_s: float = 5.0,
                 ca_file: str = "", cert_file: str = "", key_file: str = "",
                 user: str = "", password: str = "") -> None:
        if not endpoints:
            raise ValueError("EtcdMembership needs at least one endpoint (host:port)")
        if not job_prefix.endswith("/"):
            raise ValueError(f"job_prefix {job_prefix!r} must end with '/'")
        self._endpoints = [_split_endpoint(ep) for ep in endpoints]
        self._prefix = job_prefix
        self._timeout_s = timeout_s
        self._tls = (ca_file, cert_file, key_file)
        self._auth = (user, password)
        self._lock = threading.RLock()
        self._client: Any = None
        self._endpoint = ""
        self._closed = False
        self._lease_id = 0
        self._lease_lost = ""
        self._refreshed_at = 0.0
        self._keepalive_stop = threading.Event()
        self._keepalive: threading.Thread | None = None
        self._watches: set[_PrefixWatch] = set()

    # -- connection -----------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """``host:port`` in use, or the configured list before connecting."""
        return self._endpoint or ",".join(f"{h}:{p}" for h, p in self._endpoints)

    @property
    def lease_id(self) -> int:
        """Our lease id, 0 when not joined."""
        return self._lease_id

    def connect(self, retry_for_s: float = 0.0) -> "EtcdMembership":
        """Connect to the first endpoint that answers a status call within ``timeout_s``,
        trying again until ``retry_for_s`` has passed (a busy machine can delay the first
        connection of many processes starting at once).

        Raises ``MembershipUnavailable`` naming every endpoint tried.
        """
        deadline = time.monotonic() + retry_for_s
        while True:
            try:
                self._conn()
                return self
            except MembershipUnavailable as exc:
                if self._closed or time.monotonic() >= deadline:
                    raise
                log.warning("event=etcd_connect_retry prefix=%s error=%s", self._prefix, exc)
                time.sleep(0.5)

    def _conn(self) -> Any:
        with self._lock:
            if self._closed:
                raise MembershipUnavailable(f"etcd membership for {self._prefix} is closed")
            if self._client is not None:
                return self._client
            errors = []
            for host, port in self._endpoints:
                try:
                    client = self._open(host, port)
                except (*_VENDOR_ERRORS, OSError) as exc:
                    errors.append(f"{host}:{port} ({_describe(exc)})")
                    continue
                self._client, self._endpoint = client, f"{host}:{port}"
                log.info("event=etcd_connected endpoint=%s prefix=%s", self._endpoint, self._prefix)
                return client
            raise MembershipUnavailable(f"no etcd endpoint answered within {self._timeout_s} s: "
                                        f"{'; '.join(errors)}; check etcd.endpoints and that "
                                        "etcd is running")

    def _open(self, host: str, port: int) -> Any:
        ca_file, cert_file, key_file = self._tls
        creds = None
        if ca_file or cert_file:
            creds = etcd3.MultiEndpointEtcd3Client.get_secure_creds(
                ca_file or None, key_file or None, cert_file or None)
        # time_retry=0: a failed call must not mark the only endpoint dead for 300 s.
        ep = etcd3.Endpoint(host, port, secure=creds is not None, creds=creds,
                            time_retry=0.0, opts=_GRPC_OPTIONS)
        user, password = self._auth
        try:
            client = etcd3.MultiEndpointEtcd3Client(endpoints=[ep], timeout=self._timeout_s,
                                                    user=user or None, password=password or None)
            client.status()
        except BaseException:
            ep.close()
            raise
        return client

    def _fail_over(self, client: Any, error: str) -> None:
        """Drop ``client``, on which a call just found its member unreachable, so the next
        call connects to another member (this one moved to the end of the list), and
        re-subscribe every watch there. No-op with one endpoint or when another thread
        already failed over. Never raises."""
        with self._lock:
            if len(self._endpoints) < 2 or client is None or self._client is not client:
                return
            failed = self._endpoint
            self._endpoints = ([ep for ep in self._endpoints if f"{ep[0]}:{ep[1]}" != failed]
                               + [ep for ep in self._endpoints if f"{ep[0]}:{ep[1]}" == failed])
            self._client, self._endpoint = None, ""
            watches = list(self._watches)
        log.warning("event=etcd_failover from=%s next=%s prefix=%s error=%s", failed,
                    self.endpoint, self._prefix, error)
        for watch in watches:
            watch.resubscribe_elsewhere()
        try:
            client.close()
        except Exception as exc:  # noqa: BLE001 - a dead member's channel; nothing to keep
            log.info("event=etcd_close_failed endpoint=%s error=%r", failed, exc)

    def _call(self, op: str, key: str, call: Callable[[Any], _T],
              again: Callable[[Any], _T] | None = None) -> _T:
        """``call(client)`` on the member in use. When that member turns out unreachable
        and the client fails over, the call is made again on the next member (``again``
        if given: for a transaction whose first try may have landed), each member once at
        most, so a call in flight on a member that dies does not fail its caller, also
        while the survivors still elect a leader (a member without one times out and the
        next is asked). Raises ``MembershipUnavailable`` when every member failed, or a
        call failed without a failover (one endpoint, or the member answered)."""
        tries = 0
        while True:
            client = self._conn()
            tries += 1
            try:
                with self._translate(op, key):
                    return (call if tries == 1 else again or call)(client)
            except MembershipUnavailable:
                with self._lock:
                    moved = len(self._endpoints) > 1 and self._client is not client \
                        and not self._closed
                    if not moved or tries >= len(self._endpoints):
                        raise
            log.info("event=etcd_call_repeated op=%s key=%s try=%d", op, key, tries + 1)

    @contextlib.contextmanager
    def _translate(self, op: str, key: str = "") -> Iterator[None]:
        client = self._client       # the connection the caller got from _conn()
        where = f" key={self._prefix}{key}" if key else ""
        try:
            yield
        except _VENDOR_ERRORS as exc:
            if _unreachable(exc):
                self._fail_over(client, _describe(exc))
            raise MembershipUnavailable(
                f"etcd {self.endpoint} {op}{where} failed: {_describe(exc)}; "
                "check that etcd is running and reachable") from exc
        except ValueError as exc:
            # grpc's "Cannot invoke RPC on closed channel!": another thread closed this
            # membership (or failed it over) between _conn() and the call
            if not (self._closed or self._client is not client):
                raise
            raise MembershipUnavailable(f"etcd {op}{where} failed: the connection was closed "
                                        f"under the call ({exc})") from exc

    # -- members and the lease ---------------------------------------------------------

    def join(self, member: MemberRecord, ttl_s: float) -> None:
        """Grant a lease of ``ceil(ttl_s)`` s, write our record under it, keep it alive."""
        self.leave()
        ttl = max(1, math.ceil(ttl_s))
        # a grant repeated after a failover may leave the first one's lease behind: it
        # holds nothing and expires after ttl
        lease = self._call("lease grant", "", lambda client: client.lease(ttl))
        with self._lock:
            self._lease_id, self._lease_lost = lease.id, ""
            self._refreshed_at = time.monotonic()
        self._put_leased(member)
        self._start_keepalive(lease.id, ttl, member.worker_id)
        log.info("event=member_joined worker=%s lease=%x ttl_s=%d endpoint=%s",
                 member.worker_id, lease.id, ttl, self.endpoint)

    def create_leased(self, key: str, value: bytes, ttl_s: float) -> bool:
        """Write ``key`` under a fresh lease kept alive like ``join``'s, only if the key does
        not exist (one transaction): leader election. False, and no lease, when it exists."""
        client = self._conn()
        self.leave()
        ttl = max(1, math.ceil(ttl_s))
        full = self._prefix + key
        with self._translate("lease grant"):
            lease = client.lease(ttl)
        tx = client.transactions
        with self._translate("create_leased", key):
            created, _ = client.transaction(compare=[tx.create(full) == 0],
                                            success=[tx.put(full, value, lease=lease.id)],
                                            failure=[])
        if not created:
            with self._translate("lease revoke"), contextlib.suppress(grpc.RpcError):
                client.revoke_lease(lease.id)
            return False
        with self._lock:
            self._lease_id, self._lease_lost = lease.id, ""
            self._refreshed_at = time.monotonic()
        self._start_keepalive(lease.id, ttl, key)
        return True

    @property
    def lease_lost(self) -> str:
        """Why our lease is gone; "" while held (or never joined)."""
        with self._lock:
            return self._lease_lost if self._lease_id else ""

    def update(self, member: MemberRecord) -> None:
        """Rewrite our record under our lease; raises ``LeaseLost`` once it is gone."""
        self._put_leased(member)

    def _put_leased(self, member: MemberRecord) -> None:
        self.put_leased(MEMBERS + member.worker_id, encode_member(member))

    def put_leased(self, key: str, value: bytes) -> None:
        """Write ``key`` under our lease (it vanishes with us); raises ``LeaseLost``."""
        with self._lock:
            lease, lost = self._lease_id, self._lease_lost
        if lost or not lease:
            raise LeaseLost(f"key {key!r} holds no lease at {self.endpoint} "
                            f"({lost or 'not joined'}); join again")

        def put(client: Any) -> None:
            try:
                client.put(self._prefix + key, value, lease=lease)
            except grpc.RpcError as exc:
                if not _lease_not_found(exc):
                    raise
                self._mark_lost(lease, "lease not found on put")
                raise LeaseLost(f"lease {lease:x} for {key!r} is gone at "
                                f"{self.endpoint}; join again") from exc

        self._call("put", key, put)

    def leave(self) -> None:
        """Stop the keepalive and revoke our lease: our member key disappears at once."""
        self._stop_keepalive()
        with self._lock:
            lease, self._lease_id = self._lease_id, 0
            client = self._client
        if lease and client is not None:
            with self._translate("lease revoke"):
                try:
                    client.revoke_lease(lease)
                except grpc.RpcError as exc:
                    if not _lease_not_found(exc):  # already expired: nothing to revoke
                        raise
            log.info("event=member_left lease=%x endpoint=%s", lease, self.endpoint)

    def members(self) -> dict[str, MemberRecord]:
        return read_table(self).members

    def _start_keepalive(self, lease_id: int, ttl: int, worker_id: str) -> None:
        stop = threading.Event()
        thread = threading.Thread(target=self._keepalive_loop, args=(lease_id, ttl, stop),
                                  name=f"etcd-keepalive-{worker_id}", daemon=True)
        with self._lock:
            self._keepalive_stop, self._keepalive = stop, thread
        thread.start()

    def _keepalive_loop(self, lease_id: int, ttl: int, stop: threading.Event) -> None:
        """Refresh at ttl/3. The lease is lost only when etcd says so (TTL <= 0): while
        etcd cannot be reached the refresh is retried with backoff (0.1 s doubling up to
        ttl/3), since etcd gives every lease it holds a fresh TTL when it restarts (3.5,
        also after SIGKILL and an outage longer than the TTL). How long no refresh has
        succeeded is ``lease_silent_s``. Runs on the keepalive thread."""
        wait = ttl / 3
        while not stop.wait(wait):
            client = None
            try:
                client = self._conn()
                responses = list(client.refresh_lease(lease_id))
                if not responses:
                    raise MembershipUnavailable("lease keepalive stream closed without reply")
            except Exception as exc:  # thread boundary: etcd unreachable, retried
                if _unreachable(exc):
                    self._fail_over(client, _describe(exc))
                wait = _RETRY_FIRST_S if wait >= ttl / 3 else min(ttl / 3, wait * 2)
                log.warning("event=lease_refresh_failed lease=%x silent_s=%.1f error=%s",
                            lease_id, self.lease_silent_s, _describe(exc))
                continue
            if responses[0].TTL <= 0:
                self._mark_lost(lease_id, "etcd reports the lease expired or revoked")
                return
            if wait < ttl / 3:
                log.info("event=lease_refreshed_again lease=%x silent_s=%.1f", lease_id,
                         self.lease_silent_s)
            wait = ttl / 3
            with self._lock:
                self._refreshed_at = time.monotonic()

    @property
    def lease_silent_s(self) -> float:
        """Seconds since etcd last confirmed our lease (granted or refreshed); 0 when we
        hold none. Grows while etcd is unreachable, though etcd may still keep the lease."""
        with self._lock:
            if not self._lease_id or self._lease_lost:
                return 0.0
            return time.monotonic() - self._refreshed_at

    def _mark_lost(self, lease_id: int, reason: str) -> None:
        with self._lock:
            if self._lease_id == lease_id and not self._lease_lost:
                self._lease_lost = reason
                log.warning("event=lease_lost lease=%x endpoint=%s reason=%s", lease_id,
                            self.endpoint, reason)

    def _stop_keepalive(self) -> None:
        """Stop refreshing without revoking (also the test hook for a dead process)."""
        with self._lock:
            thread, self._keepalive = self._keepalive, None
            self._keepalive_stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=max(_KEEPALIVE_JOIN_S, self._timeout_s + 1))

    # -- plain keys -----------------------------------------------------------------------

    def put(self, key: str, value: bytes) -> None:
        self._call("put", key, lambda client: client.put(self._prefix + key, value))

    def get(self, key: str) -> KeyValue | None:
        value, meta = self._call("get", key, lambda client: client.get(self._prefix + key))
        return None if meta is None else KeyValue(key, value, meta.mod_revision)

    def delete(self, key: str) -> None:
        self._call("delete", key, lambda client: client.delete(self._prefix + key))

    def list_prefix(self, prefix: str) -> list[KeyValue]:
        """Every key under ``prefix`` as of one revision, read in pages of ``LIST_PAGE_KEYS``
        keys (the first page's revision pins the later ones): one reply over gRPC's 4 MiB
        was refused ("Received message larger than max"), which a member table of 10,000
        ranks' records (600 bytes each) reached (``bench/scale_sim.py``)."""
        full = etcd3.utils.to_bytes(self._prefix + prefix)
        end = etcd3.utils.prefix_range_end(full)
        kvs: list[Any] = []
        start, revision = full, None
        while True:
            resp = self._call("list", prefix, lambda client: client.get_range_response(
                start, end, sort_order="ascend", sort_target="key", limit=LIST_PAGE_KEYS,
                revision=revision))
            kvs.extend(resp.kvs)
            if not resp.more or not resp.kvs:
                break
            start = resp.kvs[-1].key + b"\0"
            if revision is None:     # a later page's header names the newest revision
                revision = resp.header.revision
        cut = len(self._prefix)
        return [KeyValue(kv.key.decode()[cut:], kv.value, kv.mod_revision) for kv in kvs]

    def compare_and_swap(self, key: str, expected_revision: int, value: bytes) -> bool:
        """One transaction: compare mod_revision (create_revision == 0 for "absent").
        Repeated on the next member after a failover, where a compare that fails because
        the first try landed before its member died reads ``key`` back: holding ``value``,
        the swap is ours (values are the caller's own: a generation, a plan)."""
        return self.put_if(key, expected_revision, {key: value})

    def put_if(self, key: str, expected_revision: int, writes: Mapping[str, bytes]) -> bool:
        """One transaction: every key of ``writes`` is written only if ``key``'s
        mod_revision is ``expected_revision`` (create_revision == 0 for "absent"); all or
        none. After a failover it is repeated on the next member, and a failed compare
        there counts as done when every key of ``writes`` holds its value (the first try
        landed before its member died). Raises ``MembershipUnavailable`` (the writes may or
        may not have happened: read back to tell)."""
        if not writes:
            raise ValueError(f"put_if on {key!r} needs at least one key to write")
        full = self._prefix + key

        def write(client: Any) -> bool:
            tx = client.transactions
            compare = (tx.create(full) == 0) if expected_revision == 0 else \
                (tx.mod(full) == expected_revision)
            succeeded, _ = client.transaction(
                compare=[compare], success=[tx.put(self._prefix + k, v) for k, v in writes.items()],
                failure=[])
            return bool(succeeded)

        def again(client: Any) -> bool:
            return write(client) or all(client.get(self._prefix + k)[0] == v
                                        for k, v in writes.items())

        return self._call("put_if", key, write, again)

    # -- watches and lifecycle ------------------------------------------------------------

    def watch_prefix(self, prefix: str,
                     callback: Callable[[WatchEvent], None]) -> Callable[[], None]:
        """Call ``callback`` on etcd3's watcher thread for each change under ``prefix``
        after this call; returns an idempotent cancel function.

        A broken stream (etcd restarted, network blip) is re-subscribed in the background
        from the revision after the last delivered event, so no change is lost or repeated.
        """
        watch = _PrefixWatch(self, prefix, callback)
        watch.subscribe()
        with self._lock:
            self._watches.add(watch)

        def cancel() -> None:
            with self._lock:
                self._watches.discard(watch)
            watch.cancel()
        return cancel

    def close(self) -> None:
        """Cancel watches, stop the keepalive, revoke the lease, close the channel.

        Idempotent; never raises (a failed revoke is logged: the lease then expires by TTL).
        """
        with self._lock:
            if self._closed:
                return
            watches, self._watches = list(self._watches), set()
        for watch in watches:
            with contextlib.suppress(MembershipUnavailable):
                watch.cancel()
        try:
            self.leave()
        except MembershipUnavailable as exc:
            log.warning("event=lease_revoke_failed endpoint=%s error=%s", self.endpoint, exc)
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()
        log.info("event=membership_closed endpoint=%s prefix=%s", self.endpoint, self._prefix)


class _PrefixWatch:
    """One prefix watch of an ``EtcdMembership`` that survives broken streams.

    It starts at the revision read just before subscribing and remembers the revision
    after each delivered event; after a stream error a retry thread subscribes again
    from there (backoff 50 ms .. 1 s) until it succeeds or the watch is cancelled.
    """

    def __init__(self, owner: EtcdMembership, prefix: str,
                 callback: Callable[[WatchEvent], None]) -> None:
        self._owner = owner
        self._prefix = prefix
        self._full = owner._prefix + prefix
        self._callback = callback
        self._lock = threading.Lock()
        self._watch_id: int | None = None
        self._next_revision = 0
        self._cancelled = threading.Event()
        self._retry: threading.Thread | None = None

    def subscribe(self) -> None:
        """Subscribe from ``_next_revision`` (or from now); raises ``MembershipUnavailable``."""
        client = self._owner._conn()
        with self._owner._translate("watch", self._prefix):
            if not self._next_revision:
                head = client.get_response(self._full, count_only=True)
                self._next_revision = head.header.revision + 1
            watch_id = client.add_watch_prefix_callback(
                self._full, functools.partial(self._on_response, client=client),
                start_revision=self._next_revision)
        with self._lock:
            if not self._cancelled.is_set():
                self._watch_id = watch_id
                return
        client.cancel_watch(watch_id)  # cancelled while subscribing

    def cancel(self) -> None:
        """Stop delivering; idempotent. Raises ``MembershipUnavailable`` if etcd refuses."""
        self._cancelled.set()
        with self._lock:
            watch_id, self._watch_id = self._watch_id, None
            retry = self._retry
        if retry is not None and retry is not threading.current_thread():
            retry.join(timeout=self._owner._timeout_s + 1)
        client = self._owner._client
        if watch_id is not None and client is not None:
            with self._owner._translate("cancel watch", self._prefix):
                client.cancel_watch(watch_id)

    def resubscribe_elsewhere(self) -> None:
        """The owner failed over to another member: subscribe there from the revision
        after the last delivered event (this stream's later responses are ignored)."""
        self._start_retry()

    def _on_response(self, resp: Any, client: Any = None) -> None:
        """Runs on etcd3's watcher thread."""
        if resp is None or self._cancelled.is_set():  # None: the stream was closed by us
            return
        if client is not None and client is not self._owner._client:
            return      # a stream of a connection dropped by a failover: resubscribed elsewhere
        if isinstance(resp, BaseException):
            log.warning("event=watch_broken prefix=%s endpoint=%s error=%s next_revision=%d",
                        self._full, self._owner.endpoint, _describe(resp), self._next_revision)
            self._start_retry()
            return
        cut = len(self._owner._prefix)
        for ev in resp.events:
            self._next_revision = ev.mod_revision + 1
            kind = "delete" if isinstance(ev, etcd3.events.DeleteEvent) else "put"
            self._callback(WatchEvent(kind, ev.key.decode()[cut:],
                                      b"" if kind == "delete" else ev.value))

    def _start_retry(self) -> None:
        with self._lock:
            self._watch_id = None
            if self._cancelled.is_set() or (self._retry is not None and self._retry.is_alive()):
                return
            self._retry = threading.Thread(target=self._resubscribe, daemon=True,
                                           name=f"etcd-rewatch-{self._prefix}")
            self._retry.start()

    def _resubscribe(self) -> None:
        delay = 0.05
        while not self._cancelled.wait(delay):
            try:
                self.subscribe()
            except MembershipUnavailable as exc:
                if isinstance(exc.__cause__, etcd3.exceptions.RevisionCompactedError):
                    log.warning("event=watch_gap prefix=%s from_revision=%d reason=compacted",
                                self._full, self._next_revision)
                    self._next_revision = 0
                delay = min(delay * 2, 1.0)
                continue
            log.info("event=watch_resumed prefix=%s from_revision=%d", self._full,
                     self._next_revision)
            return
