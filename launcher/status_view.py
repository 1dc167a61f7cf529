"""The human view of a ``phalanx status`` document: a header, the goodput line, the ranks
(one row each, or grouped by state and generation from ``GROUP_FROM`` ranks on), what the
keepers hold and the newest events; for an ended run, its summary."""
from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, Mapping, Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from phalanx.launcher.goodput import summary_line

GROUP_FROM = 1000           # ranks: from this many on, rows per (state, generation)
KEEPERS_LISTED = 64         # keepers: above this many, one line of totals
DETAILS_CHARS = 300         # an event's details in the table, at most
Doc = Mapping[str, Any]


def render_status(doc: Doc, console: Console) -> None:
    """Print ``doc`` (``phalanx.launcher.status.status_document``) to ``console``."""
    if doc["state"] != "running":
        _render_ended(doc, console)
        return
    console.print(f"job {doc['job']}  running  generation {doc['generation']}  phase "
                  f"{doc['phase']}  committed step {doc['committed_step']}  run "
                  f"{doc['run_dir']}", highlight=False, soft_wrap=True)
    if doc.get("goodput"):
        console.print(f"so far: {summary_line(doc['goodput'])}", highlight=False)
    _render_protection(doc, console)
    ranks = doc["ranks"]
    grouped = len(ranks) >= GROUP_FROM
    console.print(rank_groups_table(ranks) if grouped else ranks_table(ranks))
    console.print(snapshot_groups_table(doc) if grouped else snapshots_table(doc))
    if doc.get("state_copies"):
        console.print(state_copies_table(doc["state_copies"]))
    console.print(keepers_view(doc["keepers"]))
    if doc["events"]:
        console.print(events_table(doc["events"]))


def state_copies_table(rows: Sequence[Mapping[str, Any]]) -> Table:
    """Where each state class's copies live (``phalanx.launcher.status.state_copies``)."""
    table = Table(title="state by class: where its copies live")
    for column in ("class", "objects", "live copies", "snapshots"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["class"], ", ".join(row["objects"]), row["live"], row["snapshots"])
    return table


def _render_ended(doc: Doc, console: Console) -> None:
    summary = doc.get("summary") or {}
    if doc["state"] == "unreachable":
        gone = ("its launcher (pid {0}) is gone".format(doc.get("launcher_pid"))
                if summary.get("outcome") == "dead" else
                "its launcher may still run: check etcd")
        console.print(f"job {doc['job']} is not running: its etcd "
                      f"({', '.join(doc.get('etcd_endpoints') or ['?'])}) does not answer and "
                      f"the run left no summary.json ({gone}); from events.jsonl:",
                      highlight=False, soft_wrap=True)
    error = summary.get("error") or {}
    console.print(f"job {doc['job']} {summary.get('outcome', doc['state'])}: "
                  f"{summary.get('steps')} steps, {summary.get('recoveries', 0)} recoveries, "
                  f"generation {doc['generation']}, committed step {doc['committed_step']}, "
                  f"{summary.get('wall_s', 0.0):.1f} s wall"
                  + (f"; {error.get('type')}: {escape(str(error.get('message')))}"
                     if error else "") + f"; run {doc['run_dir']}",
                  highlight=False, soft_wrap=True)
    if doc.get("goodput"):
        console.print(summary_line(doc["goodput"]), highlight=False)
    _render_protection(doc, console)
    for record in summary.get("recovery_history") or []:
        console.print(f"  recovered from {record.get('fault')} of ranks {record.get('ranks')}: "
                      f"generation {record.get('generation')}, restore step "
                      f"{record.get('restore_step')}, lost steps {record.get('lost_steps')}, "
                      f"fault to first step {record.get('fault_to_first_step_s')} s",
                      highlight=False)
    if doc["events"]:
        console.print(events_table(doc["events"]))


def protection_line(protection: Mapping[str, Any] | None) -> str | None:
    """The status line of degraded snapshot protection; None when protection is full."""
    if not protection or protection.get("state") != "degraded":
        return None
    ranks = protection.get("ranks") or []
    return (f"snapshot protection: DEGRADED on {', '.join(protection.get('nodes') or ['?'])}"
            + (f" (ranks {_sample(ranks)})" if ranks else "")
            + f": {protection.get('reason', '')}")


def _render_protection(doc: Doc, console: Console) -> None:
    line = protection_line(doc.get("protection"))
    if line is not None:
        console.print(line, style="bold red", highlight=False, markup=False, soft_wrap=True)


def ranks_table(ranks: Sequence[Mapping[str, Any]]) -> Table:
    table = Table(title=f"ranks ({len(ranks)})")
    for column in ("rank", "worker", "node", "step", "generation", "state", "pid", "age s"):
        table.add_column(column)
    for row in ranks:
        table.add_row(str(row["rank"]), row["worker"], row["node"], str(row["step"]),
                      str(row["generation"]), row["state"], str(row.get("pid", "")),
                      f"{row['heartbeat_age_s']:.1f}")
    return table


