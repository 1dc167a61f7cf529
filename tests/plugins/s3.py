"""S3 test services: a moto S3 server per session and a fresh bucket per test.

``PHALANX_TEST_SERVICES=containers`` uses a MinIO container instead, only when
testcontainers imports and a Docker engine answers; otherwise the moto server.
"""
from __future__ import annotations

import logging
import os
import uuid
from typing import Any, Iterator

import boto3
import pytest
from botocore.config import Config

from phalanx.configs.schema import S3TierConfig

log = logging.getLogger(__name__)

ACCESS_KEY_ID = "testing"
SECRET_ACCESS_KEY = "phalanx-test-secret-7f3a9c1e"  # distinctive: tests assert it never leaks
REGION = "us-east-1"
_MINIO_IMAGE = "minio/minio:RELEASE.2024-12-18T13-15-44Z"


def _start_minio() -> Any | None:
    """A started MinIO container, or None when testcontainers or Docker is missing."""
    try:
        from testcontainers.minio import MinioContainer
    except ImportError:
        log.info("s3_service kind=moto reason=testcontainers_missing")
        return None
    container = MinioContainer(_MINIO_IMAGE, access_key=ACCESS_KEY_ID, secret_key=SECRET_ACCESS_KEY)
    try:
        container.start()
    except Exception as exc:  # DockerException and friends: no engine answers
        log.info("s3_service kind=moto reason=docker_unavailable error=%s", type(exc).__name__)
        return None
    return container


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """Endpoint URL of an S3 server for the whole session, stopped at its end."""
    container = _start_minio() if os.environ.get("PHALANX_TEST_SERVICES") == "containers" else None
    if container is not None:
        try:
            host, port = container.get_container_host_ip(), container.get_exposed_port(9000)
            yield f"http://{host}:{port}"
        finally:
            container.stop()
        return
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        log.info("s3_service kind=moto endpoint=http://%s:%d", host, port)
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def set_dummy_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dummy credentials from env vars only (no profile or ~/.aws file can interfere)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_ACCESS_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        monkeypatch.delenv(name, raising=False)


def make_client(endpoint: str) -> Any:
    """A plain boto3 client on the test endpoint, with short timeouts."""
    config = Config(connect_timeout=5, read_timeout=30, retries={"total_max_attempts": 2},
                    s3={"addressing_style": "path"})
    return boto3.session.Session().client("s3", endpoint_url=endpoint, region_name=REGION,
                                          config=config)


@pytest.fixture
def s3_config(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> S3TierConfig:
    """An enabled S3TierConfig on a freshly created, uniquely named bucket."""
    set_dummy_credentials(monkeypatch)
    bucket = f"phalanx-test-{uuid.uuid4().hex[:16]}"
    make_client(s3_server).create_bucket(Bucket=bucket)
    return S3TierConfig(enabled=True, bucket=bucket, endpoint_url=s3_server, region=REGION)
