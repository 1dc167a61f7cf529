"""A small tmpfs of its own, for tests of shared memory running out (Docker's default
/dev/shm is 64 MiB): mounted under the test's tmp_path as root, unmounted after. Tests
that use it are skipped where mounting is not allowed (not root, no mount(8))."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest


@contextlib.contextmanager
def small_tmpfs(folder: Path, size_mb: int) -> Iterator[str]:
    """``folder`` (created) with a ``size_mb`` MiB tmpfs mounted on it until exit."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root and mount(8)")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=1777", "tmpfs",
                           str(folder)], capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield str(folder)
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True, timeout=10)