def rank_groups_table(ranks: Sequence[Mapping[str, Any]]) -> Table:
    """One row per (state, generation): how many ranks, their step range, nodes and the
    oldest heartbeat. O(ranks)."""
    groups: dict[tuple[str, int], dict[str, Any]] = {}
    for row in ranks:
        group = groups.setdefault((row["state"], row["generation"]), {
            "ranks": 0, "steps": [row["step"], row["step"]], "nodes": set(), "age": 0.0})
        group["ranks"] += 1
        group["steps"] = [min(group["steps"][0], row["step"]), max(group["steps"][1], row["step"])]
        group["nodes"].add(row["node"])
        group["age"] = max(group["age"], row["heartbeat_age_s"])
    table = Table(title=f"ranks ({len(ranks)}, grouped by state and generation)")
    for column in ("state", "generation", "ranks", "steps", "nodes", "oldest heartbeat s"):
        table.add_column(column)
    for (state, generation), group in sorted(groups.items(), key=lambda kv: (-kv[1]["ranks"],
                                                                              kv[0])):
        low, high = group["steps"]
        table.add_row(state, str(generation), str(group["ranks"]),
                      str(low) if low == high else f"{low}..{high}", str(len(group["nodes"])),
                      f"{group['age']:.1f}")
    return table


def copies_by_rank(doc: Doc) -> dict[int, tuple[int, int, list[str]]]:
    """rank -> (newest local step, newest replicated step, replica holders), -1 for none,
    over the world's ranks; O(copies held)."""
    world = int(doc.get("world_size") or 0)
    found: dict[int, tuple[int, int, list[str]]] = {r: (-1, -1, []) for r in range(world)}
    for keeper in doc["keepers"]:
        for rank, step in keeper["local"].items():
            local, replicated, holders = found.get(int(rank), (-1, -1, []))
            found[int(rank)] = (max(local, step), replicated, holders)
        for rank, step in keeper["replicas"].items():
            local, replicated, holders = found.get(int(rank), (-1, -1, []))
            found[int(rank)] = (local, max(replicated, step), [*holders, keeper["node"]])
    return found


def snapshots_table(doc: Doc) -> Table:
    table = Table(title=f"snapshots (committed step {doc['committed_step']})")
    for column in ("rank", "last local step", "last replicated step", "holders"):
        table.add_column(column)
    for rank, (local, replicated, holders) in sorted(copies_by_rank(doc).items()):
        table.add_row(str(rank), str(local), str(replicated), ",".join(sorted(holders)) or "-")
    return table


def snapshot_groups_table(doc: Doc) -> Table:
    """One row per (newest local step, newest replicated step, holder count)."""
    groups: dict[tuple[int, int, int], list[int]] = {}
    for rank, (local, replicated, holders) in copies_by_rank(doc).items():
        groups.setdefault((local, replicated, len(holders)), []).append(rank)
    table = Table(title=f"snapshots (committed step {doc['committed_step']}, grouped)")
    for column in ("ranks", "last local step", "last replicated step", "replica holders",
                   "e.g. ranks"):
        table.add_column(column)
    for (local, replicated, count), members in sorted(groups.items(),
                                                      key=lambda kv: -len(kv[1])):
        table.add_row(str(len(members)), str(local), str(replicated), str(count),
                      _sample(sorted(members)))
    return table


def keepers_view(keepers: Sequence[Mapping[str, Any]]) -> Table:
    """Per keeper: the memory its snapshots hold, and the replica bytes it keeps as
    references to another copy on its node instead (one copy per node: "shared MiB")."""
    table = Table(title=f"keepers ({len(keepers)})")
    for column in ("node", "held MiB", "shared MiB", "own ranks", "replicated ranks"):
        table.add_column(column)
    if len(keepers) > KEEPERS_LISTED:
        held = [k["bytes_held"] / 2**20 for k in keepers]
        shared = sum(k.get("bytes_shared", 0) for k in keepers) / 2**20
        table.add_row(f"{len(keepers)} keepers", f"{sum(held):.1f} (each {min(held):.1f}.."
                      f"{max(held):.1f})", f"{shared:.1f}",
                      str(sum(len(k["local"]) for k in keepers)),
                      str(sum(len(k["replicas"]) for k in keepers)))
        return table
    for keeper in keepers:
        table.add_row(keeper["node"], f"{keeper['bytes_held'] / 2**20:.1f}",
                      f"{keeper.get('bytes_shared', 0) / 2**20:.1f}",
                      str(len(keeper["local"])), str(len(keeper["replicas"])))
    return table


def events_table(events: Sequence[Mapping[str, Any]]) -> Table:
    """The newest events, oldest first (the whole log is ``events.jsonl`` in the run dir)."""
    table = Table(title=f"recent events (newest {len(events)})")
    for column in ("time", "event", "details"):
        table.add_column(column)
    for event in events:
        details = " ".join(f"{k}={v}" for k, v in sorted(event.items())
                           if k not in ("time", "event"))
        if len(details) > DETAILS_CHARS:      # a placement names every rank's holders
            details = details[:DETAILS_CHARS] + " ..."
        table.add_row(time.strftime("%H:%M:%S", time.localtime(float(event.get("time", 0)))),
                      str(event.get("event", "?")), escape(details))
    return table


def _sample(ranks: Iterable[int], shown: int = 4) -> str:
    ranks = list(ranks)
    text = ",".join(str(r) for r in ranks[:shown])
    return text + (f",... ({len(ranks)})" if len(ranks) > shown else "")
