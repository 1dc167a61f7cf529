"""``bounded_lookup``: Ray's node lookup during the local Ray's start, given up after its
bound with the ``RuntimeError`` Ray's ``Node`` start retries on, never blocking the start
for the lookup's whole 60 s RPC deadline."""
from __future__ import annotations

import inspect
import threading
import time

import pytest
from ray._private import node as ray_node

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
