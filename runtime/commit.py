"""The global commit point: step s is committed when every rank's snapshot of s is held by
at least f+1 keepers (its own and f replica holders). Pure: computed from the keepers'
reports, which each keeper publishes as one leased key per node (``keepers/<node>``).
The launcher writes the result to ``commit`` (``COMMIT_KEY``) at most every few steps or
seconds; each keeper reads it at its heartbeat and hands it to its workers with every slot
claim, so every worker knows the committed step without any per-step etcd write."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from phalanx.runtime.base import KEEPERS, NODE_MEMBERS, KeyValue


COMMIT_KEY = "commit"


def commit_value(step: int, now: float) -> bytes:
    """What ``COMMIT_KEY`` holds: the committed step and when it was written."""
    return json.dumps({"step": step, "time": now}).encode()


def committed_from(value: bytes | None) -> int:
    """The step in a ``COMMIT_KEY`` value; -1 when absent or unreadable."""
    if not value:
        return -1
    try:
        step = json.loads(value).get("step")
    except (ValueError, AttributeError):
        return -1
    return step if type(step) is int and step >= 0 else -1


@dataclass(frozen=True)
class KeeperReport:
    """What one node keeper holds: per rank, local steps and replica steps."""

    node: str
    address: tuple[str, int]
    local: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    replicas: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    bytes_held: int = 0
    generation: int = 0
    # replica bytes kept as references to another snapshot on the node, not held twice
    # (``phalanx.runtime.keeper.shared_copies``): a copy's size is held + shared over copies
    bytes_shared: int = 0
    # the node's ranks' member records (worker id -> record as JSON), published under the
    # keeper's lease: one lease and one heartbeat per node (``phalanx.runtime.keeper.members``)
    members: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps({"node": self.node, "address": list(self.address),
                           "local": {str(r): list(s) for r, s in self.local.items()},
                           "replicas": {str(r): list(s) for r, s in self.replicas.items()},
                           "bytes_held": self.bytes_held, "generation": self.generation,
                           "bytes_shared": self.bytes_shared,
                           NODE_MEMBERS: dict(self.members)},
                          sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "KeeperReport":
        raw = json.loads(data)
        return cls(node=str(raw["node"]), address=(str(raw["address"][0]), int(raw["address"][1])),
                   local={int(r): tuple(int(x) for x in s) for r, s in raw["local"].items()},
                   replicas={int(r): tuple(int(x) for x in s) for r, s in raw["replicas"].items()},
                   bytes_held=int(raw.get("bytes_held", 0)),
                   bytes_shared=int(raw.get("bytes_shared", 0)),
                   generation=int(raw.get("generation", 0)),
                   members=dict(raw.get(NODE_MEMBERS) or {}))


def reports_of(keepers: Iterable[KeyValue]) -> dict[str, KeeperReport]:
    """The keepers' reports, by node, from their ``keepers/<node>`` keys."""
    return {kv.key.removeprefix(KEEPERS): KeeperReport.from_json(kv.value) for kv in keepers}


def gate(step: int, verified: int | None) -> int:
    """``step`` held back to ``verified``, the newest step whose replicas agreed on every
    rank (``detection.compare_replicas``), so the commit point never passes a step whose
    replica digests differ or are not all known yet; ``verified`` None: no gate."""
    return step if verified is None else min(step, verified)


def committed_step(reports: Mapping[str, KeeperReport], ranks: Sequence[int], factor: int) -> int:
    """The newest step every rank has on at least ``factor + 1`` keepers; -1 when none.
    One pass over the reports, O(entries held): 10,000 ranks on 1,250 keepers in ~0.07 s
    (a loop over the reports per rank took 4.5 s there; the launcher reads every 0.5 s)."""
    if not ranks:
        return -1
    counts: dict[int, dict[int, int]] = {}
    for report in reports.values():
        for rank in report.local.keys() | report.replicas.keys():
            per_step = counts.setdefault(rank, {})
            for step in set(report.local.get(rank, ())) | set(report.replicas.get(rank, ())):
                per_step[step] = per_step.get(step, 0) + 1
    candidates: set[int] | None = None
    for rank in ranks:
        good = {step for step, count in counts.get(rank, {}).items() if count >= factor + 1}
        candidates = good if candidates is None else candidates & good
        if not candidates:
            return -1
    return max(candidates) if candidates else -1
