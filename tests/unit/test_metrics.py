"""The launcher's Prometheus metrics (``phalanx.launcher.metrics``) fed with synthetic members,
keeper reports and events: values read back from the registry, Prometheus naming
conventions, bounded label cardinality, and the endpoint's lifecycle."""
from __future__ import annotations

import socket
from dataclasses import replace
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from phalanx.configs.errors import ConfigError
from phalanx.configs.schema import JobConfig, MetricsConfig, PhalanxConfig, RayConfig
from phalanx.launcher.events import EventLog
from phalanx.launcher.metrics import JobMetrics, current_ranks, replication_lag
from phalanx.runtime.base import MemberRecord
from phalanx.runtime.commit import KeeperReport

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

RECOVERED = {"event": "recovered", "generation": 1, "restore_step": 20, "fault": "worker_died",
             "ranks": [1], "fault_to_first_step_s": 1.234, "lost_steps": 1,
             "phases_s": {"detecting": 0.0101, "planning": 0.002, "fencing": 0.004,
                          "promoting": 0.03, "restoring": 0.5, "resuming": 0.2}}


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def member(rank: int, step: int, *, generation: int = 0, beat: float = 1000.0,
           state: str = "running", worker: str | None = None, **extra: Any) -> MemberRecord:
    return MemberRecord(worker_id=worker or f"w{rank}-g{generation}", rank=rank,
                        node=f"node{rank % 2}", step=step, generation=generation,
                        extra={"state": state, "time": beat, **extra})


def members(*records: MemberRecord) -> dict[str, MemberRecord]:
    return {r.worker_id: r for r in records}


def job_metrics(world_size: int = 4, per_rank: bool = False, clock: Clock | None = None,
                tiers: tuple[str, ...] = ("disk",)) -> JobMetrics:
    clock = clock or Clock()
    return JobMetrics(MetricsConfig(port=0, per_rank=per_rank), world_size, tiers,
                      clock=clock, wall_clock=clock)


