"""Value types, identities and ports (protocols) shared by the runtime's adapters."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, NewType, Protocol, runtime_checkable

Rank = NewType("Rank", int)
NodeId = NewType("NodeId", str)
WorkerId = NewType("WorkerId", str)
SpareId = NewType("SpareId", str)
Step = NewType("Step", int)
Generation = NewType("Generation", int)
# A rank's per-rank state (RNG, data position, buffers, extras) is snapshotted every step
# under its own keeper "rank" id, apart from its full snapshots (runtime/snapshot/state_classes)
CHANNEL_BASE = 1 << 20


def per_rank_channel(rank: int) -> int:
    """The keeper rank id of ``rank``'s per-rank snapshots."""
    return CHANNEL_BASE + rank


def is_channel(rank: int) -> bool:
    return rank >= CHANNEL_BASE


@dataclass(frozen=True)
class KeyValue:
    """One key under a watched or listed prefix; ``mod_revision`` fences CAS writes."""

    key: str
    value: bytes
    mod_revision: int


@dataclass(frozen=True)
class WatchEvent:
    """A change under a watched prefix: ``kind`` is ``put`` or ``delete``."""

    kind: str
    key: str
    value: bytes


@dataclass(frozen=True)
class MemberRecord:
    """One row of the member table (``members/<worker-id>``), stored as JSON."""

    worker_id: str
    rank: int
    node: str
    endpoint: str = ""
    step: int = -1
    generation: int = 0
    pid: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


# --- where a rank's state comes from in a new generation ---------------------------------
# One closed union, decided by the planner (phalanx.recovery.planner, logical: which keeper,
# tier or peer), given addresses by the coordinator (dataclasses.replace, nothing re-decided)
# and read by the worker (phalanx.runtime.worker.rejoin). Sent as JSON, never pickle.


@dataclass(frozen=True)
class KeeperCopy:
    """A snapshot held by the keeper on ``node`` (its own or a replica), served at
    ``host:port``."""

    node: NodeId
    host: str = ""
    port: int = 0


@dataclass(frozen=True)
class TierCopy:
    """A checkpoint in the persistent ``tier``: "disk" under ``path``, or "s3" with ``s3``
    the S3 tier's config as plain values."""

    tier: str
    path: str = ""
    s3: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class PeerCopy:
    """The replicated ``objects`` (model, optimizer) of healthy rank ``peer`` from its own
    keeper on ``node``: a silent-corruption repair, applied after the rank's own restore."""

    peer: Rank
    node: NodeId
    objects: tuple[str, ...] = ()
    host: str = ""
    port: int = 0


RestoreSource = KeeperCopy | TierCopy | PeerCopy
_SOURCE_TAGS: dict[type, str] = {KeeperCopy: "keeper", TierCopy: "tier", PeerCopy: "peer"}
_SOURCE_TYPES = {tag: kind for kind, tag in _SOURCE_TAGS.items()}


def source_to_json(source: RestoreSource) -> dict[str, Any]:
    """``{"kind": tag, **fields}``: the one place a source becomes plain JSON values."""
    doc = dataclasses.asdict(source)
    if isinstance(source, PeerCopy):
        doc["objects"] = list(source.objects)
    return {"kind": _SOURCE_TAGS[type(source)], **doc}


def source_from_json(doc: dict[str, Any]) -> RestoreSource:
    """The inverse of ``source_to_json``. Raises ValueError on an unknown kind or fields."""
    body = dict(doc)
    kind = _SOURCE_TYPES.get(body.pop("kind", None))
    if kind is None:
        raise ValueError(f"unknown restore source kind {doc.get('kind')!r}")
    expected = {f.name for f in dataclasses.fields(kind)}
    if not set(body) <= expected:
        raise ValueError(f"restore source {doc.get('kind')!r} has unknown fields "
                         f"{sorted(set(body) - expected)}")
    if kind is PeerCopy:
        body["objects"] = tuple(str(o) for o in body.get("objects", ()))
    source: RestoreSource = kind(**body)
    return source


