"""The ``phalanx`` command line: launch, status (and the subcommands later issues add)."""
from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import signal
import sys
import traceback
from typing import Sequence

from rich.console import Console
from rich.markup import escape

from phalanx import __version__
from phalanx.configs.errors import ConfigError, PhalanxError, WorkerFailed
from phalanx.launcher.ckpt_commands import add_ckpt_parser, run_ckpt
from phalanx.launcher.drills.commands import add_drill_parser
from phalanx.runtime.logs import FORMATS, logging_configured

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_RUNNING = 0, 1, 2, 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="phalanx", description="Checkpointless training "
                                     "for PyTorch with elastic recovery.")
    parser.add_argument("--version", action="version", version=f"phalanx {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log events to stderr")
    parser.add_argument("--log-format", choices=FORMATS, default=FORMATS[0],
                        help="log lines as logfmt key=value (default) or JSON, in the launcher, "
                        "keepers and workers (rank logs)")
    sub = parser.add_subparsers(dest="command", required=True)
    launch = sub.add_parser("launch", help="run a training job from a YAML config")
    launch.add_argument("config", help="YAML config file (e.g. configs/demo.yaml)")
    launch.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a config key (repeatable)")
    launch.add_argument("--standby", action="store_true",
                        help="stand by for a job another launcher leads and take it over when "
                        "that launcher stops (needs coordinator.standby: true)")
    _add_resume(launch)
    run = sub.add_parser("run", help="run a training script like torchrun, with no YAML: "
                         "phalanx run --nnodes 2 --nproc-per-node 2 train.py --lr 0.1",
                         description="Run SCRIPT as __main__ on every rank with ARGS, like "
                         "`torchrun`; every other setting is the embedded default, a --config "
                         "file's or a --set override's.")
    run.add_argument("--nnodes", type=int, default=1, help="nodes (virtual nodes of this "
                     "machine's local Ray; default 1)")
    run.add_argument("--nproc-per-node", type=int, default=1,
                     help="ranks per node (default 1)")
    run.add_argument("--spares", type=int, default=0, help="warm spares (default 0)")
    run.add_argument("--max-restarts", type=int, default=None,
                     help="faults to recover from before the job fails, as torchrun's flag "
                     "(recovery.max_recoveries; default 20): a script with no phalanx.Session "
                     "restarts every rank from its top, one with a Session recovers in place")
    run.add_argument("--name", default="", help="job name (default: the script's name)")
    run.add_argument("--config", default=None, help="a YAML config to start from")
    run.add_argument("--set", dest="overrides", action="append", default=[],
                     metavar="KEY=VALUE", help="override a config key (repeatable)")
    _add_resume(run)
    run.add_argument("script", help="the training script (run as __main__)")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's arguments")
    status = sub.add_parser("status", help="show members, snapshots and the commit point of a "
                            "running job, or the summary of a finished one")
    status.add_argument("run_dir", nargs="?", help="run directory (default: the newest run)")
    status.add_argument("--json", action="store_true", help="print one JSON document (job, "
                        "state, generation, phase, ranks, copies held, events, goodput) to "
                        "stdout")
    add_drill_parser(sub)
    add_ckpt_parser(sub)
    return parser


def _add_resume(parser: argparse.ArgumentParser) -> None:
    from phalanx.launcher.resume import parse_resume

    parser.add_argument("--resume", nargs="?", const="latest", default=None, type=parse_resume,
                        metavar="STEP|latest", help="start from an earlier run's committed "
                        "checkpoint of this job (default: the latest), verified (world size, "
                        "HMAC, checksums) before anything starts: the restart after a total "
                        "loss")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if argv is None:   # the `phalanx` process: `kill -USR1 <pid>` prints every thread's stack
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    # the process's logging as it was once main returns (main also runs in-process: tests)
    with logging_configured(args.log_format, logging.INFO if args.verbose else logging.WARNING):
        return _command(args, Console(stderr=True))


def _command(args: argparse.Namespace, console: Console) -> int:
    """Run the parsed command; every error becomes a message and an exit code."""
    try:
        if args.command == "launch":
            return _launch(args, console)
        if args.command == "run":
            args.standby = False
            args.overrides = [*run_overrides(args), *args.overrides]
            return _launch(args, console)
        if args.command == "drill":
            from phalanx.launcher.drills.commands import run_drill_command

            return run_drill_command(args, console)
        if args.command == "ckpt":
            return run_ckpt(args, console)
        if args.command == "status":
            from phalanx.launcher.rundir import RunDir
            from phalanx.launcher.status import show_status
            return show_status(RunDir.find(args.run_dir), console, as_json=args.json)
    except ConfigError as exc:     # user text ([a, b], paths) is escaped: never read as markup
        console.print(f"[red]config error:[/red] {escape(str(exc))}", highlight=False)
        return EXIT_USAGE
    except WorkerFailed as exc:
        console.print(f"[red]job failed:[/red] rank {exc.rank}: {escape(exc.message)}",
                      highlight=False)
        console.print(exc.traceback_text, highlight=False, markup=False)
        return EXIT_FAILED
    except PhalanxError as exc:
        console.print(f"[red]job failed:[/red] {type(exc).__name__}: {escape(str(exc))}",
                      highlight=False)
        return EXIT_FAILED
    except KeyboardInterrupt:
        console.print("phalanx: interrupted; everything started was stopped")
        return 130
    except Exception as exc:  # process boundary: an unexpected error is reported, not hidden
        console.print("[red]phalanx internal error:[/red]", end=" ")
        console.print(f"{type(exc).__name__}: {exc}", highlight=False, markup=False)
        console.print(traceback.format_exc(), highlight=False, markup=False)
        return EXIT_FAILED
    return EXIT_USAGE


