"""``phalanx drill run|inject|chaos|list``: run a job with a scenario's faults (each run a
separate ``phalanx launch`` process, as a user runs them), optionally against a fault-free
reference (run now or cached by config hash), and write the drill report."""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Sequence

import yaml
from rich.console import Console
from rich.markup import escape
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from phalanx.configs.errors import ConfigError, MembershipUnavailable
from phalanx.configs.loader import load_config
from phalanx.launcher.drills.chaos import chaos_scenario
from phalanx.launcher.drills.report import (RunOutcome, build_report, console_rows, goodput_text,
                                            write_report)
from phalanx.launcher.run_summary import read_summary
from phalanx.launcher.drills.scenario import (Scenario, check_targets, load_scenario, parse_fault,
                                             parse_scenario)
from phalanx.launcher.events import read_events
from phalanx.runtime.logs import current_format

HASH_RE = re.compile(r"^rank (\d+) final parameter hash ([0-9a-f]{64})$", re.M)
RUN_RE = re.compile(r"^run directory: (.+)$", re.M)
REFERENCES = "references"      # under job.run_dir: cached fault-free hashes by config hash
DEFAULT_CONFIG = "configs/demo.yaml"    # a file of a source checkout, relative to the cwd


def add_drill_parser(sub: Any) -> None:
    drill = sub.add_parser("drill", help="fault drills: run a scenario, inject into a running "
                           "job, or a seeded chaos campaign")
    verbs = drill.add_subparsers(dest="drill_command", required=True)
    run = verbs.add_parser("run", help="run a job with a drill scenario's faults and check "
                           "its expectations")
    run.add_argument("scenario", help="drill file (e.g. configs/drills/kill_worker.yaml)")
    _job_args(run)
    run.add_argument("--verify", action="store_true", help="compare final parameters with "
                     "a fault-free run of the same config (cached by config hash)")
    run.add_argument("--fresh-reference", action="store_true",
                     help="with --verify: run the fault-free reference even if cached")
    inject = verbs.add_parser("inject", help="inject one fault into a running job")
    inject.add_argument("fault", help="fault kind (phalanx drill list)")
    inject.add_argument("--job", default=None, help="run directory of the job (default: the "
                        "newest run under .phalanx/runs)")
    inject.add_argument("--rank", type=int, help="target rank")
    inject.add_argument("--node", type=int, help="target node index")
    inject.add_argument("--role", help="target role (spare, etcd, s3, coordinator)")
    inject.add_argument("--at-step", type=int, help="fire when the job reaches this step")
    inject.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                        help="fault parameter (repeatable; JSON values)")
    chaos = verbs.add_parser("chaos", help="a seeded, bounded random sequence of recoverable "
                             "faults, verified bit-identical")
    chaos.add_argument("--faults", type=int, default=10, help="how many faults")
    chaos.add_argument("--seed", type=int, default=0, help="seed (same seed, same faults)")
    chaos.add_argument("--max-minutes", type=float, default=10.0,
                       help="bound on the drilled run's wall time")
    _job_args(chaos)
    verbs.add_parser("list", help="the fault catalogue")


def _job_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help=f"job config to drill (default: {DEFAULT_CONFIG}, "
                        "in a source checkout)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a config key (repeatable)")


def run_drill_command(args: argparse.Namespace, console: Console) -> int:
    if args.drill_command in ("run", "chaos"):
        args.config = job_config(args.config, f"phalanx drill {args.drill_command}")
    if args.drill_command == "run":
        return run_scenario(args.config, args.overrides, args.scenario, console,
                            verify=args.verify, fresh_reference=args.fresh_reference)
    if args.drill_command == "inject":
        return inject_fault(args, console)
    if args.drill_command == "chaos":
        return run_chaos(args, console)
    return list_faults(console)


