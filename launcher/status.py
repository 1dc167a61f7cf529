"""``phalanx status``: one document describing a run, live or ended. A running job's comes
from its etcd (members with rank, worker, node, step and heartbeat age; generation; the
coordinator's phase; the committed step; what each keeper holds; the newest events, tier
alerts such as ``tier_degraded`` included) and its goodput so far and snapshot protection
(degraded after a ``snapshot_unprotected`` alert) from ``events.jsonl``; a
finished or failed run's from its ``summary.json``; a run whose launcher died without one
(its etcd does not answer) from what ``events.jsonl`` still tells. ``--json`` prints the
document; the default view renders it (``phalanx.launcher.status_view``)."""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from rich.console import Console

from phalanx.configs.errors import MembershipUnavailable
from phalanx.launcher.events import EVENTS_PREFIX
from phalanx.launcher.goodput import goodput_from_events
from phalanx.launcher.run_summary import read_run_events, read_summary, reconstruct
from phalanx.launcher.rundir import RunDir
from phalanx.launcher.status_view import render_status
from phalanx.runtime.base import MemberRecord, read_table
from phalanx.runtime.commit import COMMIT_KEY, KeeperReport, committed_from, reports_of
from phalanx.runtime.membership.etcd import EtcdMembership, client_options, job_prefix

STATES = ("running", "finished", "failed", "unreachable")
EVENTS_SHOWN = 10
EXIT_OK, EXIT_NOT_RUNNING = 0, 3
Event = Mapping[str, Any]


def show_status(run: RunDir, console: Console, timeout_s: float = 3.0,
                as_json: bool = False) -> int:
    """Print the document (``as_json``: to stdout) or its view (to ``console``). Returns 0
    for a running, finished or failed run, 3 when the run is unreachable: no summary.json
    and its etcd does not answer (its launcher was killed, or etcd is down)."""
    doc = status_document(run, timeout_s)
    if as_json:
        print(json.dumps(doc, indent=2, default=str))
    else:
        render_status(doc, console)
    return EXIT_NOT_RUNNING if doc["state"] == "unreachable" else EXIT_OK


def status_document(run: RunDir, timeout_s: float = 3.0) -> dict[str, Any]:
    """The run's document: live from etcd, else from the run directory (never raises for
    an unreachable etcd)."""
    info = run.read_job()
    summary = read_summary(run.path)
    if summary is None:
        try:
            live = _read_live(info, timeout_s)
        except MembershipUnavailable:
            live = None
        if live is not None:
            events = read_run_events(run.path)
            now = time.time()
            goodput = goodput_from_events(events, _started_at(info, run.path, events), now)
            members, generation, committed, reports, etcd_events = live
            return live_document(info, run.path, members, generation, committed, reports,
                                 etcd_events, events, goodput.to_json(), now)
        summary = read_summary(run.path)    # the job may have ended while we asked
    if summary is not None:
        return ended_document(info, run.path, summary, read_run_events(run.path))
    outcome = "unknown" if _launcher_alive(info) else "dead"
    return ended_document(info, run.path, reconstruct(run.path, outcome),
                          read_run_events(run.path), state="unreachable")


