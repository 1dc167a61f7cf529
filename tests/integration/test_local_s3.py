"""The drills' local S3 (a moto server process) serves a bucket the S3 tier uses and stops
cleanly; and an S3 outage made by the s3_outage mechanism (the endpoint proxied by
``prepare_job``, then refused) only degrades persistence, which resumes after it."""
from __future__ import annotations

import itertools
import os
import socket
import time
from typing import Iterator

import pytest

from phalanx.configs.errors import ConfigError
from phalanx.configs.schema import JobConfig, PhalanxConfig, S3TierConfig, TiersConfig
from phalanx.launcher.drills.faults.network import prepare_job
from phalanx.launcher.drills.local_s3 import DUMMY_CREDENTIALS, LocalS3, start_local_s3
from phalanx.runtime.tiers.s3 import S3Tier
from tests.integration.test_persister import Node, _wait
from tests.plugins.s3 import set_dummy_credentials

pytestmark = pytest.mark.integration
_names = itertools.count()


@pytest.fixture(scope="module")
def local_s3() -> Iterator[LocalS3]:
    server = start_local_s3("drill-outage-bucket", export_credentials=False)
    yield server
    server.close()


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(90)
def test_local_s3_serves_a_bucket_and_stops(monkeypatch) -> None:
    """With no AWS credentials around, the server exports dummy ones for the job it
    serves (an S3 tier opened from the environment alone works) and removes them."""
    with pytest.raises(ConfigError, match="tiers.s3.bucket"):
        start_local_s3("No_Such")
    set_dummy_credentials(monkeypatch)            # no profile or ~/.aws file interferes,
    for name in DUMMY_CREDENTIALS:                # and no credentials either
        monkeypatch.delenv(name)
    started = time.monotonic()
    server = start_local_s3("drill-local-bucket")
    try:
        assert time.monotonic() - started < 60
        assert server.endpoint_url.startswith("http://127.0.0.1:")
        assert set(server.exported) == set(DUMMY_CREDENTIALS)
        assert all(os.environ[k] == v for k, v in server.credentials_env().items())
        tier = S3Tier(S3TierConfig(enabled=True, bucket=server.bucket,
                                   endpoint_url=server.endpoint_url), "local-s3-job")
        tier.write_rank(4, 0, b"payload bytes", b'{"m": 1}')
        tier.commit_step(4, [0])
        assert tier.committed_steps() == [4]
        assert tier.read_rank(4, 0) == (b"payload bytes", b'{"m": 1}')
    finally:
        server.close()
    server.close()                                      # idempotent
    assert not set(DUMMY_CREDENTIALS) & set(os.environ)
    assert not _pid_alive(server.pid)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", int(server.endpoint_url.rsplit(":", 1)[1])),
                                 timeout=5)


def fast_failing_tier(cfg: S3TierConfig, job: str) -> S3Tier:
    """An S3 tier whose own retries give up within 0.2 s, so an outage outlasts them by
    construction (the job's tier, at its defaults, retries for 0.85-1.6 s)."""
    return S3Tier(cfg, job, max_attempts=2, botocore_max_attempts=1, backoff_base_s=0.05,
                  backoff_cap_s=0.2, connect_timeout_s=2.0)


@pytest.mark.timeout(120)
def test_persistence_rides_out_an_s3_outage_and_resumes(local_s3: LocalS3, monkeypatch) -> None:
    set_dummy_credentials(monkeypatch)
    s3 = S3TierConfig(enabled=True, bucket=local_s3.bucket, endpoint_url=local_s3.endpoint_url,
                      every_steps=1, keep=2)
    cfg = PhalanxConfig(job=JobConfig(entrypoint="x.py:main"), tiers=TiersConfig(s3=s3))
    proxied, services = prepare_job(cfg, {"s3_outage"})
    proxy = services["s3_proxy"]
    job = f"s3out{os.getpid()}-{next(_names)}"
    tier = fast_failing_tier(proxied.tiers.s3, job)
    node = Node("n0", job, [0], [(tier, 1, 2)], world=[0])
    try:
        node.publish(1)
        _wait(lambda: node.persister.last_committed().get("s3") == 1, "step 1 committed")
        proxy.refuse()                                  # what fire_s3_outage does
        node.publish(2)
        _wait(lambda: any(e["step"] == 2 for e in node.events.of("tier_degraded", "s3")),
              "step 2 degraded during the outage")
        degraded = node.events.of("tier_degraded", "s3")[0]
        assert "TierUnavailable" in degraded["error"]
        proxy.accept()
        node.publish(3)
        _wait(lambda: node.persister.last_committed().get("s3") == 3, "step 3 committed",
              timeout_s=30)
        assert 3 in tier.committed_steps()
        assert tier.read_rank(3, 0) == node.published[(0, 3)]
        assert not node.events.of("persister_error")
        assert proxy.stats()["refused_periods"] == 1
    finally:
        node.close()
        proxy.close()


@pytest.mark.timeout(120)
def test_a_write_failed_in_an_outage_is_retried_after_it(local_s3: LocalS3,
                                                         monkeypatch) -> None:
    """The S3 tier's own retries give up within 0.2 s (their jittered backoff, left at
    the default, sometimes bridged the whole outage); the persister then tries the same
    step again (backing off) while the keeper holds it, so a step whose write started
    during a 1.5 s outage is still persisted and committed after it."""
    set_dummy_credentials(monkeypatch)
    s3 = S3TierConfig(enabled=True, bucket=local_s3.bucket, endpoint_url=local_s3.endpoint_url)
    cfg = PhalanxConfig(job=JobConfig(entrypoint="x.py:main"), tiers=TiersConfig(s3=s3))
    proxied, services = prepare_job(cfg, {"s3_outage"})
    proxy = services["s3_proxy"]
    job = f"s3short{os.getpid()}-{next(_names)}"
    tier = fast_failing_tier(proxied.tiers.s3, job)
    node = Node("n0", job, [0], [(tier, 1, 2)], world=[0])
    try:
        node.publish(1)
        _wait(lambda: node.persister.last_committed().get("s3") == 1, "step 1 committed")
        proxy.refuse(for_s=1.5)
        node.publish(2)
        _wait(lambda: node.persister.last_committed().get("s3") == 2, "step 2 committed",
              timeout_s=30)
        degraded = node.events.of("tier_degraded", "s3")
        assert [e["step"] for e in degraded] == [2]       # one alert, however many retries
        assert [e["step"] for e in node.events.of("tier_persisted")] == [1, 2]
    finally:
        node.close()
        proxy.close()
