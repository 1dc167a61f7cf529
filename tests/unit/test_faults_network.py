"""The communication/storage-endpoint fault kinds against a fake FaultEnv whose keeper is
an echo server: each fire routes through a real LinkProxy, changes the link as asked, and
its ``later`` callback (run by the test) routes back and cleans up."""
from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from phalanx.configs.errors import ConfigError
from phalanx.configs.schema import JobConfig, PhalanxConfig, S3TierConfig, TiersConfig
from phalanx.launcher.drills.catalogue import REGISTRY, FaultSpec, catalogue
from phalanx.launcher.drills.faults.network import prepare_job
from phalanx.launcher.drills.link_proxy import LinkProxy
from tests.unit.test_link_proxy import _EchoServer, _round_trip

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


class FakeEnv:
    """Records keeper_route, later and emit calls; ``run_later`` runs the callbacks."""

    def __init__(self, keeper: tuple[str, int], services: dict[str, Any] | None = None) -> None:
        self.run_dir, self.shm_dir, self.job = Path("/nonexistent"), "/dev/shm", "fake"
        self._keeper, self._services = keeper, services or {}
        self.routes: list[tuple[int, tuple[str, int] | None]] = []
        self.pending: list[tuple[float, Callable[[], None]]] = []
        self.events: list[tuple[str, dict]] = []

    def keeper_address(self, node: int) -> tuple[str, int]:
        return self._keeper

    def keeper_route(self, node: int, address: tuple[str, int] | None) -> None:
        self.routes.append((node, address))

    def service(self, name: str) -> Any:
        return self._services[name]

    def later(self, seconds: float, action: Callable[[], None]) -> None:
        self.pending.append((seconds, action))

    def emit(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))

    def run_later(self) -> None:
        pending, self.pending = self.pending, []
        for _, action in pending:
            action()


@pytest.fixture
def echo() -> Iterator[_EchoServer]:
    server = _EchoServer()
    yield server
    server.close()


@pytest.fixture(autouse=True)
def no_proxy_left() -> Iterator[None]:
    yield
    deadline = time.monotonic() + 3
    while [t for t in threading.enumerate() if t.name.startswith("link-")]:
        assert time.monotonic() < deadline, [t.name for t in threading.enumerate()]
        time.sleep(0.02)


def _fire(kind: str, env: FakeEnv, **spec: Any) -> dict[str, Any]:
    return dict(catalogue()[kind].fire(FaultSpec(kind=kind, **spec), env))


def _address(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)


def test_kinds_are_registered_with_their_family_target_and_recovery() -> None:
    kinds = catalogue()
    got = {k: (kinds[k].family, kinds[k].target, kinds[k].recovers, kinds[k].chaos)
           for k in ("slow_link", "corrupt_payload", "s3_outage")}
    assert got == {"slow_link": ("liveness", "node", "none", True),
                   "corrupt_payload": ("communication", "node", "none", True),
                   "s3_outage": ("storage", "role", "none", False)}
    assert REGISTRY["s3_outage"].roles == ("s3",) and REGISTRY["s3_outage"].needs == ("s3",)
    assert REGISTRY["slow_link"].params["delay_ms"] == (float, 200.0)


def test_slow_link_delays_the_route_then_restores_it(echo: _EchoServer) -> None:
    env = FakeEnv(echo.address)
    details = _fire("slow_link", env, node=1, params={"delay_ms": 150, "for_s": 5})
    proxy = _address(details["proxy"])
    assert details["delay_ms"] == 150.0 and details["for_s"] == 5.0
    assert env.routes == [(1, proxy)] and [s for s, _ in env.pending] == [5.0]
    got, seconds = _round_trip(proxy, b"replica bytes")
    assert got == b"replica bytes" and 0.15 <= seconds < 1.5, seconds
    env.run_later()
    assert env.routes[-1] == (1, None)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(proxy, timeout=5)
    event, fields = env.events[-1]
    assert event == "fault_cleared" and fields["kind"] == "slow_link" and fields["node"] == 1
    assert fields["bytes_forward"] == len(b"replica bytes")


