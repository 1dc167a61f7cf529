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
