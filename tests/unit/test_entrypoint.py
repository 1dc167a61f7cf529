"""Loading a job's entrypoint: a file entrypoint imports its sibling modules by name, as
the script would under ``python file.py``; bad entrypoints are typed config errors."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from phalanx.configs.errors import ConfigError
from phalanx.runtime.worker.entrypoint import load_entrypoint


def test_a_file_entrypoint_imports_its_siblings(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))   # restored after the test
    (tmp_path / "helpers_for_entry_test.py").write_text("def twice(x):\n    return 2 * x\n")
    (tmp_path / "job.py").write_text("from helpers_for_entry_test import twice\n\n"
                                     "def main(x):\n    return twice(x)\n")
    try:
        assert load_entrypoint(f"{tmp_path / 'job.py'}:main")(21) == 42
        assert sys.path[0] == str(tmp_path.resolve())
    finally:
        sys.modules.pop("helpers_for_entry_test", None)


def test_bad_entrypoints_are_config_errors(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text("value = 1\n")
    with pytest.raises(ConfigError, match="not 'file.py:fn'"):
        load_entrypoint("job.py")
    with pytest.raises(ConfigError, match="has no function 'value'"):
        load_entrypoint(f"{tmp_path / 'job.py'}:value")
