"""``phalanx status``: the live state of a running job read from etcd: members (rank,
worker, node, step), and per rank what the keepers hold (last local and replicated step,
holders), the committed step, the bytes each keeper holds, and the newest events (faults,
recoveries, tier alerts such as ``tier_degraded``)."""
from __future__ import annotations

import json
import time

from rich.console import Console
from rich.table import Table

from phalanx.configs.errors import MembershipUnavailable
from phalanx.launcher.coordination.commit_tracker import read_reports
from phalanx.launcher.events import EVENTS_PREFIX
from phalanx.launcher.rundir import RunDir
from phalanx.runtime.commit import COMMIT_KEY, KeeperReport, committed_from
from phalanx.runtime.membership.etcd import EtcdMembership, client_options, job_prefix

EVENTS_SHOWN = 10


def show_status(run: RunDir, console: Console, timeout_s: float = 3.0) -> int:
    """Print the tables; returns 0, or 3 when the job's etcd does not answer."""
    info = run.read_job()
    try:
        membership = EtcdMembership(list(info["etcd_endpoints"]),
                                    job_prefix(info["etcd_prefix"], info["job"]),
                                    timeout_s=timeout_s,
                                    **client_options(**info.get("etcd_client", {}))).connect()
    except MembershipUnavailable as exc:
        console.print(f"job {info['job']} is not running (etcd {info['etcd_endpoints']} "
                      f"does not answer: {exc}); run directory {run.path}")
        return 3
    try:
        members = membership.members()
        generation = membership.get("generation")
        commit = membership.get(COMMIT_KEY)
        reports = read_reports(membership)
        events = [json.loads(kv.value) for kv in membership.list_prefix(EVENTS_PREFIX)]
    finally:
        membership.close()
    committed = committed_from(commit.value if commit else None)
    console.print(f"job {info['job']}  generation {int(generation.value) if generation else 0}"
                  f"  committed step {committed}  run {run.path.name}")
    console.print(_members_table(members))
    console.print(_ranks_table(reports, info.get("world_size", 0), committed))
    if events:
        console.print(_events_table(events[-EVENTS_SHOWN:]))
    return 0


def _members_table(members: dict) -> Table:
    table = Table(title="members")
    for column in ("rank", "worker", "node", "step", "generation", "state", "pid", "age s"):
        table.add_column(column)
    now = time.time()
    for record in sorted(members.values(), key=lambda r: (r.rank, r.worker_id)):
        age = now - float(record.extra.get("time", now))
        table.add_row("keeper" if record.rank < 0 else str(record.rank), record.worker_id,
                      record.node, str(record.step), str(record.generation),
                      str(record.extra.get("state", record.extra.get("role", "?"))),
                      str(record.pid), f"{age:.1f}")
    return table


def _ranks_table(reports: dict[str, KeeperReport], world_size: int, committed: int) -> Table:
    table = Table(title=f"snapshots (committed step {committed})")
    for column in ("rank", "last local step", "last replicated step", "holders"):
        table.add_column(column)
    for rank in range(world_size):
        local = [max(r.local[rank]) for r in reports.values() if r.local.get(rank)]
        replicated = [max(r.replicas[rank]) for r in reports.values() if r.replicas.get(rank)]
        holders = sorted(n for n, r in reports.items() if r.replicas.get(rank))
        table.add_row(str(rank), str(max(local, default=-1)), str(max(replicated, default=-1)),
                      ",".join(holders) or "-")
    for node, report in sorted(reports.items()):
        table.add_row(f"keeper {node}", "", "", f"{report.bytes_held / 2**20:.1f} MiB held")
    return table


def _events_table(events: list[dict]) -> Table:
    """The newest events, oldest first (the whole log is ``events.jsonl`` in the run dir)."""
    table = Table(title=f"recent events (newest {len(events)})")
    for column in ("time", "event", "details"):
        table.add_column(column)
    for event in events:
        details = " ".join(f"{k}={v}" for k, v in sorted(event.items())
                           if k not in ("time", "event"))
        table.add_row(time.strftime("%H:%M:%S", time.localtime(float(event.get("time", 0)))),
                      str(event.get("event", "?")), details)
    return table