def value(metrics: JobMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def samples(metrics: JobMetrics) -> list[Any]:
    return [s for family in metrics.registry.collect() for s in family.samples]


def test_progress_generation_and_heartbeat_age() -> None:
    clock = Clock(1000.0)
    metrics = job_metrics(clock=clock)
    metrics.observe_members(members(member(0, 10, beat=999.0), member(1, 12, beat=998.5),
                                    member(2, 11), member(-1, -1, worker="keeper.node0")))
    clock.now = 1002.0
    metrics.observe_members(members(member(0, 14, beat=1001.0), member(1, 16, beat=1001.5),
                                    member(2, 15, beat=1002.0)))
    metrics.observe_job(generation=3, committed=12, live_nodes=2)
    assert value(metrics, "phalanx_job_step") == 14
    assert value(metrics, "phalanx_job_step_max") == 16
    assert value(metrics, "phalanx_job_steps_per_second") == pytest.approx(2.0)
    assert value(metrics, "phalanx_heartbeat_age_seconds_max") == pytest.approx(1.0)
    assert value(metrics, "phalanx_generation") == 3
    assert value(metrics, "phalanx_committed_step") == 12
    assert value(metrics, "phalanx_ranks", state="running") == 3
    assert value(metrics, "phalanx_ranks", state="absent") == 1     # rank 3 not reported
    assert value(metrics, "phalanx_world_size") == 4


def test_newest_generation_wins_and_a_rollback_restarts_the_rate() -> None:
    clock = Clock(1000.0)
    metrics = job_metrics(world_size=2, clock=clock)
    metrics.observe_members(members(member(0, 30), member(1, 30)))
    clock.now = 1001.0
    old, new = member(1, 31, generation=0), member(1, 21, generation=1, worker="spare0")
    assert current_ranks(members(old, new))[1] is new
    metrics.observe_members(members(member(0, 21, generation=1), old, new))
    assert value(metrics, "phalanx_job_step") == 21
    assert value(metrics, "phalanx_job_steps_per_second") == 0.0     # the window restarted
    clock.now = 1003.0
    metrics.observe_members(members(member(0, 25, generation=1), replace(new, step=27)))
    assert value(metrics, "phalanx_job_steps_per_second") == pytest.approx(2.0)


def test_finished_ranks_are_not_stale_heartbeats() -> None:
    clock = Clock(1100.0)
    metrics = job_metrics(world_size=2, clock=clock)
    metrics.observe_members(members(member(0, 60, beat=1000.0, state="finished"),
                                    member(1, 59, beat=1099.0)))
    assert value(metrics, "phalanx_heartbeat_age_seconds_max") == pytest.approx(1.0)
    assert value(metrics, "phalanx_ranks", state="finished") == 1


def test_snapshot_stall_is_summed_over_workers_and_survives_replacement() -> None:
    metrics = job_metrics(world_size=2)
    snap = lambda stall, captures, every=1: {"snapshot": {"every_steps": every, "stall_s": stall,
                                                          "captures": captures}}
    metrics.observe_members(members(member(0, 5, **snap(0.010, 5)), member(1, 5, **snap(0.020, 5))))
    metrics.observe_members(members(member(0, 6, **snap(0.012, 6)), member(1, 6, **snap(0.020, 5))))
    # rank 1 replaced by a spare whose counters start again at zero
    metrics.observe_members(members(member(0, 7, generation=1, worker="w0-g0", **snap(0.013, 7)),
                                    member(1, 7, generation=1, worker="spare0",
                                           **snap(0.004, 1, every=4))))
    assert value(metrics, "phalanx_snapshot_stall_seconds_total") == pytest.approx(0.037)
    assert value(metrics, "phalanx_snapshot_captures_total") == 13
    assert value(metrics, "phalanx_snapshot_interval_steps") == 4


def test_recovered_event_counts_recovery_phases_and_lost_steps() -> None:
    metrics = job_metrics()
    assert value(metrics, "phalanx_recoveries_total", fault="node_died") == 0   # pre-created
    metrics.on_event(RECOVERED)
    metrics.on_event({**RECOVERED, "fault": "node_died", "lost_steps": 0,
                      "fault_to_first_step_s": 3.5, "phases_s": {"restoring": 2.0}})
    assert value(metrics, "phalanx_recoveries_total", fault="worker_died") == 1
    assert value(metrics, "phalanx_recoveries_total", fault="node_died") == 1
    assert value(metrics, "phalanx_recovery_seconds_count") == 2
    assert value(metrics, "phalanx_recovery_seconds_sum") == pytest.approx(1.234 + 3.5)
    assert value(metrics, "phalanx_recovery_seconds_bucket", le="2.0") == 1
    assert value(metrics, "phalanx_recovery_phase_seconds_count", phase="restoring") == 2
    assert value(metrics, "phalanx_recovery_phase_seconds_sum", phase="restoring") == \
        pytest.approx(2.5)
    assert value(metrics, "phalanx_recovery_phase_seconds_count", phase="planning") == 1
    assert value(metrics, "phalanx_recovery_phase_seconds_count", phase="degraded") == 0
    assert value(metrics, "phalanx_lost_steps_total") == 1
    assert value(metrics, "phalanx_generation") == 1


def test_tier_events_give_latency_bytes_commits_and_failures() -> None:
    metrics = job_metrics(tiers=("disk", "s3"))
    metrics.on_event({"event": "tier_persisted", "tier": "disk", "node": "node0", "step": 20,
                      "ranks": [0, 2], "bytes": 1000, "seconds": 0.02})
    metrics.on_event({"event": "tier_persisted", "tier": "disk", "node": "node1", "step": 20,
                      "ranks": [1, 3], "bytes": 1000, "seconds": 0.04})
    metrics.on_event({"event": "tier_committed", "tier": "disk", "node": "node0", "step": 20})
    metrics.on_event({"event": "tier_degraded", "tier": "s3", "node": "node0", "step": 20,
                      "error": "TierUnavailable: down"})
    metrics.on_event({"event": "tier_skipped", "tier": "s3", "node": "node1", "step": 20,
                      "rank": 1, "cause": "gone"})
    metrics.on_event({"event": "persister_error", "node": "node1", "error": "boom"})
    metrics.on_event({"event": "phase", "from": "steady", "to": "detecting"})   # ignored
    assert value(metrics, "phalanx_tier_persist_seconds_count", tier="disk") == 2
    assert value(metrics, "phalanx_tier_persist_seconds_sum", tier="disk") == pytest.approx(0.06)
    assert value(metrics, "phalanx_tier_persisted_bytes_total", tier="disk") == 2000
    assert value(metrics, "phalanx_tier_committed_step", tier="disk") == 20
    assert value(metrics, "phalanx_tier_committed_step", tier="s3") == -1
    assert value(metrics, "phalanx_tier_persist_failures_total", tier="s3", kind="degraded") == 1
    assert value(metrics, "phalanx_tier_persist_failures_total", tier="s3", kind="skipped") == 1
    assert value(metrics, "phalanx_tier_persist_failures_total", tier="disk", kind="degraded") == 0
    assert value(metrics, "phalanx_tier_persist_failures_total", tier="unknown",
                 kind="error") == 1


def report(node: str, local: dict[int, tuple[int, ...]], replicas: dict[int, tuple[int, ...]],
           bytes_held: int = 0, bytes_shared: int = 0) -> KeeperReport:
    return KeeperReport(node=node, address=("127.0.0.1", 1), local=local, replicas=replicas,
                        bytes_held=bytes_held, bytes_shared=bytes_shared)


def test_replication_lag_per_node_in_steps_and_bytes() -> None:
    reports = {
        # node0 holds ranks 0 and 2 (newest 12 and 11) and replicas of rank 1
        "node0": report("node0", {0: (11, 12), 2: (10, 11)}, {1: (9, 10)}, bytes_held=6 * 100),
        # node1 holds rank 1 (newest 12) and replicas of ranks 0 (to 12) and 2 (to 9)
        "node1": report("node1", {1: (11, 12)}, {0: (11, 12), 2: (8, 9)}, bytes_held=6 * 100),
    }
    lag = replication_lag(reports, copies=1)
    assert lag["node0"] == (2, 2 * 100)       # rank 0: 0 behind, rank 2: 11 - 9 = 2
    assert lag["node1"] == (2, 2 * 100)       # rank 1: 12 - 10
    assert replication_lag(reports, copies=0) == {"node0": (0, 0), "node1": (0, 0)}
    # replicas sharing their tensors with the node's own copies hold fewer pages: a
    # copy's size is what is held plus what is shared
    shared = {**reports, "node0": report("node0", {0: (11, 12), 2: (10, 11)}, {1: (9, 10)},
                                         bytes_held=4 * 100, bytes_shared=2 * 100)}
    assert replication_lag(shared, copies=1)["node0"] == (2, 2 * 100)
    lone = replication_lag({"node0": report("node0", {0: (0,)}, {}, 100)}, copies=1)
    assert lone == {"node0": (1, 100)}        # no replica yet: its one snapshot is behind

    metrics = job_metrics()
    metrics.observe_reports(reports, copies=1)
    assert value(metrics, "phalanx_replication_lag_steps", node="node1") == 2
    assert value(metrics, "phalanx_replication_lag_bytes", node="node0") == 200
    assert value(metrics, "phalanx_shm_held_bytes", node="node0") == 600
    metrics.observe_reports({"node0": reports["node0"]}, copies=1)     # node1 lost
    assert value(metrics, "phalanx_shm_held_bytes", node="node1") is None
    assert value(metrics, "phalanx_replication_lag_steps", node="node1") is None


def test_spares_by_state() -> None:
    metrics = job_metrics()
    assert value(metrics, "phalanx_spares", state="ready") == 0
    metrics.observe_spares(ready=1, starting=2)
    assert (value(metrics, "phalanx_spares", state="ready"),
            value(metrics, "phalanx_spares", state="starting")) == (1, 2)


def test_names_follow_prometheus_conventions() -> None:
    metrics = job_metrics(per_rank=True)
    metrics.on_event(RECOVERED)
    metrics.observe_members(members(member(0, 1)))
    for family in metrics.registry.collect():
        assert family.name.startswith("phalanx_"), family.name
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples)
        if family.type == "histogram":
            assert family.name.endswith("_seconds"), family.name
        if "seconds" in family.name:       # base units, named as the last word
            assert family.name.endswith(("_seconds", "_seconds_max")), family.name
        if "bytes" in family.name:
            assert family.name.endswith("_bytes"), family.name
        for sample in family.samples:
            assert set(sample.labels) <= {"state", "fault", "phase", "node", "tier", "kind",
                                          "rank", "le"}, sample