def job_config(given: str | None, command: str) -> str:
    """The job config a drill runs: ``--config``, else ``configs/demo.yaml`` when the
    current directory is a phalanx source checkout. Raises ConfigError otherwise."""
    if given:
        return given
    if Path(DEFAULT_CONFIG).is_file():
        return DEFAULT_CONFIG
    raise ConfigError("--config", f"not given, and the default {DEFAULT_CONFIG} (a file of a "
                      f"phalanx source checkout) is not in {Path.cwd()}",
                      "pass the job to drill: --config path/to/job.yaml (a job config like "
                      "the repository's configs/demo.yaml), or run from a checkout", command)


def run_scenario(config: str, overrides: Sequence[str], scenario_path: str, console: Console,
                 *, verify: bool = False, fresh_reference: bool = False,
                 scenario: Scenario | None = None) -> int:
    """Exit 0 when every expectation held, 1 otherwise."""
    scenario = scenario or load_scenario(scenario_path)
    overrides = [*scenario.override_args(), *overrides]
    with DrillServices(scenario, console) as services:
        overrides += services.overrides
        cfg = load_config(config, overrides)     # bad input fails before any run
        check_targets(scenario, cfg.job.world_size, max(cfg.job.nodes, cfg.ray.virtual_nodes))
        console.print(f"drill {scenario.name}: {scenario.description}", markup=False)
        reference, source = (reference_hashes(config, overrides, console, fresh_reference)
                             if verify else (None, "none (run with --verify)"))
        console.print(f"drilled run: {len(scenario.faults)} fault(s) injected")
        run = launch_with_standby if "standby" in scenario.needs else launch
        drilled = run(config, [*overrides, f"drills.scenario={scenario_path}"])
    events = read_events(drilled.run_dir / "events.jsonl") if drilled.run_dir else []
    failed = next((e for e in events if e["event"] == "job_failed"), None)
    if failed is not None:
        drilled = RunOutcome(drilled.returncode, drilled.hashes, drilled.run_dir,
                             f"{failed['error_type']}: {failed['message']}", drilled.seconds)
    report = build_report(scenario, drilled, reference, source, events,
                          read_summary(drilled.run_dir) if drilled.run_dir else None)
    _print_report(report, console)
    if drilled.run_dir is not None:
        for path in write_report(report, drilled.run_dir):
            console.print(f"report: {path}", soft_wrap=True, highlight=False, markup=False)
    console.print("drill PASSED" if report["passed"] else "drill FAILED")
    return 0 if report["passed"] else 1


def _print_report(report: dict[str, Any], console: Console) -> None:
    for fault in report["faults"]:
        console.print(_fault_line(fault), highlight=False, markup=False)
    table = Table(title=f"drill {report['scenario']['name']}")
    for column in ("check", "expected", "measured", "result"):
        table.add_column(column)
    for row in console_rows(report):
        table.add_row(*(escape(str(cell)) for cell in row))
    console.print(table)
    console.print(goodput_text(report), highlight=False, markup=False)


def _fault_line(fault: dict[str, Any]) -> str:
    recovery = fault.get("recovery") or {}
    text = f"  {fault['kind']} of {fault['target']} at step {fault.get('step')}: "
    if fault.get("detection_s") is not None:
        text += f"detected in {fault['detection_s']:.3f} s, "
    if fault.get("recovery_s") is not None:
        up = recovery.get("workers_up_s")
        text += (f"first step after {fault['recovery_s']:.3f} s"
                 + ("" if up is None else f" (new workers running after {up:.3f} s)")
                 + ", lost "
                 f"{recovery.get('lost_steps')} step(s), restored from "
                 f"{sorted({r.get('source_kind') for r in recovery.get('restores', [])})}")
    else:
        text += fault.get("no_recovery") or "no recovery"
    return text


def launch_command(config: str, overrides: Sequence[str]) -> list[str]:
    """``phalanx launch`` of ``config`` with ``overrides``, in this process's log format."""
    cmd = [sys.executable, "-m", "phalanx.launcher.cli", "--log-format", current_format(),
           "launch", config]
    for item in overrides:
        cmd += ["--set", item]
    return cmd


