"""Run identity of tier checkpoints: a relaunch into the same tier path never sees,
commits over or deletes another run's steps (issue 17, item 1)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from phalanx.configs.errors import SnapshotNotFound, SnapshotOfOtherRun
from phalanx.runtime.tiers.disk import COMMIT_NAME, DiskTier
from phalanx.runtime.tiers.run_identity import RankRecord, record_name, run_id_of

pytestmark = pytest.mark.unit

RUN1, RUN2 = "demo-20260101-000000-aaaa", "demo-20260102-000000-bbbb"


def _persist(tier: DiskTier, step: int, ranks: tuple[int, ...] = (0, 1)) -> None:
    for rank in ranks:
        tier.write_rank(step, rank, b"payload-%d-%d" % (step, rank),
                        json.dumps({"run": tier.run_id, "rank": rank, "step": step}).encode())
    tier.commit_step(step, list(ranks))


def test_second_run_does_not_see_the_first_runs_newer_steps(tmp_path: Path) -> None:
    assert run_id_of(tmp_path / ".phalanx" / "runs" / RUN1) == RUN1    # the run directory
    first = DiskTier(tmp_path, "demo", run_id=RUN1)
    for step in (20, 40, 60):
        _persist(first, step)
    second = DiskTier(tmp_path, "demo", run_id=RUN2)
    assert second.committed_steps() == []          # today: [20, 40, 60] (run 1's)
    _persist(second, 30)
    assert second.committed_steps() == [30]
    assert first.committed_steps() == [20, 40, 60]
    assert DiskTier(tmp_path, "demo").committed_steps() == [20, 30, 40, 60]   # ckpt: every run
    marker = json.loads((second.step_dir(30) / COMMIT_NAME).read_bytes())
    assert marker["run"] == RUN2 and marker["ranks"] == [0, 1]


def test_restore_refuses_another_runs_files(tmp_path: Path) -> None:
    _persist(DiskTier(tmp_path, "demo", run_id=RUN1), 40)
    with pytest.raises(SnapshotOfOtherRun, match=f"rank 0's files belong to run '{RUN1}'"):
        DiskTier(tmp_path, "demo", run_id=RUN2).read_rank(40, 0)
    payload, _ = DiskTier(tmp_path, "demo", run_id=RUN1).read_rank(40, 0)
    assert payload == b"payload-40-0"


def test_retention_of_run_two_never_deletes_run_ones_steps(tmp_path: Path) -> None:
    first = DiskTier(tmp_path, "demo", run_id=RUN1)
    for step in (40, 60, 80):
        _persist(first, step)
    first.write_rank(90, 0, b"partial", b"{}")      # run 1 died while persisting step 90
    second = DiskTier(tmp_path, "demo", run_id=RUN2)
    _persist(second, 20)
    assert second.apply_retention(keep=1) == []     # today: [40, 60, 80] or its own 20
    _persist(second, 30)
    assert second.apply_retention(keep=1) == [20]
    everything = DiskTier(tmp_path, "demo")
    assert everything.committed_steps() == [30, 40, 60, 80]
    assert second.step_dir(90).is_dir()             # run 1's partial step is not run 2's


def test_commit_refused_when_a_rank_belongs_to_another_run(tmp_path: Path) -> None:
    first = DiskTier(tmp_path, "demo", run_id=RUN1)
    first.write_rank(20, 1, b"old", b"{\"rank\": 1}")
    second = DiskTier(tmp_path, "demo", run_id=RUN2)
    second.write_rank(20, 0, b"new", b"{\"rank\": 0}")
    with pytest.raises(SnapshotOfOtherRun, match=f"rank 1's files belong to run '{RUN1}'"):
        second.commit_step(20, [0, 1])
    assert not (second.step_dir(20) / COMMIT_NAME).exists()
    assert isinstance(SnapshotOfOtherRun("x"), SnapshotNotFound)   # the persister retries it


def test_commit_refused_when_another_run_overwrote_a_manifest(tmp_path: Path) -> None:
    second = DiskTier(tmp_path, "demo", run_id=RUN2)
    second.write_rank(20, 0, b"new", b"{\"rank\": 0, \"by\": 2}")
    second.write_rank(20, 1, b"new", b"{\"rank\": 1, \"by\": 2}")
    (second.step_dir(20) / "rank_1.json").write_bytes(b"{\"rank\": 1, \"by\": 1}")
    with pytest.raises(SnapshotOfOtherRun, match="rank 1's files have a manifest another run"):
        second.commit_step(20, [0, 1])


def test_another_runs_committed_step_is_never_overwritten(tmp_path: Path) -> None:
    _persist(DiskTier(tmp_path, "demo", run_id=RUN1), 20)
    second = DiskTier(tmp_path, "demo", run_id=RUN2)
    with pytest.raises(SnapshotOfOtherRun, match=f"step 20 is a committed checkpoint of run "
                       f"{RUN1}; run '{RUN2}' does not overwrite it"):
        second.write_rank(20, 0, b"new", b"{}")
    assert DiskTier(tmp_path, "demo", run_id=RUN1).read_rank(20, 0)[0] == b"payload-20-0"


def test_abandoned_writes_of_this_run_are_cleaned(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, "demo", run_id=RUN1)
    _persist(tier, 20)
    # a crash between the intent record and the manifest: rank 0 of step 40 half written
    tier.put_object(40, record_name(0), RankRecord(RUN1, 0, 40).to_json())
    (tier.step_dir(40) / "rank_0.safetensors").write_bytes(b"torn")
    (tier.step_dir(40) / ".rank_0.safetensors.123.tmp").write_bytes(b"torn")
    other = DiskTier(tmp_path, "demo", run_id=RUN2)
    other.put_object(60, record_name(0), RankRecord(RUN2, 0, 60).to_json())
    assert tier.clean_abandoned([0, 1]) == [(40, 0)]
    assert not tier.step_dir(40).exists()
    assert other.step_dir(60).is_dir()              # another run's: left alone
    assert tier.committed_steps() == [20]


# --- the persister: markers wait for the job's commit point; crashed writes are cleaned -----

def test_persister_commits_a_step_only_once_the_job_committed_it(tmp_path: Path) -> None:
    from tests.unit.test_persister_cadence import Node, _wait

    point = [-1]
    tier = DiskTier(tmp_path / "tier", "cadence", run_id=RUN1)
    node = Node(tmp_path, "n0", [0], [(tier, 20, 5)], [0], committed=lambda: point[0])
    try:
        node.persister.start()
        node.publish(20)
        _wait(lambda: node.steps("tier_persisted") == [20], "step 20 written")
        node.keeper.wait_polls(5)
        assert tier.committed_steps() == []         # today: committed at once
        point[0] = 20                                # the job's commit point reaches 20
        _wait(lambda: tier.committed_steps() == [20], "step 20 committed")
    finally:
        node.close()


def test_persister_cleans_its_ranks_half_written_steps_at_start(tmp_path: Path) -> None:
    from tests.unit.test_persister_cadence import Node, _wait

    tier = DiskTier(tmp_path / "tier", "cadence", run_id=RUN1)
    tier.put_object(40, record_name(0), RankRecord(RUN1, 0, 40).to_json())
    (tier.step_dir(40) / "rank_0.safetensors").write_bytes(b"torn by a crash")
    node = Node(tmp_path, "n0", [0], [(tier, 20, 5)], [0])
    try:
        node.persister.start()
        _wait(lambda: node.events.of("tier_cleaned"), "the start-up clean")
        assert not tier.step_dir(40).exists()       # today: left forever (never committed)
        assert node.events.of("tier_cleaned")[0]["removed"] == [[40, 0]]
    finally:
        node.close()


# --- the commit tracker: another run's keepers and commit never count -----------------------

def test_commit_tracker_ignores_another_runs_keepers_and_resets_commit() -> None:
    from phalanx.launcher.coordination.commit_tracker import CommitTracker, reset_commit_point
    from phalanx.runtime.commit import COMMIT_KEY, KeeperReport, commit_value, committed_from
    from phalanx.runtime.keeper.reporter import KEEPERS
    from tests.fakes.membership_memory import InMemoryMembership, InMemoryStore

    etcd = InMemoryMembership(InMemoryStore())
    etcd.put(COMMIT_KEY, commit_value(60, 0.0))                       # run 1's last commit
    etcd.put(KEEPERS + "node0", KeeperReport("node0", ("h", 1), {0: (59, 60)}).to_json())
    reset_commit_point(etcd)
    assert committed_from(etcd.get(COMMIT_KEY).value) == -1
    tracker = CommitTracker(etcd, world_size=1, factor=0, every_steps=1,
                            keepers=lambda: [("h", 2)])                # run 2's keeper
    assert tracker.poll(now=10.0) == -1                               # today: 60
    etcd.put(KEEPERS + "node0", KeeperReport("node0", ("h", 2), {0: (3, 4)}).to_json())
    assert tracker.poll(now=20.0) == 4
    assert committed_from(etcd.get(COMMIT_KEY).value) == 4


# --- --resume: what is found, and what is refused before anything starts --------------------

def _config(tmp_path: Path, *overrides: str):
    from phalanx.configs.loader import load_config
    from tests.integration.launching import ROOT

    return load_config(str(ROOT / "configs" / "demo.yaml"),
                       [f"tiers.disk.path={tmp_path / 'tier'}", f"job.run_dir={tmp_path / 'runs'}",
                        *overrides])


def test_resume_without_a_checkpoint_lists_what_exists(tmp_path: Path) -> None:
    from phalanx.configs.errors import ResumeRefused
    from phalanx.launcher.resume import find_resume_point

    cfg = _config(tmp_path)
    with pytest.raises(ResumeRefused, match=r"--resume latest: no committed checkpoint of job "
                       r"'demo' .*newest last: none\); .*launch without --resume"):
        find_resume_point(cfg, "latest")
    _persist(DiskTier(tmp_path / "tier", "demo", run_id=RUN1), 20, (0, 1, 2, 3))
    with pytest.raises(ResumeRefused, match=rf"--resume 30: no committed checkpoint of job "
                       rf"'demo' at step 30 .*step 20 of run {RUN1} in tier disk"):
        find_resume_point(cfg, "30")


def test_resume_refuses_another_world_size_and_a_lost_secret(tmp_path: Path) -> None:
    from phalanx.configs.errors import ResumeRefused
    from phalanx.launcher.resume import find_resume_point

    _persist(DiskTier(tmp_path / "tier", "demo", run_id=RUN1), 20, (0, 1))
    with pytest.raises(ResumeRefused, match=r"secret_file"):
        find_resume_point(_config(tmp_path), "latest")       # run 1's directory is gone
    (tmp_path / "runs" / RUN1).mkdir(parents=True)
    (tmp_path / "runs" / RUN1 / "secret").write_bytes(b"0" * 64 + b"\n")
    with pytest.raises(ResumeRefused, match=rf"step 20 of run {RUN1} .* holds 2 ranks but "
                       r"this launch has job.world_size 4; .*job.world_size=2"):
        find_resume_point(_config(tmp_path), "latest")
