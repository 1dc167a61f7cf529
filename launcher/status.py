"""``phalanx status``: the live member table of a running job, read from etcd."""
from __future__ import annotations

import json
import time

from rich.console import Console
from rich.table import Table

from configs.errors import MembershipUnavailable
from launcher.rundir import RunDir
from runtime.membership_etcd import EtcdMembership, job_prefix


def show_status(run: RunDir, console: Console, timeout_s: float = 3.0) -> int:
    """Print the member table; returns 0, or 3 when the job's etcd does not answer."""
    info = run.read_job()
    try:
        membership = EtcdMembership(list(info["etcd_endpoints"]),
                                    job_prefix(info["etcd_prefix"], info["job"]),
                                    timeout_s=timeout_s).connect()
    except MembershipUnavailable as exc:
        console.print(f"job {info['job']} is not running (etcd {info['etcd_endpoints']} "
                      f"does not answer: {exc}); run directory {run.path}")
        return 3
    try:
        members = membership.members()
        generation = membership.get("generation")
    finally:
        membership.close()
    table = Table(title=f"job {info['job']}  generation "
                        f"{json.loads(generation.value) if generation else 0}  "
                        f"run {run.path.name}")
    for column in ("rank", "worker", "node", "step", "state", "pid", "age s"):
        table.add_column(column)
    now = time.time()
    for record in sorted(members.values(), key=lambda r: r.rank):
        age = now - float(record.extra.get("time", now))
        table.add_row(str(record.rank), record.worker_id, record.node, str(record.step),
                      str(record.extra.get("state", "?")), str(record.pid), f"{age:.1f}")
    console.print(table)
    return 0
