"""Which run of a job a tier checkpoint belongs to, so a relaunch into the same tier path
never restores, commits over or deletes another run's steps.

A launch's run id is its run directory's name (``demo-20261202-005321-ab12``: unique per
launch; a standby and a restarted keeper carry on the same run). A tier bound to a run
(``DiskTier(..., run_id=)``, ``S3Tier(..., run_id=)``) joins each rank's files of a step
with a small record, and names the run in the step's ``COMMIT`` marker:

    step_000000000020/
      rank_0.run          {"run": R, "rank": 0, "step": 20, "manifest_sha256": ""}   1. intent
      rank_0.safetensors                                                             2.
      rank_0.json         (the signed manifest)                                      3.
      rank_0.run          {"run": R, "rank": 0, "step": 20, "manifest_sha256": H}    4. complete
      COMMIT              {"step": 20, "ranks": [...], "run": R, ...}   only if every rank is 4.

A rank is this run's when its record names the run and the sha256 of the manifest beside
it (so files half-overwritten by another run are never taken for this run's). An unbound
tier (``run_id=""``: ``phalanx ckpt``, DCP) sees every run, as before.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any, Iterable, Protocol

from phalanx.configs.errors import SnapshotOfOtherRun

log = logging.getLogger(__name__)

RECORD_SUFFIX = ".run"


def run_id_of(run_dir: str | os.PathLike[str] | None) -> str:
    """The run id of a launch: its run directory's name ("" outside a launched job)."""
    return PurePath(run_dir).name if run_dir else ""


def record_name(rank: int) -> str:
    """``rank_<r>.run``: the object naming the run that wrote rank ``r``'s files."""
    return f"rank_{rank}{RECORD_SUFFIX}"


@dataclass(frozen=True)
class RankRecord:
    """One rank's run record; ``manifest_sha256`` is "" while its files are being written."""

    run: str
    rank: int
    step: int
    manifest_sha256: str = ""

    def to_json(self) -> bytes:
        return json.dumps({"run": self.run, "rank": self.rank, "step": self.step,
                           "manifest_sha256": self.manifest_sha256},
                          sort_keys=True).encode()

    @classmethod
    def parse(cls, data: bytes | None) -> "RankRecord | None":
        """The record in ``data``; None when absent or unreadable (treated as no owner)."""
        if not data:
            return None
        try:
            raw = json.loads(data)
            record = cls(str(raw["run"]), int(raw["rank"]), int(raw["step"]),
                         str(raw.get("manifest_sha256", "")))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
        return record


def manifest_digest(manifest: bytes) -> str:
    return hashlib.sha256(bytes(manifest)).hexdigest()


def marker_fields(marker: bytes | None) -> dict[str, Any]:
    """A ``COMMIT`` marker's fields ({} when absent or unreadable); ``run`` is "" in
    markers written before run ids existed."""
    if not marker:
        return {}
    try:
        raw = json.loads(marker)
    except ValueError:
        return {}
    return raw if isinstance(raw, dict) else {}


def marker_run(marker: bytes | None) -> str:
    return str(marker_fields(marker).get("run", "") or "")


class StepObjects(Protocol):
    """The small-object access a tier gives the run checks (disk files, S3 objects)."""

    name: str

    def get_object(self, step: int, name: str) -> bytes | None:
        """The object's bytes, None when absent. Raises TierUnavailable."""

    def put_object(self, step: int, name: str, data: bytes) -> None:
        """Write the object atomically. Raises TierUnavailable."""

    def delete_object(self, step: int, name: str) -> None:
        """Remove it; absent is no error. Raises TierUnavailable."""


def owner_problem(objects: StepObjects, step: int, rank: int, run: str) -> str | None:
    """Why rank ``rank``'s files of ``step`` are not run ``run``'s complete files, or None."""
    from phalanx.runtime.tiers.disk import rank_file_names

    record = RankRecord.parse(objects.get_object(step, record_name(rank)))
    if record is None:
        return "have no run record (written by a phalanx without run ids, or half-written)"
    if record.run != run:
        return f"belong to run {record.run!r}"
    if (record.rank, record.step) != (rank, step):
        return f"have a run record of rank {record.rank} step {record.step} (misplaced)"
    if not record.manifest_sha256:
        return "are still being written (their run record has no manifest digest yet)"
    manifest = objects.get_object(step, rank_file_names(rank)[1])
    if manifest is None:
        return "have no manifest"
    if manifest_digest(manifest) != record.manifest_sha256:
        return "have a manifest another run wrote over this run's (digest differs from its record)"
    return None