def launch(config: str, overrides: Sequence[str]) -> RunOutcome:
    cmd = launch_command(config, overrides)
    started = time.monotonic()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True)
    run = RUN_RE.search(proc.stdout)
    run_dir = Path(run.group(1)) if run else _latest_run(config, overrides)
    return RunOutcome(proc.returncode, {int(r): h for r, h in HASH_RE.findall(proc.stdout)},
                      run_dir, "" if proc.returncode == 0 else f"exit {proc.returncode}",
                      round(time.monotonic() - started, 2))


def _latest_run(config: str, overrides: Sequence[str]) -> Path | None:
    """A failed launch prints no run directory: the newest one under job.run_dir."""
    latest = Path(load_config(config, overrides).job.run_dir) / "latest"
    return Path(latest.read_text().strip()) if latest.is_file() else None


def reference_hashes(config: str, overrides: Sequence[str], console: Console,
                     fresh: bool = False) -> tuple[dict[int, str] | None, str]:
    """Final hashes of the fault-free run of this config: cached under
    ``<job.run_dir>/references/<sha256 of the effective config>.json``."""
    free = [*overrides, "drills.scenario=''"]
    cfg = load_config(config, free)
    key = computation_key(cfg)
    cache = Path(cfg.job.run_dir) / REFERENCES / f"{key}.json"
    if cache.is_file() and not fresh:
        console.print(f"fault-free reference: cached {cache}", markup=False)
        return {int(r): h for r, h in json.loads(cache.read_text())["hashes"].items()}, \
            f"cached reference {cache}"
    console.print("fault-free reference run")
    outcome = launch(config, free)
    if outcome.returncode == 0 and not outcome.hashes:
        raise ConfigError(
            "job.entrypoint", f"{cfg.job.entrypoint} ran without a phalanx.Session: its "
            "fault-free run finished (exit 0), but no rank counted a step or reported its "
            "state, so a fault triggered at a step would never fire and there is no final "
            "state to compare", "make the script fault tolerant with a phalanx.Session "
            "(docs/porting.md, section 2: seven lines), then drill it; an unchanged script "
            "fails on a fault as it would under torchrun", source=config)
    if outcome.returncode != 0 or not outcome.hashes:
        console.print(f"the fault-free run failed (exit {outcome.returncode}); the drill "
                      "cannot be verified")
        return None, f"fault-free run failed (exit {outcome.returncode})"
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"hashes": outcome.hashes, "run_dir": str(outcome.run_dir)}))
    return outcome.hashes, f"fault-free run {outcome.run_dir}"


def computation_key(cfg: Any) -> str:
    """What a run's final parameters depend on: the entrypoint (name and file content), its
    arguments (``job.args``, a script's ``job.argv``), the world size and torch's threads.
    Placement, spares, snapshots and tiers do not change the result (the master
    assertion), so drills with different ones share one reference."""
    job = cfg.job
    script = Path(job.entrypoint.partition(":")[0])
    what = {"entrypoint": job.entrypoint, "args": job.args, "argv": job.argv,
            "world_size": job.world_size,
            "torch_threads": job.torch_threads,     # and the script's own bytes
            "script": hashlib.sha256(script.read_bytes()).hexdigest() if script.is_file()
            else ""}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:20]


