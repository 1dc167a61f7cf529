"""Scale simulation (issue 21, item 5): phalanx's pure control-plane code and a real etcd at
10 to 1,250 nodes x 8 ranks (10,000 ranks), and how each cost grows with nodes.

    python bench/scale_sim.py [--nodes 10,100,1000,1250] [--repeats 5] [--no-etcd]

In process (medians of ``--repeats``): the planner for a node loss, a worker loss and both
at once; replica placement after a node loss and the replicas it moves; detection (one
poll's member records decoded, the stall detector fed, the signals of a node loss
classified); the commit point from the keepers' reports. Against a real etcd holding the
job's member records and keeper reports under one lease each: the launcher's reads of
those tables, the fence (generation CAS + plan put), the heartbeats at today's rate and at
one per node (puts/s reached, bytes per heartbeat, what a prefix watch receives) and a
recovery's burst (every rank's restore reports, the plan every rank reads). The steady
request rates of both designs come from ``bench.scale_model.LoadModel``; ``bench/etcd_load.py``
checks them on a real launch. Writes ``bench/results/scale_sim.{json,md,png}``; about 70 s
on 2 cores.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import scale_model as model  # noqa: E402
from bench import scale_report as report  # noqa: E402
from bench.common import machine_info, median, progress, time_calls, verdict, write_json  # noqa: E402
from phalanx.recovery.base import PromoteSpare, RestartWorker  # noqa: E402
from phalanx.recovery.detection import (ActorDied, LeaseLost, NodeLost, Progress,  # noqa: E402
                                        StallDetector, classify)
from phalanx.recovery.planner import plan_recovery  # noqa: E402
from phalanx.runtime.base import NodeId, Rank, Step, WorkerId, decode_member  # noqa: E402
from phalanx.runtime.commit import KeeperReport, committed_step  # noqa: E402
from phalanx.runtime.replication.placement import (PlacementInput, moved_replicas,  # noqa: E402
                                                   place_replicas)

DEFAULT_NODES = (10, 100, 1000, 1250)
PREFIX_BYTES = "/phalanx/scale/"
QUOTA_BYTES = 2 << 30        # etcd's default --quota-backend-bytes
PLAN_TARGET_S = 0.1          # DESIGN.md: plan a recovery for 10,000 ranks well under 100 ms


def timed(fn: Callable[[], Any], repeats: int) -> float:
    return median(time_calls(fn, repeats, warmup=1))


def in_process(job: model.Job, repeats: int) -> dict[str, Any]:
    """The pure computations at one size (seconds are medians)."""
    out: dict[str, Any] = {}
    policy = model.policy()
    plans = {}
    for name, faults in model.scenarios(job).items():
        def plan(faults: list = faults) -> Any:
            return plan_recovery(faults, job.world, job.replicas, job.tiers, job.spares, policy, 0.0)
        out[f"plan_{name}_s"] = timed(plan, repeats)
        plans[name] = plan()
    worker = model.worker_plan(plans["node_loss"], job)
    out["plan_json_bytes"], out["plan_encoded_bytes"] = len(worker.to_json()), len(worker.encode())
    out.update(placement(job, plans["node_loss"], repeats))
    out.update(detection(job, repeats))
    values = [r.to_json() for r in job.reports.values()]
    ranks = list(range(job.ranks))
    out["commit_s"] = timed(lambda: committed_step(job.reports, ranks, model.FACTOR), repeats)
    out["commit_reports_decode_s"] = timed(lambda: [KeeperReport.from_json(v) for v in values],
                                           repeats)
    return {"plans": plans, **out}


def placement(job: model.Job, plan: Any, repeats: int) -> dict[str, Any]:
    """Placement after the node loss: the lost node's ranks rebound where the plan put
    them, the node gone; timed with ``previous`` (as the coordinator calls it)."""
    lost = model.node_loss(job).node
    rank_nodes = dict(job.rank_nodes)
    for action in plan.actions:
        if isinstance(action, (PromoteSpare, RestartWorker)):
            rank_nodes[action.rank] = action.node
    nodes = [n for n in job.world.live_nodes if n != lost]
    after = PlacementInput(rank_nodes, nodes, model.FACTOR)
    names = sorted(job.world.live_nodes)
    full_s = timed(lambda: place_replicas(PlacementInput(job.rank_nodes, names, model.FACTOR)),
                   repeats)
    again_s = timed(lambda: place_replicas(after, job.placement), repeats)
    new = place_replicas(after, job.placement)
    fresh = place_replicas(after)
    held = len(job.placement.held_by(lost)) if lost else 0
    return {"placement_full_s": full_s, "placement_after_loss_s": again_s,
            "replicas_moved": moved_replicas(job.placement, new),
            "replicas_moved_without_previous": moved_replicas(job.placement, fresh),
            "replicas_lost_node_held": held,
            "replicas_of_lost_ranks": len(job.world.ranks_on(lost)) * model.FACTOR if lost else 0,
            "replicas_total": job.ranks * model.FACTOR}


def detection(job: model.Job, repeats: int) -> dict[str, Any]:
    """One poll's fault computation: decode every member record, feed the stall detector
    every rank's progress, check it, classify a node loss's signals."""
    values = [model.member_value(r, n, model.STEP) for r, n in job.rank_nodes.items()]
    lost = model.node_loss(job)
    signals: list[Any] = [NodeLost(NodeId(lost.node or ""), 10.0)]
    for rank in lost.ranks:
        worker = job.world.rank_workers[rank]
        signals += [ActorDied(WorkerId(worker), 10.0, "died"), LeaseLost(WorkerId(worker), 10.2)]

    def poll() -> Any:
        records = [decode_member(v) for v in values]
        stall = StallDetector(10.0)
        for rec in records:
            stall.observe(Progress(Rank(rec.rank), Step(rec.step), 11.0, step_s=0.4))
        return classify(signals, job.world, 11.0), stall.check(11.0)

    decode_s = timed(lambda: [decode_member(v) for v in values], repeats)
    return {"detection_poll_s": timed(poll, repeats), "detection_decode_s": decode_s,
            "detection_reports": len(poll()[0])}


def against_etcd(bench: Any, job: model.Job, plan: Any, beat_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {"populate": bench.populate(job)}
    out["reads"] = bench.launcher_reads(repeats=3)
    plan_json = model.worker_plan(plan, job).encode()     # what plan/<g> holds
    out["fence"] = bench.fence(plan_json, repeats=3)
    today, per_node = model.LoadModel(job.nodes), model.LoadModel(job.nodes, per_node=True)
    beats = {"today": (job.ranks + job.nodes) / today.heartbeat_s,
             "per_node": job.nodes / per_node.heartbeat_s}
    out["heartbeats_today"] = bench.heartbeats(job, False, beats["today"], beat_s)
    out["heartbeats_per_node"] = bench.heartbeats(job, True, beats["per_node"], beat_s)
    out["recovery"] = bench.recovery_burst(job, len(plan_json), out["fence"]["ok"],
                                           plan_readers=min(job.ranks, 64))
    return out


def derived(etcd: dict[str, Any]) -> dict[str, Any]:
    """What the measured per-put figures mean at the full demand: the bytes a watcher of
    the job would receive, and how long until etcd's default 2 GiB backend quota is full
    when nothing compacts its history (the embedded etcd runs without compaction)."""
    out: dict[str, Any] = {}
    for mode in ("today", "per_node"):
        beat = etcd[f"heartbeats_{mode}"]
        demand = beat["demand_puts_per_s"]
        per_put = beat["watch_bytes_per_s"] / beat["puts_per_s"] if beat["puts_per_s"] else None
        out[f"watch_mb_per_s_{mode}"] = None if per_put is None else per_put * demand / 1e6
        growth = beat["db_growth_bytes_per_put"]
        out[f"db_growth_per_put_{mode}"] = growth
        out[f"hours_to_quota_{mode}"] = QUOTA_BYTES / (growth * demand) / 3600 if growth > 0 else None
    out["member_table_read"] = "ok" if "bytes" in etcd["reads"].get("members", {}) else "FAILED"
    out["fence"] = "ok" if etcd["fence"]["ok"] else "FAILED"
    return out


def one_size(nodes: int, args: argparse.Namespace, bench: Any) -> dict[str, Any]:
    started = time.perf_counter()
    job = model.build_job(nodes)
    cell: dict[str, Any] = {"nodes": nodes, "ranks": job.ranks,
                            "build_s": time.perf_counter() - started}
    repeats = args.repeats if nodes < 1000 else max(3, args.repeats // 2)
    pure = in_process(job, repeats)
    plans = pure.pop("plans")
    cell.update(pure)
    progress(f"{nodes} nodes: plan node loss {pure['plan_node_loss_s'] * 1e3:.1f} ms, placement "
             f"{pure['placement_after_loss_s'] * 1e3:.1f} ms ({pure['replicas_moved']} moved), "
             f"detection {pure['detection_poll_s'] * 1e3:.1f} ms, commit {pure['commit_s'] * 1e3:.1f} ms")
    today, per_node = model.LoadModel(nodes), model.LoadModel(nodes, per_node=True)
    cell["model"] = {"today": today.as_dict(), "per_node": per_node.as_dict()}
    members = sum(len(PREFIX_BYTES) + len(f"members/w{r}-g0") + len(model.member_value(r, n, model.STEP))
                  for r, n in job.rank_nodes.items())
    keepers = sum(len(PREFIX_BYTES) + len(f"keepers/{n}") + len(rep.to_json())
                  for n, rep in job.reports.items())
    cell["member_table_bytes"] = members
    cell["launcher_read_mb_per_s"] = (members * today.member_lists_per_s()
                                      + keepers / model.COMMIT_READ_S) / 1e6
    if bench is not None:
        etcd = against_etcd(bench, job, plans["node_loss"], args.beat_seconds)
        cell["etcd"] = etcd
        cell["derived"] = derived(etcd)
        fence, beat = etcd["fence"], etcd["heartbeats_today"]
        progress(f"{nodes} nodes: etcd populated in {etcd['populate']['seconds']:.1f} s; fence "
                 + (f"{fence['seconds'] * 1e3:.1f} ms" if fence["ok"] else f"FAILED ({fence['error'][:90]})")
                 + f"; heartbeats {beat['puts_per_s']:.0f}/{beat['demand_puts_per_s']:.0f} puts/s; "
                 f"recovery burst {etcd['recovery']['seconds']:.1f} s")
    return cell


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default=",".join(map(str, DEFAULT_NODES)),
                        help="comma-separated node counts (8 ranks per node)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--beat-seconds", type=float, default=3.0,
                        help="how long each heartbeat load runs against etcd")
    parser.add_argument("--no-etcd", action="store_true", help="only the in-process part")
    parser.add_argument("--out", default=str(ROOT / "bench/results/scale_sim.json"))
    args = parser.parse_args(argv)
    sizes = sorted(int(n) for n in args.nodes.split(","))
    if sizes[0] < 3:
        parser.error(f"--nodes {args.nodes}: every size needs at least 3 nodes (a node loss "
                     "must leave 2, one to hold each rank's replica)")
    result = run(sizes, args)
    write_outputs(Path(args.out), result)
    return 0


def run(sizes: list[int], args: argparse.Namespace) -> dict[str, Any]:
    cells = []
    with tempfile.TemporaryDirectory(prefix="phalanx-scale-") as tmp:
        bench = None
        if not args.no_etcd:
            from bench.scale_etcd import EtcdBench
            bench = EtcdBench(Path(tmp)).start()
            progress(f"etcd at {bench.endpoint}")
        try:
            for nodes in sizes:
                cells.append(one_size(nodes, args, bench))
        finally:
            if bench is not None:
                bench.close()
    sections = {name: report.rows_of(cells, rows) for name, rows in
                (("in_process", report.IN_PROCESS), ("etcd", report.ETCD), ("model", report.MODEL))}
    largest = cells[-1]
    return {"nodes": sizes, "ranks_per_node": model.RANKS_PER_NODE, "cells": cells,
            "sections": sections, "machine": machine_info(),
            "targets": {"plan_10000_ranks_under_100ms": {
                "ranks": largest["ranks"], "plan_node_loss_s": largest["plan_node_loss_s"],
                "verdict": verdict(largest["plan_node_loss_s"] < PLAN_TARGET_S)}}}


def write_outputs(out: Path, result: dict[str, Any]) -> None:
    cells, sections = result["cells"], result["sections"]
    parts = [f"# phalanx control plane at scale ({result['ranks_per_node']} ranks per node)", ""]
    titles = {"in_process": "In process (medians)", "etcd": "Against a real etcd",
              "model": "etcd request model (steady state)"}
    for name, rows in sections.items():
        if rows:
            parts += [f"## {titles[name]}", "", report.table(cells, rows), ""]
    target = result["targets"]["plan_10000_ranks_under_100ms"]
    parts.append(f"Plan for {target['ranks']} ranks: {target['plan_node_loss_s'] * 1e3:.1f} ms "
                 f"(target < {PLAN_TARGET_S * 1e3:.0f} ms): {target['verdict']}")
    text = "\n".join(parts) + "\n"
    print(text)
    write_json(out, result)
    out.with_suffix(".md").write_text(text, encoding="utf-8")
    report.plot(str(out.with_suffix(".png")), cells, sections)
    progress(f"wrote {out} (.md, .png)")


if __name__ == "__main__":
    sys.exit(main())
