"""``bench/scale_sim.py`` at a tiny size, in process only (no etcd): every figure is
measured, the placement moves no more replicas than its stability bound, the request
model counts what the heartbeats write, and the outputs are written."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench import scale_model, scale_report, scale_sim

pytestmark = pytest.mark.unit


@pytest.mark.timeout(120)
def test_a_tiny_run_measures_every_pure_figure_and_writes_its_outputs(tmp_path: Path) -> None:
    args = argparse.Namespace(no_etcd=True, repeats=1, beat_seconds=0.1)
    result = scale_sim.run([3, 12], args)
    small, large = result["cells"]
    assert (small["ranks"], large["ranks"]) == (24, 96)
    for cell in (small, large):
        for key in ("plan_node_loss_s", "plan_worker_loss_s", "plan_two_faults_s",
                    "placement_after_loss_s", "detection_poll_s", "commit_s"):
            assert cell[key] > 0, key
        # stability: only the replicas the lost node held and those of its own ranks move
        assert 0 < cell["replicas_moved"] <= (cell["replicas_lost_node_held"]
                                              + cell["replicas_of_lost_ranks"])
        assert cell["detection_reports"] == 1          # the node loss absorbs its workers'
    assert large["plan_json_bytes"] > 3 * small["plan_json_bytes"]   # one entry per rank
    assert large["member_table_bytes"] == pytest.approx(4 * small["member_table_bytes"], rel=0.05)
    rows = {r["figure"]: r for r in result["sections"]["in_process"]}
    assert rows["worker-facing plan, JSON (bytes)"]["growth"]["exponent"] == pytest.approx(1.0, abs=0.1)
    assert large["plan_encoded_bytes"] * 4 < large["plan_json_bytes"]      # compressed
    scale_sim.write_outputs(tmp_path / "scale.json", result)
    saved = json.loads((tmp_path / "scale.json").read_text())
    assert [c["nodes"] for c in saved["cells"]] == [3, 12]
    assert "| plan: node loss (ms) |" in (tmp_path / "scale.md").read_text()


def test_the_request_model_counts_a_put_per_rank_and_node_today_and_per_node_after() -> None:
    today, per_node = scale_model.LoadModel(1250), scale_model.LoadModel(1250, per_node=True)
    # every beat (0.5 s) each of the 10,000 ranks and 1,250 keepers writes; plus the
    # launcher's commit (~0.2/s) and progress events (2/s)
    assert today.puts_per_s() == pytest.approx(11250 / 0.5 + 2.2)
    assert per_node.puts_per_s() == pytest.approx(1250 / 0.5 + 2.2)
    assert (today.leases, per_node.leases) == (11250, 1250)
    assert today.keepalives_per_s() == pytest.approx(11250.0)   # ttl 3 s, refreshed at ttl/3
    # world 8 on 4 nodes, as bench/etcd_load.py measured a real launch: 25.8-28.1 puts/s
    # with a lease per rank, 10.2 with one per node
    assert scale_model.LoadModel(4, ranks_per_node=2).puts_per_s() == pytest.approx(26.2)
    assert scale_model.LoadModel(4, ranks_per_node=2, per_node=True).puts_per_s() == \
        pytest.approx(10.2)


def test_the_growth_fit_finds_the_exponent() -> None:
    nodes = [10, 100, 1000]
    assert scale_report.fit(nodes, [3 * n for n in nodes])["exponent"] == pytest.approx(1.0)
    assert scale_report.fit(nodes, [n * n for n in nodes])["exponent"] == pytest.approx(2.0)
    assert scale_report.fit(nodes, ["ok", None, 5]) is None      # one usable point