class DrillServices:
    """What a scenario ``needs`` beyond the job's config: a local S3 endpoint (moto) when
    the config names none. Yields the config overrides that point the job at them."""

    def __init__(self, scenario: Scenario, console: Console) -> None:
        self.scenario = scenario
        self.console = console
        self.overrides: list[str] = []
        self._closers: list[Any] = []

    def __enter__(self) -> "DrillServices":
        if "standby" in self.scenario.needs:
            self._start_standby_services()
        if "s3" in self.scenario.needs:
            from phalanx.launcher.drills.local_s3 import start_local_s3

            s3 = start_local_s3("phalanx-drill")
            self._closers.append(s3.close)
            self.overrides += ["tiers.s3.enabled=true", f"tiers.s3.endpoint_url={s3.endpoint_url}",
                               f"tiers.s3.bucket={s3.bucket}"]
            self.console.print(f"local S3 endpoint for the drill: {s3.endpoint_url}",
                               markup=False)
        return self

    def _start_standby_services(self) -> None:
        """A standby launcher needs services that outlive the leader: an etcd and a Ray
        cluster of their own processes, as an operator's would be."""
        import tempfile

        from phalanx.launcher.services.etcd_server import EmbeddedEtcd

        data = Path(tempfile.mkdtemp(prefix="phalanx-drill-etcd-"))
        self._closers.append(lambda: shutil.rmtree(data, ignore_errors=True))
        etcd = EmbeddedEtcd(data / "etcd").start()
        self._closers.append(etcd.close)
        ray_proc = subprocess.Popen([sys.executable, "-m", "phalanx.launcher.services.ray_cluster", "--nodes",
                                     "2", "--cpus-per-node", "4"], stdout=subprocess.PIPE,
                                    text=True)
        self._closers.append(lambda: _stop(ray_proc))
        assert ray_proc.stdout is not None
        address = json.loads(ray_proc.stdout.readline())["address"]
        self.overrides += ["coordinator.standby=true", f"etcd.endpoints=[{etcd.endpoint!r}]",
                           f"ray.address={address}"]
        self.console.print(f"standby drill: etcd {etcd.endpoint}, Ray {address}", markup=False)

    def __exit__(self, *exc: object) -> None:
        for close in reversed(self._closers):
            close()


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()


def launch_with_standby(config: str, overrides: Sequence[str]) -> RunOutcome:
    """The leader and, once it leads a running job, a standby: the scenario kills the
    leader; the standby's outcome is the run's (its stdout has the final hashes)."""
    cmd = launch_command(config, overrides)
    started = time.monotonic()
    leader = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True)
    root = Path(load_config(config, overrides).job.run_dir)
    before = (root / "latest").read_text() if (root / "latest").is_file() else ""
    while leader.poll() is None and not _placed(root, before):
        time.sleep(0.2)
    standby = subprocess.run(cmd + ["--standby"], stdout=subprocess.PIPE, stderr=None,
                             text=True)
    leader.wait()
    run = RUN_RE.search(standby.stdout)
    return RunOutcome(standby.returncode, {int(r): h for r, h in HASH_RE.findall(standby.stdout)},
                      Path(run.group(1)) if run else _latest_run(config, overrides),
                      "" if standby.returncode == 0 else f"exit {standby.returncode}",
                      round(time.monotonic() - started, 2))


def _placed(root: Path, before: str) -> bool:
    """The leader's new run has placed its workers (its state is published)."""
    latest = root / "latest"
    if not latest.is_file() or latest.read_text() == before:
        return False
    events = Path(latest.read_text().strip()) / "events.jsonl"
    return events.is_file() and '"placement"' in events.read_text()


def inject_fault(args: argparse.Namespace, console: Console) -> int:
    """Write the fault under the job's ``drills/inject/`` key in etcd; the launcher fires it
    within a poll and records it in the run's events."""
    from phalanx.launcher.drills.injector import INJECT_PREFIX
    from phalanx.launcher.rundir import RunDir
    from phalanx.runtime.membership.etcd import EtcdMembership, client_options, job_prefix

    run = RunDir.find(args.job, source="phalanx drill inject --job")
    target = {k: v for k, v in (("rank", args.rank), ("node", args.node), ("role", args.role))
              if v is not None}
    params = dict(_param(p) for p in args.param)
    fault: dict[str, Any] = {"kind": args.fault, "target": target, "params": params,
                             "trigger": {"at_step": args.at_step} if args.at_step else
                             {"at_time_s": 0}}
    parse_fault(fault, "fault", "phalanx drill inject")    # refuse bad input here, not later
    _check_drills_on(run.path)
    info = run.read_job()
    try:
        membership = EtcdMembership(list(info["etcd_endpoints"]),
                                    job_prefix(info["etcd_prefix"], info["job"]),
                                    **client_options(**info.get("etcd_client", {}))).connect()
    except MembershipUnavailable as exc:
        console.print(f"phalanx drill inject: the job {info['job']} of {run.path} cannot be "
                      f"reached (its etcd does not answer: {exc}); is it still running? "
                      "`phalanx status` tells", markup=False, highlight=False)
        return 1
    try:
        membership.put(f"{INJECT_PREFIX}{uuid.uuid4().hex[:12]}", json.dumps(fault).encode())
    finally:
        membership.close()
    console.print(f"injected {args.fault} into job {info['job']} ({run.path}); its drill_fault "
                  "event lands in events.jsonl", markup=False)
    return _await_fired(run.path / "events.jsonl", args.fault, console)


