"""What the checkpoints of the disk and S3 tiers hold, decided purely from object listings
(``summarize_steps``; the tier accessors only fetch), and the checks and export of one
rank's checkpoint that ``phalanx ckpt`` runs (``phalanx.launcher.ckpt_commands``).
"""
from __future__ import annotations

import json
import logging
import os
import re
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence


from phalanx.configs.errors import (ConfigError, SnapshotCorrupt, SnapshotNotFound,
                                    SnapshotUnauthenticated, TierUnavailable)
from phalanx.runtime.tiers.disk import COMMIT_NAME, STEP_RE, DiskTier, atomic_write, rank_file_names

if TYPE_CHECKING:                # torch and boto3 load only when a command needs them
    import torch

    from phalanx.runtime.snapshot.format import Manifest
    from phalanx.runtime.base import Tier
    from phalanx.runtime.tiers.s3 import S3Tier

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
SOURCE = "phalanx ckpt"                    # the "file" named by our usage errors
TREE_SPEC_KEY = "phalanx_tree_spec"        # safetensors __metadata__ key of an export
_RANK_OBJECT_RE = re.compile(r"^rank_(\d+)\.(safetensors|json)$")
_TENSOR_RE = re.compile(r"tensor '([^']*)'")


def usage_error(key: str, problem: str, hint: str) -> ConfigError:
    return ConfigError(key, problem, hint, SOURCE)


# ----------------------------------------------------------------------- value types

@dataclass(frozen=True)
class StoredObject:
    """One object of a tier's step folder: ``name`` is relative to the folder."""

    step: int
    name: str
    size: int
    mtime: float


@dataclass(frozen=True)
class StepListing:
    """What a tier holds of one step. ``ranks`` have both payload and manifest;
    ``missing_ranks`` are named by the commit marker or half-written, but incomplete;
    ``created_at`` is the newest object's time (the marker's, once committed)."""

    tier: str
    location: str
    step: int
    committed: bool
    ranks: tuple[int, ...]
    missing_ranks: tuple[int, ...]
    total_bytes: int
    created_at: float
    run: str = ""      # the run that wrote it (its marker's, else its ranks' records)

    @property
    def state(self) -> str:
        return "committed" if self.committed else "partial"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "state": self.state, "ranks": list(self.ranks),
                "missing_ranks": list(self.missing_ranks), "created_at": iso_time(self.created_at)}


@dataclass(frozen=True)
class RankVerdict:
    """The outcome of checking one rank: ``status`` is ok, missing, corrupt or
    unauthenticated; ``tensor`` names the first bad tensor when one is known."""

    tier: str
    step: int
    rank: int
    status: str
    tensor: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def summarize_steps(tier: str, location: str, objects: Iterable[StoredObject],
                    markers: Mapping[int, Sequence[int] | None]) -> list[StepListing]:
    """Group a tier's objects into per-step listings, ascending. ``markers`` holds the
    ranks each committed step's marker names (None when the marker is unreadable)."""
    by_step: dict[int, list[StoredObject]] = defaultdict(list)
    for obj in objects:
        by_step[obj.step].append(obj)
    listings = []
    for step, objs in sorted(by_step.items()):
        kinds: dict[int, set[str]] = defaultdict(set)
        total = 0
        for obj in objs:
            match = _RANK_OBJECT_RE.match(obj.name)
            if match:
                kinds[int(match.group(1))].add(match.group(2))
                total += obj.size
        complete = {r for r, k in kinds.items() if k == {"safetensors", "json"}}
        named = set(markers.get(step) or ())
        listings.append(StepListing(
            tier, location, step, any(o.name == COMMIT_NAME for o in objs),
            tuple(sorted(complete)), tuple(sorted((named | set(kinds)) - complete)), total,
            max(o.mtime for o in objs)))
    return listings


def marker_ranks(raw: bytes) -> tuple[int, ...] | None:
    """The ranks a ``COMMIT`` marker names, or None when it is not a valid marker."""
    try:
        ranks = json.loads(raw).get("ranks")
    except (ValueError, AttributeError):
        return None
    if not isinstance(ranks, list) or not all(type(r) is int and r >= 0 for r in ranks):
        return None
    return tuple(ranks)


