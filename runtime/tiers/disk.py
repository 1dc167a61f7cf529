"""The local-disk checkpoint tier, and the step layout every tier shares.

Owns ``<root>/<job>/step_<n:012d>/`` folders: atomic per-file writes (temp, fsync,
rename, fsync dir), the ``COMMIT`` marker written last, and retention. A tier bound to a
run (``run_id``) sees, commits and deletes only that run's steps
(``phalanx.runtime.tiers.run_identity``).
"""
from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Iterable

from phalanx.configs.errors import ConfigError, SnapshotNotFound, TierUnavailable
from phalanx.runtime.base import iter_chunks
from phalanx.runtime.tiers import run_identity as runs

log = logging.getLogger(__name__)

COMMIT_NAME = "COMMIT"
STEP_RE = re.compile(r"^step_(\d{12})$")
_WRITE_CHUNK = 16 * 1024 * 1024  # one write(2) call at most; the kernel caps a call near 2 GiB
# a job name, optionally with one ".<namespace>" (job names have no dots: DCP's <job>.dcp)
_JOB_RE = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)?$")


# ----------------------------------------------------------------- shared layout helpers

def step_dir_name(step: int) -> str:
    """``step_000000000042``: zero padded so names sort like numbers."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:012d}"


def rank_file_names(rank: int) -> tuple[str, str]:
    """(payload, manifest) object names of one rank inside a step folder."""
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    return f"rank_{rank}.safetensors", f"rank_{rank}.json"


def validate_job(job: str) -> str:
    """Reject job names that could escape the tier's root (``..``, ``/``); one
    ``.namespace`` suffix is allowed (``phalanx.runtime.tiers.config.open_tier``)."""
    if not _JOB_RE.match(job):
        raise ConfigError("job.name", f"{job!r} has characters other than letters, digits, '-' "
                          "and '_'", "it becomes a folder and an S3 key prefix")
    return job


def commit_marker(step: int, ranks: list[int], run: str = "") -> bytes:
    """The JSON body of a step's ``COMMIT`` marker (``run``: the run that wrote it)."""
    body: dict[str, object] = {"step": step, "ranks": ranks, "written_at": time.time()}
    if run:
        body["run"] = run
    return json.dumps(body, sort_keys=True).encode()


def normalize_ranks(ranks: Iterable[int]) -> list[int]:
    """Sorted unique ranks; raises ValueError for an empty or negative list."""
    unique = sorted(set(int(r) for r in ranks))
    if not unique:
        raise ValueError("commit_step needs at least one rank")
    for rank in unique:
        rank_file_names(rank)
    return unique


def retention_victims(steps: Iterable[int], committed: Iterable[int], keep: int) -> list[int]:
    """Steps retention deletes: committed ones but the newest ``keep``, and partial
    (uncommitted) ones older than the newest committed step. Ascending."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    done = sorted(set(committed))
    if not done:
        return []
    newest = done[-1]
    partial = {s for s in steps if s < newest} - set(done)
    return sorted(set(done[:-keep]) | partial)


def as_byte_view(payload: memoryview | bytes | bytearray) -> memoryview:
    """A flat unsigned-byte view of ``payload`` without copying it."""
    view = payload if isinstance(payload, memoryview) else memoryview(payload)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


# ----------------------------------------------------------------------- file helpers

def _errno_text(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, "")
    text = exc.strerror or str(exc)
    return f"{name}: {text}" if name else text


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, view: memoryview) -> None:
    """Write every byte of ``view``; os.write takes the memoryview itself (no copy)."""
    for chunk in iter_chunks(view, _WRITE_CHUNK):
        while len(chunk):
            written = os.write(fd, chunk)
            chunk = chunk[written:]


def atomic_write(path: Path, view: memoryview) -> None:
    """Temp file in the same folder, write, fsync, rename over ``path``, fsync the folder.

    On any failure the temp file is removed and the error re-raised (OSError included),
    so a reader sees the old file or the new one, never a torn one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        try:
            _write_all(fd, view)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)


def _remove_stale_temps(step_dir: Path, names: tuple[str, ...]) -> None:
    """Drop temp files a killed writer of these files left (one writer per rank)."""
    for name in names:
        for stale in step_dir.glob(f".{name}.*.tmp"):
            try:
                stale.unlink()
            except FileNotFoundError:
                pass


# -------------------------------------------------------------------------- the tier

