"""One contract suite for the ``Tier`` port (memory fake, disk, moto S3), then the
behaviour only one adapter has (disk crash and ENOSPC, S3 owner/SSE/retries/secrets)."""
from __future__ import annotations

import dataclasses
import errno
import logging
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
from botocore.exceptions import ClientError

from phalanx.configs.errors import (ConfigError, SnapshotNotFound, SnapshotOfOtherRun,
                                    TierUnavailable)
from phalanx.configs.schema import S3TierConfig
from phalanx.runtime.base import Tier
from phalanx.runtime.tiers.disk import DiskTier
from tests.fakes.tier_memory import MemoryTier
from phalanx.runtime.tiers.s3 import MIN_PART_SIZE, S3Tier
from tests.plugins.s3 import SECRET_ACCESS_KEY

pytestmark = pytest.mark.contract

JOB = "job-1"
MIB = 1024 * 1024


def _s3_tier(cfg: S3TierConfig, **kw: Any) -> S3Tier:
    """Small parts (20 MiB -> 4 parts), quick retries, short deadlines for tests."""
    options: dict[str, Any] = dict(part_size=MIN_PART_SIZE, backoff_base_s=0.01,
                                   deadline_s=20.0, connect_timeout_s=2.0, read_timeout_s=20.0)
    return S3Tier(cfg, JOB, **(options | kw))


