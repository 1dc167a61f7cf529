"""The security controls of docs/security.md that no other test file covers: loopback by
default, size caps before any allocation (also for a peer that never authenticated),
constant-time MAC comparison, a keeper refusing other jobs, wrong secrets and fenced
generations, S3 bucket names refused at config load, and the job secret and passwords kept
out of config dumps, reprs and logs."""
from __future__ import annotations

import datetime
import hmac
import json
import logging
import os
import socket
import stat
import struct
import time
import tracemalloc
from pathlib import Path

import pytest
import torch.distributed as dist

from phalanx.configs.errors import ConfigError, StaleGeneration
from phalanx.configs.loader import dump_config, load_config
from phalanx.configs.schema import JobConfig, PhalanxConfig, ReplicationConfig
from phalanx.launcher.job import job_secret
from phalanx.launcher.rundir import RunDir
from phalanx.launcher.services.stack import host_store
from phalanx.runtime.context import WorkerContext
from phalanx.runtime.keeper.daemon import Keeper
from phalanx.runtime.keeper.wire import KeeperClient
from phalanx.runtime.snapshot.format import Manifest
from phalanx.runtime.transport.tcp import (MAX_HEADER_BYTES, FrameClient, FrameServer, PeerRefused,
                                           Reply, Request, client_handshake, recv_header)

SECRET = b"s" * 32
JOB = "job-sec"


def _echo(request: Request) -> Reply:
    return Reply({"echo": request.header.get("value")}, request.payload.read() or None)


def _raw(server: FrameServer) -> socket.socket:
    sock = socket.create_connection(server.address, timeout=5.0)
    sock.settimeout(5.0)
    return sock


# ------------------------------------------------------------------ peers

@pytest.mark.unit
@pytest.mark.timeout(20)
def test_servers_listen_on_loopback_by_default(tmp_path: Path) -> None:
    assert ReplicationConfig().bind_host == "auto"   # 127.0.0.1 on the launcher's local Ray
    with FrameServer(secret=SECRET, job=JOB, handler=_echo) as server:
        assert server.address[0] == "127.0.0.1"
    with Keeper("n0", JOB, SECRET, shm_dir=str(tmp_path)) as keeper:
        assert keeper.address[0] == "127.0.0.1"


def _listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table, encoding="ascii") as fh:
            for line in fh.read().splitlines()[1:]:
                fields = line.split()
                address, hex_port = fields[1].rsplit(":", 1)
                if int(hex_port, 16) == port and fields[3] == "0A":     # LISTEN
                    found.append(address)
    return found


@pytest.mark.unit
@pytest.mark.timeout(20)
@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's socket table")
def test_the_launcher_store_listens_on_its_host_only() -> None:
    """c10d's TCPStore has no authentication and, left alone, listens on every interface."""
    store = host_store("127.0.0.1", datetime.timedelta(seconds=5))
    try:
        assert _listening(store.port) == ["0100007F"]                 # 127.0.0.1 only
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False,
                               timeout=datetime.timedelta(seconds=5))
        client.set("k", b"v")
        assert store.get("k") == b"v"
        del client
    finally:
        del store


@pytest.mark.integration
@pytest.mark.timeout(20)
def test_a_peer_without_the_secret_cannot_make_the_server_allocate() -> None:
    """Before authenticating, a peer may send only a small auth frame with no payload."""
    with FrameServer("127.0.0.1", secret=SECRET, job=JOB, handler=_echo) as server:
        tracemalloc.start()
        started = time.monotonic()
        for claim in (struct.pack(">I", 0xFFFFFFFF),                       # a 4 GiB header
                      struct.pack(">I", 2 + len(b'"nbytes":1099511627776')) +
                      b'{"nbytes":1099511627776}'):                       # a 1 TiB payload
            sock = _raw(server)
            hello = recv_header(sock, where="t", max_payload=0)
            assert hello is not None and hello["op"] == "hello"
            sock.sendall(claim)
            reply = recv_header(sock, where="t", max_payload=0)
            assert reply is not None and reply["ok"] is False
            assert reply["error"] == "FrameInvalid" and reply["closing"] is True
            assert sock.recv(1) == b""                      # and the server hung up
            sock.close()
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < MAX_HEADER_BYTES and time.monotonic() - started < 2.0
        with FrameClient(*server.address, SECRET, JOB, "worker", 5.0) as client:
            assert client.request({"op": "echo", "value": 1})[0]["echo"] == 1   # still serving


@pytest.mark.integration
@pytest.mark.timeout(20)
def test_a_payload_header_of_2_40_bytes_is_refused_before_allocation() -> None:
    with FrameServer("127.0.0.1", secret=SECRET, job=JOB, handler=_echo,
                     max_payload=1 << 20) as server:
        sock = _raw(server)
        client_handshake(sock, "t", SECRET, JOB, "worker", 0)
        tracemalloc.start()
        started = time.monotonic()
        body = json.dumps({"op": "echo", "nbytes": 1 << 40}).encode()
        sock.sendall(struct.pack(">I", len(body)) + body)        # and no payload at all
        reply = recv_header(sock, where="t", max_payload=0)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert reply is not None and reply["error"] == "FrameInvalid"
        assert "1099511627776 bytes exceeds the limit 1048576" in reply["message"]
        assert peak < MAX_HEADER_BYTES and time.monotonic() - started < 2.0
        sock.close()