# --------------------------------------------------------------------- tier accessors

@dataclass(frozen=True)
class DiskAccess:
    """Lists a DiskTier's folders directly (the tier has no listing with sizes)."""

    tier: DiskTier

    @property
    def location(self) -> str:
        return str(self.tier.job_dir)

    def objects(self) -> list[StoredObject]:
        """Raises ConfigError when the job folder does not exist (wrong --path/--job)."""
        job_dir = self.tier.job_dir
        if not job_dir.is_dir():
            jobs = job_folders(job_dir.parent)
            raise usage_error("--job", f"tier disk has no job folder {job_dir}",
                         f"jobs under {job_dir.parent}: {', '.join(jobs)}" if jobs else
                         "no step was persisted there yet (a run writes its disk tier every "
                         "tiers.disk.every_steps steps), or check --path/tiers.disk.path: it "
                         "should hold <job>/step_*/")
        found: list[StoredObject] = []
        try:
            for step_dir in job_dir.iterdir():
                match = STEP_RE.match(step_dir.name)
                if not match or not step_dir.is_dir():
                    continue
                for entry in os.scandir(step_dir):
                    if entry.name.startswith(".") or not entry.is_file():
                        continue            # atomic_write's temp files
                    stat = entry.stat()
                    found.append(StoredObject(int(match.group(1)), entry.name, stat.st_size,
                                              stat.st_mtime))
        except OSError as exc:
            raise TierUnavailable(f"tier disk: listing {job_dir} failed: {exc}") from exc
        return found

    def marker(self, step: int) -> bytes:
        try:
            return (self.tier.step_dir(step) / COMMIT_NAME).read_bytes()
        except FileNotFoundError as exc:
            raise SnapshotNotFound(f"tier disk: step {step} has no marker") from exc
        except OSError as exc:
            raise TierUnavailable(f"tier disk: reading the marker of step {step} failed: "
                                  f"{exc}") from exc


@dataclass(frozen=True)
class S3Access:
    """Lists an S3Tier's objects. S3Tier has no public listing with sizes, so this uses its
    private request helpers to keep its retries, owner check and error translation."""

    tier: S3Tier

    @property
    def location(self) -> str:
        return self.tier._url(self.tier._base)

    def objects(self) -> list[StoredObject]:
        prefix, tier = f"{self.tier._base}/", self.tier
        found: list[StoredObject] = []
        token = ""
        while True:
            extra: dict[str, Any] = {"Prefix": prefix}
            if token:
                extra["ContinuationToken"] = token
            page = tier._retry("list_objects_v2", tier._url(prefix), lambda:
                               tier.client.list_objects_v2(**tier._params(**extra)))
            for item in page.get("Contents", []):
                folder, _, name = item["Key"][len(prefix):].partition("/")
                match = STEP_RE.match(folder)
                if match and name and "/" not in name:
                    found.append(StoredObject(int(match.group(1)), name, int(item["Size"]),
                                              item["LastModified"].timestamp()))
            token = page.get("NextContinuationToken") or ""
            if not page.get("IsTruncated") or not token:
                return found

    def marker(self, step: int) -> bytes:
        key = self.tier._key(step, COMMIT_NAME)
        return self.tier._get(key, f"step {step} marker ({self.tier._url(key)})")


Access = DiskAccess | S3Access


def list_steps(access: Access) -> list[StepListing]:
    """Every step of the tier, committed or partial. Raises TierUnavailable."""
    objects = access.objects()
    markers: dict[int, tuple[int, ...] | None] = {}
    for step in {o.step for o in objects if o.name == COMMIT_NAME}:
        try:
            markers[step] = marker_ranks(access.marker(step))
        except SnapshotNotFound:    # deleted since the listing (retention): ranks unknown
            markers[step] = None
    listings = summarize_steps(access.tier.name, access.location, objects, markers)
    return [replace(listing, run=_step_run(access, listing)) for listing in listings]


