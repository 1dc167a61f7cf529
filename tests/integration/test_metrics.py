"""The launcher's Prometheus endpoint on a real drilled demo job: scraped while it runs
(``phalanx launch`` with the kill_worker scenario and ``metrics.port``), its values after
the recovery match the run's ``recovered`` event and the drill report built from the run's
events, number for number."""
from __future__ import annotations

import math
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from phalanx.launcher.drills.report import RunOutcome, build_report
from phalanx.launcher.drills.scenario import load_scenario
from phalanx.launcher.events import read_events
from tests.integration.launching import ROOT, latest_run, phalanx_command
from tests.plugins.leaks import Footprint, assert_nothing_left

pytestmark = pytest.mark.integration
SCENARIO = ROOT / "configs" / "drills" / "kill_worker.yaml"
FAULT_STEP = 20                      # the scenario's trigger
AFTER_RECOVERY_S = 2.0               # the scrape compared is the first this long after it
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def scrape(port: int) -> tuple[str, Samples] | None:
    """The endpoint's text and every sample by (name, labels); None while nothing listens."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as reply:
            text = reply.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None
    return text, {(s.name, frozenset(s.labels.items())): s.value
                  for family in text_string_to_metric_families(text) for s in family.samples}


def get(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


@pytest.mark.timeout(240)
def test_scrape_of_a_drilled_demo_matches_its_events(tmp_path: Path,
                                                     footprint: Footprint) -> None:
    port = free_port()
    cmd = phalanx_command("configs/demo.yaml", f"drills.scenario={SCENARIO}",
                          "job.name=metrics", "job.args.steps=60",   # 6 s on after the kill
                          "job.args.sleep_per_step_s=0.15", f"metrics.port={port}",
                          "snapshot.every_steps=1",   # the commit point follows the steps
                          run_root=tmp_path)
    with (tmp_path / "launch.out").open("w") as out, (tmp_path / "launch.err").open("w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err,
                                env={**os.environ, "COLUMNS": "200"})
        chosen: Samples | None = None
        lags: list[dict[str, float]] = []      # replication lag per node, scrapes after chosen
        text, recovered_at = "", None
        try:
            deadline = time.monotonic() + 200
            while proc.poll() is None and time.monotonic() < deadline:
                scraped = scrape(port)
                if scraped is not None and chosen is None and get(
                        scraped[1], "phalanx_recoveries_total", fault="worker_died") == 1:
                    recovered_at = recovered_at or time.monotonic()
                    if time.monotonic() - recovered_at >= AFTER_RECOVERY_S:
                        text, chosen = scraped
                if scraped is not None and chosen is not None:
                    lags.append({node: get(scraped[1], "phalanx_replication_lag_steps",
                                           node=node) for node in ("node0", "node1")})
                time.sleep(0.25)
            returncode = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    stderr = (tmp_path / "launch.err").read_text()
    assert returncode == 0, stderr[-4000:]
    assert f"metrics at http://127.0.0.1:{port}/metrics" in stderr
    assert chosen is not None, f"no scrape saw the recovery {AFTER_RECOVERY_S} s before the end"
    assert scrape(port) is None, "the endpoint outlived the job"

    run_dir = latest_run(tmp_path)
    events = read_events(run_dir / "events.jsonl")
    recovered = [e for e in events if e["event"] == "recovered"]
    assert len(recovered) == 1, recovered
    record = recovered[0]
    report = build_report(load_scenario(SCENARIO), RunOutcome(0, {}, run_dir), None, "none",
                          events)
    drilled = report["faults"][0]["recovery"]

    # recoveries, lost steps and the recovery's time: the event's numbers and the report's
    for fault in ("worker_died", "node_died", "stalled"):
        assert get(chosen, "phalanx_recoveries_total", fault=fault) == (fault == "worker_died")
    assert get(chosen, "phalanx_lost_steps_total") == record["lost_steps"] == \
        drilled["lost_steps"]
    assert get(chosen, "phalanx_recovery_seconds_count") == 1
    assert math.isclose(get(chosen, "phalanx_recovery_seconds_sum"),
                        record["fault_to_first_step_s"], abs_tol=1e-3)
    assert drilled["phases_s"] == record["phases_s"]
    for phase in ("detect", "detecting", "planning", "fencing", "promoting", "restoring",
                  "resuming", "degraded"):
        count = get(chosen, "phalanx_recovery_phase_seconds_count", phase=phase)
        assert count == (phase in record["phases_s"]), (phase, record["phases_s"])
        if phase in record["phases_s"]:
            assert math.isclose(get(chosen, "phalanx_recovery_phase_seconds_sum", phase=phase),
                                record["phases_s"][phase], abs_tol=1e-6)

    # progress and the job's state after the recovery
    assert get(chosen, "phalanx_generation") == record["generation"] == 1
    assert FAULT_STEP < get(chosen, "phalanx_job_step") <= get(chosen, "phalanx_job_step_max")
    assert get(chosen, "phalanx_job_steps_per_second") > 0
    # the commit point in etcd is written at most every replication.commit_every_steps (10);
    # it comes from the keepers, the job's steps from heartbeats (etcd.heartbeat_s 0.5 s,
    # late by up to a second on a loaded machine: 7 steps of 0.15 s), so it may lead them
    commit_every, heartbeat_steps = 10, 7
    assert record["restore_step"] - commit_every <= get(chosen, "phalanx_committed_step") \
        <= get(chosen, "phalanx_job_step_max") + heartbeat_steps
    assert get(chosen, "phalanx_ranks", state="running") + get(
        chosen, "phalanx_ranks", state="finished") == 4
    assert 0 <= get(chosen, "phalanx_heartbeat_age_seconds_max") < 5
    assert not [key for key in chosen if "rank" in dict(key[1])]      # per_rank is off
    for node in ("node0", "node1"):
        assert get(chosen, "phalanx_shm_held_bytes", node=node) > 0
        # the replacement's snapshots reach their new holder some steps after the recovery
        # (the keepers' reports lag by a heartbeat or more on a loaded machine): the lag is
        # never negative, and it comes back under 10 steps before the job ends
        assert all(lag[node] >= 0 for lag in lags), lags
        assert min(lag[node] for lag in lags) < 10, lags
    spares = get(chosen, "phalanx_spares", state="ready") + get(chosen, "phalanx_spares",
                                                                state="starting")
    assert spares == 1                                         # demo.yaml: spares.count 1

    # snapshots (every step in the demo) and the disk tier (every 20 steps)
    assert get(chosen, "phalanx_snapshot_interval_steps") == 1
    assert get(chosen, "phalanx_snapshot_captures_total") > FAULT_STEP
    assert get(chosen, "phalanx_snapshot_stall_seconds_total") > 0
    persisted = [e for e in events if e["event"] == "tier_persisted"]
    assert 1 <= get(chosen, "phalanx_tier_persist_seconds_count", tier="disk") <= len(persisted)
    assert get(chosen, "phalanx_tier_persist_failures_total", tier="disk", kind="degraded") == 0
    (tmp_path / "scrape.txt").write_text(text)
    print("\n".join(line for line in text.splitlines() if line.startswith("phalanx_")
                    and "_bucket" not in line and "_created" not in line))
    assert_nothing_left(footprint)