NODE_PREFIX = "node"
# a finished worker's last step, under its worker id (written by its session, read by the launcher)
FINISHED_PREFIX = "finished/"


def group_formed_key(generation: int) -> str:
    """The launcher's store counter of ranks whose script's ``init_process_group()`` formed
    ``generation``'s default group (its script trains from there, with or without a
    Session)."""
    return f"phalanx/default_group_formed/gen{generation}"


def node_name(index: int) -> NodeId:
    """The name of node ``index`` in etcd keys, shm files, plans and reports."""
    return NodeId(f"{NODE_PREFIX}{index}")


def node_index(node: str) -> int:
    """The index of node ``node`` ("node3" -> 3); ValueError for any other name."""
    digits = node.removeprefix(NODE_PREFIX)
    if digits == node or not digits.isdigit():
        raise ValueError(f"{node!r} is not a node name (node<index>)")
    return int(digits)


MEMBERS = "members/"          # member records live under <job prefix>/members/<worker-id>
KEEPERS = "keepers/"          # each node keeper's report (and its ranks' records): keepers/<node>
NODE_MEMBERS = "members"      # the field of a keeper's report holding its ranks' records
REPORT_REVISION = "report_rev"   # a relayed record's extra: its keeper report's revision


def encode_member(member: MemberRecord) -> bytes:
    """A member record as the JSON stored under ``members/<worker_id>`` (shared by adapters)."""
    return json.dumps(dataclasses.asdict(member), sort_keys=True).encode()


def decode_member(raw: bytes) -> MemberRecord:
    """The inverse of ``encode_member``; fields unknown to this version are ignored."""
    return member_from(json.loads(raw))


def member_from(data: Mapping[str, Any]) -> MemberRecord:
    """A member record from its decoded JSON object; unknown fields are ignored."""
    known = {f.name for f in dataclasses.fields(MemberRecord)}
    return MemberRecord(**{k: v for k, v in data.items() if k in known})


def member_table(own: Iterable[KeyValue], keepers: Iterable[KeyValue]) -> dict[str, MemberRecord]:
    """The member table from both places a record lives: ``members/<worker>`` (a record
    under its writer's own lease: keepers, a rank whose keeper is gone) and the ``members``
    field of each ``keepers/<node>`` report (the node's ranks, under the keeper's one lease
    and heartbeat per node). A rank found in both (moving between them) counts by its
    newest record (``extra.time``). A relayed record carries its report's etcd revision
    (``extra.report_rev``): the report is rewritten every heartbeat, so a revision that
    stops moving means the node's records are not current (its keeper cannot reach etcd)."""
    table = {kv.key[len(MEMBERS):]: decode_member(kv.value) for kv in own}
    for kv in keepers:
        rows = json.loads(kv.value).get(NODE_MEMBERS) or {}
        for worker_id, data in rows.items():
            extra = {**(data.get("extra") or {}), REPORT_REVISION: kv.mod_revision}
            data = {**data, "extra": extra}
            record, held = member_from(data), table.get(worker_id)
            if held is None or _written_at(record) >= _written_at(held):
                table[worker_id] = record
    return table


@dataclass(frozen=True)
class TableRead:
    """One read of the member table (``members``) with the keepers' reports it came from
    (``keepers``: the ``keepers/<node>`` keys), so a reader that needs both reads etcd once."""
    members: dict[str, MemberRecord]
    keepers: list[KeyValue]


def read_table(membership: Membership) -> TableRead:
    """``membership.members()`` and the keepers' reports in the same two range reads.
    Raises MembershipUnavailable."""
    own = membership.list_prefix(MEMBERS)
    keepers = membership.list_prefix(KEEPERS)
    return TableRead(member_table(own, keepers), keepers)


def _written_at(record: MemberRecord) -> float:
    written = record.extra.get("time")
    return float(written) if isinstance(written, (int, float)) else 0.0