def test_no_rank_label_without_per_rank_even_at_ten_thousand_ranks() -> None:
    metrics = job_metrics(world_size=10_000)
    records = members(*(member(r, 100 + r % 7, beat=999.0) for r in range(10_000)))
    metrics.observe_members(records)
    metrics.observe_reports({f"node{n}": report(f"node{n}", {r: (5,) for r in range(n, 10_000, 8)},
                                                {}, 10) for n in range(8)}, copies=1)
    found = samples(metrics)
    assert not [s for s in found if "rank" in s.labels]
    assert len(found) < 500, len(found)         # independent of the number of ranks
    assert value(metrics, "phalanx_job_step") == 100
    assert value(metrics, "phalanx_ranks", state="running") == 10_000


def test_per_rank_gives_one_series_per_rank() -> None:
    clock = Clock(1000.0)
    metrics = job_metrics(world_size=3, per_rank=True, clock=clock)
    metrics.observe_members(members(member(0, 4, beat=999.5), member(1, 5), member(2, 6)))
    steps = {s.labels["rank"]: s.value for s in samples(metrics) if s.name == "phalanx_rank_step"}
    assert steps == {"0": 4, "1": 5, "2": 6}
    assert value(metrics, "phalanx_rank_heartbeat_age_seconds", rank="0") == pytest.approx(0.5)


