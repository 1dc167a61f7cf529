"""``phalanx ckpt ls|verify|export`` over a real disk tier (2 ranks, steps 5 and 10 committed,
15 partial) and a moto S3 tier: listing, checksum and HMAC failures, safetensors export."""
from __future__ import annotations

import argparse
import io
import json
import time
from pathlib import Path

import pytest
import torch
import yaml
from rich.console import Console
from safetensors import safe_open
from safetensors.torch import load_file

from phalanx.configs.schema import S3TierConfig
from phalanx.launcher.ckpt_commands import add_ckpt_parser, run_ckpt
from phalanx.runtime.base import Tier
from phalanx.runtime.snapshot.format import (Manifest, checksums, make_manifest, plan_layout,
                                             write_into)
from phalanx.runtime.tiers.disk import DiskTier
from phalanx.runtime.tiers.s3 import MIN_PART_SIZE, S3Tier

pytestmark = pytest.mark.integration

JOB = "ckpt-job"
SECRET = b"ckpt-test-secret-0123456789abcdef"
RANKS = (0, 1)


def _tensors(step: int, rank: int) -> dict[str, torch.Tensor]:
    base = float(step * 100 + rank)
    return {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4) + base,
            "b": torch.tensor([step, rank, 7], dtype=torch.int64),
            "half": torch.full((5,), base, dtype=torch.bfloat16),
            "mask": torch.tensor([True, False, rank == 1])}


def _tree_spec(step: int, rank: int) -> dict:
    return {"version": 1, "objects": {"model": {"kind": "value", "step": step, "rank": rank}}}


def _write_rank(tier: Tier, step: int, rank: int) -> None:
    tensors = _tensors(step, rank)
    layout = plan_layout(tensors, {"format": "pt"})
    buf = bytearray(layout.total_bytes)
    write_into(buf, layout, tensors)
    manifest = make_manifest(layout, checksums(buf, layout), job=JOB, rank=rank, step=step,
                             generation=1, tree_spec=_tree_spec(step, rank),
                             created_at=time.time()).sign(SECRET)
    tier.write_rank(step, rank, buf, manifest.to_json())


def _fill(tier: Tier) -> None:
    """Steps 5 and 10 committed on both ranks; step 15 has rank 0 only, uncommitted."""
    for step in (5, 10):
        for rank in RANKS:
            _write_rank(tier, step, rank)
        tier.commit_step(step, list(RANKS))
    _write_rank(tier, 15, 0)


@pytest.fixture
def disk(tmp_path: Path) -> DiskTier:
    tier = DiskTier(tmp_path / "tier", JOB)
    _fill(tier)
    return tier


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    return path


def _run(*argv: str) -> tuple[int, str, str]:
    """(exit code, console text, --json text) of ``phalanx ckpt <argv>``."""
    parser = argparse.ArgumentParser()
    add_ckpt_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["ckpt", *argv])
    console_text, out = io.StringIO(), io.StringIO()
    code = run_ckpt(args, Console(file=console_text, width=200), out=out)
    return code, console_text.getvalue(), out.getvalue()


def _disk_args(tier: DiskTier) -> list[str]:
    return ["--path", str(tier.job_dir.parent), "--job", JOB]


@pytest.mark.timeout(60)
def test_ls_shows_committed_and_partial_steps(disk: DiskTier) -> None:
    code, text, _ = _run("ls", *_disk_args(disk))
    assert code == 0
    rows = {line.split("│")[1].strip(): line for line in text.splitlines()
            if line.count("│") > 3 and line.split("│")[1].strip().isdigit()}
    assert set(rows) == {"5", "10", "15"}
    assert "committed" in rows["5"] and "committed" in rows["10"] and "partial" in rows["15"]

    code, _, out = _run("ls", *_disk_args(disk), "--json")
    assert code == 0
    steps = {s["step"]: s for s in json.loads(out)["steps"]}
    assert sorted(steps) == [5, 10, 15]
    assert [steps[s]["state"] for s in (5, 10, 15)] == ["committed", "committed", "partial"]
    assert steps[10]["ranks"] == [0, 1] and steps[15]["ranks"] == [0]
    assert steps[10]["missing_ranks"] == [] and steps[10]["tier"] == "disk"
    files = [p for p in disk.step_dir(10).iterdir() if p.name.startswith("rank_")]
    assert steps[10]["total_bytes"] == sum(p.stat().st_size for p in files)
    assert steps[10]["created_at"].endswith("Z")


