"""``phalanx ckpt ls|verify|export``: inspect the checkpoints of the disk and S3 tiers.

Listings are decided purely from object listings (``summarize_steps``); the tier accessors
only fetch. Exit codes: 0 ok, 1 a check failed or a tier refused, 2 bad input.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence, TextIO

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from phalanx.configs.errors import (ConfigError, SnapshotCorrupt, SnapshotNotFound,
                                    SnapshotUnauthenticated, TierUnavailable)
from phalanx.launcher.rundir import LATEST
from phalanx.runtime.tiers.disk import COMMIT_NAME, STEP_RE, DiskTier, atomic_write, rank_file_names

if TYPE_CHECKING:                # torch and boto3 load only when a command needs them
    import torch

    from phalanx.configs.schema import PhalanxConfig
    from phalanx.runtime.snapshot.format import Manifest
    from phalanx.runtime.base import Tier
    from phalanx.runtime.tiers.s3 import S3Tier

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
SOURCE = "phalanx ckpt"                    # the "file" named by our usage errors
TREE_SPEC_KEY = "phalanx_tree_spec"        # safetensors __metadata__ key of an export
_RANK_OBJECT_RE = re.compile(r"^rank_(\d+)\.(safetensors|json)$")
_TENSOR_RE = re.compile(r"tensor '([^']*)'")


def _usage(key: str, problem: str, hint: str) -> ConfigError:
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

    @property
    def state(self) -> str:
        return "committed" if self.committed else "partial"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "state": self.state, "ranks": list(self.ranks),
                "missing_ranks": list(self.missing_ranks), "created_at": _iso(self.created_at)}


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
            found = _job_folders(job_dir.parent)
            raise _usage("--job", f"tier disk has no job folder {job_dir}",
                         f"jobs under {job_dir.parent}: {', '.join(found)}" if found else
                         "check --path/tiers.disk.path: it should hold <job>/step_*/")
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
            page = tier._retry("list_objects_v2", tier._url(prefix), lambda extra=extra:
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
    return summarize_steps(access.tier.name, access.location, objects, markers)


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

def add_ckpt_parser(subparsers: Any) -> None:
    """Add ``ckpt`` with ``ls``, ``verify`` and ``export`` to the root's subparsers."""
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument("--tier", choices=("disk", "s3"), help="which tier (default: those the "
                       "config enables; disk with --path)")
    where.add_argument("--config", help="the job's YAML config (tiers.disk, tiers.s3, job.name)")
    where.add_argument("--set", dest="overrides", action="append", default=[],
                       metavar="KEY=VALUE", help="override a config key (repeatable)")
    where.add_argument("--path", help="disk tier root holding <job>/step_*/ (or a job folder)")
    where.add_argument("--job", help="job name (default: job.name, or the only job under --path)")
    secret = argparse.ArgumentParser(add_help=False)
    secret.add_argument("--secret-file", help="job secret to check manifest HMACs (default: "
                        "security.secret_file; none skips the HMAC check)")
    ckpt = subparsers.add_parser("ckpt", help="list, verify and export tier checkpoints")
    sub = ckpt.add_subparsers(dest="ckpt_command", required=True, metavar="{ls,verify,export}")
    ls = sub.add_parser("ls", parents=[where], help="list the steps of each tier")
    ls.add_argument("--json", action="store_true", help="print JSON to stdout")
    verify = sub.add_parser("verify", parents=[where, secret],
                            help="check manifests, HMACs and every tensor checksum of a step")
    verify.add_argument("--step", type=_step, help="step to check (default: newest committed)")
    verify.add_argument("--json", action="store_true", help="print JSON to stdout")
    export = sub.add_parser("export", parents=[where, secret],
                            help="write a verified step as plain safetensors files")
    export.add_argument("--step", type=_step, required=True, help="step to export")
    export.add_argument("--out", required=True, help="folder for rank_<r>.safetensors/.json")
    export.add_argument("--force", action="store_true", help="overwrite existing files")


