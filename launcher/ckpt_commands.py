"""``phalanx ckpt ls|verify|export``: inspect the checkpoints of the disk and S3 tiers.

Listings are decided purely from object listings (``summarize_steps``); the tier accessors
only fetch. Exit codes: 0 ok, 1 a check failed or a tier refused, 2 bad input.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence, TextIO

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from phalanx.configs.errors import (ConfigError, TierUnavailable)
from phalanx.launcher.rundir import LATEST, RunDir
from phalanx.runtime.tiers.disk import STEP_RE, DiskTier, rank_file_names

if TYPE_CHECKING:                # torch and boto3 load only when a command needs them

    from phalanx.configs.schema import PhalanxConfig

from phalanx.launcher.ckpt_inventory import (iso_time, job_folders, Access, DiskAccess, EXIT_FAILED,
                                             EXIT_OK, EXIT_USAGE, RankVerdict, S3Access,
                                             StepListing, usage_error, check_rank, export_rank,
                                             list_steps, verify_step)

log = logging.getLogger(__name__)


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
                        "security.secret_file, or the run's own secret for a run's "
                        "config.yaml; none skips the HMAC check)")
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
        secret = read_secret(args.secret_file, cfg, args.config)
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
        rows = [s.to_json() for tier_steps in listings for s in tier_steps]
        out.write(json.dumps({"steps": rows}, indent=2) + "\n")
        return EXIT_OK
    for access, steps in zip(accesses, listings):
        if not steps:
            console.print(f"tier {access.tier.name} {escape(access.location)}: no steps",
                          highlight=False, soft_wrap=True)
            continue
        table = Table(title=f"tier {access.tier.name}  {escape(access.location)}")
        for column in ("step", "state", "ranks", "bytes", "created_at", "run"):
            table.add_column(column)
        for s in steps:
            state = s.state + (f" (missing {_ranges(s.missing_ranks)})" if s.missing_ranks else "")
            table.add_row(str(s.step), state, _ranges(s.ranks), _size(s.total_bytes),
                          iso_time(s.created_at), escape(s.run or "-"))
        console.print(table)
    return EXIT_OK


def _pick_step(access: Access, step: int | None) -> StepListing:
    steps = list_steps(access)
    name, where = access.tier.name, access.location
    if step is None:
        committed = [s for s in steps if s.committed]
        if not committed:
            raise usage_error("--step", f"tier {name} at {where} has no committed step",
                         "pass --step N to check a partial one" if steps else
                         "check --path/--config: the tier holds no steps")
        return committed[-1]
    for listing in steps:
        if listing.step == step:
            return listing
    have = ", ".join(f"{s.step} ({s.state})" for s in steps) or "none"
    raise usage_error("--step", f"step {step} does not exist in tier {name} at {where}",
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
        raise usage_error("--out", f"{existing[0]} already exists ({len(existing)} of the "
                     f"{len(targets)} files to write)", "pass --force to overwrite them, or "
                     "choose another --out")
    if out_dir.exists() and not out_dir.is_dir():
        raise usage_error("--out", f"{out_dir} is not a folder", "choose a folder path for --out")
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
        raise usage_error("--out", f"writing into {out_dir} failed: {exc}",
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
        raise usage_error("--config", "no tier given", "pass --config CONFIG (the job's YAML with "
                     "tiers.disk/tiers.s3) or --path DIR (a disk tier root)")
    if args.overrides and not args.config:
        raise usage_error("--set", "overrides need a config", "pass --config CONFIG with --set")
    if not args.config:
        return None
    from phalanx.configs.loader import RETIRED_KEYS, load_config
    saved = RunDir.of_config(args.config) is not None   # written by an older phalanx, maybe
    return load_config(args.config, args.overrides, drop=RETIRED_KEYS if saved else ())


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
            raise usage_error("--tier", f"{args.config} enables neither tiers.disk nor tiers.s3",
                         "pass --tier disk or --tier s3")
    return [_disk(args, cfg) if name == "disk" else _s3(args, cfg) for name in names]


def _disk(args: argparse.Namespace, cfg: PhalanxConfig | None) -> DiskAccess:
    if args.path:
        root = Path(args.path)
        if not root.is_dir():
            raise usage_error("--path", f"{root} is not a folder", "pass the disk tier root (the "
                         "folder holding <job>/step_*/)")
    elif cfg is not None and cfg.tiers.disk.path:
        root = Path(cfg.tiers.disk.path)
    elif args.config and (run := RunDir.of_config(args.config)) is not None:
        root = run.path / "checkpoints"     # a run's saved config from before paths were kept
    else:
        root = _latest_checkpoints(cfg.job.run_dir if cfg else ".phalanx/runs")
    job = args.job or (cfg.job.name if cfg is not None else None)
    if job is None:
        root, job = _detect_job(root)
    return DiskAccess(DiskTier(root, job))


def _s3(args: argparse.Namespace, cfg: PhalanxConfig | None) -> S3Access:
    if cfg is None:
        raise usage_error("--tier", "tier s3 needs a config with tiers.s3", "pass --config CONFIG")
    if not cfg.tiers.s3.bucket:
        raise usage_error("tiers.s3.bucket", f"is empty in {args.config}",
                     "set it in the config or with --set tiers.s3.bucket=NAME")
    from phalanx.runtime.tiers.s3 import S3Tier
    return S3Access(S3Tier(cfg.tiers.s3, args.job or cfg.job.name, deadline_s=30.0))


def _latest_checkpoints(run_root: str) -> Path:
    """``<newest run>/checkpoints``: the disk tier of a run when tiers.disk.path is empty."""
    latest = Path(run_root) / LATEST
    if not latest.is_file():
        where = "" if Path(run_root).is_absolute() else f" (in {Path.cwd()})"
        raise usage_error("tiers.disk.path", f"is empty and no run was found under "
                          f"{run_root!r}{where}", "pass --config <run dir>/config.yaml or "
                          "--path DIR, set tiers.disk.path, or run this where you launched from")
    return Path(latest.read_text().strip()) / "checkpoints"




def _detect_job(root: Path) -> tuple[Path, str]:
    """(tier root, job) from --path alone: a job folder itself, or a root with one job."""
    if any(STEP_RE.match(p.name) for p in root.iterdir()):
        return root.resolve().parent, root.resolve().name
    jobs = job_folders(root)
    if len(jobs) == 1:
        return root, jobs[0]
    raise usage_error("--job", f"{root} holds " + (f"several jobs: {', '.join(jobs)}" if jobs
                                               else "no job folder with step_* folders"),
                 "pass --job NAME" if jobs else "pass the disk tier root as --path")


def _one(accesses: list[Access], command: str) -> Access:
    if len(accesses) > 1:
        raise usage_error("--tier", f"ckpt {command} checks one tier, and the config enables "
                     f"{' and '.join(a.tier.name for a in accesses)}",
                     "pass --tier disk or --tier s3")
    return accesses[0]


def read_secret(path: str | None, cfg: PhalanxConfig | None,
                config_file: str | None = None) -> bytes | None:
    """The job secret from ``path`` (--secret-file), else the config's
    security.secret_file, else, for a run's saved config (``config_file``), the secret that
    run generated; None when none is found. Raises ConfigError."""
    key = "--secret-file"
    if not path and cfg is not None:
        path, key = cfg.security.secret_file, "security.secret_file"
    run = RunDir.of_config(config_file) if config_file and not path else None
    if run is not None and (run.path / "secret").is_file():
        path, key = str(run.path / "secret"), "the run's secret"
    if not path:
        return None
    try:
        with open(path, "rb") as fh:
            secret = fh.read().rstrip(b"\r\n")  # text secrets (hex) end in a newline
    except OSError as exc:
        raise usage_error(key, f"{path} cannot be read: {exc.strerror or exc}",
                     "pass a readable file holding the job secret") from exc
    if not secret:
        raise usage_error(key, f"{path} is empty", "write the job secret into it")
    return secret


# ------------------------------------------------------------------------ formatting



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
