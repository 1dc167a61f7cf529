"""The keeper's wire ops: the server-side op table a Keeper serves and the ``KeeperClient``
workers and peers call it with, plus the errors a keeper answers with.

Snapshot payload bytes travel raw; manifests are opaque bytes sent at the start of the
payload (``manifest_nbytes``), never inside the JSON header.
"""
from __future__ import annotations

import contextlib
import logging
import mmap
import os
from typing import Any, Callable, Iterator, Mapping, Protocol

from phalanx.configs.errors import FatalError, PeerUnreachable, TransientError
from phalanx.runtime.keeper.shared_copies import payload_views
from phalanx.runtime.transport.frames import FrameInvalid, register_remote_error
from phalanx.runtime.transport.tcp import DEFAULT_TIMEOUT_S, FrameClient, Reply, Request

log = logging.getLogger(__name__)
MAX_MANIFEST_BYTES = 64 << 20


@register_remote_error
class SlotBusy(TransientError):
    """Every slot a claim could use is being read by a peer or protected; retry soon."""


@register_remote_error
class KeeperRequestInvalid(FatalError):
    """A request broke the keeper's protocol: unknown op or rank, unclaimed slot, bad size."""


class _Served(Protocol):
    """What the op table needs of a Keeper (phalanx.runtime.keeper.daemon.Keeper)."""

    node: str
    job: str

    def alloc(self, rank: int, nbytes: int, *, releasable: bool = True) -> list[str]: ...
    def claim(self, rank: int, protect_step: int | None = None, *,
              wait: bool = True) -> tuple[int, str]: ...
    def replication_cost(self, rank: int) -> float: ...
    def take_tier_work(self, rank: int) -> float: ...
    def committed_step(self) -> int: ...
    def publish(self, rank: int, step: int, slot: int, manifest: bytes, nbytes: int, *,
                notify: bool = True) -> None: ...
    def notify_published(self) -> None: ...
    def pin(self, rank: int, step: int | None = None) -> tuple[str, Any]: ...
    def unpin(self, held: Any) -> None: ...
    def ready_snapshots(self) -> list[Any]: ...
    def store_replica(self, rank: int, step: int, manifest: bytes, nbytes: int,
                      fill: Callable[[memoryview], None]) -> list[int]: ...
    def holdings(self) -> dict[int, dict[str, Any]]: ...
    def stats(self) -> dict[str, int]: ...
    def drop(self, rank: int | None, below_step: int | None = None,
             above_step: int | None = None) -> dict[str, list[int]]: ...


class OpHandler(Protocol):
    """The keeper's op port: an op another concept serves on the keeper's connections
    (replication registers ``replica_offer`` and ``replica_push``), so the keeper never
    imports what it serves. Called on a connection thread; fenced like the keeper's own
    write ops."""

    def __call__(self, keeper: Any, request: Request) -> Reply: ...


class Unfenced:
    """An op of the op port that a caller of any generation may use (a rank's member beat:
    whose record counts is the launcher's judgement); every other registered op is fenced."""

    fenced = False

    def __init__(self, op: Callable[[Any, Request], Reply]) -> None:
        self._op = op

    def __call__(self, keeper: Any, request: Request) -> Reply:
        return self._op(keeper, request)