@pytest.fixture(params=["memory", "disk", "s3"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Tier:
    if request.param == "memory":
        return MemoryTier(JOB)
    if request.param == "disk":
        return DiskTier(tmp_path / "tier", JOB)
    return _s3_tier(request.getfixturevalue("s3_config"))


def _payload(step: int, rank: int, size: int = 1000) -> bytes:
    seed = f"{step}:{rank}:".encode()
    return (seed * (size // len(seed) + 1))[:size]


def _manifest(step: int, rank: int) -> bytes:
    return f'{{"step": {step}, "rank": {rank}}}'.encode()


def _write_step(tier: Tier, step: int, ranks: list[int], commit: bool = True) -> None:
    for rank in ranks:
        tier.write_rank(step, rank, _payload(step, rank), _manifest(step, rank))
    if commit:
        tier.commit_step(step, ranks)


# ------------------------------------------------------------------- the contract suite

@pytest.mark.timeout(30)
def test_tier_satisfies_protocol(tier: Tier) -> None:
    assert isinstance(tier, Tier)
    assert tier.name in ("memory", "disk", "s3")


@pytest.mark.timeout(30)
def test_round_trip_of_bytes_memoryview_and_empty(tier: Tier) -> None:
    buffer = bytearray(_payload(1, 1, 4096))
    tier.write_rank(1, 0, _payload(1, 0), _manifest(1, 0))
    tier.write_rank(1, 1, memoryview(buffer)[100:3000], _manifest(1, 1))
    tier.write_rank(1, 2, b"", b"{}")
    assert tier.read_rank(1, 0) == (_payload(1, 0), _manifest(1, 0))
    assert tier.read_rank(1, 1) == (bytes(buffer[100:3000]), _manifest(1, 1))
    assert tier.read_rank(1, 2) == (b"", b"{}")


@pytest.mark.timeout(30)
def test_large_payload_round_trip(tier: Tier) -> None:
    big = bytearray(os.urandom(20 * MIB + 123))
    tier.write_rank(3, 0, memoryview(big), _manifest(3, 0))
    tier.commit_step(3, [0])
    payload, manifest = tier.read_rank(3, 0)
    assert payload == big and manifest == _manifest(3, 0)


@pytest.mark.timeout(30)
def test_rewriting_a_rank_replaces_it(tier: Tier) -> None:
    tier.write_rank(2, 0, b"old", b"{}")
    tier.write_rank(2, 0, b"new", b'{"v": 2}')
    assert tier.read_rank(2, 0) == (b"new", b'{"v": 2}')


@pytest.mark.timeout(30)
def test_commit_only_after_every_rank(tier: Tier) -> None:
    _write_step(tier, 5, [0], commit=False)
    assert tier.committed_steps() == []
    with pytest.raises(SnapshotNotFound, match="rank 1"):
        tier.commit_step(5, [0, 1])
    assert tier.committed_steps() == []
    _write_step(tier, 5, [1], commit=False)
    tier.commit_step(5, [1, 0])
    assert tier.committed_steps() == [5]


@pytest.mark.timeout(30)
def test_committed_steps_ascending_and_exclude_partial(tier: Tier) -> None:
    _write_step(tier, 20, [0, 1])
    _write_step(tier, 3, [0, 1])
    _write_step(tier, 30, [0, 1], commit=False)
    assert tier.committed_steps() == [3, 20]
    assert tier.read_rank(30, 1) == (_payload(30, 1), _manifest(30, 1))


@pytest.mark.timeout(30)
def test_retention_keeps_newest_and_removes_older_partials(tier: Tier) -> None:
    for step in (1, 3, 5, 6):
        _write_step(tier, step, [0, 1])
    for step in (2, 4, 7):
        _write_step(tier, step, [0], commit=False)
    assert tier.apply_retention(2) == [1, 2, 3, 4]
    assert tier.committed_steps() == [5, 6]
    assert tier.read_rank(7, 0) == (_payload(7, 0), _manifest(7, 0))  # newer partial stays
    for step in (1, 2, 3, 4):
        with pytest.raises(SnapshotNotFound):
            tier.read_rank(step, 0)
    assert tier.apply_retention(2) == []


@pytest.mark.timeout(30)
def test_delete_step(tier: Tier) -> None:
    _write_step(tier, 1, [0, 1])
    _write_step(tier, 2, [0, 1])
    tier.delete_step(1)
    assert tier.committed_steps() == [2]
    with pytest.raises(SnapshotNotFound):
        tier.read_rank(1, 1)
    tier.delete_step(1)  # absent: no error
    tier.delete_step(99)
    assert tier.read_rank(2, 1) == (_payload(2, 1), _manifest(2, 1))


@pytest.mark.timeout(30)
def test_read_missing_rank_names_tier_step_and_rank(tier: Tier) -> None:
    _write_step(tier, 7, [0])
    with pytest.raises(SnapshotNotFound) as info:
        tier.read_rank(7, 3)
    text = str(info.value)
    assert "step 7" in text and "rank 3" in text and tier.name in text


@pytest.mark.timeout(30)
def test_bad_arguments_are_rejected(tier: Tier) -> None:
    with pytest.raises(ValueError):
        tier.commit_step(1, [])
    with pytest.raises(ValueError):
        tier.apply_retention(0)
    with pytest.raises(ValueError):
        tier.write_rank(-1, 0, b"x", b"{}")


@pytest.mark.timeout(30)
def test_check_passes(tier: Tier) -> None:
    tier.check()


# ------------------------------------------------------------- tiers bound to a run

@pytest.fixture(params=["disk", "s3"])
def bind(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """A factory of the disk or S3 tier bound to a run, all under one root/prefix."""
    if request.param == "disk":
        return lambda run: DiskTier(tmp_path / "tier", JOB, run_id=run)
    cfg = request.getfixturevalue("s3_config")
    return lambda run: _s3_tier(cfg, run_id=run)


@pytest.mark.timeout(60)
def test_run_bound_tiers_keep_two_runs_apart(bind: Any) -> None:
    """Two launches into one tier path: run 2 neither sees, commits over, restores nor
    deletes run 1's steps; an unbound tier (``phalanx ckpt``) still sees every run."""
    first, second = bind("run-1"), bind("run-2")
    for step in (40, 60):
        _write_step(first, step, [0, 1])
    assert second.committed_steps() == []
    second.write_rank(20, 0, _payload(20, 0), _manifest(20, 0))
    first.write_rank(20, 1, _payload(20, 1), _manifest(20, 1))   # a stale writer of run 1
    with pytest.raises(SnapshotOfOtherRun, match="rank 1's files belong to run 'run-1'"):
        second.commit_step(20, [0, 1])
    with pytest.raises(SnapshotOfOtherRun):
        second.read_rank(40, 0)
    with pytest.raises(SnapshotOfOtherRun, match="step 40 is a committed checkpoint of run"):
        second.write_rank(40, 0, _payload(40, 0), _manifest(40, 0))
    _write_step(second, 20, [0, 1])
    _write_step(second, 30, [0, 1])
    assert second.committed_steps() == [20, 30]
    assert second.apply_retention(1) == [20]
    assert first.committed_steps() == [40, 60]
    assert first.read_rank(40, 0) == (_payload(40, 0), _manifest(40, 0))
    assert bind("").committed_steps() == [30, 40, 60]


# ------------------------------------------------------------------------- memory fake

@pytest.mark.timeout(10)
def test_memory_fail_writes_simulates_full_tier() -> None:
    tier = MemoryTier(JOB)
    _write_step(tier, 1, [0])
    tier.fail_writes = True
    with pytest.raises(TierUnavailable):
        tier.write_rank(2, 0, b"x", b"{}")
    with pytest.raises(TierUnavailable):
        tier.commit_step(1, [0])
    with pytest.raises(TierUnavailable):
        tier.check()
    assert tier.read_rank(1, 0) == (_payload(1, 0), _manifest(1, 0))


# -------------------------------------------------------------------------------- disk

def _temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith(".tmp")]


@pytest.mark.timeout(10)
def test_disk_layout_and_commit_marker(tmp_path: Path) -> None:
    import json

    tier = DiskTier(tmp_path, JOB)
    _write_step(tier, 42, [0, 1])
    step_dir = tmp_path / JOB / "step_000000000042"
    names = sorted(p.name for p in step_dir.iterdir())
    assert names == ["COMMIT", "rank_0.json", "rank_0.safetensors", "rank_1.json",
                     "rank_1.safetensors"]
    marker = json.loads((step_dir / "COMMIT").read_text())
    assert marker["step"] == 42 and marker["ranks"] == [0, 1] and marker["written_at"] > 0


@pytest.mark.timeout(10)
def test_disk_crash_before_rename_leaves_no_visible_step(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    tier = DiskTier(tmp_path, JOB)

    def crash(src: Any, dst: Any) -> None:
        raise OSError(errno.EIO, "simulated crash before rename")

    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", crash)
        with pytest.raises(TierUnavailable, match="EIO"):
            tier.write_rank(1, 0, _payload(1, 0), _manifest(1, 0))
    assert tier.committed_steps() == []
    assert _temp_files(tmp_path) == []
    with pytest.raises(SnapshotNotFound):
        tier.read_rank(1, 0)
    _write_step(tier, 2, [0])
    assert tier.apply_retention(1) == [1]  # the crashed step's folder is swept
    assert not (tmp_path / JOB / "step_000000000001").exists()
    assert tier.committed_steps() == [2]


@pytest.mark.timeout(10)
def test_disk_enospc_becomes_tier_unavailable(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    tier = DiskTier(tmp_path, JOB)

    def full(fd: int, data: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patch:
        patch.setattr(os, "write", full)
        with pytest.raises(TierUnavailable) as info:
            tier.write_rank(1, 0, _payload(1, 0), _manifest(1, 0))
        with pytest.raises(TierUnavailable, match="ENOSPC"):
            tier.check()
    assert "ENOSPC" in str(info.value) and str(tmp_path) in str(info.value)
    assert _temp_files(tmp_path) == []
    assert tier.committed_steps() == []


@pytest.mark.timeout(10)
def test_disk_writes_the_memoryview_without_copying(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    tier = DiskTier(tmp_path, JOB)
    buffer = bytearray(os.urandom(3 * MIB))
    seen: list[Any] = []
    real_write = os.write

    def spy(fd: int, data: Any) -> int:
        seen.append(data)
        return real_write(fd, data)

    with monkeypatch.context() as patch:
        patch.setattr(os, "write", spy)
        tier.write_rank(1, 0, memoryview(buffer), b"{}")
    big = [d for d in seen if len(d) >= MIB]
    assert big and all(isinstance(d, memoryview) and d.obj is buffer for d in big)
    assert tier.read_rank(1, 0)[0] == buffer


@pytest.mark.timeout(10)
def test_disk_check_rejects_too_little_free_space(tmp_path: Path) -> None:
    with pytest.raises(TierUnavailable, match="bytes free"):
        DiskTier(tmp_path, JOB, min_free_bytes=2 ** 62).check()


@pytest.mark.timeout(10)
def test_disk_rejects_job_names_that_escape_the_root(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        DiskTier(tmp_path, "../evil")


# ---------------------------------------------------------------------------------- s3

def _capture(tier: S3Tier) -> list[tuple[str, dict[str, Any]]]:
    calls: list[tuple[str, dict[str, Any]]] = []

    def hook(event_name: str, params: dict[str, Any], **_: Any) -> None:
        calls.append((event_name.rsplit(".", 1)[-1], dict(params)))

    tier.client.meta.events.register("provide-client-params.s3.*", hook)
    return calls


@pytest.mark.timeout(30)
def test_s3_expected_bucket_owner_on_every_request(s3_config: S3TierConfig) -> None:
    owner = "123456789012"
    tier = _s3_tier(dataclasses.replace(s3_config, expected_owner=owner))
    calls = _capture(tier)
    tier.check()
    tier.write_rank(1, 0, b"small", b"{}")
    tier.write_rank(1, 1, memoryview(bytearray(11 * MIB)), b"{}")
    tier.commit_step(1, [0, 1])
    tier.read_rank(1, 0)
    assert tier.committed_steps() == [1]
    _write_step(tier, 2, [0])
    tier.delete_step(1)
    with pytest.raises(SnapshotNotFound):
        tier.read_rank(9, 0)
    tier.apply_retention(1)
    ops = {op for op, _ in calls}
    assert {"HeadBucket", "PutObject", "CreateMultipartUpload", "UploadPart",
            "CompleteMultipartUpload", "ListObjectsV2", "HeadObject", "GetObject",
            "DeleteObject", "DeleteObjects"} <= ops
    assert all(params.get("ExpectedBucketOwner") == owner for _, params in calls)


@pytest.mark.timeout(30)
def test_s3_multipart_uses_bounded_parts_and_sse(s3_config: S3TierConfig) -> None:
    tier = _s3_tier(dataclasses.replace(s3_config, sse="AES256"))
    calls = _capture(tier)
    big = bytearray(os.urandom(20 * MIB))
    tier.write_rank(1, 0, memoryview(big), b"{}")
    parts = [p for op, p in calls if op == "UploadPart"]
    assert len(parts) == 4 and all(p["ContentLength"] <= MIN_PART_SIZE for p in parts)
    assert not any(isinstance(p["Body"], (bytes, bytearray)) for p in parts)
    create = [p for op, p in calls if op in ("CreateMultipartUpload", "PutObject")]
    assert create and all(p["ServerSideEncryption"] == "AES256" for p in create)
    head = tier.client.head_object(Bucket=s3_config.bucket,
                                   Key=f"phalanx/{JOB}/step_000000000001/rank_0.safetensors")
    assert head["ServerSideEncryption"] == "AES256" and head["ContentLength"] == len(big)
    assert tier.read_rank(1, 0)[0] == big


@pytest.mark.timeout(30)
def test_s3_kms_parameters_pass_through(s3_config: S3TierConfig) -> None:
    cfg = dataclasses.replace(s3_config, sse="aws:kms", sse_kms_key_id="alias/phalanx")
    tier = _s3_tier(cfg)
    calls = _capture(tier)
    tier.client.meta.events.register("before-call.s3.PutObject", _short_circuit)
    tier.write_rank(1, 0, b"x", b"{}")
    puts = [p for op, p in calls if op == "PutObject"]
    assert puts and all(p["ServerSideEncryption"] == "aws:kms"
                        and p["SSEKMSKeyId"] == "alias/phalanx" for p in puts)


def _short_circuit(**_: Any) -> tuple[Any, dict[str, Any]]:
    """A before-call answer: the request never leaves the client."""
    return SimpleNamespace(status_code=200), {"ResponseMetadata": {"HTTPStatusCode": 200}, "ETag": '"0"'}


def _server_error() -> ClientError:
    return ClientError({"Error": {"Code": "InternalError", "Message": "simulated"},
                        "ResponseMetadata": {"HTTPStatusCode": 500}}, "UploadPart")


@pytest.mark.timeout(30)
def test_s3_transient_part_failure_is_retried(s3_config: S3TierConfig,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    tier = _s3_tier(s3_config)
    real = tier.client.upload_part
    failures = iter([True, True])

    def flaky(**kw: Any) -> Any:
        if next(failures, False):
            raise _server_error()
        return real(**kw)

    monkeypatch.setattr(tier.client, "upload_part", flaky)
    big = os.urandom(11 * MIB)
    tier.write_rank(1, 0, big, b"{}")
    assert tier.read_rank(1, 0)[0] == big


@pytest.mark.timeout(30)
def test_s3_persistent_failure_aborts_multipart(s3_config: S3TierConfig,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    tier = _s3_tier(dataclasses.replace(s3_config, expected_owner="123456789012"),
                    max_attempts=3)
    calls = _capture(tier)
    attempts: list[int] = []
    real = tier.client.upload_part

    def broken(**kw: Any) -> Any:
        if kw["PartNumber"] == 2:
            attempts.append(1)
            raise _server_error()
        return real(**kw)

    monkeypatch.setattr(tier.client, "upload_part", broken)
    with pytest.raises(TierUnavailable, match="InternalError"):
        tier.write_rank(1, 0, os.urandom(11 * MIB), b"{}")
    assert len(attempts) == 3
    aborts = [p for op, p in calls if op == "AbortMultipartUpload"]
    assert len(aborts) == 1 and aborts[0]["ExpectedBucketOwner"] == "123456789012"
    uploads = tier.client.list_multipart_uploads(Bucket=s3_config.bucket)
    assert uploads.get("Uploads", []) == []
    with pytest.raises(SnapshotNotFound):
        tier.read_rank(1, 0)


@pytest.mark.timeout(30)
def test_s3_unreachable_endpoint_fails_within_bounds(s3_config: S3TierConfig) -> None:
    cfg = dataclasses.replace(s3_config, endpoint_url="http://127.0.0.1:9")
    tier = _s3_tier(cfg, max_attempts=2, botocore_max_attempts=1, connect_timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(TierUnavailable, match="attempt"):
        tier.check()
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("bucket", [
    "ab", "a" * 64, "Upper-case", "under_score", "has space", "-leading", "trailing-",
    ".dot", "dot.", "two..dots", "192.168.1.1", "xn--punycode", "name-s3alias", "bad/slash",
    "newline-at-end\n",
])
@pytest.mark.timeout(10)
def test_s3_bad_bucket_names_raise_config_error(bucket: str) -> None:
    with pytest.raises(ConfigError) as info:        # an enabled tier's config refuses it
        S3TierConfig(enabled=True, bucket=bucket)
    assert info.value.key == "tiers.s3.bucket"
    cfg = S3TierConfig(enabled=False, bucket=bucket)
    with pytest.raises(ConfigError) as info:        # and so does the tier itself
        S3Tier(cfg, JOB)
    assert info.value.key == "tiers.s3.bucket"


@pytest.mark.parametrize("bucket", ["abc", "a" * 63, "my.team-checkpoints.2", "1.2.3"])
@pytest.mark.timeout(10)
def test_s3_good_bucket_names_are_accepted(bucket: str) -> None:
    S3Tier(S3TierConfig(enabled=True, bucket=bucket), JOB)


@pytest.mark.timeout(10)
def test_s3_too_small_part_size_is_rejected(s3_config: S3TierConfig) -> None:
    with pytest.raises(ValueError, match="part_size"):
        S3Tier(s3_config, JOB, part_size=MIB)


@pytest.mark.timeout(30)
def test_s3_check_of_missing_bucket_is_unavailable(s3_config: S3TierConfig) -> None:
    tier = _s3_tier(dataclasses.replace(s3_config, bucket="phalanx-no-such-bucket"))
    with pytest.raises(TierUnavailable, match="phalanx-no-such-bucket"):
        tier.check()


@pytest.mark.timeout(30)
def test_s3_corrupted_object_is_returned_byte_for_byte(s3_config: S3TierConfig) -> None:
    tier = _s3_tier(s3_config)
    _write_step(tier, 1, [0])
    key = f"phalanx/{JOB}/step_000000000001/rank_0.safetensors"
    damaged = bytearray(_payload(1, 0))
    damaged[10] ^= 0xFF
    tier.client.put_object(Bucket=s3_config.bucket, Key=key, Body=bytes(damaged))
    assert tier.read_rank(1, 0) == (bytes(damaged), _manifest(1, 0))


@pytest.mark.timeout(30)
def test_s3_secret_never_in_errors_or_logs(s3_config: S3TierConfig,
                                           caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    texts: list[str] = []
    failing = [
        lambda: _s3_tier(dataclasses.replace(s3_config, bucket="phalanx-missing")).check(),
        lambda: _s3_tier(s3_config).read_rank(4, 4),
        lambda: _s3_tier(dataclasses.replace(s3_config, endpoint_url="http://127.0.0.1:9"),
                         max_attempts=2, botocore_max_attempts=1).check(),
    ]
    for call in failing:
        with pytest.raises((TierUnavailable, SnapshotNotFound)) as info:
            call()
        texts += [str(info.value), repr(info.value)]
    _s3_tier(s3_config).write_rank(1, 0, os.urandom(6 * MIB), b"{}")
    assert caplog.text
    for text in texts + [caplog.text]:
        assert SECRET_ACCESS_KEY not in text


@pytest.fixture
def no_credentials(s3_config: S3TierConfig, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    yield


@pytest.mark.timeout(30)
def test_s3_check_without_credentials_says_so(s3_config: S3TierConfig,
                                              no_credentials: None) -> None:
    with pytest.raises(TierUnavailable, match="credentials"):
        _s3_tier(s3_config).check()


# ------------------------------------------------------------- s3 launch check: write probe

def _keys(cfg: S3TierConfig) -> list[str]:
    listed = _s3_tier(cfg).client.list_objects_v2(Bucket=cfg.bucket)
    return [o["Key"] for o in listed.get("Contents", [])]


def _refuse(operation: str, code: str = "AccessDenied", status: int = 403) -> Any:
    """A before-call answer refusing ``operation`` the way S3 does (the bucket is real)."""
    def handler(**_: Any) -> tuple[Any, dict[str, Any]]:
        return SimpleNamespace(status_code=status), {
            "Error": {"Code": code, "Message": "simulated refusal"},
            "ResponseMetadata": {"HTTPStatusCode": status}}
    return handler


@pytest.mark.timeout(30)
def test_s3_check_probes_writing_with_owner_and_sse_then_removes_the_probe(
        s3_config: S3TierConfig) -> None:
    owner = "123456789012"  # moto's account: the real server accepts the owner check
    tier = _s3_tier(dataclasses.replace(s3_config, expected_owner=owner, sse="AES256"))
    calls = _capture(tier)
    tier.check()
    puts = [p for op, p in calls if op == "PutObject"]
    deletes = [p for op, p in calls if op == "DeleteObject"]
    assert len(puts) == 1 and len(deletes) == 1
    assert puts[0]["Key"] == deletes[0]["Key"] and puts[0]["Key"].startswith(f"phalanx/{JOB}/")
    assert puts[0]["ServerSideEncryption"] == "AES256"
    assert all(p["ExpectedBucketOwner"] == owner for _, p in calls)
    assert _keys(s3_config) == []
    tier.check()  # a second launch with the same prefix: a fresh probe key, removed again
    assert _keys(s3_config) == []
    assert tier.committed_steps() == []


@pytest.mark.timeout(30)
def test_s3_check_sends_kms_options_on_the_probe(s3_config: S3TierConfig) -> None:
    cfg = dataclasses.replace(s3_config, sse="aws:kms", sse_kms_key_id="alias/phalanx")
    tier = _s3_tier(cfg)
    calls = _capture(tier)
    tier.client.meta.events.register("before-call.s3.PutObject", _short_circuit)
    tier.check()
    puts = [p for op, p in calls if op == "PutObject"]
    assert puts and puts[0]["ServerSideEncryption"] == "aws:kms"
    assert puts[0]["SSEKMSKeyId"] == "alias/phalanx"


@pytest.mark.timeout(30)
def test_s3_check_refused_write_names_bucket_prefix_and_fix(s3_config: S3TierConfig) -> None:
    tier = _s3_tier(dataclasses.replace(s3_config, prefix="team/ckpt"))
    tier.client.meta.events.register("before-call.s3.PutObject", _refuse("PutObject"))
    with pytest.raises(TierUnavailable) as info:
        tier.check()
    text = str(info.value)
    assert f"s3://{s3_config.bucket}/team/ckpt/{JOB}/" in text
    assert "AccessDenied" in text and "s3:PutObject" in text and "tiers.s3.prefix" in text
    assert SECRET_ACCESS_KEY not in text
    assert _keys(s3_config) == []


@pytest.mark.timeout(30)
def test_s3_check_refused_delete_says_the_probe_was_left(s3_config: S3TierConfig) -> None:
    tier = _s3_tier(s3_config)
    tier.client.meta.events.register("before-call.s3.DeleteObject", _refuse("DeleteObject"))
    with pytest.raises(TierUnavailable, match="cannot delete") as info:
        tier.check()
    left = _keys(s3_config)
    assert len(left) == 1 and left[0] in str(info.value) and "s3:DeleteObject" in str(info.value)
