"""What a keeper serves of the run directory on its machine (``launcher.run_files``): the
log folder's files and sizes, byte ranges of them, and nothing outside that folder."""
from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.launcher.run_files import CHUNK_BYTES, list_run_files, read_run_file


def _run(tmp_path: Path) -> Path:
    run = tmp_path / "demo-20261202-000000-abcd"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "rank_0_w0-g0.log").write_bytes(b"event=worker_run rank=0\n" * 3)
    (run / "logs" / "rank_1_spare0.log").write_bytes(b"")
    (run / "config.yaml").write_text("job: {name: demo}\n")
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "x.safetensors").write_bytes(b"\0" * 8)
    return run


def test_only_the_log_folder_is_listed_with_sizes(tmp_path: Path) -> None:
    run = _run(tmp_path)
    assert list_run_files(str(run)) == {"logs/rank_0_w0-g0.log": 72,
                                        "logs/rank_1_spare0.log": 0}
    assert list_run_files(str(tmp_path / "absent")) == {}


def test_a_byte_range_is_read_and_capped_at_one_chunk(tmp_path: Path) -> None:
    run = _run(tmp_path)
    assert read_run_file(str(run), "logs/rank_0_w0-g0.log", 24, 24) == \
        b"event=worker_run rank=0\n"
    assert read_run_file(str(run), "logs/rank_0_w0-g0.log", 72, 10) == b""
    big = run / "logs" / "big.log"
    big.write_bytes(b"x" * (CHUNK_BYTES + 5))
    assert len(read_run_file(str(run), "logs/big.log", 0, CHUNK_BYTES * 2)) == CHUNK_BYTES


@pytest.mark.parametrize("relative", ["config.yaml", "checkpoints/x.safetensors",
                                      "logs/../config.yaml", "../../etc/passwd", "logs"])
def test_nothing_outside_the_log_folder_is_served(tmp_path: Path, relative: str) -> None:
    run = _run(tmp_path)
    with pytest.raises(ValueError, match="not a file of the run's logs"):
        read_run_file(str(run), relative, 0, 100)