def handle(keeper: _Served, request: Request,
           ops: Mapping[str, OpHandler] | None = None) -> Reply:
    """Run one op for a connection thread, the keeper's own or one registered through the
    op port; raises PhalanxErrors the client re-raises."""
    h = request.header
    match h.get("op"):
        case "ping":
            return Reply({"node": keeper.node, "job": keeper.job, "pid": os.getpid()})
        case "alloc":
            return Reply({"paths": keeper.alloc(header_int(h, "rank"), header_int(h, "size"),
                                                releasable=h.get("releasable") is not False)})
        case "claim":
            rank = header_int(h, "rank")
            slot, path = keeper.claim(rank, header_int(h, "protect_step", None))
            return Reply(_claimed(keeper, rank, slot, path))
        case "publish":
            rank = header_int(h, "rank")
            manifest = read_manifest(request, request.payload.nbytes)
            keeper.publish(rank, header_int(h, "step"), header_int(h, "slot"), manifest,
                           header_int(h, "size"), notify=False)
            claimed = {}
            if h.get("claim_next") is True:      # the writer's next slot, if one is free now
                with contextlib.suppress(SlotBusy):
                    claimed = _claimed(keeper, rank, *keeper.claim(rank, wait=False))
            return Reply(claimed, on_done=keeper.notify_published)   # after the reply is sent
        case "get":
            return _get(keeper, header_int(h, "rank"), header_int(h, "step", None))
        case "lend":
            return _lend(keeper, request, header_int(h, "rank"), header_int(h, "step", None))
        case "give_back":
            held = request.scope.get("lent", {}).pop(header_int(h, "token"), None)
            if held is None:
                raise KeeperRequestInvalid(f"keeper {keeper.node}: token {h.get('token')!r} "
                                           "names nothing lent on this connection")
            keeper.unpin(held)
            return Reply({})
        case "put_replica":
            rank, step = header_int(h, "rank"), header_int(h, "step")
            manifest = read_manifest(request, header_int(h, "manifest_nbytes"))
            evicted = keeper.store_replica(rank, step, manifest, request.payload.remaining,
                                           request.payload.recv_into)
            return Reply({"evicted": evicted})
        case "list":
            return Reply({"ranks": {str(r): v for r, v in keeper.holdings().items()}})
        case "stats":
            return Reply(keeper.stats())
        case "drop":
            return Reply(keeper.drop(header_int(h, "rank", None), header_int(h, "below_step", None),
                                     header_int(h, "above_step", None)))
        case str(op) if ops and op in ops:
            return ops[op](keeper, request)
        case op:
            raise KeeperRequestInvalid(f"keeper {keeper.node}: unknown op {op!r}")


def _claimed(keeper: _Served, rank: int, slot: int, path: str) -> dict[str, Any]:
    """A claim's reply: the slot, and what the writer learns from the keeper at a claim."""
    return {"slot": slot, "path": path, "replication_s": keeper.replication_cost(rank),
            "tier_s": keeper.take_tier_work(rank), "committed": keeper.committed_step()}


def _get(keeper: _Served, rank: int, step: int | None) -> Reply:
    """Stream manifest + payload straight from the pinned mmap; unpinned once sent (the
    reader verifies every checksum and the HMAC of what arrives)."""
    source, held = keeper.pin(rank, step)
    try:
        views = payload_views(held)     # a replica's shared ranges from their sources
    except BaseException:
        keeper.unpin(held)
        raise

    def done() -> None:
        for view in views:
            view.release()
        keeper.unpin(held)

    header = {"rank": rank, "step": held.step, "source": source,
              "manifest_nbytes": len(held.manifest), "size": held.used}
    return Reply(header, [held.manifest, *views], done)


def _lend(keeper: _Served, request: Request, rank: int, step: int | None) -> Reply:
    """Pin a snapshot for a reader on this host, which maps the slot file itself (no bytes
    cross the socket): the pin lasts until ``give_back`` or until the connection ends."""
    source, held = keeper.pin(rank, step)
    lent: dict[int, Any] = request.scope.setdefault("lent", {})
    if "on_close" not in request.scope:
        def give_all_back() -> None:
            for held in lent.values():
                keeper.unpin(held)
        request.scope["on_close"] = [give_all_back]
    token = max(lent, default=0) + 1
    lent[token] = held
    # a replica sharing ranges with other snapshots here has no one file to map (a source
    # may be unlinked already): the reader gets it through the socket instead
    return Reply({"token": token, "rank": rank, "step": held.step, "source": source,
                  "path": held.buf.path, "size": held.used, "shared": bool(held.refs)},
                 [held.manifest])


_REQUIRED = object()


def header_int(header: dict[str, Any], key: str, default: Any = _REQUIRED) -> Any:
    value = header.get(key)
    if value is None and default is not _REQUIRED:
        return default
    if type(value) is not int:
        raise KeeperRequestInvalid(f"field {key!r} must be an integer, got {value!r}")
    return value


def read_manifest(request: Request, nbytes: int) -> bytes:
    if not 0 <= nbytes <= min(request.payload.remaining, MAX_MANIFEST_BYTES):
        raise KeeperRequestInvalid(f"manifest of {nbytes} bytes is negative, larger than the "
                                   f"payload or over {MAX_MANIFEST_BYTES}")
    return bytes(request.payload.read(nbytes))


