"""NodeWatch against real processes: a keeper-like FrameServer and a raylet-like listener in
a child process, killed with SIGKILL the way a lost node's processes die."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phalanx.launcher.coordination.node_watch import NodeWatch, refuses
from phalanx.runtime.transport.tcp import FrameServer, Reply

ROOT = Path(__file__).resolve().parents[2]
SECRET = b"s" * 32
JOB = "watchjob"
CHILD = """
import json, socket, sys, time
from phalanx.runtime.transport.tcp import FrameServer, Reply
server = FrameServer("127.0.0.1", secret=b"s" * 32, job="watchjob",
                     handler=lambda request: Reply({})).start()
raylet = socket.create_server(("127.0.0.1", 0))
print(json.dumps({"keeper": server.address, "raylet": raylet.getsockname()}), flush=True)
time.sleep(600)
"""


def _node_process() -> tuple[subprocess.Popen[str], tuple[str, int], tuple[str, int]]:
    child = subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE)
    assert child.stdout is not None
    ports = json.loads(child.stdout.readline())
    return child, tuple(ports["keeper"]), tuple(ports["raylet"])  # type: ignore[return-value]


def _wait_for(watch: NodeWatch, seconds: float) -> list[tuple[int, float]]:
    deadline = time.monotonic() + seconds
    found: list[tuple[int, float]] = []
    while time.monotonic() < deadline and not found:
        found = watch.drain()
        time.sleep(0.01)
    return found


@pytest.fixture
def node():
    child, keeper, raylet = _node_process()
    yield child, keeper, raylet
    child.kill()
    child.wait()


def test_a_killed_node_is_reported_once_stamped_when_its_keeper_connection_ended(node):
    child, keeper, raylet = node
    watch = NodeWatch({3: keeper}, {3: raylet}, SECRET, JOB, lambda: 0).start()
    try:
        assert watch.watched == [3]
        killed = time.monotonic()
        os.kill(child.pid, signal.SIGKILL)
        lost = _wait_for(watch, 10.0)
        assert [index for index, _ in lost] == [3], (lost, watch.watched, child.poll())
        assert lost[0][1] >= killed
        time.sleep(0.2)
        assert watch.drain() == [] and watch.watched == []
    finally:
        watch.close()


def test_a_keeper_gone_on_a_live_node_is_not_a_lost_node(node):
    child, keeper, _ = node
    raylet = socket.create_server(("127.0.0.1", 0))   # this node's raylet stays up
    watch = NodeWatch({0: keeper}, {0: raylet.getsockname()}, SECRET, JOB, lambda: 0).start()
    try:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        assert _wait_for(watch, 1.5) == []
        assert watch.watched == []
    finally:
        watch.close()
        raylet.close()


def test_an_idle_close_by_a_live_keeper_is_watched_again():
    server = FrameServer("127.0.0.1", secret=SECRET, job=JOB, handler=lambda r: Reply({}),
                         idle_timeout_s=0.3).start()
    raylet = socket.create_server(("127.0.0.1", 0))
    watch = NodeWatch({1: server.address}, {1: raylet.getsockname()}, SECRET, JOB,
                      lambda: 0).start()
    try:
        assert _wait_for(watch, 1.5) == []      # at least four idle closes in that time
        # watched again after each close: between a close and its reconnection (a moment,
        # longer on a loaded machine) the node is briefly not watched, never reported lost
        deadline = time.monotonic() + 5
        while watch.watched != [1] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watch.watched == [1]
        assert watch.drain() == []
    finally:
        watch.close()
        server.close()
        raylet.close()


def test_a_keeper_that_refuses_the_secret_is_not_watched_and_not_reported(node):
    _, keeper, raylet = node
    watch = NodeWatch({0: keeper}, {0: raylet}, b"w" * 32, JOB, lambda: 0).start()
    try:
        assert watch.watched == []
        assert watch.drain() == []
    finally:
        watch.close()


def test_refuses_only_when_nothing_listens():
    listener = socket.create_server(("127.0.0.1", 0))
    address = listener.getsockname()
    assert not refuses(address)
    listener.close()
    assert refuses(address)


def test_descendants_finds_the_whole_process_tree():
    from phalanx.launcher.services.ray_cluster import descendants

    tree = subprocess.Popen(["sh", "-c", "sleep 30 & (sleep 30 & wait) & wait"])
    try:
        deadline = time.monotonic() + 5
        found: list[int] = []
        while time.monotonic() < deadline and len(found) < 4:  # sleep, subshell, its sleep
            found = descendants(tree.pid)
            time.sleep(0.02)
        assert len(found) >= 3, found
        assert tree.pid not in found
        names = [Path(f"/proc/{pid}/comm").read_text().strip() for pid in found]
        assert names.count("sleep") == 2, names
    finally:
        for pid in descendants(tree.pid):
            os.kill(pid, signal.SIGKILL)
        tree.kill()
        tree.wait()