def live_document(info: Mapping[str, Any], run_dir: Path, members: Mapping[str, MemberRecord],
                  generation: int, committed: int, reports: Mapping[str, KeeperReport],
                  etcd_events: Sequence[Event], events: Sequence[Event],
                  goodput: Mapping[str, Any], now: float) -> dict[str, Any]:
    """Pure: the document of a running job (``events``: the run's whole log, for the phase
    when etcd's bounded copy holds no phase change)."""
    ranks = [{"rank": r.rank, "worker": r.worker_id, "node": r.node, "step": r.step,
              "generation": r.generation, "state": str(r.extra.get("state", "running")),
              "heartbeat_age_s": round(max(0.0, now - _float(r.extra.get("time"), now)), 3),
              "pid": r.pid}
             for r in sorted(members.values(), key=lambda r: (r.rank, r.worker_id))
             if r.rank >= 0]
    keepers = [{"node": node, "bytes_held": report.bytes_held,
                "bytes_shared": report.bytes_shared, "generation": report.generation,
                "local": {str(rank): max(steps) for rank, steps in sorted(report.local.items())
                          if steps},
                "replicas": {str(rank): max(steps) for rank, steps
                             in sorted(report.replicas.items()) if steps}}
               for node, report in sorted(reports.items())]
    recent = list(etcd_events)[-EVENTS_SHOWN:] or list(events)[-EVENTS_SHOWN:]
    return {"job": str(info.get("job", "")), "run_dir": str(run_dir), "state": "running",
            "generation": generation, "phase": _phase(etcd_events) or _phase(events) or "steady",
            "committed_step": committed, "world_size": int(info.get("world_size", 0)),
            "ranks": ranks, "keepers": keepers, "events": recent, "goodput": dict(goodput),
            "state_copies": state_copies([r for r in members.values() if r.rank >= 0], keepers),
            "protection": protection([*events, *etcd_events]), "summary": None}


