"""Shared by the bench tests: run a bench script's ``--quick`` mode in a subprocess."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest


def positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) and value > 0


def run_quick(bench: Path, out: Path, timeout_s: float,
              stop_grace_s: float) -> tuple[str, int]:
    """(stdout+stderr, pid) of ``bench --quick --out OUT`` run from ``out``'s parent; fails
    the test when it runs past ``timeout_s`` (stopped with SIGTERM, so it cleans up) or
    exits non-zero."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, str(bench), "--quick", "--out", str(out)],
                            cwd=out.parent, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        stdout, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()            # SIGTERM: the bench unwinds and removes what it started
        stdout, _ = proc.communicate(timeout=stop_grace_s)
        pytest.fail(f"bench did not finish in {timeout_s:.0f} s:\n{stdout[-3000:]}")
    assert proc.returncode == 0, stdout[-3000:]
    return stdout, proc.pid