def _step(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a step number (0 or more)")
    return int(text)


def run_ckpt(args: argparse.Namespace, console: Console, out: TextIO | None = None) -> int:
    """Run ``phalanx ckpt <command>``; human output to ``console``, ``--json`` to ``out``
    (stdout). Returns 0 ok, 1 a check failed or a tier refused, 2 bad input."""
    out = sys.stdout if out is None else out
    try:
        cfg = load_ckpt_config(args)
        accesses = resolve_accesses(args, cfg)
        if args.ckpt_command == "ls":
            return _ls(accesses, console, out, args.json)
        secret = read_secret(args.secret_file, cfg)
        access = _one(accesses, args.ckpt_command)
        if args.ckpt_command == "verify":
            return _verify(access, args.step, secret, console, out, args.json)
        return _export(access, args.step, secret, Path(args.out), args.force, console)
    except ConfigError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return EXIT_USAGE
    except TierUnavailable as exc:
        console.print(f"[red]tier unavailable:[/red] {escape(str(exc))}", highlight=False,
                      soft_wrap=True)
        return EXIT_FAILED


def _ls(accesses: list[Access], console: Console, out: TextIO, as_json: bool) -> int:
    listings = [list_steps(access) for access in accesses]
    if as_json:
        steps = [s.to_json() for tier_steps in listings for s in tier_steps]
        out.write(json.dumps({"steps": steps}, indent=2) + "\n")
        return EXIT_OK
    for access, steps in zip(accesses, listings):
        if not steps:
            console.print(f"tier {access.tier.name} {escape(access.location)}: no steps",
                          highlight=False, soft_wrap=True)
            continue
        table = Table(title=f"tier {access.tier.name}  {escape(access.location)}")
        for column in ("step", "state", "ranks", "bytes", "created_at"):
            table.add_column(column)
        for s in steps:
            state = s.state + (f" (missing {_ranges(s.missing_ranks)})" if s.missing_ranks else "")
            table.add_row(str(s.step), state, _ranges(s.ranks), _size(s.total_bytes),
                          _iso(s.created_at))
        console.print(table)
    return EXIT_OK


def _pick_step(access: Access, step: int | None) -> StepListing:
    steps = list_steps(access)
    name, where = access.tier.name, access.location
    if step is None:
        committed = [s for s in steps if s.committed]
        if not committed:
            raise _usage("--step", f"tier {name} at {where} has no committed step",
                         "pass --step N to check a partial one" if steps else
                         "check --path/--config: the tier holds no steps")
        return committed[-1]
    for listing in steps:
        if listing.step == step:
            return listing
    have = ", ".join(f"{s.step} ({s.state})" for s in steps) or "none"
    raise _usage("--step", f"step {step} does not exist in tier {name} at {where}",
                 f"pick one of the steps there: {have}")


def _verify(access: Access, step: int | None, secret: bytes | None, console: Console,
            out: TextIO, as_json: bool) -> int:
    listing = _pick_step(access, step)
    verdicts = verify_step(access.tier, listing, secret)
    # a partial step (no commit marker) is not restorable, however sound its ranks are
    ok = all(v.ok for v in verdicts) and listing.committed
    if as_json:
        out.write(json.dumps({"tier": listing.tier, "location": listing.location,
                              "step": listing.step, "committed": listing.committed,
                              "hmac_checked": secret is not None, "ok": ok,
                              "ranks": [asdict(v) for v in verdicts]}, indent=2) + "\n")
    else:
        _print_verdicts(listing, verdicts, secret is not None, console)
    return EXIT_OK if ok else EXIT_FAILED


def _print_verdicts(listing: StepListing, verdicts: list[RankVerdict], hmac_checked: bool,
                    console: Console) -> None:
    table = Table(title=f"tier {listing.tier} step {listing.step} ({listing.state})  "
                        f"{escape(listing.location)}")
    for column in ("rank", "result", "first bad tensor"):
        table.add_column(column)
    for v in verdicts:
        style = "green" if v.ok else "red"
        table.add_row(str(v.rank), f"[{style}]{v.status.upper()}[/{style}]", escape(v.tensor))
    console.print(table)
    for v in verdicts:
        if not v.ok:
            console.print(f"[red]{v.status}:[/red] {escape(v.error)}", highlight=False,
                          soft_wrap=True)
    good = sum(v.ok for v in verdicts)
    console.print(f"tier {listing.tier} step {listing.step}: {good}/{len(verdicts)} ranks OK; "
                  + ("HMAC checked" if hmac_checked else "HMAC not checked (no secret file)"),
                  highlight=False, soft_wrap=True)
    if not listing.committed:
        console.print(f"[red]partial:[/red] step {listing.step} has no commit marker (some rank "
                      "never finished writing): it is not restorable; verify a committed step",
                      highlight=False, soft_wrap=True)


def _export(access: Access, step: int, secret: bytes | None, out_dir: Path, force: bool,
            console: Console) -> int:
    listing = _pick_step(access, step)
    ranks = sorted(set(listing.ranks) | set(listing.missing_ranks))
    targets = [out_dir / name for rank in ranks for name in rank_file_names(rank)]
    existing = [str(t) for t in targets if t.exists()]
    if existing and not force:
        raise _usage("--out", f"{existing[0]} already exists ({len(existing)} of the "
                     f"{len(targets)} files to write)", "pass --force to overwrite them, or "
                     "choose another --out")
    if out_dir.exists() and not out_dir.is_dir():
        raise _usage("--out", f"{out_dir} is not a folder", "choose a folder path for --out")
    verdicts = verify_step(access.tier, listing, secret)
    if not all(v.ok for v in verdicts):
        _print_verdicts(listing, verdicts, secret is not None, console)
        console.print(f"[red]export refused:[/red] tier {listing.tier} step {listing.step} "
                      "failed verification; nothing was written", highlight=False)
        return EXIT_FAILED
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for rank in ranks:
            verdict, checked = check_rank(access.tier, listing.step, rank, secret)
            if checked is None:  # changed since the verify pass
                console.print(f"[red]export stopped:[/red] {escape(verdict.error)}",
                              highlight=False, soft_wrap=True)
                return EXIT_FAILED
            export_rank(checked, out_dir, rank)
    except OSError as exc:
        raise _usage("--out", f"writing into {out_dir} failed: {exc}",
                     "choose a writable folder with enough free space") from exc
    log.info("ckpt_export tier=%s step=%d ranks=%d out=%s", listing.tier, listing.step,
             len(ranks), out_dir)
    console.print(f"exported tier {listing.tier} step {listing.step} ({len(ranks)} ranks, "
                  f"HMAC {'checked' if secret is not None else 'not checked'}) to "
                  f"{escape(str(out_dir))}", highlight=False, soft_wrap=True)
    return EXIT_OK


# ------------------------------------------------------------- resolving the tiers

def load_ckpt_config(args: argparse.Namespace) -> PhalanxConfig | None:
    """The --config file with --set applied, or None with --path alone. Raises ConfigError."""
    if not args.config and not args.path:
        raise _usage("--config", "no tier given", "pass --config CONFIG (the job's YAML with "
                     "tiers.disk/tiers.s3) or --path DIR (a disk tier root)")
    if args.overrides and not args.config:
        raise _usage("--set", "overrides need a config", "pass --config CONFIG with --set")
    if not args.config:
        return None
    from phalanx.configs.loader import load_config
    return load_config(args.config, args.overrides)


def resolve_accesses(args: argparse.Namespace, cfg: PhalanxConfig | None) -> list[Access]:
    """The tiers named by --tier/--config/--path/--job. Raises ConfigError (exit 2)."""
    if args.tier:
        names = [args.tier]
    elif cfg is None:
        names = ["disk"]
    else:
        names = [n for n, on in (("disk", cfg.tiers.disk.enabled or args.path),
                                 ("s3", cfg.tiers.s3.enabled)) if on]
        if not names:
            raise _usage("--tier", f"{args.config} enables neither tiers.disk nor tiers.s3",
                         "pass --tier disk or --tier s3")
    return [_disk(args, cfg) if name == "disk" else _s3(args, cfg) for name in names]


def _disk(args: argparse.Namespace, cfg: PhalanxConfig | None) -> DiskAccess:
    if args.path:
        root = Path(args.path)
        if not root.is_dir():
            raise _usage("--path", f"{root} is not a folder", "pass the disk tier root (the "
                         "folder holding <job>/step_*/)")
    elif cfg is not None and cfg.tiers.disk.path:
        root = Path(cfg.tiers.disk.path)
    else:
        root = _latest_checkpoints(cfg.job.run_dir if cfg else ".phalanx/runs")
    job = args.job or (cfg.job.name if cfg is not None else None)
    if job is None:
        root, job = _detect_job(root)
    return DiskAccess(DiskTier(root, job))


def _s3(args: argparse.Namespace, cfg: PhalanxConfig | None) -> S3Access:
    if cfg is None:
        raise _usage("--tier", "tier s3 needs a config with tiers.s3", "pass --config CONFIG")
    if not cfg.tiers.s3.bucket:
        raise _usage("tiers.s3.bucket", f"is empty in {args.config}",
                     "set it in the config or with --set tiers.s3.bucket=NAME")
    from phalanx.runtime.tiers.s3 import S3Tier
    return S3Access(S3Tier(cfg.tiers.s3, args.job or cfg.job.name, deadline_s=30.0))


def _latest_checkpoints(run_root: str) -> Path:
    """``<newest run>/checkpoints``: the disk tier of a run when tiers.disk.path is empty."""
    latest = Path(run_root) / LATEST
    if not latest.is_file():
        raise _usage("tiers.disk.path", f"is empty and no run was found under {run_root!r}",
                     "set tiers.disk.path, pass --path DIR, or launch a job first")
    return Path(latest.read_text().strip()) / "checkpoints"


def _job_folders(root: Path) -> list[str]:
    try:
        return sorted(p.name for p in root.iterdir() if p.is_dir()
                      and any(STEP_RE.match(q.name) for q in p.iterdir()))
    except OSError:
        return []


def _detect_job(root: Path) -> tuple[Path, str]:
    """(tier root, job) from --path alone: a job folder itself, or a root with one job."""
    if any(STEP_RE.match(p.name) for p in root.iterdir()):
        return root.resolve().parent, root.resolve().name
    jobs = _job_folders(root)
    if len(jobs) == 1:
        return root, jobs[0]
    raise _usage("--job", f"{root} holds " + (f"several jobs: {', '.join(jobs)}" if jobs
                                               else "no job folder with step_* folders"),
                 "pass --job NAME" if jobs else "pass the disk tier root as --path")


def _one(accesses: list[Access], command: str) -> Access:
    if len(accesses) > 1:
        raise _usage("--tier", f"ckpt {command} checks one tier, and the config enables "
                     f"{' and '.join(a.tier.name for a in accesses)}",
                     "pass --tier disk or --tier s3")
    return accesses[0]


def read_secret(path: str | None, cfg: PhalanxConfig | None) -> bytes | None:
    """The job secret from ``path`` (--secret-file), else the config's
    security.secret_file; None when neither names one. Raises ConfigError."""
    key = "--secret-file"
    if not path and cfg is not None:
        path, key = cfg.security.secret_file, "security.secret_file"
    if not path:
        return None
    try:
        with open(path, "rb") as fh:
            secret = fh.read().rstrip(b"\r\n")  # text secrets (hex) end in a newline
    except OSError as exc:
        raise _usage(key, f"{path} cannot be read: {exc.strerror or exc}",
                     "pass a readable file holding the job secret") from exc
    if not secret:
        raise _usage(key, f"{path} is empty", "write the job secret into it")
    return secret


# ------------------------------------------------------------------------ formatting

def _iso(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.1f} {unit}"


def _ranges(ranks: Sequence[int]) -> str:
    """``0-3,5``: sorted ranks as compact ranges ("-" when none)."""
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in runs) or "-"
