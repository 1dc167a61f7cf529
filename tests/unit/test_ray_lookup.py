"""``bounded_lookup``: Ray's node lookup during the local Ray's start, given up after its
bound with the ``RuntimeError`` Ray's ``Node`` start retries on, never blocking the start
for the lookup's whole 60 s RPC deadline."""
from __future__ import annotations

import inspect
import threading
import time

import pytest
from ray._private import node as ray_node

from phalanx.launcher.services import ray_cluster
from phalanx.launcher.services.ray_cluster import bounded_lookup

pytestmark = pytest.mark.unit


def test_an_answer_and_an_error_come_back_as_they_are() -> None:
    assert bounded_lookup(lambda gcs, node: {"gcs": gcs, "node": node}, "g:1", "ab", 5.0) \
        == {"gcs": "g:1", "node": "ab"}

    def missing(gcs: str, node: str) -> None:
        raise RuntimeError("node not found")

    with pytest.raises(RuntimeError, match="node not found"):
        bounded_lookup(missing, "g:1", "ab", 5.0)


def test_a_lookup_with_no_answer_is_given_up_after_its_bound() -> None:
    release = threading.Event()

    def stuck(gcs: str, node: str) -> None:
        release.wait(30)     # as Ray's lookup did: no answer until its RPC deadline

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="no answer to the node lookup within 0.3 s"):
        bounded_lookup(stuck, "g:1", "ab" * 28, 0.3)
    assert 0.3 <= time.monotonic() - started < 2.0
    release.set()


def test_rays_node_start_asks_again_after_a_runtime_error() -> None:
    """What the bound relies on: the Ray in use retries its lookup on ``RuntimeError``."""
    source = inspect.getsource(ray_node.Node.__init__)
    lookup = source.index("ray._private.services.get_node(")
    assert "except RuntimeError" in source[lookup:lookup + 400]
    assert "while True" in source[lookup - 400:lookup]


def _rays_node_start_loop(limit_s: float) -> float:
    """Ray's ``Node`` start, as it asks for its node's record: again on ``RuntimeError``
    (not registered yet), until its 30 s; returns the seconds until a lookup came back."""
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        try:
            ray_cluster.ray_services.get_node("g:1", "ab" * 28)
            return time.monotonic() - started
        except RuntimeError:
            time.sleep(0.01)
    raise AssertionError("Ray's own limit ran out")


def test_a_node_never_registered_fails_the_attempt_after_the_limit(monkeypatch,
                                                                   tmp_path) -> None:
    def unregistered(gcs: str, node: str) -> None:
        raise RuntimeError("node not found")     # what the GCS answers until it registers

    monkeypatch.setattr(ray_cluster.ray_services, "get_node", unregistered)
    assert not issubclass(ray_cluster.RegistrationStalled, RuntimeError)   # Ray re-raises it
    started = time.monotonic()
    with ray_cluster._registration_polled(limit_s=0.4, cluster_dir=tmp_path):
        # the error says whether the cluster's raylets run (none under this folder)
        with pytest.raises(ray_cluster.RegistrationStalled,
                           match=r"not registered .*\(0 raylet process\(es\) of the cluster"):
            _rays_node_start_loop(5.0)
    assert 0.4 <= time.monotonic() - started < 2.0
    assert ray_cluster.ray_services.get_node is unregistered     # Ray's own again after


def test_without_a_limit_rays_own_lookup_decides(monkeypatch) -> None:
    answers = iter([RuntimeError("node not found")] * 3 + [{"node": "ab"}])

    def registers_late(gcs: str, node: str) -> dict:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(ray_cluster.ray_services, "get_node", registers_late)
    with ray_cluster._registration_polled(limit_s=None):
        assert _rays_node_start_loop(5.0) < 2.0


def _spawn(kind: str, code: str) -> None:
    """Ray's own process spawn, as Ray calls it for its GCS and raylets (output to
    /dev/null, the process opening its own logs once running)."""
    import subprocess
    import sys
    ray_cluster.ray_services.start_ray_process(
        [sys.executable, "-c", code], kind, fate_share=False,
        stdout_file=subprocess.DEVNULL, stderr_file=subprocess.DEVNULL)


def test_a_gcs_that_dies_at_start_ends_rays_wait_for_its_port_at_once(tmp_path) -> None:
    spawns = ray_cluster.Spawns(tmp_path)
    original_wait = ray_node.wait_for_persisted_port
    with ray_cluster._spawns_kept(spawns):
        _spawn("gcs_server", "import sys; sys.stderr.write('epoll_wait error'); sys.exit(3)")
        _spawn("log_monitor", "import time; time.sleep(3)")
        started = time.monotonic()
        # Ray waits 30 s for the port file of a GCS that will never write it
        with pytest.raises(ray_cluster.RayProcessDied,
                           match=r"gcs_server exited 3 .*1 of 2 spawned Ray process\(es\) "
                                 r"running; gcs_server exited 3 saying 'epoll_wait error'"):
            ray_node.wait_for_persisted_port(str(tmp_path), "ab" * 28, "gcs_server_port",
                                             timeout_ms=30_000)
        assert time.monotonic() - started < 2.0
    assert ray_node.wait_for_persisted_port is original_wait     # Ray's own again after
    assert (tmp_path / "gcs_server-spawn-0.err").read_text() == "epoll_wait error"


def test_a_live_gcs_leaves_the_wait_to_rays_own_limit(tmp_path) -> None:
    spawns = ray_cluster.Spawns(tmp_path)
    with ray_cluster._spawns_kept(spawns):
        _spawn("gcs_server", "import time; time.sleep(5)")
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="Timed out waiting for file"):
            ray_node.wait_for_persisted_port(str(tmp_path), "ab" * 28, "gcs_server_port",
                                             timeout_ms=700)
        assert 0.7 <= time.monotonic() - started < 1.5
        assert spawns.report() == "1 of 1 spawned Ray process(es) running"
        spawns.entries[0][1].process.kill()


def test_a_raylet_that_died_is_not_waited_for_on_any_attempt(monkeypatch, tmp_path) -> None:
    def unregistered(gcs: str, node: str) -> None:
        raise RuntimeError("node not found")

    monkeypatch.setattr(ray_cluster.ray_services, "get_node", unregistered)
    spawns = ray_cluster.Spawns(tmp_path)
    with ray_cluster._spawns_kept(spawns), \
            ray_cluster._registration_polled(limit_s=None, cluster_dir=tmp_path, spawns=spawns):
        _spawn("raylet", "import os; os.abort()")
        spawns.entries[0][1].process.wait(timeout=10)
        started = time.monotonic()
        with pytest.raises(ray_cluster.RayProcessDied, match=r"raylet exited -6"):
            _rays_node_start_loop(5.0)    # the last attempt: no limit, yet no 30 s wait
        assert time.monotonic() - started < 1.0