def _check_drills_on(run_path: Path) -> None:
    """Refuse to inject into a job launched without drills: it has no injector to fire the
    fault (nor drill hooks in its workers), so the fault would sit in etcd unfired."""
    try:
        saved = yaml.safe_load((run_path / "config.yaml").read_text(encoding="utf-8")) or {}
        drills = saved.get("drills") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return                      # no readable saved config: let the launcher decide
    if not drills.get("enabled") and not drills.get("scenario"):
        raise ConfigError("drills.enabled", f"is false for the job of {run_path}: it was "
                          "launched without drills, so nothing in it fires injected faults",
                          "launch the job with --set drills.enabled=true (or with a "
                          "drills.scenario), then inject into it", "phalanx drill inject")


def _await_fired(events_path: Path, kind: str, console: Console, timeout_s: float = 15.0) -> int:
    seen = len(read_events(events_path)) if events_path.exists() else 0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        events = read_events(events_path) if events_path.exists() else []
        fired = [e for e in events[seen:] if e["event"] == "drill_fault" and e["kind"] == kind]
        if fired:
            console.print(f"fired at step {fired[-1]['step']}: {fired[-1].get('details')}",
                          markup=False)
            return 0
        time.sleep(0.2)
    console.print(f"not fired within {timeout_s:.0f} s (is the job running, or is its step "
                  "trigger still ahead?)")
    return 1


def _param(text: str) -> tuple[str, Any]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise ConfigError("--param", f"{text!r} is not NAME=VALUE", "e.g. --param for_s=2")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def run_chaos(args: argparse.Namespace, console: Console) -> int:
    cfg = load_config(args.config, args.overrides)
    if not isinstance(cfg.job.args.get("steps"), int):
        console.print("chaos needs a job whose entrypoint takes a `steps` argument "
                      "(job.args.steps), to fit the faults in")
        return 2
    raw = chaos_scenario(cfg, args.faults, args.seed, args.max_minutes)
    path = Path(cfg.job.run_dir) / f"chaos-seed{args.seed}-n{args.faults}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    scenario = parse_scenario(raw, str(path))
    console.print(f"chaos: {len(scenario.faults)} faults from seed {args.seed} -> {path}",
                  markup=False)
    for spec in scenario.faults:
        console.print(f"  {spec.kind} of {spec.target_text()} {spec.trigger_text()}",
                      highlight=False, markup=False)
    return run_scenario(args.config, args.overrides, str(path), console, verify=True,
                        scenario=scenario)


def list_faults(console: Console) -> int:
    """The catalogue, one block per kind: whole names and texts at any terminal width."""
    from phalanx.launcher.drills.catalogue import FAMILIES, catalogue

    kinds = catalogue()
    console.print(f"fault catalogue: {len(kinds)} kinds, by family (use them in a scenario's "
                  "faults, or with phalanx drill inject KIND)", markup=False, highlight=False)
    for family in FAMILIES:
        members = sorted(kind for kind, mech in kinds.items() if mech.family == family)
        if members:
            console.print()
            console.print(Text(family, style="bold"))
        for kind in members:
            mech = kinds[kind]
            target = f"role {'/'.join(mech.roles)}" if mech.target == "role" else mech.target
            params = ", ".join(f"{n}={d!r}" for n, (_, d) in mech.params.items())
            console.print(Text.assemble(("  " + kind, "bold"), f"  (target: {target})"),
                          no_wrap=True, overflow="ignore", crop=False)
            for label, text in (("fault", mech.summary), ("phalanx", mech.response),
                                ("params", params or "no parameters")):
                console.print(Padding(Text(f"{label}: {text}"), (0, 0, 0, 4), expand=False),
                              highlight=False)
    return 0