class KeeperClient:
    """A worker's or peer's handle on one keeper (thread-safe, one request at a time).

    Raises PeerUnreachable, PeerRefused, StaleGeneration (write ops of a fenced
    generation), SnapshotNotFound, SlotBusy, KeeperRequestInvalid, ConfigError (shm full).
    """

    def __init__(self, host: str, port: int, secret: bytes, job: str,
                 timeout_s: float = DEFAULT_TIMEOUT_S, *, role: str = "worker",
                 generation: int = 0) -> None:
        self._frames = FrameClient(host, port, secret, job, role, timeout_s,
                                   generation=generation)
        self._timeout_s = timeout_s
        # what the keeper said at the last claim: seconds its replicator spent pushing the
        # claimed rank's previous snapshot to every holder, seconds its tiers spent writing
        # the rank's snapshots since the claim before, and the job's committed step
        self.replication_s = 0.0
        self.tier_s = 0.0
        self.committed = -1

    @property
    def address(self) -> str:
        return self._frames.address

    @property
    def generation(self) -> int:
        return self._frames.generation

    @generation.setter
    def generation(self, value: int) -> None:
        self._frames.generation = value

    def ping(self) -> dict[str, Any]:
        return self._call({"op": "ping"})

    def alloc(self, rank: int, nbytes: int, *, releasable: bool = True) -> list[str]:
        """Paths of the rank's slot files (created and sized by the keeper; the writer
        allocates a slot's pages as it writes it, ``reserve_file``). ``releasable=False``:
        this writer pins its maps (CUDA), so the keeper keeps their pages even when they
        hold nothing worth keeping."""
        reply = self._call({"op": "alloc", "rank": rank, "size": nbytes,
                            "releasable": releasable})
        return reply["paths"]

    def claim(self, rank: int, protect_step: int | None = None) -> tuple[int, str]:
        """(slot, path) to write the next snapshot into; unpublished until ``publish``."""
        reply = self._call({"op": "claim", "rank": rank, "protect_step": protect_step},
                           reply_timeout_s=2 * self._timeout_s)
        return self._note_claim(reply)

    def publish(self, rank: int, step: int, slot: int, manifest: bytes, nbytes: int) -> None:
        self._call({"op": "publish", "rank": rank, "step": step, "slot": slot, "size": nbytes},
                   manifest)

    def send_publish(self, rank: int, step: int, slot: int, manifest: bytes,
                     nbytes: int) -> None:
        """``publish`` without waiting: the request is in the keeper's socket when this
        returns (the keeper handles it even if this process dies now) and asks for the
        writer's next slot; ``collect_publish`` reads the reply."""
        self._frames.send(self._stamp({"op": "publish", "rank": rank, "step": step,
                                       "slot": slot, "size": nbytes, "claim_next": True}),
                          manifest)

    def collect_publish(self) -> tuple[int, str] | None:
        """The reply to the last ``send_publish`` (raises its error): the next slot the
        keeper claimed for the writer, or None when none was free."""
        reply = self._frames.collect()
        return self._note_claim(reply) if reply is not None and "slot" in reply else None

    def _note_claim(self, reply: dict[str, Any]) -> tuple[int, str]:
        self.replication_s = float(reply.get("replication_s", 0.0))
        self.tier_s = float(reply.get("tier_s", 0.0))
        committed = reply.get("committed", -1)
        self.committed = max(self.committed, committed if type(committed) is int else -1)
        return reply["slot"], reply["path"]

    def get(self, rank: int, step: int | None = None) -> tuple[int, bytes, bytearray]:
        """(step, manifest, payload) of ``rank`` at ``step`` or the newest held."""
        holder: dict[str, Any] = {}
        reply = self._frames.request_into(self._stamp({"op": "get", "rank": rank, "step": step}),
                                          self._sink(holder, None))
        return reply["step"], bytes(holder["manifest"]), holder["payload"]

    @contextlib.contextmanager
    def borrow(self, rank: int, step: int | None = None
               ) -> Iterator[tuple[int, bytes, memoryview]]:
        """(step, manifest, payload) of ``rank`` at ``step`` (or the newest held), the
        payload a read-only map of the keeper's own slot file: for a reader on the keeper's
        host, nothing is copied through the socket (but for a replica that shares ranges
        with other snapshots there: that one comes through it). The keeper keeps the slot
        pinned until the block ends; drop every view of the payload (tensors over it)
        before that."""
        reply, manifest = self._frames.request(
            self._stamp({"op": "lend", "rank": rank, "step": step}))
        try:
            mapping: mmap.mmap | None = None
            if reply.get("shared"):     # a replica sharing ranges: copied through the socket
                view = memoryview(self.get(rank, reply["step"])[2]).toreadonly()
                self._give_back(reply["token"])     # (the copy needs no pin)
            else:
                mapping = _map_readonly(reply["path"], reply["size"])
                view = memoryview(mapping)
            try:
                yield reply["step"], bytes(manifest or b""), view
            finally:
                with contextlib.suppress(BufferError):  # a view outlived the block: the
                    view.release()                      # map goes with the last one
                    if mapping is not None:
                        mapping.close()
        finally:
            if not reply.get("shared"):
                self._give_back(reply["token"])

    def _give_back(self, token: int) -> None:
        try:
            self._call({"op": "give_back", "token": token})
        except (KeeperRequestInvalid, PeerUnreachable) as exc:
            # the loan ended with the connection that took it
            log.debug("keeper.give_back_skipped token=%s error=%s", token, exc)

    def get_into(self, rank: int, dest: memoryview,
                 step: int | None = None) -> tuple[int, bytes, int]:
        """Like ``get`` but the payload lands at the start of ``dest`` (e.g. an mmap);
        returns (step, manifest, payload size). FrameInvalid if it does not fit."""
        holder: dict[str, Any] = {}
        reply = self._frames.request_into(self._stamp({"op": "get", "rank": rank, "step": step}),
                                          self._sink(holder, dest))
        return reply["step"], bytes(holder["manifest"]), reply["size"]

    def put_replica(self, rank: int, step: int, manifest: bytes,
                    payload: bytes | bytearray | memoryview) -> list[int]:
        """Send a replica (streamed from ``payload``, e.g. a view of the slot mmap);
        returns the steps the keeper evicted to stay at its retention."""
        header = {"op": "put_replica", "rank": rank, "step": step, "manifest_nbytes": len(manifest)}
        return self._call(header, [manifest, payload])["evicted"]

    def holdings(self) -> dict[int, dict[str, Any]]:
        """Per rank: {"local": [steps], "replica": [steps], "writing": bool} (wire op list)."""
        return {int(r): v for r, v in self._call({"op": "list"})["ranks"].items()}

    def latest(self, rank: int) -> int | None:
        held = self.holdings().get(rank, {})
        return max(held.get("local", []) + held.get("replica", []), default=None)

    def stats(self) -> dict[str, int]:
        return {k: v for k, v in self._call({"op": "stats"}).items() if k not in ("ok", "nbytes")}

    def member_beat(self, worker_id: str, record: bytes | None, ttl_s: float,
                    join: bool = False, urgent: bool = False) -> dict[str, bool]:
        """Hand the keeper this rank's member record (None: unchanged, still alive); see
        ``phalanx.runtime.keeper.members``. Answers ``known`` and ``published``."""
        reply = self._call({"op": "member_beat", "worker": worker_id, "ttl_s": ttl_s,
                            "join": join, "urgent": urgent}, record)
        return {"known": bool(reply.get("known")), "published": bool(reply.get("published"))}

    def member_leave(self, worker_id: str) -> None:
        self._call({"op": "member_leave", "worker": worker_id})

    def drop(self, rank: int | None, below_step: int | None = None,
             above_step: int | None = None) -> dict[str, list[int]]:
        reply = self._call({"op": "drop", "rank": rank, "below_step": below_step,
                            "above_step": above_step})
        return {"local": reply["local"], "replica": reply["replica"]}

    def close(self) -> None:
        self._frames.close()

    def __enter__(self) -> "KeeperClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _stamp(self, header: dict[str, Any]) -> dict[str, Any]:
        return {**header, "generation": self._frames.generation}

    def _call(self, header: dict[str, Any], payload: Any = None,
              reply_timeout_s: float | None = None) -> dict[str, Any]:
        reply, _ = self._frames.request(self._stamp(header), payload,
                                        reply_timeout_s=reply_timeout_s)
        return reply

    @staticmethod
    def _sink(holder: dict[str, Any], dest: memoryview | None) -> Callable[[dict], list]:
        def sink(reply: dict[str, Any]) -> list[memoryview]:
            size = reply["size"]
            holder["manifest"] = bytearray(reply["manifest_nbytes"])
            if dest is None:
                holder["payload"] = bytearray(size)
                target = memoryview(holder["payload"])
            else:
                target = memoryview(dest).cast("B")
                if size > target.nbytes:
                    raise FrameInvalid(f"snapshot of {size} bytes does not fit the "
                                       f"destination of {target.nbytes} bytes")
                target = target[:size]
            return [memoryview(holder["manifest"]), target]
        return sink


def _map_readonly(path: str, nbytes: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDONLY)
    try:
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