@pytest.mark.timeout(60)
def test_ls_finds_the_job_from_the_path_alone(disk: DiskTier) -> None:
    for path in (disk.job_dir.parent, disk.job_dir):
        code, _, out = _run("ls", "--path", str(path), "--json")
        assert code == 0, path
        assert [s["step"] for s in json.loads(out)["steps"]] == [5, 10, 15]


@pytest.mark.timeout(60)
def test_ls_of_the_newest_run_from_a_config(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / f"{JOB}-1"
    _fill(DiskTier(run_dir / "checkpoints", JOB))
    (tmp_path / "runs" / "latest").write_text(f"{run_dir}\n")
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({"job": {"name": JOB, "entrypoint": "train.py:main",
                                              "run_dir": str(tmp_path / "runs")}}))
    code, _, out = _run("ls", "--config", str(config), "--json")
    assert code == 0
    assert [s["step"] for s in json.loads(out)["steps"]] == [5, 10, 15]


@pytest.mark.timeout(60)
def test_verify_of_a_partial_step_fails_and_says_why(disk: DiskTier, secret_file: Path) -> None:
    code, text, _ = _run("verify", *_disk_args(disk), "--step", "15", "--secret-file",
                         str(secret_file))
    assert code == 1, text
    assert "1/1 ranks OK" in text and "no commit marker" in text and "not restorable" in text
    code, _, out = _run("verify", *_disk_args(disk), "--step", "15", "--json")
    report = json.loads(out)
    assert code == 1 and report["committed"] is False and report["ok"] is False


@pytest.mark.timeout(60)
def test_verify_newest_committed_step_is_ok(disk: DiskTier, secret_file: Path) -> None:
    code, text, _ = _run("verify", *_disk_args(disk), "--secret-file", str(secret_file))
    assert code == 0, text
    assert "step 10" in text and "2/2 ranks OK; HMAC checked" in text

    code, _, out = _run("verify", *_disk_args(disk), "--step", "5", "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] and report["step"] == 5 and not report["hmac_checked"]
    assert [(r["rank"], r["status"]) for r in report["ranks"]] == [(0, "ok"), (1, "ok")]


@pytest.mark.timeout(60)
def test_verify_names_rank_and_tensor_of_a_flipped_byte(disk: DiskTier,
                                                        secret_file: Path) -> None:
    manifest = Manifest.from_json((disk.step_dir(10) / "rank_1.json").read_bytes())
    payload_path = disk.step_dir(10) / "rank_1.safetensors"
    data = bytearray(payload_path.read_bytes())
    data[manifest.tensors["w"]["offset"] + 5] ^= 0x01
    payload_path.write_bytes(bytes(data))

    code, text, _ = _run("verify", *_disk_args(disk), "--secret-file", str(secret_file))
    assert code == 1
    assert "tier disk step 10 rank 1: tensor 'w' checksum mismatch" in text
    assert "1/2 ranks OK" in text

    code, _, out = _run("verify", *_disk_args(disk), "--json")
    ranks = json.loads(out)["ranks"]
    assert code == 1
    assert (ranks[0]["status"], ranks[1]["status"], ranks[1]["tensor"]) == ("ok", "corrupt", "w")


@pytest.mark.timeout(60)
def test_verify_with_a_wrong_secret_reports_unauthenticated(disk: DiskTier,
                                                            tmp_path: Path) -> None:
    wrong = tmp_path / "wrong-secret"
    wrong.write_bytes(b"not-the-job-secret")
    code, text, out = _run("verify", *_disk_args(disk), "--secret-file", str(wrong), "--json")
    assert code == 1
    assert {r["status"] for r in json.loads(out)["ranks"]} == {"unauthenticated"}
    code, text, _ = _run("verify", *_disk_args(disk), "--secret-file", str(wrong))
    assert code == 1 and "unauthenticated: tier disk step 10 rank 0" in text
    assert "HMAC does not match" in text


@pytest.mark.timeout(60)
def test_export_writes_safetensors_that_load_back(disk: DiskTier, secret_file: Path,
                                                  tmp_path: Path) -> None:
    out_dir = tmp_path / "export"
    code, text, _ = _run("export", *_disk_args(disk), "--step", "10", "--out", str(out_dir),
                         "--secret-file", str(secret_file))
    assert code == 0, text
    for rank in RANKS:
        loaded = load_file(str(out_dir / f"rank_{rank}.safetensors"))
        original = _tensors(10, rank)
        assert loaded.keys() == original.keys()
        for name, tensor in original.items():
            assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)
        with safe_open(str(out_dir / f"rank_{rank}.safetensors"), "pt") as handle:
            metadata = handle.metadata()
        assert json.loads(metadata["phalanx_tree_spec"]) == _tree_spec(10, rank)
        assert metadata["format"] == "pt"
        assert (out_dir / f"rank_{rank}.json").read_bytes() == \
            (disk.step_dir(10) / f"rank_{rank}.json").read_bytes()