class DiskTier:
    """Checkpoint tier on a local (or mounted) filesystem.

    Thread-safe for concurrent ``write_rank`` calls of distinct ranks. Every method raises
    ``TierUnavailable`` (with the path and errno text) when the filesystem refuses. With a
    ``run_id`` the tier is that run's: ``committed_steps`` and retention see only its steps,
    and ``commit_step``/``read_rank`` raise ``SnapshotOfOtherRun`` for another run's files.
    """

    name = "disk"

    def __init__(self, root: Path, job: str, *, run_id: str = "", min_free_bytes: int = 0) -> None:
        self._root = Path(root)
        self._job = validate_job(job)
        self.run_id = run_id
        self._min_free_bytes = min_free_bytes

    @property
    def job_dir(self) -> Path:
        return self._root / self._job

    def step_dir(self, step: int) -> Path:
        return self.job_dir / step_dir_name(step)

    # ----- small objects of a step folder (the run records, the marker) ---------------

    def get_object(self, step: int, name: str) -> bytes | None:
        try:
            return (self.step_dir(step) / name).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise TierUnavailable(f"tier disk: reading {self.step_dir(step) / name} failed: "
                                  f"{_errno_text(exc)}") from exc

    def put_object(self, step: int, name: str, data: bytes) -> None:
        try:
            self._ensure_step_dir(self.step_dir(step))
            atomic_write(self.step_dir(step) / name, memoryview(data))
        except OSError as exc:
            raise TierUnavailable(f"tier disk: writing {self.step_dir(step) / name} failed: "
                                  f"{_errno_text(exc)}") from exc

    def delete_object(self, step: int, name: str) -> None:
        try:
            (self.step_dir(step) / name).unlink(missing_ok=True)
        except OSError as exc:
            raise TierUnavailable(f"tier disk: deleting {self.step_dir(step) / name} failed: "
                                  f"{_errno_text(exc)}") from exc

    def step_names(self, step: int) -> list[str]:
        try:
            return sorted(os.listdir(self.step_dir(step)))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise TierUnavailable(f"tier disk: listing {self.step_dir(step)} failed: "
                                  f"{_errno_text(exc)}") from exc

    # ----- the Tier port ---------------------------------------------------------------

    def write_rank(self, step: int, rank: int, payload: memoryview | bytes, manifest: bytes) -> None:
        """Store one rank's payload then manifest, each atomically (with a run: between
        its run records). Raises TierUnavailable."""
        runs.write_owned(self, step, rank, self.run_id,
                         lambda: self._write_files(step, rank, payload, manifest))

    def _write_files(self, step: int, rank: int, payload: memoryview | bytes,
                     manifest: bytes) -> bytes:
        payload_name, manifest_name = rank_file_names(rank)
        step_dir = self.step_dir(step)
        view = as_byte_view(payload)
        started = time.monotonic()
        try:
            self._ensure_step_dir(step_dir)
            _remove_stale_temps(step_dir, (payload_name, manifest_name))
            atomic_write(step_dir / payload_name, view)
            atomic_write(step_dir / manifest_name, as_byte_view(manifest))
        except OSError as exc:
            raise TierUnavailable(f"tier disk: writing step {step} rank {rank} under {step_dir} "
                                  f"failed: {_errno_text(exc)}") from exc
        log.debug("tier_write tier=disk step=%d rank=%d bytes=%d elapsed_s=%.3f",
                  step, rank, view.nbytes, time.monotonic() - started)
        return bytes(manifest)

    def _ensure_step_dir(self, step_dir: Path) -> None:
        if step_dir.is_dir():
            return
        step_dir.mkdir(parents=True, exist_ok=True)
        _fsync_dir(step_dir.parent)  # the new step folder's entry survives a crash
        _fsync_dir(step_dir.parent.parent)  # and the job folder's, when just created

    def commit_step(self, step: int, ranks: list[int]) -> None:
        """Write ``COMMIT`` after checking every rank's two files exist (and, bound to a
        run, are that run's). Raises SnapshotNotFound naming the first missing rank
        (SnapshotOfOtherRun: another run's), TierUnavailable on I/O errors."""
        wanted = normalize_ranks(ranks)
        step_dir = self.step_dir(step)
        for rank in wanted:
            for name in rank_file_names(rank):
                if not (step_dir / name).is_file():
                    raise SnapshotNotFound(f"tier disk: cannot commit step {step}: rank {rank} "
                                           f"has no {name} in {step_dir}")
        if self.run_id:
            runs.check_owned(self, step, wanted, self.run_id, "commit")
        try:
            atomic_write(step_dir / COMMIT_NAME,
                         memoryview(commit_marker(step, wanted, self.run_id)))
        except OSError as exc:
            raise TierUnavailable(f"tier disk: committing step {step} in {step_dir} failed: "
                                  f"{_errno_text(exc)}") from exc
        log.info("tier_commit tier=disk step=%d ranks=%d", step, len(wanted))

    def locate(self, step: int, rank: int) -> str:
        """Where one rank's files of ``step`` live (both names), for messages."""
        payload_name, manifest_name = rank_file_names(rank)
        return f"{self.step_dir(step) / payload_name} + {manifest_name}"

    def read_rank(self, step: int, rank: int) -> tuple[bytes, bytes]:
        """(payload, manifest); raises SnapshotNotFound when either file is absent
        (SnapshotOfOtherRun: bound to a run, and the files are another run's)."""
        step_dir = self.step_dir(step)
        payload_name, manifest_name = rank_file_names(rank)
        if self.run_id:
            runs.check_owned(self, step, [rank], self.run_id, "restore")
        try:
            return (step_dir / payload_name).read_bytes(), (step_dir / manifest_name).read_bytes()
        except FileNotFoundError as exc:
            raise SnapshotNotFound(f"tier disk: step {step} rank {rank} not found "
                                   f"({exc.filename})") from exc
        except OSError as exc:
            raise TierUnavailable(f"tier disk: reading step {step} rank {rank} under {step_dir} "
                                  f"failed: {_errno_text(exc)}") from exc

    def _scan(self) -> tuple[list[int], list[int]]:
        """(every step folder, committed steps), both ascending."""
        steps: list[int] = []
        committed: list[int] = []
        try:
            entries = list(os.scandir(self.job_dir))
        except FileNotFoundError:
            return [], []
        except OSError as exc:
            raise TierUnavailable(f"tier disk: listing {self.job_dir} failed: "
                                  f"{_errno_text(exc)}") from exc
        for entry in entries:
            match = STEP_RE.match(entry.name)
            if match and entry.is_dir(follow_symlinks=False):
                step = int(match.group(1))
                steps.append(step)
                if os.path.isfile(os.path.join(entry.path, COMMIT_NAME)):
                    committed.append(step)
        return sorted(steps), sorted(committed)

    def committed_steps(self) -> list[int]:
        """Steps with a ``COMMIT`` marker (bound to a run: of that run), ascending."""
        committed = self._scan()[1]
        return runs.committed_of_run(self, committed, self.run_id) if self.run_id else committed

    def delete_step(self, step: int) -> None:
        """Remove the marker (then fsync) before the files; absent steps are no error."""
        step_dir = self.step_dir(step)
        try:
            (step_dir / COMMIT_NAME).unlink(missing_ok=True)
            if step_dir.is_dir():
                _fsync_dir(step_dir)
                shutil.rmtree(step_dir)
                _fsync_dir(self.job_dir)
        except OSError as exc:
            raise TierUnavailable(f"tier disk: deleting step {step} in {step_dir} failed: "
                                  f"{_errno_text(exc)}") from exc
        log.info("tier_delete tier=disk step=%d", step)

    def apply_retention(self, keep: int) -> list[int]:
        """Delete all but the newest ``keep`` committed steps and older partial ones;
        bound to a run, only that run's (another run's steps are never deleted)."""
        steps, committed = self._scan()
        if self.run_id:
            steps, committed = runs.steps_of_run(self, steps, committed, self.run_id)
        victims = retention_victims(steps, committed, keep)
        for step in victims:
            self.delete_step(step)
        if victims:
            log.info("tier_retention tier=disk keep=%d deleted=%s", keep, victims)
        return victims

    def clean_abandoned(self, ranks: list[int]) -> list[tuple[int, int]]:
        """Remove the files of ``ranks`` whose write this run started and never finished
        (a crash mid-write) in uncommitted steps, and a step folder left empty; returns
        the (step, rank) pairs removed. Unbound: nothing."""
        if not self.run_id:
            return []
        steps, committed = self._scan()
        found = runs.abandoned_writes(self, steps, committed, ranks, self.run_id)
        for step, rank in found:
            step_dir = self.step_dir(step)
            names = (*rank_file_names(rank), runs.record_name(rank))
            try:
                _remove_stale_temps(step_dir, names)
                for name in names:
                    (step_dir / name).unlink(missing_ok=True)
                if not any(step_dir.iterdir()):
                    step_dir.rmdir()
            except OSError as exc:
                raise TierUnavailable(f"tier disk: cleaning step {step} rank {rank} in "
                                      f"{step_dir} failed: {_errno_text(exc)}") from exc
        if found:
            log.info("tier_cleaned tier=disk run=%s abandoned=%s", self.run_id, found)
        return found

    def check(self) -> None:
        """Create the job folder, write and remove a probe file, check free space.

        Raises TierUnavailable (path, errno text) when not writable or below min_free_bytes."""
        job_dir = self.job_dir
        probe = job_dir / f".probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            job_dir.mkdir(parents=True, exist_ok=True)
            atomic_write(probe, memoryview(b"phalanx"))
            probe.unlink()
            usage = shutil.disk_usage(job_dir)
        except OSError as exc:
            raise TierUnavailable(f"tier disk: {job_dir} is not writable: {_errno_text(exc)}; "
                                  "free space or fix permissions, or set tiers.disk.path") from exc
        if usage.free < self._min_free_bytes:
            raise TierUnavailable(f"tier disk: {job_dir} has {usage.free} bytes free, below the "
                                  f"{self._min_free_bytes} needed; free space or move tiers.disk.path")
        log.info("tier_check tier=disk path=%s free_bytes=%d total_bytes=%d",
                 job_dir, usage.free, usage.total)