def check_owned(objects: StepObjects, step: int, ranks: Iterable[int], run: str,
                action: str) -> None:
    """Raise SnapshotOfOtherRun naming the first rank whose files of ``step`` are not run
    ``run``'s, what was attempted (``action``) and the fix."""
    for rank in ranks:
        problem = owner_problem(objects, step, rank, run)
        if problem is not None:
            raise SnapshotOfOtherRun(
                f"tier {objects.name}: cannot {action} step {step} for run {run!r}: rank {rank}'s "
                f"files {problem}; a step mixes files of two runs only when two launches share "
                "a tier path: give each job its own tiers.disk.path / tiers.s3.prefix, or "
                "resume explicitly with `phalanx launch --resume`")


def write_owned(objects: StepObjects, step: int, rank: int, run: str | None,
                write_files: Any) -> None:
    """Write rank ``rank``'s files of ``step`` as run ``run``'s: the intent record, the
    files (``write_files()``), then the complete record; with no run (a tool's tier) just
    the files. Raises SnapshotOfOtherRun when another run committed ``step`` there (its
    checkpoint is never overwritten)."""
    from phalanx.runtime.tiers.disk import COMMIT_NAME

    if not run:
        write_files()
        return

    marker = objects.get_object(step, COMMIT_NAME)
    if marker is not None and marker_run(marker) != run:
        raise SnapshotOfOtherRun(
            f"tier {objects.name}: step {step} is a committed checkpoint of run "
            f"{marker_run(marker) or '(unknown run)'}; run {run!r} does not overwrite it and "
            "persists a later step (give each job its own tiers.disk.path / tiers.s3.prefix "
            "to keep every step)")
    objects.put_object(step, record_name(rank), RankRecord(run, rank, step).to_json())
    manifest: bytes = write_files()
    objects.put_object(step, record_name(rank),
                       RankRecord(run, rank, step, manifest_digest(manifest)).to_json())


def committed_of_run(objects: StepObjects, committed: Iterable[int], run: str) -> list[int]:
    """The committed steps whose marker names run ``run``, ascending."""
    from phalanx.runtime.tiers.disk import COMMIT_NAME

    return sorted(s for s in committed if marker_run(objects.get_object(s, COMMIT_NAME)) == run)


def partial_of_run(objects: StepObjects, step: int, ranks: Iterable[int], run: str) -> bool:
    """Whether an uncommitted step folder holding run records of ``ranks`` is run ``run``'s
    alone (at least one record, every record names it)."""
    owners = {getattr(RankRecord.parse(objects.get_object(step, record_name(r))), "run", None)
              for r in ranks}
    return owners == {run}


def record_ranks(names: Iterable[str]) -> list[int]:
    """The ranks with a run record among object names of one step folder."""
    out = []
    for name in names:
        if name.startswith("rank_") and name.endswith(RECORD_SUFFIX):
            digits = name[len("rank_"):-len(RECORD_SUFFIX)]
            if digits.isdigit():
                out.append(int(digits))
    return sorted(out)


def steps_of_run(objects: Any, steps: Iterable[int], committed: Iterable[int],
                 run: str) -> tuple[list[int], list[int]]:
    """(step folders, committed steps) of run ``run`` alone: retention's view of a run.
    ``objects`` also lists a step's object names (``step_names``)."""
    done = set(committed)
    mine = committed_of_run(objects, done, run)
    partial = [s for s in steps if s not in done
               and partial_of_run(objects, s, record_ranks(objects.step_names(s)), run)]
    return sorted(set(mine) | set(partial)), mine


def abandoned_writes(objects: Any, steps: Iterable[int], committed: Iterable[int],
                     ranks: Iterable[int], run: str) -> list[tuple[int, int]]:
    """(step, rank) of ``ranks`` whose write run ``run`` started and never finished (the
    intent record alone) in steps without a ``COMMIT``: what a crashed persister left."""
    done = set(committed)
    wanted = list(ranks)
    out = []
    for step in steps:
        if step in done:
            continue
        for rank in wanted:
            record = RankRecord.parse(objects.get_object(step, record_name(rank)))
            if record is not None and record.run == run and not record.manifest_sha256:
                out.append((step, rank))
    return out
