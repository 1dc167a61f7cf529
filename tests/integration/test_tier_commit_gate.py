"""Issue 17 item 8: a tier commits only steps the job committed. Over real keepers, a real
etcd ``commit`` key and a disk tier, a persisted step's marker waits while the commit point
is held back, appears promptly once ``commit`` reaches it (read by the persister itself,
no keeper heartbeat), and a marker still waiting when the keeper closes is written if the
final commit point (written by the launcher before the keepers close) allows it. End to
end, every ``tier_committed`` of a launched job passed the job's commit point."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterator

import pytest

from phalanx.runtime.commit import COMMIT_KEY, commit_value
from phalanx.runtime.keeper.reporter import read_commit_point
from phalanx.runtime.membership.etcd import EtcdMembership
from phalanx.runtime.tiers.disk import DiskTier
from phalanx.runtime.tiers.persister import TierPersister
from tests.integration.launching import latest_run, launch
from tests.integration.test_persister import Events, Node, _wait

pytestmark = pytest.mark.integration
WORLD = [0, 1]


@pytest.fixture
def membership(etcd_endpoint: str) -> Iterator[EtcdMembership]:
    client = EtcdMembership([etcd_endpoint], f"/phalanx/gate{time.monotonic_ns()}/",
                            timeout_s=3.0).connect(retry_for_s=10)
    client.put(COMMIT_KEY, commit_value(-1, time.time()))
    yield client
    client.close()


def _set_commit(membership: EtcdMembership, step: int) -> None:
    membership.put(COMMIT_KEY, commit_value(step, time.time()))


def _gated_node(membership: EtcdMembership, tmp_path: Path, refresh_s: float
                ) -> tuple[DiskTier, Node, Events, TierPersister]:
    """A real keeper with a disk tier whose persister is gated on ``commit`` in etcd (the
    Node's own persister has no gate: it is replaced), reading it every ``refresh_s``."""
    tier = DiskTier(tmp_path / "tier", "gate", run_id="run-1")
    node = Node("n0", f"gate{time.monotonic_ns()}", WORLD, [(tier, 5, 10)], world=WORLD)
    node.persister.close()
    events = Events()
    persister = TierPersister(node.keeper, [(tier, 5, 10)], WORLD, WORLD, poll_s=0.02,
                              on_event=events, commit_retry_s=0.02,
                              committed=node.keeper.committed_step,
                              read_committed=lambda: read_commit_point(membership),
                              refresh_s=refresh_s, settle_s=5.0).start()
    return tier, node, events, persister


@pytest.mark.timeout(60)
def test_markers_wait_for_the_commit_point_and_follow_it_promptly(
        membership: EtcdMembership, tmp_path: Path) -> None:
    tier, node, events, persister = _gated_node(membership, tmp_path, refresh_s=0.1)
    try:
        node.publish(5)
        _wait(lambda: persister.last_persisted().get("disk") == 5, "step 5 persisted")
        time.sleep(0.5)                                  # persisted, commit point at -1:
        assert tier.committed_steps() == [] and events.of("tier_committed") == []
        _set_commit(membership, 4)                       # not there yet
        time.sleep(0.4)
        assert tier.committed_steps() == []
        _set_commit(membership, 5)
        started = time.monotonic()
        _wait(lambda: tier.committed_steps() == [5], "step 5 committed", timeout_s=5)
        assert time.monotonic() - started < 1.0          # read by the persister itself
        assert node.keeper.committed_step() == -1        # (no keeper heartbeat runs here)
        # the marker is written first, the event reported after it (another thread)
        _wait(lambda: bool(events.of("tier_committed")), "tier_committed reported", timeout_s=5)
        assert [(e["step"], e["commit"]) for e in events.of("tier_committed")] == [(5, 5)]
    finally:
        persister.close()
        node.close()


@pytest.mark.timeout(60)
def test_closing_writes_the_marker_the_final_commit_point_allows(
        membership: EtcdMembership, tmp_path: Path) -> None:
    tier, node, events, persister = _gated_node(membership, tmp_path, refresh_s=30.0)
    try:
        node.publish(5)                                  # the job's last checkpoint
        node.publish(6)                                  # and a step past it
        _wait(lambda: persister.last_persisted().get("disk") == 5, "step 5 persisted")
        time.sleep(0.3)
        assert tier.committed_steps() == []              # gated; next read only in 30 s
        _set_commit(membership, 5)                       # the launcher's final commit point
        started = time.monotonic()
        persister.close()                                # then the keepers close
        assert time.monotonic() - started < 2.0
        assert tier.committed_steps() == [5]
        assert [(e["step"], e["commit"]) for e in events.of("tier_committed")] == [(5, 5)]
    finally:
        persister.close()
        node.close()


@pytest.mark.timeout(300)
def test_a_launched_job_commits_to_its_tier_only_what_the_job_committed(tmp_path: Path) -> None:
    tier = tmp_path / "tier"
    # snapshots at the tier's steps: at ``auto`` the interval the run measures (13-16 steps
    # here) decides how many comparisons are still in flight at the end, and the final
    # commit lagged 10 to 30 steps from run to run (at_auto below covers ``auto``)
    result = launch("configs/demo.yaml", "job.world_size=2", "spares.count=0",
                    "job.args.steps=60", "snapshot.every_steps=10",
                    "tiers.disk.every_steps=10", "tiers.disk.keep=10",
                    f"tiers.disk.path={tier}", run_root=tmp_path / "runs")
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = latest_run(tmp_path / "runs")
    events = [json.loads(line) for line in (run_dir / "events.jsonl").open()]
    committed = [e for e in events if e["event"] == "tier_committed"]
    assert all(e["step"] <= e["commit"] for e in committed), committed
    # the end of the run: the newest checkpoint committed in memory is committed in the tier
    final = json.loads((run_dir / "summary.json").read_text())["committed_step"]
    markers = sorted(int(p.parent.name.removeprefix("step_")) for p in
                     tier.glob("demo/step_*/COMMIT"))
    persisted = sorted({e["step"] for e in events if e["event"] == "tier_persisted"})
    assert markers and markers[-1] == max(s for s in persisted if s <= final), (
        markers, persisted, final)
    assert max(persisted) - markers[-1] <= 10, (markers, persisted, final)   # not far behind
    # the last marker's events reached the log: the keepers settle their tiers before the
    # final drain (written at their close, after it, they were lost now and then)
    assert markers[-1] in {e["step"] for e in committed}, (markers, committed)


def test_at_auto_the_newest_snapshot_commits_without_waiting_for_the_next(
        tmp_path: Path) -> None:
    """``every_steps: auto`` with a budget that stretches the interval past the run: the
    snapshots the start-up takes are the only ones, so their digest comparison cannot wait
    for a next capture. The interval agreements offer it; the newest persisted step is
    committed in the tier well before the run ends (it was never committed before)."""
    tier = tmp_path / "tier"
    result = launch("configs/demo.yaml", "job.world_size=2", "spares.count=0",
                    "job.args.steps=120", "snapshot.overhead_budget=0.0001",
                    "tiers.disk.every_steps=auto", "tiers.disk.keep=10",
                    f"tiers.disk.path={tier}", run_root=tmp_path / "runs")
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = latest_run(tmp_path / "runs")
    events = [json.loads(line) for line in (run_dir / "events.jsonl").open()]
    persisted = sorted({e["step"] for e in events if e["event"] == "tier_persisted"})
    assert persisted and max(persisted) <= 60, persisted     # only start-up snapshots
    markers = sorted(int(p.parent.name.removeprefix("step_")) for p in
                     tier.glob("demo/step_*/COMMIT"))
    assert markers and markers[-1] == max(persisted), (markers, persisted)
    committed = [e for e in events if e["event"] == "tier_committed"]
    assert all(e["step"] <= e["commit"] for e in committed), committed
