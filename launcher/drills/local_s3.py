"""A local S3 endpoint for drill scenarios that need one (``needs: [s3]``): a moto server
in its own process on a free loopback port, with the scenario's bucket created."""
from __future__ import annotations

import contextlib
import http.client
import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import IO

from phalanx.configs.errors import ServiceStartError

log = logging.getLogger(__name__)

__all__ = ["LocalS3", "start_local_s3", "DUMMY_CREDENTIALS"]

# moto accepts any credentials, but boto3 signs every request and needs some: the runner
# puts these in the environment of processes that open the S3 tier when none are set
DUMMY_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "phalanx-drill", "AWS_SECRET_ACCESS_KEY":
                     "phalanx-drill-not-a-secret", "AWS_DEFAULT_REGION": "us-east-1"}
_STOP_WAIT_S = 5.0
_PORT_ATTEMPTS = 3


@dataclass
class LocalS3:
    """A running local S3 server: ``endpoint_url`` (http://127.0.0.1:<port>), ``bucket``
    (created), ``region``. ``close`` stops the server process (idempotent); everything
    stored is lost with it."""

    endpoint_url: str
    bucket: str
    region: str
    pid: int
    _proc: subprocess.Popen = field(repr=False)
    _log: IO[bytes] | None = field(default=None, repr=False)
    exported: tuple[str, ...] = ()       # variables start_local_s3 set in os.environ

    def credentials_env(self) -> dict[str, str]:
        """Dummy AWS credentials and region for boto3 clients of this endpoint."""
        return dict(DUMMY_CREDENTIALS, AWS_DEFAULT_REGION=self.region)

    def close(self) -> None:
        """Stop the server and unset the credentials it exported."""
        for name in self.exported:
            os.environ.pop(name, None)
        self.exported = ()
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(_STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(_STOP_WAIT_S)
            log.info("local_s3.stopped endpoint=%s pid=%d", self.endpoint_url, self.pid)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "LocalS3":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_local_s3(bucket: str, *, region: str = "us-east-1", start_timeout_s: float = 60.0,
                   log_path: str | None = None, export_credentials: bool = True) -> LocalS3:
    """Start ``python -m moto.server`` on a free 127.0.0.1 port, wait until it answers and
    create ``bucket``. Blocks up to ``start_timeout_s``. Raises ConfigError (bad bucket
    name) or ServiceStartError (the server did not start, or refused the bucket); a server
    that started is stopped again on failure. ``log_path``: where its output goes.

    ``export_credentials``: when this process has no AWS credentials in its environment
    (no AWS_ACCESS_KEY_ID, no AWS_PROFILE), put ``DUMMY_CREDENTIALS`` there, so the job it
    launches (keepers opening the S3 tier) can sign requests; ``close`` removes them."""
    _check_bucket(bucket)
    deadline = time.monotonic() + start_timeout_s
    for attempt in range(1, _PORT_ATTEMPTS + 1):
        server = _spawn(bucket, region, log_path)
        try:
            _wait_until_serving(server._proc, server.pid, deadline)
            _create_bucket(server.endpoint_url, bucket, region)
        except _PortTaken:
            server.close()
            log.info("local_s3.port_taken endpoint=%s attempt=%d", server.endpoint_url, attempt)
            continue
        except BaseException:
            server.close()
            raise
        if export_credentials:
            server.exported = _export_credentials(region)
        log.info("local_s3.started endpoint=%s bucket=%s pid=%d exported=%s",
                 server.endpoint_url, bucket, server.pid, list(server.exported))
        return server
    raise ServiceStartError(f"local S3 (moto) exited at start {_PORT_ATTEMPTS} times; see "
                            f"{log_path or 'its output (pass log_path)'}")


def _spawn(bucket: str, region: str, log_path: str | None) -> LocalS3:
    port = _free_port()
    out = open(log_path, "ab") if log_path else None
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdin=subprocess.DEVNULL, stdout=out or subprocess.DEVNULL, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    return LocalS3(f"http://127.0.0.1:{port}", bucket, region, proc.pid, proc, out)


class _PortTaken(Exception):
    """The server exited before serving: most likely its port was taken meanwhile."""


def _export_credentials(region: str) -> tuple[str, ...]:
    if os.environ.get("AWS_ACCESS_KEY_ID") or os.environ.get("AWS_PROFILE"):
        return ()
    wanted = dict(DUMMY_CREDENTIALS, AWS_DEFAULT_REGION=region)
    exported = tuple(name for name in wanted if name not in os.environ)
    for name in exported:
        os.environ[name] = wanted[name]
    return exported


def _check_bucket(bucket: str) -> None:
    from phalanx.runtime.tiers.s3 import validate_bucket  # the S3 tier owns the naming rules
    validate_bucket(bucket)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_until_serving(proc: subprocess.Popen, pid: int, deadline: float) -> None:
    """Poll with an HTTP GET / until the server answers; _PortTaken if it exits first,
    ServiceStartError once ``deadline`` (monotonic) passes."""
    argv = proc.args
    assert isinstance(argv, list) and isinstance(argv[-1], str)  # _spawn's argv ends in the port
    port = int(argv[-1])
    while True:
        if proc.poll() is not None:
            raise _PortTaken(f"moto pid {pid} exited with code {proc.returncode}")
        with contextlib.suppress(OSError, http.client.HTTPException):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2.0)
            try:
                conn.request("GET", "/")
                conn.getresponse().read()
                return
            finally:
                conn.close()
        if time.monotonic() >= deadline:
            raise ServiceStartError(f"local S3 (moto, pid {pid}) on port {port} did not answer "
                                    "in time")
        time.sleep(0.1)


def _create_bucket(endpoint_url: str, bucket: str, region: str) -> None:
    """PUT /<bucket> (moto accepts unsigned requests: no boto3 needed here)."""
    body = b"" if region == "us-east-1" else (
        "<CreateBucketConfiguration><LocationConstraint>"
        f"{region}</LocationConstraint></CreateBucketConfiguration>").encode()
    host, port = endpoint_url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10.0)
    try:
        conn.request("PUT", f"/{bucket}", body=body)
        response = conn.getresponse()
        text = response.read()[:300].decode(errors="replace")
    except (OSError, http.client.HTTPException) as exc:
        raise ServiceStartError(f"local S3 at {endpoint_url}: creating bucket {bucket!r} "
                                f"failed: {exc}") from exc
    finally:
        conn.close()
    if response.status != 200:
        raise ServiceStartError(f"local S3 at {endpoint_url} refused bucket {bucket!r}: "
                                f"HTTP {response.status} {text}")
