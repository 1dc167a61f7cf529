"""``phalanx status``'s default view from simulated documents: one row per rank below 1,000
ranks, groups by state and generation from 1,000 on (bounded output, fast at 10,000); an
ended run shows its summary and goodput; a killed launcher's run (no summary.json, etcd
gone) is reconstructed from events.jsonl and exits 3, without a gRPC error."""
from __future__ import annotations

import io
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from phalanx.launcher.status import live_document, ended_document
from phalanx.launcher.status_view import GROUP_FROM, render_status
from phalanx.runtime.base import MemberRecord
from phalanx.runtime.commit import KeeperReport

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]
NOW = 2_000.0
RANKS_PER_NODE = 8
GOODPUT = {"wall_s": 10.0, "effective": 0.7, "startup_s": 2.0, "productive_s": 7.0,
           "redone_s": 0.0, "snapshot_stall_s": 0.1, "recovery_s": {"restoring": 0.4},
           "waiting_for_capacity_s": 0.0, "shutdown_s": 0.5, "sum_s": 10.0,
           "snapshot_stall_reported": True}


def simulated(world: int, recovering: int = 0) -> dict[str, Any]:
    """A live document of ``world`` ranks on ``world / 8`` nodes; the first ``recovering``
    ranks are restoring in generation 2, the rest run in generation 1."""
    members = {}
    for rank in range(world):
        worker = f"w{rank}-g0"
        state, generation = ("restoring", 2) if rank < recovering else ("running", 1)
        members[worker] = MemberRecord(worker, rank, f"node{rank // RANKS_PER_NODE}",
                                       step=100 + rank % 3, generation=generation, pid=rank,
                                       extra={"state": state, "time": NOW - 0.2})
    nodes = -(-world // RANKS_PER_NODE)
    reports = {}
    for node in range(nodes):
        own = range(node * RANKS_PER_NODE, min(world, (node + 1) * RANKS_PER_NODE))
        held = range(((node + 1) % nodes) * RANKS_PER_NODE,
                     min(world, ((node + 1) % nodes + 1) * RANKS_PER_NODE))
        reports[f"node{node}"] = KeeperReport(
            f"node{node}", ("127.0.0.1", 7000 + node), local={r: (99, 100) for r in own},
            replicas={r: (99,) for r in held}, bytes_held=3 * 2**20, generation=1)
    events = [{"event": "phase", "time": NOW - 1, "from": "steady", "to": "detecting"}]
    return live_document({"job": "big", "world_size": world}, Path("/runs/big-1"), members, 1,
                         99, reports, events, events, GOODPUT, NOW)


def render(doc: dict[str, Any]) -> str:
    out = io.StringIO()
    render_status(doc, Console(file=out, width=160, color_system=None))
    return out.getvalue()


def test_small_jobs_get_one_row_per_rank() -> None:
    text = render(simulated(16))
    assert "ranks (16)" in text and "grouped" not in text
    assert "w15-g0" in text and "phase detecting" in text and "so far: goodput 70.0%" in text


def test_the_view_says_where_each_state_class_lives() -> None:
    """Each rank's member record names its objects' classes (after its first snapshot); a
    BatchNorm model's parameters are replicated and its statistics per rank (split)."""
    doc = simulated(16)
    assert doc["state_copies"] == []                   # no snapshot yet: no classes known
    members = {f"w{rank}-g0": MemberRecord(
        f"w{rank}-g0", rank, f"node{rank // RANKS_PER_NODE}", step=100, generation=1, pid=rank,
        extra={"state": "running", "time": NOW, "snapshot": {
            "every_steps": 40, "classes": {"model": "split", "optimizer": "replicated",
                                           "__rng__": "per_rank"}}})
        for rank in range(16)}
    reports = {f"node{n}": KeeperReport(f"node{n}", ("127.0.0.1", 7000 + n),
                                        local={r: (99,) for r in range(8 * n, 8 * n + 8)},
                                        replicas={r: (99,) for r in range(8 - 8 * n, 16 - 8 * n)},
                                        bytes_held=1, generation=1) for n in (0, 1)}
    doc = live_document({"job": "bn", "world_size": 16}, Path("/runs/bn-1"), members, 1, 99,
                        reports, [], [], GOODPUT, NOW)
    copies = {row["class"]: row for row in doc["state_copies"]}
    assert copies["replicated"]["objects"] == ["model", "optimizer"]
    assert copies["per_rank"]["objects"] == ["__rng__", "model"]
    assert copies["replicated"]["live"].startswith("16 (every rank")
    assert copies["replicated"]["snapshots"].startswith(
        "full snapshot every 40 steps in the rank's keeper + 1 replica on other nodes")
    text = render(doc)
    assert "state by class: where its copies live" in text
    assert "every step in the rank's keeper" in text
    # HSDP on a 2 x 8 mesh: each rank's shards are replicated on the 2 ranks of its group
    for rank, member in members.items():
        member.extra["snapshot"]["replica_group"] = [member.rank % 8, member.rank % 8 + 8]
    doc = live_document({"job": "hsdp", "world_size": 16}, Path("/runs/hsdp-1"), members, 1,
                        99, reports, [], [], GOODPUT, NOW)
    copies = {row["class"]: row for row in doc["state_copies"]}
    assert copies["replicated"]["live"].startswith("2 per replica group (8 groups")


@pytest.mark.parametrize("world", [GROUP_FROM, 10_000])
def test_from_1000_ranks_the_view_groups_ranks_and_stays_short(world: int) -> None:
    started = time.perf_counter()
    doc = simulated(world, recovering=3)
    text = render(doc)
    seconds = time.perf_counter() - started
    assert f"ranks ({world}, grouped by state and generation)" in text
    lines = text.splitlines()
    assert len(lines) < 60, text
    assert "w999-g0" not in text                      # no row per rank
    row = next(line for line in lines if "running" in line and f"{world - 3}" in line)
    assert "100..102" in row                           # the group's step range
    assert any("restoring" in line and " 3 " in line for line in lines)
    assert "snapshots (committed step 99, grouped)" in text
    assert f"keepers ({world // RANKS_PER_NODE})" in text
    assert seconds < 5.0, f"{world} ranks took {seconds:.2f} s"


def test_a_finished_run_shows_its_summary_and_goodput() -> None:
    summary = {"outcome": "finished", "job": "demo", "steps": 60, "recoveries": 1,
               "generation": 1, "committed_step": 58, "wall_s": 10.0, "goodput": GOODPUT,
               "recovery_history": [{"fault": "worker_died", "ranks": [1], "generation": 1,
                                     "restore_step": 26, "lost_steps": 0,
                                     "fault_to_first_step_s": 0.34}]}
    doc = ended_document({"job": "demo"}, Path("/runs/demo-1"), summary,
                         [{"event": "finished", "time": NOW}])
    assert doc["state"] == "finished" and doc["ranks"] == []
    text = render(doc)
    assert "job demo finished: 60 steps, 1 recoveries" in text
    assert "goodput 70.0% of 10.00 s wall" in text and "recovered from worker_died" in text


def test_an_unreachable_run_says_what_it_knows_without_grpc_errors() -> None:
    summary = {"outcome": "dead", "job": "demo", "steps": 31, "recoveries": 0, "wall_s": 5.0,
               "goodput": GOODPUT, "reconstructed": True}
    doc = ended_document({"job": "demo", "etcd_endpoints": ["127.0.0.1:2379"],
                          "launcher_pid": 4242}, Path("/runs/demo-2"), summary, [],
                         state="unreachable")
    text = render(doc)
    assert "is not running: its etcd (127.0.0.1:2379) does not answer" in text
    assert "pid 4242" in text and "job demo dead: 31 steps" in text
    assert "Connection refused" not in text and "StatusCode" not in text


def test_a_killed_launcher_s_run_is_reconstructed_and_exits_3(tmp_path: Path,
                                                             capfd: pytest.CaptureFixture) -> None:
    import json
    import socket
    import subprocess

    from phalanx.launcher.rundir import RunDir
    from phalanx.launcher.status import show_status

    gone = subprocess.Popen(["true"])
    gone.wait()
    with socket.socket() as sock:                  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    (tmp_path / "job.json").write_text(json.dumps({
        "job": "demo", "etcd_endpoints": [f"127.0.0.1:{port}"], "etcd_prefix": "/phalanx",
        "launcher_pid": gone.pid, "launcher_host": socket.gethostname(), "world_size": 2,
        "started_at": NOW}))
    events = [{"event": "first_step", "time": NOW + 3, "step": 1},
              {"event": "progress", "time": NOW + 5, "min_step": 30, "max_step": 31,
               "generation": 0}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert show_status(RunDir(tmp_path), Console(file=io.StringIO()), timeout_s=1,
                       as_json=True) == 3
    doc = json.loads(capfd.readouterr().out)
    assert doc["state"] == "unreachable" and doc["summary"]["outcome"] == "dead"
    assert doc["summary"]["steps"] == 30 and doc["goodput"]["wall_s"] == pytest.approx(5.0)
    out = io.StringIO()
    assert show_status(RunDir(tmp_path), Console(file=out, width=160), timeout_s=1) == 3
    text = out.getvalue() + capfd.readouterr().err
    assert "is not running" in text and "job demo dead: 30 steps" in text
    assert "Connection refused" not in text and "UNAVAILABLE" not in text


def test_the_keepers_view_shows_the_replica_bytes_each_keeper_shares() -> None:
    """One copy per node: a keeper's replicas of data-parallel peers keep references to its
    own ranks' snapshots; the view says how much (and the JSON carries it)."""
    doc = simulated(16)
    for keeper in doc["keepers"]:
        keeper["bytes_shared"] = 5 * 2**20
    text = render(doc)
    assert "shared MiB" in text and "5.0" in text
    reports = {f"node{n}": KeeperReport(f"node{n}", ("127.0.0.1", 7000 + n), local={n: (1,)},
                                        bytes_held=2**20, bytes_shared=3 * 2**20, generation=1)
               for n in (0, 1)}
    again = KeeperReport.from_json(reports["node0"].to_json())
    assert again.bytes_shared == 3 * 2**20
    doc = live_document({"job": "small", "world_size": 2}, Path("/runs/small-1"), {}, 1, 1,
                        reports, [], [], GOODPUT, NOW)
    assert [k["bytes_shared"] for k in doc["keepers"]] == [3 * 2**20] * 2