def test_per_rank_is_refused_above_ten_thousand_ranks() -> None:
    job = JobConfig(entrypoint="train.py:main", world_size=10_001, nodes=2)
    with pytest.raises(ConfigError) as info:
        PhalanxConfig(job=job, ray=RayConfig(address="10.0.0.5:6379"),
                      metrics=MetricsConfig(per_rank=True))
    assert info.value.key == "metrics.per_rank"
    assert PhalanxConfig(job=job, ray=RayConfig(address="10.0.0.5:6379")).metrics.port == 0
    with pytest.raises(ConfigError, match="not a TCP port"):
        MetricsConfig(port=70000)


def test_event_log_feeds_listeners_and_survives_a_broken_one(tmp_path) -> None:
    metrics = job_metrics()
    log = EventLog(tmp_path / "events.jsonl")
    log.add_listener(lambda record: 1 / 0)
    log.add_listener(metrics.on_event)
    fields = {k: v for k, v in RECOVERED.items() if k != "event"}
    log.emit("recovered", **fields)
    log.record("tier_persisted", tier="disk", step=1, bytes=5, seconds=0.5)
    assert value(metrics, "phalanx_recoveries_total", fault="worker_died") == 1
    assert value(metrics, "phalanx_tier_persist_seconds_count", tier="disk") == 1
    assert len(log.events) == 2


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_endpoint_serves_the_registry_and_closes() -> None:
    port = free_port()
    metrics = JobMetrics(MetricsConfig(port=port), 2, ("disk",))
    with metrics:
        metrics.on_event(RECOVERED)
        assert metrics.port == port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        assert families["phalanx_recoveries"].type == "counter"
        assert any(s.value == 1 for s in families["phalanx_recoveries"].samples
                   if s.labels.get("fault") == "worker_died")
        with pytest.raises(ConfigError, match="metrics.port|cannot listen"):
            JobMetrics(MetricsConfig(port=port), 2).start()       # the port is taken
    with socket.socket() as sock:      # closed: nothing listens on the port any more
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))


def test_goodput_is_exported_as_a_ratio_and_parts_that_sum_to_the_wall() -> None:
    from phalanx.configs.schema import MetricsConfig
    from phalanx.launcher.goodput import goodput_from_events
    from phalanx.launcher.metrics import JobMetrics

    metrics = JobMetrics(MetricsConfig(), world_size=2)
    events = [{"time": 100.0, "event": "started"},
              {"time": 110.0, "event": "first_step", "step": 1},
              {"time": 130.0, "event": "progress", "min_step": 20, "max_step": 20,
               "generation": 0}]
    goodput = goodput_from_events(events, 100.0, 140.0)
    metrics.observe_goodput(goodput)
    value = metrics.registry.get_sample_value
    assert value("phalanx_goodput_ratio") == pytest.approx(goodput.effective)
    parts = {s.labels["part"]: s.value for m in metrics.registry.collect()
             if m.name == "phalanx_goodput_seconds" for s in m.samples}
    assert parts["startup"] == pytest.approx(10.0)
    assert sum(parts.values()) == pytest.approx(40.0, rel=0.01)
