"""The tables and plot of ``bench/scale_sim.py``: one row per figure, one column per size,
and how the figure grows with nodes (the exponent b of a least-squares fit y = a * N**b,
and the ratio of the largest size's value to the smallest's)."""
from __future__ import annotations

import math
from typing import Any, Callable

from bench.common import bar_chart, markdown_table

Row = tuple[str, Callable[[dict[str, Any]], Any]]


def _ms(value: Any) -> Any:
    return None if value is None else 1e3 * value


def _get(cell: dict[str, Any], *path: str) -> Any:
    for key in path:
        if not isinstance(cell, dict) or key not in cell:
            return None
        cell = cell[key]
    return cell


IN_PROCESS: list[Row] = [
    ("plan: node loss (ms)", lambda c: _ms(c["plan_node_loss_s"])),
    ("plan: worker loss (ms)", lambda c: _ms(c["plan_worker_loss_s"])),
    ("plan: node + worker loss (ms)", lambda c: _ms(c["plan_two_faults_s"])),
    ("worker-facing plan, JSON (bytes)", lambda c: c["plan_json_bytes"]),
    ("  as fenced into plan/<g>, compressed (bytes)", lambda c: c["plan_encoded_bytes"]),
    ("placement, whole job (ms)", lambda c: _ms(c["placement_full_s"])),
    ("placement after a node loss (ms)", lambda c: _ms(c["placement_after_loss_s"])),
    ("replicas moved by it", lambda c: c["replicas_moved"]),
    ("  bound: replicas the node held + its ranks'", lambda c: c["replicas_lost_node_held"]
     + c["replicas_of_lost_ranks"]),
    ("  moved, placed afresh (no previous)", lambda c: c["replicas_moved_without_previous"]),
    ("detection: one poll (ms)", lambda c: _ms(c["detection_poll_s"])),
    ("  of which decoding member records (ms)", lambda c: _ms(c["detection_decode_s"])),
    ("commit point from keeper reports (ms)", lambda c: _ms(c["commit_s"])),
    ("  decoding the keeper reports (ms)", lambda c: _ms(c["commit_reports_decode_s"])),
]

ETCD: list[Row] = [
    ("member table (bytes)", lambda c: c["member_table_bytes"]),
    ("  one read by the launcher (pages of 1,000 keys)", lambda c: _get(c, "derived", "member_table_read")),
    ("  read (ms)", lambda c: _ms(_get(c, "etcd", "reads", "members", "seconds"))),
    ("  decode (ms)", lambda c: _ms(_get(c, "etcd", "reads", "members", "decode_s"))),
    ("keeper reports read (bytes)", lambda c: _get(c, "etcd", "reads", "keepers", "bytes")),
    ("launcher reads at today's poll rates (MB/s)", lambda c: _get(c, "launcher_read_mb_per_s")),
    ("fence: generation CAS + plan put (2 MiB limit)", lambda c: _get(c, "derived", "fence")),
    ("  fence (ms)", lambda c: _ms(_get(c, "etcd", "fence", "seconds"))),
    ("heartbeat puts/s needed, today", lambda c: _get(c, "etcd", "heartbeats_today", "demand_puts_per_s")),
    ("  reached here (today)", lambda c: _get(c, "etcd", "heartbeats_today", "puts_per_s")),
    ("  put p50 (ms)", lambda c: _get(c, "etcd", "heartbeats_today", "put_p50_ms")),
    ("  bytes per heartbeat on the wire", lambda c: _get(c, "etcd", "heartbeats_today", "wire_bytes_per_put")),
    ("  watch events/s received", lambda c: _get(c, "etcd", "heartbeats_today", "watch_events_per_s")),
    ("  watch bytes/s received", lambda c: _get(c, "etcd", "heartbeats_today", "watch_bytes_per_s")),
    ("  a watcher at full demand (MB/s)", lambda c: _get(c, "derived", "watch_mb_per_s_today")),
    ("  etcd backend growth per put (bytes)", lambda c: _get(c, "derived", "db_growth_per_put_today")),
    ("  hours to the 2 GiB quota, uncompacted", lambda c: _get(c, "derived", "hours_to_quota_today")),
    ("heartbeat puts/s needed, one per node", lambda c: _get(c, "etcd", "heartbeats_per_node",
                                                             "demand_puts_per_s")),
    ("  reached here (one per node)", lambda c: _get(c, "etcd", "heartbeats_per_node", "puts_per_s")),
    ("  bytes per heartbeat on the wire", lambda c: _get(c, "etcd", "heartbeats_per_node",
                                                         "wire_bytes_per_put")),
    ("  watch bytes/s received", lambda c: _get(c, "etcd", "heartbeats_per_node", "watch_bytes_per_s")),
    ("  a watcher at full demand (MB/s)", lambda c: _get(c, "derived", "watch_mb_per_s_per_node")),
    ("  hours to the 2 GiB quota, uncompacted", lambda c: _get(c, "derived", "hours_to_quota_per_node")),
    ("recovery: restore-report writes", lambda c: _get(c, "etcd", "recovery", "writes")),
    ("  at (writes/s)", lambda c: _get(c, "etcd", "recovery", "writes_per_s")),
    ("  taking (s)", lambda c: _get(c, "etcd", "recovery", "seconds")),
    ("  plan bytes read by all ranks (MB)", lambda c: _mb(_get(c, "etcd", "recovery", "all_ranks_plan_bytes"))),
    ("  plan reads by all ranks (s, extrapolated)", lambda c: _get(c, "etcd", "recovery",
                                                                   "all_ranks_plan_read_s")),
]