def test_corrupt_payload_flips_one_bit_of_a_large_chunk(echo: _EchoServer) -> None:
    env = FakeEnv(echo.address)
    details = _fire("corrupt_payload", env, node=0)
    assert details["count"] == 1 and details["for_s"] == 10.0
    proxy = _address(details["proxy"])
    small = b"handshake" * 10
    assert _round_trip(proxy, small)[0] == small        # under min_chunk_bytes: untouched
    data = b"\x00" * 8192
    got, _ = _round_trip(proxy, data)
    assert sum(bin(b).count("1") for b in got) == 1
    assert _round_trip(proxy, data)[0] == data          # count spent
    env.run_later()
    assert env.routes == [(0, proxy), (0, None)]
    assert env.events[-1][1]["chunks_corrupted"] == 1


def test_node_faults_need_a_node_and_valid_params(echo: _EchoServer) -> None:
    env = FakeEnv(echo.address)
    with pytest.raises(ConfigError, match="node"):
        _fire("slow_link", env)
    with pytest.raises(ConfigError, match="delay_ms"):
        _fire("slow_link", env, node=0, params={"delay_ms": "slow"})
    with pytest.raises(ConfigError, match="count"):
        _fire("corrupt_payload", env, node=0, params={"count": 0})
    assert env.routes == [] and env.pending == []


def _s3_config(endpoint: str, enabled: bool = True) -> PhalanxConfig:
    s3 = S3TierConfig(enabled=enabled, bucket="drill-bucket", endpoint_url=endpoint)
    return PhalanxConfig(job=JobConfig(entrypoint="examples/train_mlp.py:main"),
                         tiers=TiersConfig(s3=s3))


def test_prepare_job_proxies_the_s3_endpoint_only_for_an_s3_outage(echo: _EchoServer) -> None:
    endpoint = "http://{}:{}".format(*echo.address)
    cfg = _s3_config(endpoint)
    assert prepare_job(cfg, {"kill_worker"}) == (cfg, {})
    assert prepare_job(_s3_config(endpoint, enabled=False), {"s3_outage"})[1] == {}
    with pytest.raises(ConfigError, match="endpoint_url"):
        prepare_job(_s3_config("https://s3.example.com"), {"s3_outage"})
    with pytest.raises(ConfigError, match="endpoint_url"):
        prepare_job(_s3_config(""), {"s3_outage"})
    proxied, services = prepare_job(cfg, {"s3_outage", "kill_worker"})
    proxy = services["s3_proxy"]
    try:
        assert isinstance(proxy, LinkProxy) and proxy.target == echo.address
        assert proxied.tiers.s3.endpoint_url == "http://{}:{}".format(*proxy.address)
        assert proxied.tiers.s3.bucket == cfg.tiers.s3.bucket and proxied.job == cfg.job
        assert _round_trip(proxy.address, b"GET /")[0] == b"GET /"
    finally:
        proxy.close()


def test_s3_outage_refuses_then_serves_on_the_same_port(echo: _EchoServer) -> None:
    _, services = prepare_job(_s3_config("http://{}:{}".format(*echo.address)), {"s3_outage"})
    proxy = services["s3_proxy"]
    try:
        env = FakeEnv(echo.address, services)
        details = _fire("s3_outage", env, role="s3", params={"for_s": 30})
        assert details["for_s"] == 30.0 and _address(details["proxy"]) == proxy.address
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(proxy.address, timeout=5)
        env.run_later()                                  # what the env's timer does at for_s
        assert _round_trip(proxy.address, b"PUT")[0] == b"PUT"
        assert env.events[-1][0] == "fault_cleared"
    finally:
        proxy.close()
    with pytest.raises(ConfigError, match="s3"):
        _fire("s3_outage", FakeEnv(echo.address), role="s3")


def test_s3_outage_reopens_by_itself_without_the_env_timer(echo: _EchoServer) -> None:
    with LinkProxy(echo.address, name="s3") as proxy:
        env = FakeEnv(echo.address, {"s3_proxy": proxy})
        _fire("s3_outage", env, role="s3", params={"for_s": 0.2})
        deadline = time.monotonic() + 5
        while proxy.refusing:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert _round_trip(proxy.address, os.urandom(64))[1] < 5
