"""Leader election and the published job state, on the in-memory membership (the etcd
adapter passes the same create_leased contract in tests/contract/test_membership.py)."""
from __future__ import annotations

import threading
import time

import pytest

from phalanx.configs.errors import ConfigError
from phalanx.configs.loader import load_config
from phalanx.launcher.services.leadership import (JobState, Leadership, LeadershipLost,
                                                  StandbyError, publish_state, read_state)
from tests.fakes.membership_memory import InMemoryMembership, InMemoryStore


def test_one_leader_and_a_standby_that_takes_over_when_its_lease_ends() -> None:
    store = InMemoryStore()
    leader = Leadership(InMemoryMembership(store), ttl_s=2)   # type: ignore[arg-type]
    standby = Leadership(InMemoryMembership(store), ttl_s=2)  # type: ignore[arg-type]
    assert leader.try_acquire()
    assert not standby.try_acquire()
    holder = standby.holder()
    assert holder is not None and {"host", "pid", "since"} <= set(holder)
    seen: list[dict] = []
    waiter = threading.Thread(target=standby.wait, kwargs={"poll_s": 0.01,
                                                            "on_waiting": seen.append})
    waiter.start()
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:   # the standby saw who leads
        time.sleep(0.01)
    leader._membership._stop_keepalive()      # the leader process died
    store.advance(3)
    waiter.join(timeout=10)
    assert not waiter.is_alive() and standby.held
    assert len(seen) == 1
    with pytest.raises(LeadershipLost, match="another launcher may lead"):
        leader.check()
    standby.check()                           # still held: no error


def test_wait_gives_up_past_its_deadline() -> None:
    store = InMemoryStore()
    assert Leadership(InMemoryMembership(store), ttl_s=5).try_acquire()  # type: ignore[arg-type]
    with pytest.raises(StandbyError, match="no leader left"):
        Leadership(InMemoryMembership(store), ttl_s=5).wait(  # type: ignore[arg-type]
            poll_s=0.01, deadline_s=0.05)


def test_job_state_round_trips_and_refuses_another_version() -> None:
    state = JobState(run_dir="/runs/x", generation=3,
                     slots={0: {"worker_id": "w0-g0", "node": 0, "actor": "j-rank0"}},
                     keepers={1: {"actor": "j-keeper1", "host": "127.0.0.1", "port": 7}},
                     spares={"spare2": {"node": 1, "actor": "j-spare2"}}, spare_serial=3,
                     live_nodes=[0, 1], recoveries=2, holders={0: ["node1"]},
                     history=[{"generation": 3}])
    membership = InMemoryMembership()
    publish_state(membership, state)          # type: ignore[arg-type]
    assert read_state(membership) == state    # type: ignore[arg-type]
    with pytest.raises(StandbyError, match="version 99"):
        JobState.from_json(state.to_json().replace(b'"version": 1', b'"version": 99'))
    with pytest.raises(StandbyError, match="published no coordinator state"):
        read_state(InMemoryMembership())      # type: ignore[arg-type]


def test_standby_needs_services_that_outlive_the_launcher() -> None:
    with pytest.raises(ConfigError, match="coordinator.standby.*set etcd.endpoints and "
                                          "ray.address"):
        load_config("configs/demo.yaml", ["coordinator.standby=true"])
    cfg = load_config("configs/demo.yaml", ["coordinator.standby=true", "ray.address=x:1",
                                            "etcd.endpoints=[127.0.0.1:2379]"])
    assert cfg.coordinator.standby


def test_standby_flag_without_the_config_is_refused() -> None:
    from phalanx.launcher.job import JobRunner

    with pytest.raises(ConfigError, match="--standby was given"):
        JobRunner(load_config("configs/demo.yaml", []), standby=True)