MODEL: list[Row] = [
    ("today: leases", lambda c: c["model"]["today"]["leases"]),
    ("today: puts/s", lambda c: c["model"]["today"]["puts_per_s"]),
    ("today: lease keepalives/s", lambda c: c["model"]["today"]["keepalives_per_s"]),
    ("today: etcd requests/s", lambda c: c["model"]["today"]["requests_per_s"]),
    ("one per node: leases", lambda c: c["model"]["per_node"]["leases"]),
    ("one per node: puts/s", lambda c: c["model"]["per_node"]["puts_per_s"]),
    ("one per node: lease keepalives/s", lambda c: c["model"]["per_node"]["keepalives_per_s"]),
    ("one per node: etcd requests/s", lambda c: c["model"]["per_node"]["requests_per_s"]),
]


def _mb(value: Any) -> Any:
    return None if value is None else value / 1e6


def fit(xs: list[float], ys: list[Any]) -> dict[str, float] | None:
    """Least-squares exponent b of y = a * x**b over the positive points, and the ratio of
    the last value to the first."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys)
           if isinstance(y, (int, float)) and not isinstance(y, bool) and y > 0]
    if len(pts) < 2:
        return None
    mx, my = sum(p[0] for p in pts) / len(pts), sum(p[1] for p in pts) / len(pts)
    var = sum((p[0] - mx) ** 2 for p in pts)
    slope = sum((p[0] - mx) * (p[1] - my) for p in pts) / var if var else 0.0
    return {"exponent": slope, "ratio": math.exp(pts[-1][1] - pts[0][1])}


def rows_of(cells: list[dict[str, Any]], rows: list[Row]) -> list[dict[str, Any]]:
    nodes = [c["nodes"] for c in cells]
    out = []
    for name, get in rows:
        values = [_safe(get, c) for c in cells]
        if all(v is None for v in values):
            continue
        out.append({"figure": name, "values": values, "growth": fit(nodes, values)})
    return out


def _safe(get: Callable[[dict[str, Any]], Any], cell: dict[str, Any]) -> Any:
    try:
        return get(cell)
    except (KeyError, TypeError):
        return None


def table(cells: list[dict[str, Any]], rows: list[dict[str, Any]]) -> str:
    headers = ["figure", *(f"{c['nodes']} nodes ({c['ranks']} ranks)" for c in cells),
               "growth N^b", f"x{cells[-1]['nodes'] // cells[0]['nodes']} nodes →"]
    return markdown_table(headers, [[r["figure"], *r["values"],
                                     None if r["growth"] is None else round(r["growth"]["exponent"], 2),
                                     None if r["growth"] is None else f"x{r['growth']['ratio']:.3g}"]
                                    for r in rows])


def plot(path: str, cells: list[dict[str, Any]], sections: dict[str, list[dict[str, Any]]]) -> bool:
    groups = [str(c["nodes"]) for c in cells]

    def series(section: str, names: list[str]) -> dict[str, list[Any]]:
        found = {r["figure"]: r["values"] for r in sections.get(section, [])}
        return {n.strip(): found[n] for n in names if n in found}

    panels = [
        {"title": "pure computations (ms), by nodes", "ylabel": "ms", "log": True, "groups": groups,
         "series": series("in_process", ["plan: node loss (ms)", "placement after a node loss (ms)",
                                         "detection: one poll (ms)", "commit point from keeper reports (ms)"])},
        {"title": "etcd: heartbeat puts/s", "ylabel": "puts/s", "log": True, "groups": groups,
         "series": series("etcd", ["heartbeat puts/s needed, today", "  reached here (today)",
                                   "heartbeat puts/s needed, one per node", "  reached here (one per node)"])},
        {"title": "etcd requests/s (model)", "ylabel": "requests/s", "log": True, "groups": groups,
         "series": series("model", ["today: etcd requests/s", "one per node: etcd requests/s"])},
    ]
    return bar_chart(path, [p for p in panels if p["series"]],
                     title="phalanx control plane vs nodes (8 ranks per node)")