@pytest.mark.timeout(60)
def test_export_refuses_to_overwrite_without_force(disk: DiskTier, tmp_path: Path) -> None:
    out_dir = tmp_path / "export"
    assert _run("export", *_disk_args(disk), "--step", "5", "--out", str(out_dir))[0] == 0
    (out_dir / "rank_1.json").write_text("mine")
    code, text, _ = _run("export", *_disk_args(disk), "--step", "10", "--out", str(out_dir))
    assert code == 2
    assert "already exists" in text and "--force" in text
    assert (out_dir / "rank_1.json").read_text() == "mine"
    assert torch.equal(load_file(str(out_dir / "rank_0.safetensors"))["w"], _tensors(5, 0)["w"])

    code, text, _ = _run("export", *_disk_args(disk), "--step", "10", "--out", str(out_dir),
                         "--force")
    assert code == 0, text
    assert torch.equal(load_file(str(out_dir / "rank_0.safetensors"))["w"], _tensors(10, 0)["w"])


@pytest.mark.timeout(60)
def test_export_refuses_a_step_that_fails_verification(disk: DiskTier, tmp_path: Path) -> None:
    payload_path = disk.step_dir(5) / "rank_0.safetensors"
    data = bytearray(payload_path.read_bytes())
    data[-1] ^= 0xFF
    payload_path.write_bytes(bytes(data))
    out_dir = tmp_path / "export"
    code, text, _ = _run("export", *_disk_args(disk), "--step", "5", "--out", str(out_dir))
    assert code == 1 and "export refused" in text and "rank 0" in text
    assert not out_dir.exists()


@pytest.mark.timeout(60)
def test_bad_input_exits_2_naming_the_thing_and_the_fix(disk: DiskTier, tmp_path: Path) -> None:
    code, text, _ = _run("verify", *_disk_args(disk), "--step", "7")
    assert code == 2
    assert "step 7 does not exist in tier disk" in text and "5 (committed)" in text
    assert "15 (partial)" in text

    code, text, _ = _run("export", *_disk_args(disk), "--step", "7", "--out", str(tmp_path / "x"))
    assert code == 2 and "step 7 does not exist" in text

    code, text, _ = _run("ls")
    assert code == 2 and "no tier given" in text and "--path DIR" in text

    code, text, _ = _run("verify", *_disk_args(disk), "--secret-file", str(tmp_path / "nope"))
    assert code == 2 and "--secret-file" in text and "cannot be read" in text

    code, text, _ = _run("ls", "--path", str(disk.job_dir.parent), "--job", "other-job")
    assert code == 2 and "no job folder" in text and JOB in text

    code, text, _ = _run("ls", "--path", str(tmp_path / "missing"))
    assert code == 2 and "is not a folder" in text

    empty = tmp_path / "empty"
    empty.mkdir()
    code, text, _ = _run("verify", "--path", str(empty), "--job", JOB)
    assert code == 2 and "no job folder" in text


def _s3_config_file(s3_config: S3TierConfig, tmp_path: Path) -> Path:
    """A job config whose only tier is the test's S3 bucket."""
    config = tmp_path / "s3-job.yaml"
    config.write_text(yaml.safe_dump({
        "job": {"name": JOB, "entrypoint": "train.py:main"},
        "tiers": {"disk": {"enabled": False},
                  "s3": {"enabled": True, "bucket": s3_config.bucket,
                         "endpoint_url": s3_config.endpoint_url, "region": s3_config.region}}}))
    return config


