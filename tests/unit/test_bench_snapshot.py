"""bench/snapshot.py --quick runs end to end and writes the JSON schema the docs rely on."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.unit.bench_run import positive, run_quick

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "snapshot.py"


def check_summary(summary: dict, where: str) -> None:
    assert set(summary) >= {"median", "min", "max", "samples"}, where
    assert summary["samples"], where
    for value in [summary["median"], summary["min"], summary["max"], *summary["samples"]]:
        assert positive(value), f"{where}: {value!r}"


@pytest.mark.timeout(120)
def test_quick_bench_writes_all_four_systems(tmp_path: Path) -> None:
    out = tmp_path / "results"
    stdout, pid = run_quick(BENCH, out, timeout_s=110, stop_grace_s=10)

    report = json.loads((out / "snapshot.json").read_text())
    assert report["bench"] == "snapshot" and report["device"] == "cpu" and report["quick"]
    assert report["repeats"] == 2 and report["sizes_mib"] == [16]
    assert set(report["systems"]) == {"phalanx", "torch_save", "dcp_async", "limit"}
    assert report["checksum_algos"] == ["xxh3", "blake3", "sha256"]
    assert set(report["targets"]) == {"stall_ratio_dcp_over_phalanx_min",
                                      "throughput_vs_limit_min"}
    assert report["notes"] and isinstance(report["warnings"], list)
    assert positive(report["machine"]["cpus"])
    assert all(positive(report["checksum_gbps_one_core"][a]) for a in ("xxh3", "blake3", "sha256"))
    if report["png"] is not None:
        assert Path(report["png"]).stat().st_size > 0

    [result] = report["results"]
    assert result["size_mib"] == 16 and result["tensors"] >= 8
    assert result["checksum_algos"] == ["xxh3", "blake3", "sha256"]
    assert 15 << 20 <= result["bytes"] <= 17 << 20

    assert result["limit"]["kind"] == "memcpy" and positive(result["limit"]["gbps"])
    check_summary(result["limit"]["seconds"], "limit")
    for algo in ("xxh3", "blake3", "sha256"):
        ph = result["phalanx"][algo]
        for key in ("stall_s", "landed_s", "complete_s"):
            check_summary(ph[key], f"phalanx {algo} {key}")
            assert len(ph[key]["samples"]) == 2
        assert ph["stall_s"]["median"] <= ph["complete_s"]["median"]
        assert ph["published_step"] == 2 * report["repeats"]  # each repeat runs twice
        assert ph["snapshot_bytes"] >= result["bytes"]
        for key in ("warmup_s", "throughput_gbps", "copy_gbps"):
            assert positive(ph[key]), (algo, key)
        for key in ("throughput_vs_limit", "copy_vs_limit", "stall_dcp_over_phalanx"):
            assert positive(result["ratios"][algo][key]), (algo, key)
        verdicts = result["verdicts"][algo]
        assert {verdicts["stall"], verdicts["throughput"]} <= {"PASS", "MISS"}
        assert verdicts["default_checksum"] == (algo == "xxh3")
    check_summary(result["torch_save"]["seconds"], "torch_save")
    assert positive(result["torch_save"]["throughput_gbps"])
    check_summary(result["dcp_async"]["stall_s"], "dcp stall")
    check_summary(result["dcp_async"]["complete_s"], "dcp complete")
    assert result["dcp_async"]["stall_s"]["median"] <= result["dcp_async"]["complete_s"]["median"]
    assert positive(result["dcp_async"]["throughput_gbps"])

    # the markdown table and the verdicts were printed
    assert all(f"| 16 MiB | {a} |" in stdout for a in ("xxh3", "blake3", "sha256"))
    assert "stall DCP/phalanx" in stdout

    # nothing of this run is left in shared memory (keeper slots, torch.save/DCP tmp dir)
    if os.path.isdir("/dev/shm"):
        left = [name for name in os.listdir("/dev/shm")
                if name.startswith((f"phalanx-bench-{pid}-",
                                    f"phalanx-bench-snap-{pid}-"))]
        assert not left, left
