"""DCP (dcp.save / async_save / load) on phalanx tiers: bit-identical model + Adam round trips
in one process and over a real 2-rank gloo group, corruption, HMAC, safetensors, S3."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from phalanx.configs.errors import SnapshotCorrupt, SnapshotNotFound, SnapshotUnauthenticated
from phalanx.configs.schema import S3TierConfig
from phalanx.runtime.base import Tier
from phalanx.runtime.dcp.metadata import metadata_from_json, metadata_to_json
from phalanx.runtime.dcp.storage import TieredStorageReader, TieredStorageWriter
from phalanx.runtime.snapshot.format import Manifest, read_tensors
from phalanx.runtime.snapshot.state_tree import unflatten_state
from phalanx.runtime.tiers.disk import DiskTier
from tests.fakes.tier_memory import MemoryTier
from phalanx.runtime.tiers.s3 import MIN_PART_SIZE, S3Tier

pytestmark = [pytest.mark.integration,
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
              pytest.mark.filterwarnings("ignore:.*is deprecated:FutureWarning")]

JOB = "dcp-job"
SECRET = b"dcp-test-secret-0123456789abcdef"
REPO = Path(__file__).resolve().parents[2]


def _model_and_optim(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.8, 0.95))


def _train(model: torch.nn.Module, optim: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 6, generator=gen), torch.randn(16, 3, generator=gen)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optim.step()
        optim.zero_grad()


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    model, optim = _model_and_optim(0)
    _train(model, optim, range(3))
    msd, osd = get_state_dict(model, optim)
    return model, optim, {"model": msd, "optim": osd, "epoch": 3, "extra": {"lr_scale": 0.5,
                                                                           "tag": ("a", 1)}}


def _restore(load: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    """Fresh model/optim (other seed), load before any backward, apply; returns the dict."""
    model, optim = _model_and_optim(1)
    msd, osd = get_state_dict(model, optim)
    sd = {"model": msd, "optim": osd, "epoch": 0, "extra": {"lr_scale": 0.0, "tag": None}}
    load(sd)
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return model, optim, sd


def _assert_identical(a: tuple[torch.nn.Module, torch.optim.Optimizer],
                      b: tuple[torch.nn.Module, torch.optim.Optimizer]) -> None:
    for pa, pb in zip(a[0].parameters(), b[0].parameters(), strict=True):
        assert torch.equal(pa, pb)
    sa, sb = a[1].state_dict(), b[1].state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for key, state in sa["state"].items():
        for name, value in state.items():
            assert torch.equal(value, sb["state"][key][name]), (key, name)


def _round_trip(tier: Tier, save: Any) -> None:
    model, optim, sd = _trained()
    save(sd)
    model2, optim2, loaded = _restore(
        lambda s: dcp.load(s, storage_reader=TieredStorageReader(tier, 5, secret=SECRET)))
    assert loaded["epoch"] == 3 and loaded["extra"] == {"lr_scale": 0.5, "tag": ("a", 1)}
    _assert_identical((model, optim), (model2, optim2))
    _train(model, optim, range(3, 5))          # the resumed run continues bit-identically
    _train(model2, optim2, range(3, 5))
    _assert_identical((model, optim), (model2, optim2))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["disk", "memory"])
def test_model_and_adam_round_trip_is_bit_identical(kind: str, tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, JOB) if kind == "disk" else MemoryTier(JOB)
    _round_trip(tier, lambda sd: dcp.save(
        sd, storage_writer=TieredStorageWriter(tier, 5, secret=SECRET)))
    assert tier.committed_steps() == [5]


@pytest.mark.timeout(120)
def test_async_save_round_trip_in_one_process() -> None:
    tier = MemoryTier(JOB)

    def save(sd: dict[str, Any]) -> None:
        future = dcp.async_save(sd, storage_writer=TieredStorageWriter(tier, 5, secret=SECRET))
        future.result(timeout=60)
    _round_trip(tier, save)


@pytest.mark.timeout(120)
def test_s3_round_trip(s3_config: S3TierConfig) -> None:
    tier = S3Tier(s3_config, JOB, part_size=MIN_PART_SIZE, deadline_s=20.0)
    _round_trip(tier, lambda sd: dcp.save(
        sd, storage_writer=TieredStorageWriter(tier, 5, secret=SECRET)))


def _save(tier: Tier, step: int = 5, secret: bytes | None = SECRET) -> dict[str, Any]:
    sd = _trained()[2]
    dcp.save(sd, storage_writer=TieredStorageWriter(tier, step, secret=secret))
    return sd


def _failure(exc: CheckpointException) -> BaseException:
    (rank_failure,) = exc.failures.values()
    return rank_failure[0]


@pytest.mark.timeout(120)
def test_corrupt_payload_byte_raises_snapshot_corrupt_naming_tensor(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, JOB)
    _save(tier)
    manifest = Manifest.from_json((tier.step_dir(5) / "rank_0.json").read_bytes())
    record = manifest.tensors["optim.state.0.weight.exp_avg"]
    path = tier.step_dir(5) / "rank_0.safetensors"
    data = bytearray(path.read_bytes())
    data[record["offset"] + 5] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointException) as info:
        _restore(lambda s: dcp.load(s, storage_reader=TieredStorageReader(tier, 5, secret=SECRET)))
    error = _failure(info.value)
    assert isinstance(error, SnapshotCorrupt)
    assert "'optim.state.0.weight.exp_avg' checksum mismatch" in str(error)
    assert "step 5 rank 0" in str(error)


@pytest.mark.timeout(120)
def test_wrong_or_missing_secret_is_refused() -> None:
    tier = MemoryTier(JOB)
    _save(tier)
    with pytest.raises(SnapshotUnauthenticated, match="HMAC does not match"):
        TieredStorageReader(tier, 5, secret=b"another-job-secret").read_metadata()
    with pytest.raises(CheckpointException, match="HMAC does not match"):
        _restore(lambda s: dcp.load(s, storage_reader=TieredStorageReader(tier, 5, secret=b"x")))
    _save(tier, step=6, secret=None)
    with pytest.raises(SnapshotUnauthenticated, match="unsigned"):
        TieredStorageReader(tier, 6, secret=SECRET).read_metadata()
    TieredStorageReader(tier, 6).read_metadata()      # no secret: integrity only


@pytest.mark.timeout(120)
def test_disk_files_open_with_safetensors_and_phalanx_tools(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, JOB)
    sd = _save(tier)
    step_dir = tier.step_dir(5)
    assert sorted(p.name for p in step_dir.iterdir()) == ["COMMIT", "rank_0.json",
                                                          "rank_0.safetensors"]
    manifest = Manifest.from_json((step_dir / "rank_0.json").read_bytes())
    manifest.verify(SECRET)
    with safe_open(str(step_dir / "rank_0.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(manifest.tensors)
        assert torch.equal(f.get_tensor("model.0.weight"), sd["model"]["0.weight"])
    payload = (step_dir / "rank_0.safetensors").read_bytes()
    items = unflatten_state(read_tensors(payload, manifest), manifest.tree_spec)["dcp"]
    assert items["epoch"] == 3 and items["optim.param_groups.0.betas"] == (0.8, 0.95)
    assert b"pickle" not in payload and b"\x80\x02" not in (step_dir / "rank_0.json").read_bytes()
    metadata = metadata_from_json(manifest.tree_spec["dcp_metadata"], "test")
    assert metadata_to_json(metadata, metadata.storage_data) == manifest.tree_spec["dcp_metadata"]
    assert metadata.planner_data["optim.param_groups.0.lr"] == ("optim", "param_groups", 0, "lr")


@pytest.mark.timeout(120)
def test_non_json_value_is_refused_and_nothing_committed() -> None:
    tier = MemoryTier(JOB)
    sd = {"w": torch.ones(2), "sampler": object()}
    with pytest.raises(CheckpointException, match="Session extras") as info:
        dcp.save(sd, storage_writer=TieredStorageWriter(tier, 1))
    assert isinstance(_failure(info.value), TypeError)
    assert tier.committed_steps() == []


@pytest.mark.timeout(120)
def test_committed_step_is_not_overwritten_and_uncommitted_not_loaded() -> None:
    tier = MemoryTier(JOB)
    _save(tier, step=5)
    with pytest.raises(CheckpointException, match="already committed"):
        _save(tier, step=5)
    with pytest.raises(SnapshotNotFound, match="step 9 is not committed"):
        TieredStorageReader(tier, 9).read_metadata()
    with pytest.raises(ValueError, match="not a step"):
        TieredStorageWriter(tier, 1).reset("/ckpt/latest")


@pytest.mark.timeout(120)
def test_one_writer_reused_across_steps_keeps_each_step_intact(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, JOB)
    writer = TieredStorageWriter(tier, 0)            # its payload buffer is reused
    saved = {1: torch.arange(64.0), 2: torch.full((3,), 7.0), 3: torch.arange(100.0)}
    for step, tensor in saved.items():
        dcp.save({"t": tensor, "step": step}, checkpoint_id=step, storage_writer=writer)
    reader = TieredStorageReader(tier, 0)
    for step, tensor in saved.items():
        target = {"t": torch.zeros_like(tensor), "step": 0}
        dcp.load(target, checkpoint_id=step, storage_reader=reader)
        assert torch.equal(target["t"], tensor) and target["step"] == step


@pytest.mark.timeout(120)
def test_tampered_metadata_is_corrupt_not_a_crash() -> None:
    tier = MemoryTier(JOB)
    _save(tier, secret=None)
    payload, raw = tier.read_rank(5, 0)
    manifest = json.loads(raw)
    manifest["tree_spec"]["dcp_metadata"]["state_dict"][0][1]["dtype"] = "not_a_dtype"
    tier.write_rank(5, 0, payload, json.dumps(manifest).encode())
    with pytest.raises(SnapshotCorrupt, match="dtype 'not_a_dtype' is not a torch dtype"):
        TieredStorageReader(tier, 5).read_metadata()


# ------------------------------------------------------------------- 2 ranks over gloo

WORKER = r"""
import json, os, sys, warnings
from datetime import timedelta
from pathlib import Path
warnings.simplefilter("ignore")
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from phalanx.runtime.dcp.storage import TieredStorageReader, TieredStorageWriter
from phalanx.runtime.tiers.disk import DiskTier
from tests.integration.test_dcp_storage import (JOB, SECRET, _assert_identical, _model_and_optim,
                                               _train)