def _step_run(access: Access, listing: StepListing) -> str:
    """The run id a step belongs to: its marker's, else its lowest rank's record ("")."""
    from phalanx.runtime.tiers.run_identity import RankRecord, marker_run, record_name

    tier: Any = access.tier
    try:
        if listing.committed:
            return marker_run(tier.get_object(listing.step, COMMIT_NAME))
        ranks = sorted(listing.ranks + listing.missing_ranks)
        record = RankRecord.parse(tier.get_object(listing.step, record_name(ranks[0]))) \
            if ranks else None
    except (TierUnavailable, SnapshotNotFound):
        return ""
    return record.run if record is not None else ""


# ------------------------------------------------------------------------ checking

@dataclass(frozen=True)
class CheckedRank:
    """A rank that passed ``check_rank``: its bytes and the tensors viewing ``payload``."""

    payload: bytes
    raw_manifest: bytes
    manifest: Manifest
    tensors: dict[str, torch.Tensor]


def check_rank(tier: Tier, step: int, rank: int, secret: bytes | None
               ) -> tuple[RankVerdict, CheckedRank | None]:
    """Read and check one rank: manifest, HMAC (when ``secret``), placement, header
    against manifest, every checksum. Returns the verdict and, when ok, the checked rank.
    Raises TierUnavailable when the tier refuses."""
    from phalanx.runtime.snapshot.format import Manifest, read_tensors

    where = f"tier {tier.name} step {step} rank {rank}"
    try:
        payload, raw = tier.read_rank(step, rank)
    except SnapshotNotFound as exc:
        return RankVerdict(tier.name, step, rank, "missing", "", str(exc)), None
    try:
        manifest = Manifest.from_json(raw, where)
        manifest.verify(secret, where)
        if (manifest.rank, manifest.step) != (rank, step):
            raise SnapshotCorrupt(f"{where}: manifest is for step {manifest.step} rank "
                                  f"{manifest.rank} (misplaced object)")
        tensors = read_tensors(payload, manifest, source=where)
    except SnapshotUnauthenticated as exc:
        return RankVerdict(tier.name, step, rank, "unauthenticated", "", str(exc)), None
    except SnapshotCorrupt as exc:
        text = str(exc) if str(exc).startswith(where) else f"{where}: {exc}"
        named = _TENSOR_RE.search(text)
        return RankVerdict(tier.name, step, rank, "corrupt", named.group(1) if named else "",
                           text), None
    return RankVerdict(tier.name, step, rank, "ok"), CheckedRank(payload, raw, manifest, tensors)


def verify_step(tier: Tier, listing: StepListing, secret: bytes | None) -> list[RankVerdict]:
    """One verdict per rank the step has or should have, ascending."""
    verdicts = []
    for rank in sorted(set(listing.ranks) | set(listing.missing_ranks)):
        verdict = check_rank(tier, listing.step, rank, secret)[0]
        log.info("ckpt_verify tier=%s step=%d rank=%d status=%s tensor=%s", tier.name,
                 listing.step, rank, verdict.status, verdict.tensor or "-")
        verdicts.append(verdict)
    return verdicts


def export_rank(checked: CheckedRank, out_dir: Path, rank: int) -> None:
    """Write ``rank_<r>.safetensors`` (tensors, payload metadata plus the tree spec as
    JSON under ``phalanx_tree_spec``) and ``rank_<r>.json`` (the manifest, verbatim)."""
    from phalanx.runtime.snapshot.format import plan_layout, write_into

    length = int.from_bytes(checked.payload[:8], "little")  # parse_header checked it
    metadata = dict(json.loads(checked.payload[8:8 + length]).get("__metadata__", {}))
    metadata[TREE_SPEC_KEY] = json.dumps(checked.manifest.tree_spec, sort_keys=True)
    layout = plan_layout(checked.tensors, metadata)
    buf = bytearray(layout.total_bytes)
    write_into(buf, layout, checked.tensors)
    payload_name, manifest_name = rank_file_names(rank)
    atomic_write(out_dir / payload_name, memoryview(buf))
    atomic_write(out_dir / manifest_name, memoryview(checked.raw_manifest))


# ---------------------------------------------------------------------- argparse

def iso_time(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def job_folders(root: Path) -> list[str]:
    try:
        return sorted(p.name for p in root.iterdir() if p.is_dir()
                      and any(STEP_RE.match(q.name) for q in p.iterdir()))
    except OSError:
        return []