def state_copies(members: Sequence[MemberRecord],
                 keepers: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Pure: one row per state class the ranks registered (their member records'
    ``snapshot.classes``; a module whose parameters are replicated and whose buffers are
    per rank, BatchNorm's statistics without SyncBatchNorm, is in both) with the objects
    in it and where its copies live: in the ranks' memory, and in which snapshots of the
    keepers. Empty before the ranks' first snapshot."""
    objects: dict[str, set[str]] = {}
    intervals: set[int] = set()
    groups: set[tuple[int, ...]] = set()      # replica groups of some ranks only (HSDP)
    for member in members:
        info = member.extra.get("snapshot") or {}
        for name, kind in (info.get("classes") or {}).items():
            for cls in (("replicated", "per_rank") if kind == "split" else (kind,)):
                objects.setdefault(str(cls), set()).add(str(name))
        if "every_steps" in info:
            intervals.add(int(info["every_steps"]))
        if info.get("replica_group"):
            groups.add(tuple(int(r) for r in info["replica_group"]))
    if not objects:
        return []
    ranks = len(members)
    held: dict[str, int] = {}
    for keeper in keepers:
        for rank in keeper["replicas"]:
            held[rank] = held.get(rank, 0) + 1
    replicas = min((held.get(str(m.rank), 0) for m in members), default=0)
    every = "/".join(str(i) for i in sorted(intervals)) or "?"
    full = (f"full snapshot every {every} steps in the rank's keeper + {replicas} "
            f"replica{'s' if replicas != 1 else ''} on other nodes")
    sizes = "/".join(str(n) for n in sorted({len(g) for g in groups}))
    live = {"replicated": f"{sizes} per replica group ({len(groups)} groups of the "
                          "ranks that hold the same state; a lost rank heals from a live "
                          "one of its group)" if groups else
                          f"{ranks} (every rank of the data-parallel group; a lost rank "
                          "heals from a live one)",
            "sharded": "1 per shard (its rank)",
            "per_rank": "1 per rank"}
    snapshots = {"replicated": full + " (used only when no live copy is left)",
                 "sharded": full,
                 "per_rank": "every step in the rank's keeper (its per-rank channel, what a "
                             "heal restores it from); also in every " + full}
    return [{"class": cls, "objects": sorted(objects[cls]), "live": live.get(cls, "?"),
             "snapshots": snapshots.get(cls, full)}
            for cls in ("replicated", "sharded", "per_rank") if cls in objects]


def ended_document(info: Mapping[str, Any], run_dir: Path, summary: Mapping[str, Any],
                   events: Sequence[Event], state: str | None = None) -> dict[str, Any]:
    """Pure: the document of a run that ended (``summary``: its summary.json or the
    reconstructed one); no ranks or keepers: they are gone."""
    if state is None:
        state = "finished" if summary.get("outcome") == "finished" else "failed"
    return {"job": str(summary.get("job") or info.get("job", "")), "run_dir": str(run_dir),
            "state": state, "generation": int(summary.get("generation") or 0),
            "phase": _phase(events) or "steady",
            "committed_step": int(summary.get("committed_step", -1)),
            "world_size": int(summary.get("world_size") or info.get("world_size", 0)),
            "ranks": [], "keepers": [], "events": list(events)[-EVENTS_SHOWN:],
            "goodput": summary.get("goodput"), "protection": protection(events),
            "summary": dict(summary),
            "etcd_endpoints": list(info.get("etcd_endpoints", [])),
            "launcher_pid": info.get("launcher_pid")}


def protection(events: Sequence[Event]) -> dict[str, Any]:
    """Pure: whether the run's snapshots have the memory they were planned with. ``full``,
    or ``degraded`` while some rank trains without the slots it needs: the plan did not fit
    and ``snapshot.allow_unprotected`` let it train on, or after a recovery the tmpfs had no
    room for a promoted rank (``snapshot_unprotected`` events not yet followed by that
    rank's ``snapshot_protected``: nodes, ranks, newest reason)."""
    latest: dict[tuple[str, Any], Event] = {}    # (node, rank) -> its newest alert or all-clear
    for e in events:
        if e.get("event") in ("snapshot_unprotected", "snapshot_protected"):
            latest[(str(e.get("node", "?")), e.get("rank"))] = e
    alerts = [e for e in latest.values() if e.get("event") == "snapshot_unprotected"]
    if not alerts:
        return {"state": "full"}
    return {"state": "degraded", "nodes": sorted({str(e.get("node", "?")) for e in alerts}),
            "ranks": sorted({int(e["rank"]) for e in alerts if isinstance(e.get("rank"), int)}),
            "reason": str(alerts[-1].get("reason", ""))}


def _read_live(info: Mapping[str, Any], timeout_s: float
               ) -> tuple[dict[str, MemberRecord], int, int, dict[str, KeeperReport], list[Any]]:
    """(members, generation, committed step, keeper reports, etcd's events) from the job's
    etcd; raises ``MembershipUnavailable`` when it does not answer."""
    membership = EtcdMembership(list(info["etcd_endpoints"]),
                                job_prefix(info["etcd_prefix"], info["job"]),
                                timeout_s=timeout_s,
                                **client_options(**info.get("etcd_client", {}))).connect()
    try:
        table = read_table(membership)
        members = table.members
        generation = membership.get("generation")
        commit = membership.get(COMMIT_KEY)
        reports = reports_of(table.keepers)
        events = [json.loads(kv.value) for kv in membership.list_prefix(EVENTS_PREFIX)]
    finally:
        membership.close()
    return (members, int(generation.value) if generation else 0,
            committed_from(commit.value if commit else None), reports, events)


def _started_at(info: Mapping[str, Any], run_dir: Path, events: Sequence[Event]) -> float:
    """When the launch began: job.json's ``started_at``, else config.yaml's mtime."""
    if isinstance(info.get("started_at"), (int, float)):
        return float(info["started_at"])
    try:
        return (run_dir / "config.yaml").stat().st_mtime
    except OSError:
        return min((_float(e.get("time"), time.time()) for e in events), default=time.time())


def _phase(events: Sequence[Event]) -> str | None:
    """The coordinator's phase after the newest ``phase`` event, if any."""
    return next((str(e.get("to")) for e in reversed(events) if e.get("event") == "phase"),
                None)


def _launcher_alive(info: Mapping[str, Any]) -> bool:
    """Whether job.json's launcher process still runs (True when it cannot be told: it
    ran on another host, or job.json names none)."""
    pid = info.get("launcher_pid")
    host = info.get("launcher_host")
    if not isinstance(pid, int) or (host and host != socket.gethostname()):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _float(value: Any, default: float) -> float:
    return float(value) if isinstance(value, (int, float)) else default
