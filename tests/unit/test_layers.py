"""The import layering of DESIGN.md, enforced by import-linter's contracts in pyproject.toml."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.unit
@pytest.mark.timeout(120)
def test_import_contracts_are_kept() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                          timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_keeper_starts_without_importing_torch() -> None:
    """A keeper moves, verifies and persists snapshot bytes: it never needs torch, whose
    import is most of a process's start-up (about 2 s of CPU on a 2-core machine, paid on
    the job's critical path once per node)."""
    probe = ("import sys, phalanx.launcher.keeper_actor, phalanx.runtime.tiers.persister; "
             "print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_the_launcher_imports_without_torch_and_fetches_it_for_its_store() -> None:
    """Every launcher module (the CLI's commands, the job runner, the actor classes it
    defines) imports without torch: the launcher needs it only for the job's TCPStore and
    imports it on a thread while etcd and Ray start (``services.stack.prefetch_torch``),
    where importing it first held every launch 1.1 s before etcd even started."""
    probe = ("import importlib, pkgutil, sys, phalanx.launcher as L\n"
             "for m in pkgutil.walk_packages(L.__path__, 'phalanx.launcher.'):\n"
             "    importlib.import_module(m.name)\n"
             "    assert 'torch' not in sys.modules, m.name\n"
             "from phalanx.launcher.services.stack import prefetch_torch\n"
             "import threading\n"
             "prefetch_torch()\n"
             "[t.join() for t in threading.enumerate() if t.name == 'phalanx-torch-import']\n"
             "print('torch.distributed' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True"