@runtime_checkable
class Membership(Protocol):
    """The control-plane port: leases, members, watches and the fenced generation.

    Keys given to these methods are relative to the job prefix
    (``/phalanx/<job>/``). Every call may raise ``MembershipUnavailable``;
    ``refresh``/``put_leased`` raise ``LeaseLost`` once the lease has expired.
    """

    def join(self, member: MemberRecord, ttl_s: float) -> None:
        """Write ``members/<worker_id>`` under a fresh lease kept alive in the background."""

    def update(self, member: MemberRecord) -> None:
        """Rewrite our member record under the same lease (progress, endpoint)."""

    def put_leased(self, key: str, value: bytes) -> None:
        """Write ``key`` under our lease, so it vanishes when we do (``keepers/<node>``)."""

    def create_leased(self, key: str, value: bytes, ttl_s: float) -> bool:
        """Write ``key`` under a fresh lease of ours (kept alive like ``join``'s) only if the
        key does not exist: leader election. Returns whether this member holds it now."""

    @property
    def lease_lost(self) -> str:
        """Why our lease is gone (etcd says it expired or was revoked); "" while it is
        held, and while etcd is only unreachable (it may keep the lease: join again once
        this is set)."""

    def leave(self) -> None:
        """Revoke our lease: our member key disappears at once."""

    def members(self) -> dict[str, MemberRecord]:
        """The current member table, keyed by worker id."""

    def put(self, key: str, value: bytes) -> None:
        """Unconditional write of a plain (unleased) key."""

    def get(self, key: str) -> KeyValue | None:
        """One key with its mod_revision, or None."""

    def delete(self, key: str) -> None:
        """Remove one key (no error when absent)."""

    def list_prefix(self, prefix: str) -> list[KeyValue]:
        """Every key under ``prefix``, sorted by key."""

    def compare_and_swap(self, key: str, expected_revision: int, value: bytes) -> bool:
        """Write ``value`` only if ``key``'s mod_revision is ``expected_revision``
        (0 = key must not exist). Returns whether the write happened."""

    def put_if(self, key: str, expected_revision: int, writes: Mapping[str, bytes]) -> bool:
        """One transaction: write every key of ``writes`` (``key`` itself among them or not)
        only if ``key``'s mod_revision is ``expected_revision`` (0 = key must not exist).
        Returns whether the writes happened: all of them, or none (the fenced plan and
        generation of a recovery)."""

    def watch_prefix(self, prefix: str, callback: Callable[[WatchEvent], None]) -> Callable[[], None]:
        """Call ``callback`` (from a watcher thread) for each change; returns a cancel function."""

    def close(self) -> None:
        """Stop keepalive and watches; revoke the lease if still held."""


def iter_chunks(view: memoryview, size: int) -> Iterator[memoryview]:
    """Slices of ``view`` of at most ``size`` bytes, without copying."""
    for start in range(0, len(view), size):
        yield view[start:start + size]


@runtime_checkable
class Tier(Protocol):
    """A persistent checkpoint tier (local disk, S3): format-agnostic byte storage.

    Layout: ``<root>/<job>/step_<n>/rank_<r>.safetensors`` + ``rank_<r>.json`` and a
    step-level ``COMMIT`` marker written last, only when every rank is present. A step
    without its marker is invisible to ``committed_steps``. Errors: ``TierUnavailable``
    for I/O failures, ``SnapshotNotFound`` for a missing object.
    """

    name: str

    def write_rank(self, step: int, rank: int, payload: memoryview | bytes, manifest: bytes) -> None:
        """Store one rank's payload and manifest for ``step`` (atomic per object)."""

    def commit_step(self, step: int, ranks: list[int]) -> None:
        """Write the step's commit marker; raises if a rank's objects are missing."""

    def read_rank(self, step: int, rank: int) -> tuple[bytes, bytes]:
        """(payload, manifest) of one rank at a committed or uncommitted step."""

    def committed_steps(self) -> list[int]:
        """Steps whose commit marker exists, ascending."""

    def delete_step(self, step: int) -> None:
        """Remove a step (marker first, so it is never half-visible)."""

    def apply_retention(self, keep: int) -> list[int]:
        """Delete all but the newest ``keep`` committed steps (and stale partial ones older
        than the newest committed); returns the deleted steps."""

    def check(self) -> None:
        """Verify at launch that the tier is usable (credentials, bucket, free space)."""