def run_overrides(args: argparse.Namespace) -> list[str]:
    """``phalanx run``'s arguments as config overrides (the command line's --set win)."""
    from pathlib import Path

    for flag, value in (("--nnodes", args.nnodes), ("--nproc-per-node", args.nproc_per_node)):
        if value < 1:
            raise ConfigError(flag, f"{value} is below 1", "use 1 or more")
    if args.spares < 0:
        raise ConfigError("--spares", f"{args.spares} is negative", "use 0 or more")
    if not args.script.endswith(".py"):
        raise ConfigError("script", f"{args.script!r} is not a Python script",
                          "name a .py file, e.g. phalanx run train.py --lr 0.1",
                          source="command line")
    name = args.name or "".join(c if c.isalnum() or c in "-_" else "-"
                                for c in Path(args.script).stem)
    values = {"job.entrypoint": args.script, "job.argv": list(args.script_args),
              "job.world_size": args.nnodes * args.nproc_per_node, "job.nodes": args.nnodes,
              "ray.virtual_nodes": args.nnodes, "spares.count": args.spares, "job.name": name}
    if args.nnodes < 2:           # no other node to hold a replica
        values["replication.factor"] = 0
    if args.max_restarts is not None:
        if args.max_restarts < 0:
            raise ConfigError("--max-restarts", f"{args.max_restarts} is negative",
                              "use 0 (a fault fails the job) or more")
        values["recovery.max_recoveries"] = args.max_restarts
    return [f"{key}={json.dumps(value)}" for key, value in values.items()]


def final_hash(outcome: dict) -> str | None:
    """A rank's final hash: the ``hash`` its entrypoint returned, else the digest of its
    Session's registered state (a script returns nothing; ``drill --verify`` compares it)."""
    result = outcome.get("result")
    if isinstance(result, dict) and result.get("hash"):
        return str(result["hash"])
    return outcome.get("state_digest")


def _launch(args: argparse.Namespace, console: Console) -> int:
    from pathlib import Path

    from phalanx.configs.loader import load_config
    from phalanx.launcher.preflight import check_before_start

    cfg = load_config(args.config, args.overrides)
    if cfg.drills.scenario:     # a scenario's own config overrides; the command line wins
        from phalanx.launcher.drills.scenario import load_scenario

        scenario = load_scenario(cfg.drills.scenario)
        cfg = load_config(args.config, [*scenario.override_args(), *args.overrides])
    check_before_start(cfg, Path.cwd(), args.config, args.overrides)   # before Ray and etcd
    from phalanx.launcher.job import JobRunner  # imports Ray and torch: only when launching

    result = JobRunner(cfg, console, standby=args.standby,
                       resume=getattr(args, "resume", None)).run()
    hashes = {rank: final_hash(value) for rank, value in result.results.items()
              if isinstance(value, dict)}
    for rank, digest in hashes.items():
        if digest:
            print(f"rank {rank} final parameter hash {digest}")
    sessionless = bool(result.results) and not any(
        isinstance(value, dict) and value.get("state_digest") for value in result.results.values())
    if sessionless:
        console.print(f"phalanx: no rank of job {cfg.job.name} ran a phalanx.Session: no step "
                      "was counted and nothing was snapshotted, so a fault restarts every rank "
                      "from the top of the script (torchrun's --max-restarts); "
                      "docs/porting.md shows the seven lines that make the script recover "
                      "in place", highlight=False, markup=False)
    for record in result.recoveries:
        if record.get("restarted"):
            print(f"restarted every rank from the top of its script after {record['fault']} "
                  f"of rank(s) {record['ranks']}: generation {record['generation']}, fault to "
                  f"restart {record['fault_to_first_step_s']:.2f} s")
            continue
        print(f"recovered from {record['fault']} of rank(s) {record['ranks']}: generation "
              f"{record['generation']}, rolled back to step {record['restore_step']}, fault to "
              f"first step {record['fault_to_first_step_s']:.2f} s")
    for node, held in result.keepers.items():
        summary = "; ".join(
            f"rank {rank}: " + ", ".join(
                f"{kind} steps {info[key]}" for kind, key in (("own", "local"), ("replica", "replica"))
                if info.get(key))
            for rank, info in sorted(held.items()))
        if summary:      # a keeper holding nothing (a job without a Session) says nothing
            print(f"keeper {node}: {summary}")
    if sessionless:
        print("goodput not measured: it counts the steps of a phalanx.Session")
    elif result.summary.get("goodput"):
        from phalanx.launcher.goodput import summary_line

        print(summary_line(result.summary["goodput"]))
    print(f"run directory: {result.run_dir}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
