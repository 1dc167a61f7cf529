"""Drill hooks exist only in a run with drills on: without ``drills.enabled`` or a scenario a
worker installs no SIGUSR1 handler and writes no tensor-address files, and the launcher
opens no injector; with drills on, both hooks are there."""
from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from phalanx.configs.errors import InjectedFault
from phalanx.configs.loader import load_config
from phalanx.launcher.drills.seam import JobDrills
from phalanx.runtime.context import WorkerContext
from phalanx.runtime.worker.drill_hooks import MEMORY_DIR, read_memory_maps
from phalanx.runtime.worker.session import Session

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


@pytest.fixture(autouse=True)
def _default_sigusr1():
    previous = signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGUSR1, previous)


def _session(tmp_path: Path, drills: bool) -> Session:
    ctx = WorkerContext(job="hooks", rank=0, world_size=1, run_dir=str(tmp_path),
                        torch_threads=torch.get_num_threads(), drills=drills)
    session = Session(ctx, capture_rng=False)
    session.register(model=torch.nn.Linear(2, 2))
    return session.start()


def test_without_drills_a_worker_has_no_drill_hooks(tmp_path: Path) -> None:
    session = _session(tmp_path, drills=False)
    try:
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
        assert not (tmp_path / MEMORY_DIR).exists()
    finally:
        session.close()


def test_with_drills_the_worker_raises_on_sigusr1_and_publishes_its_tensors(
        tmp_path: Path) -> None:
    session = _session(tmp_path, drills=True)
    try:
        with pytest.raises(InjectedFault, match="worker_exception"):
            signal.raise_signal(signal.SIGUSR1)
        [entry] = read_memory_maps(tmp_path, 0)
        assert {t["object"] for t in entry["tensors"].values()} == {"model"}
    finally:
        session.close()


def test_the_launcher_opens_drills_only_when_the_config_turns_them_on() -> None:
    plain = load_config("configs/demo.yaml", [])
    assert not plain.drills.active and JobDrills.open(plain) == (plain, None)
    enabled = load_config("configs/demo.yaml", ["drills.enabled=true"])
    cfg, drills = JobDrills.open(enabled)
    assert cfg is enabled and drills is not None and drills.scenario is None
    scenario = load_config("configs/demo.yaml", ["drills.scenario=configs/drills/kill_worker.yaml"])
    assert scenario.drills.active
    cfg, drills = JobDrills.open(scenario)
    assert drills is not None and drills.scenario is not None
    drills.close()