rank, store_path, root = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
torch.set_num_threads(1)
dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                        timeout=timedelta(seconds=60))
mesh = init_device_mesh("cpu", (2,))
tier = DiskTier(root, JOB)
full = torch.arange(48, dtype=torch.float64).reshape(8, 6)

def state(model, optim, shard):
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd, "shard": shard, f"rank{rank}": torch.full((3,), rank + 0.5),
            "meta": {"epoch": 3}}

def check(step, group=None):
    model2, optim2 = _model_and_optim(1)
    target = distribute_tensor(torch.zeros(8, 6, dtype=torch.float64), mesh, [Shard(1)])
    sd = state(model2, optim2, target)
    sd[f"rank{rank}"] = torch.zeros(3)
    sd["meta"] = {"epoch": 0}
    dcp.load(sd, storage_reader=TieredStorageReader(tier, step, secret=SECRET), process_group=group)
    set_state_dict(model2, optim2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    _assert_identical((model, optim), (model2, optim2))
    assert torch.equal(sd["shard"].full_tensor(), full), "resharded Shard(0) -> Shard(1)"
    assert torch.equal(sd[f"rank{rank}"], torch.full((3,), rank + 0.5))
    assert sd["meta"] == {"epoch": 3}

model, optim = _model_and_optim(0)
_train(model, optim, range(3))
shard = distribute_tensor(full, mesh, [Shard(0)])
dcp.save(state(model, optim, shard), storage_writer=TieredStorageWriter(tier, 1, secret=SECRET))
check(1)
async_group = dist.new_group(backend="gloo")
future = dcp.async_save(state(model, optim, shard), process_group=async_group,
                        storage_writer=TieredStorageWriter(tier, 2, secret=SECRET))
future.result(timeout=60)
check(2, async_group)
dist.barrier()
dist.destroy_process_group()
print("OK", rank, flush=True)
# past this line only the interpreter's teardown runs, where torch once aborted ("terminate
# called without an active exception": a C++ thread of its own still joinable), after the
# checkpoints were written and checked
os._exit(0)
"""


@pytest.mark.timeout(120)
def test_two_rank_gloo_save_async_save_load_and_reshard(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(rank), str(tmp_path / "store"),
                               str(tmp_path / "tier")], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    try:
        outputs = [proc.communicate(timeout=100)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0 and f"OK {rank}" in out, f"rank {rank}:\n{out[-4000:]}"
    tier = DiskTier(tmp_path / "tier", JOB)
    assert tier.committed_steps() == [1, 2]
    for step in (1, 2):
        specs = []
        for rank in (0, 1):
            payload, raw = tier.read_rank(step, rank)
            manifest = Manifest.from_json(raw)
            manifest.verify(SECRET)
            read_tensors(payload, manifest)
            with safe_open(str(tier.step_dir(step) / f"rank_{rank}.safetensors"), "pt") as f:
                assert set(f.keys()) == set(manifest.tensors)
            specs.append(manifest)
        assert "dcp_metadata" in specs[0].tree_spec and "dcp_metadata" not in specs[1].tree_spec
        assert "rank1" in specs[1].tensors and "rank0" in specs[0].tensors
        assert "shard@4,0" in specs[1].tensors and "shard@0,0" in specs[0].tensors


@pytest.mark.timeout(120)
def test_from_config_writes_where_the_job_and_phalanx_ckpt_look(tmp_path: Path) -> None:
    """A DCP user names the job's phalanx config: same disk root, checksum and secret as the
    job's own checkpoints, in the job's own `<job>.dcp` namespace (never the job's steps),
    and `phalanx ckpt verify --config --job <job>.dcp` checks the step."""
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET + b"\n")
    config = tmp_path / "job.yaml"
    config.write_text(f"job: {{name: {JOB}, entrypoint: 'train.py:main'}}\n"
                      f"tiers: {{disk: {{path: '{tmp_path / 'ckpt'}'}}}}\n"
                      f"snapshot: {{checksum: blake3}}\n"
                      f"security: {{secret_file: '{secret_file}'}}\n")
    model, optim, sd = _trained()
    dcp.save(sd, storage_writer=TieredStorageWriter.from_config(config, 5))
    manifest = Manifest.from_json((DiskTier(tmp_path / "ckpt", f"{JOB}.dcp").step_dir(5)
                                   / "rank_0.json").read_bytes())
    manifest.verify(SECRET)                          # signed with the config's secret
    assert all(r["checksum"].startswith("blake3:") for r in manifest.tensors.values())
    model2, optim2, loaded = _restore(
        lambda s: dcp.load(s, storage_reader=TieredStorageReader.from_config(str(config), 5)))
    assert loaded["epoch"] == 3
    _assert_identical((model, optim), (model2, optim2))
    proc = subprocess.run([sys.executable, "-m", "phalanx.launcher.cli", "ckpt", "verify", "--config",
                           str(config), "--tier", "disk", "--job", f"{JOB}.dcp"],
                          capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).resolve().parents[2])
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "1/1 ranks OK; HMAC checked" in text, text


def test_from_config_without_a_disk_path_says_what_to_set(tmp_path: Path) -> None:
    from phalanx.configs.errors import ConfigError
    from phalanx.configs.loader import load_config_text

    cfg = load_config_text(f"job: {{name: {JOB}, entrypoint: 'train.py:main'}}\n")
    with pytest.raises(ConfigError) as info:
        TieredStorageWriter.from_config(cfg, 1)
    assert info.value.key == "tiers.disk.path" and "run_dir" in info.value.hint
    writer = TieredStorageWriter.from_config(cfg, 1, run_dir=tmp_path)   # in a run dir: fine
    assert isinstance(writer, TieredStorageWriter)
    with pytest.raises(ConfigError, match="tiers.s3.bucket"):
        TieredStorageReader.from_config(cfg, 1, tier="s3")