@pytest.mark.timeout(60)
def test_s3_ls_and_verify(s3_config: S3TierConfig, tmp_path: Path, secret_file: Path) -> None:
    _fill(S3Tier(s3_config, JOB, part_size=MIN_PART_SIZE, deadline_s=20.0))
    config = _s3_config_file(s3_config, tmp_path)

    code, _, out = _run("ls", "--config", str(config), "--json")
    assert code == 0
    steps = {s["step"]: s for s in json.loads(out)["steps"]}
    assert [(s, steps[s]["state"], steps[s]["ranks"]) for s in sorted(steps)] == \
        [(5, "committed", [0, 1]), (10, "committed", [0, 1]), (15, "partial", [0])]
    assert steps[10]["tier"] == "s3" and steps[10]["location"].startswith("s3://")
    assert steps[10]["total_bytes"] > 0

    code, text, _ = _run("verify", "--config", str(config), "--secret-file", str(secret_file))
    assert code == 0, text
    assert "tier s3 step 10: 2/2 ranks OK; HMAC checked" in text

    code, text, _ = _run("verify", "--config", str(config), "--step", "3")
    assert code == 2 and "step 3 does not exist in tier s3" in text


def _s3_key(tier: S3Tier, bucket: str, step: int, name: str) -> str:
    """The object key the tier stored ``name`` of ``step`` under, found by listing."""
    suffix = f"step_{step:012d}/{name}"
    keys = [o["Key"] for o in tier.client.list_objects_v2(Bucket=bucket)["Contents"]]
    (key,) = [k for k in keys if k.endswith(suffix)]
    return key


@pytest.mark.timeout(60)
def test_s3_verify_names_rank_step_and_tensor_of_a_corrupted_object(
        s3_config: S3TierConfig, tmp_path: Path, secret_file: Path) -> None:
    tier = S3Tier(s3_config, JOB, part_size=MIN_PART_SIZE, deadline_s=20.0)
    _fill(tier)
    payload, manifest_bytes = tier.read_rank(10, 1)
    manifest = Manifest.from_json(manifest_bytes)
    damaged = bytearray(payload)
    damaged[manifest.tensors["half"]["offset"] + 1] ^= 0x40   # one bit of one tensor
    key = _s3_key(tier, s3_config.bucket, 10, "rank_1.safetensors")
    tier.client.put_object(Bucket=s3_config.bucket, Key=key, Body=bytes(damaged))
    config = _s3_config_file(s3_config, tmp_path)

    code, text, _ = _run("verify", "--config", str(config), "--secret-file", str(secret_file))
    assert code == 1, text
    assert "tier s3 step 10 rank 1: tensor 'half' checksum mismatch" in text
    assert "tier s3 step 10: 1/2 ranks OK; HMAC checked" in text

    code, _, out = _run("verify", "--config", str(config), "--step", "10", "--json")
    report = json.loads(out)
    assert code == 1 and not report["ok"] and report["step"] == 10 and report["tier"] == "s3"
    assert [(r["rank"], r["status"], r["tensor"]) for r in report["ranks"]] == \
        [(0, "ok", ""), (1, "corrupt", "half")]

    code, text, _ = _run("export", "--config", str(config), "--step", "10",
                         "--out", str(tmp_path / "export"))
    assert code == 1 and "export refused" in text and not (tmp_path / "export").exists()


@pytest.mark.timeout(60)
def test_s3_export_writes_safetensors_per_rank_equal_to_the_originals(
        s3_config: S3TierConfig, tmp_path: Path, secret_file: Path) -> None:
    _fill(S3Tier(s3_config, JOB, part_size=MIN_PART_SIZE, deadline_s=20.0))
    out_dir = tmp_path / "export"
    code, text, _ = _run("export", "--config", str(_s3_config_file(s3_config, tmp_path)),
                         "--step", "5", "--out", str(out_dir), "--secret-file",
                         str(secret_file))
    assert code == 0, text
    assert "exported tier s3 step 5 (2 ranks, HMAC checked)" in text
    assert sorted(p.name for p in out_dir.iterdir()) == \
        ["rank_0.json", "rank_0.safetensors", "rank_1.json", "rank_1.safetensors"]
    for rank in RANKS:
        original = _tensors(5, rank)
        with safe_open(str(out_dir / f"rank_{rank}.safetensors"), "pt") as handle:
            assert set(handle.keys()) == set(original)
            for name, tensor in original.items():
                got = handle.get_tensor(name)
                assert got.dtype == tensor.dtype and torch.equal(got, tensor), (rank, name)
            assert json.loads(handle.metadata()["phalanx_tree_spec"]) == _tree_spec(5, rank)
        manifest = Manifest.from_json((out_dir / f"rank_{rank}.json").read_bytes())
        manifest.verify(SECRET, source="export")
        assert (manifest.rank, manifest.step) == (rank, 5)