@pytest.mark.unit
@pytest.mark.timeout(20)
def test_macs_are_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[int] = []
    real = hmac.compare_digest

    def spy(a: bytes | str, b: bytes | str) -> bool:
        compared.append(len(a))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    with FrameServer(secret=SECRET, job=JOB, handler=_echo) as server, \
            FrameClient(*server.address, SECRET, JOB, "worker", 5.0) as client:
        client.request({"op": "echo"})
    assert compared.count(32) >= 2        # the server checked the client, the client the server
    compared.clear()
    manifest = Manifest(job=JOB, rank=0, step=1, generation=0, tree_spec={}, tensors={},
                        total_bytes=0, created_at=0.0).sign(SECRET)
    manifest.verify(SECRET)
    assert compared == [64]               # hex HMAC-SHA256


@pytest.mark.integration
@pytest.mark.timeout(30)
def test_keeper_refuses_other_jobs_wrong_secrets_and_fenced_generations(tmp_path: Path) -> None:
    current = {"generation": 3}
    with Keeper("n0", JOB, SECRET, shm_dir=str(tmp_path),
                generation_check=lambda g: g >= current["generation"]) as keeper:
        host, port = keeper.address
        for kw, code in (({"secret": b"w" * 32}, "auth"), ({"job": "job-other"}, "job"),
                         ({"generation": 2}, "generation")):
            args = {"secret": SECRET, "job": JOB, "generation": 3} | kw
            with KeeperClient(host, port, args["secret"], args["job"], 5.0,
                              generation=args["generation"]) as client:
                with pytest.raises(PeerRefused) as info:
                    client.ping()
            assert info.value.code == code
        with KeeperClient(host, port, SECRET, JOB, 5.0, generation=3) as client:
            assert client.ping()["job"] == JOB
            current["generation"] = 4               # a newer generation was announced
            with pytest.raises(StaleGeneration, match="generation 3"):
                client.alloc(0, 4096)               # writes of the fenced one are refused


# ------------------------------------------------------------------ S3 and config

@pytest.mark.unit
@pytest.mark.parametrize("bucket", ["My_Bucket", "ab", "10.0.0.1", "two..dots", "xn--x-y"])
def test_a_bad_s3_bucket_name_is_refused_when_the_config_loads(tmp_path: Path,
                                                               bucket: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("job:\n  entrypoint: train.py:main\ntiers:\n  s3:\n    enabled: true\n"
                    f"    bucket: '{bucket}'\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    error = info.value
    assert (error.key, error.source, error.line) == ("tiers.s3.bucket", str(path), 6)
    assert repr(bucket) in str(error) and "my-team-checkpoints" in error.hint


@pytest.mark.unit
def test_config_dumps_and_contexts_hold_paths_never_secrets(tmp_path: Path) -> None:
    secret_file, password_file = tmp_path / "job.secret", tmp_path / "etcd.pw"
    secret_file.write_text("job-secret-4f1d8a2c9e7b6a5d\n")
    password_file.write_text("etcd-password-8b2e\n")
    cfg = load_config(None, ["job.entrypoint=train.py:main",
                             f"security.secret_file={secret_file}",
                             "etcd.endpoints=['127.0.0.1:2379']", "etcd.user=trainer",
                             f"etcd.password_file={password_file}"], env={})
    dumped = dump_config(cfg)
    assert str(secret_file) in dumped and str(password_file) in dumped
    assert "job-secret-4f1d8a2c9e7b6a5d" not in dumped and "etcd-password-8b2e" not in dumped
    ctx = WorkerContext(job=JOB, rank=0, world_size=1, secret_hex=b"ctx-secret-99".hex())
    assert b"ctx-secret-99".hex() not in repr(ctx)


@pytest.mark.unit
def test_the_generated_job_secret_is_random_private_and_never_logged(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    cfg = PhalanxConfig(job=JobConfig(entrypoint="train.py:main"))
    runs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        runs.append(RunDir(tmp_path / name))
    first, second = (job_secret(cfg, run) for run in runs)
    assert first != second and len(bytes.fromhex(first.decode())) == 32
    path = runs[0].path / "secret"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert job_secret(cfg, runs[0]) == first                  # a standby reads the same one
    with FrameServer(secret=first, job=JOB, handler=_echo) as server:
        with FrameClient(*server.address, first, JOB, "worker", 5.0) as client:
            client.request({"op": "echo"})
        with FrameClient(*server.address, second, JOB, "worker", 5.0) as client:
            with pytest.raises(PeerRefused, match="secret differs"):
                client.request({"op": "echo"})      # another run's secret is refused
    for secret in (first, second):
        assert secret.decode() not in caplog.text and secret.hex() not in caplog.text
