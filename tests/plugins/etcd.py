"""etcd test services: one etcd per session and a ``Membership`` factory over the fake and
the real adapter, so one contract suite runs against both.

Default: the pip-installed etcd (``EmbeddedEtcd``). ``PHALANX_TEST_SERVICES=containers``
selects an etcd container only where testcontainers imports and a Docker engine answers.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from phalanx.launcher.services.etcd_server import EmbeddedEtcd, etcd_healthy
from phalanx.runtime.base import Membership
from phalanx.runtime.membership.etcd import EtcdMembership
from tests.fakes.membership_memory import InMemoryMembership, InMemoryStore

ETCD_IMAGE = "quay.io/coreos/etcd:v3.5.17"
_MEMORY_STEP_S = 0.1


@dataclass(frozen=True)
class ContainerEtcd:
    """An etcd reached through a container's mapped port."""

    endpoint: str


def _containers_selected() -> bool:
    if os.environ.get("PHALANX_TEST_SERVICES") != "containers":
        return False
    try:
        import docker  # testcontainers' own dependency
        import testcontainers.core.container  # noqa: F401

        docker.from_env(timeout=3).ping()
    except Exception as exc:  # no package, no engine: fall back to the embedded etcd
        warnings.warn(f"PHALANX_TEST_SERVICES=containers but no Docker engine answered "
                      f"({type(exc).__name__}: {exc}); using the embedded etcd", stacklevel=1)
        return False
    return True


@contextlib.contextmanager
def _etcd_container(startup_timeout_s: float = 60.0) -> Iterator[ContainerEtcd]:
    from testcontainers.core.container import DockerContainer

    command = ["etcd", "--name=test", "--listen-client-urls=http://0.0.0.0:2379",
               "--advertise-client-urls=http://127.0.0.1:2379",
               "--heartbeat-interval=10", "--election-timeout=100"]
    with DockerContainer(ETCD_IMAGE).with_command(command).with_exposed_ports(2379) as box:
        server = ContainerEtcd(f"{box.get_container_host_ip()}:{box.get_exposed_port(2379)}")
        deadline = time.monotonic() + startup_timeout_s
        while not etcd_healthy(server.endpoint):
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd container at {server.endpoint} not healthy")
            time.sleep(0.1)
        yield server


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One etcd for the whole session: ``EmbeddedEtcd`` (or ``ContainerEtcd``)."""
    if _containers_selected():
        with _etcd_container() as container:
            yield container
        return
    server = EmbeddedEtcd(tmp_path_factory.mktemp("etcd") / "data", startup_timeout_s=15.0)
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def etcd_endpoint(etcd_server: Any) -> str:
    """``host:port`` of the session's etcd."""
    return str(etcd_server.endpoint)


class MembershipFactory:
    """Creates ``Membership`` instances sharing one backend (one job prefix per test).

    ``kind`` is ``memory`` or ``etcd``. ``pass_time_until`` lets time pass (the fake's
    clock, or real time for etcd) until a predicate holds.
    """

    def __init__(self, kind: str, endpoint: str = "") -> None:
        self.kind = kind
        self.endpoint = endpoint
        self.store = InMemoryStore()
        self.job_prefix = f"/phalanx-test/{uuid.uuid4().hex[:12]}/"
        self._made: list[Any] = []

    def __call__(self) -> Membership:
        made: Any
        if self.kind == "memory":
            made = InMemoryMembership(self.store)
        else:
            made = EtcdMembership([self.endpoint], self.job_prefix, timeout_s=5.0)
        self._made.append(made)
        return made

    def pass_time_until(self, predicate: Callable[[], bool], within_s: float) -> bool:
        """Whether ``predicate`` became true within ``within_s`` seconds of backend time."""
        if self.kind == "memory":
            for _ in range(int(within_s / _MEMORY_STEP_S)):
                if predicate():
                    return True
                self.store.advance(_MEMORY_STEP_S)
            return predicate()
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.02)
        return predicate()

    def force_expire(self, membership: Any) -> None:
        """Revoke ``membership``'s lease behind its back (a partition outlasting the TTL)."""
        if self.kind == "memory":
            self.store.expire_now(membership.lease_id)
            return
        etcdctl = str(Path(sys.executable).parent / "etcdctl")
        if not os.path.exists(etcdctl):
            etcdctl = shutil.which("etcdctl") or "etcdctl"
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCDCTL_")}
        subprocess.run([etcdctl, f"--endpoints={self.endpoint}", "lease", "revoke",
                        f"{membership.lease_id:x}"], check=True, capture_output=True,
                       timeout=10, env=env)

    def close(self) -> None:
        for made in self._made:
            made.close()


@pytest.fixture(params=["memory", "etcd"])
def membership_factory(request: pytest.FixtureRequest) -> Iterator[MembershipFactory]:
    """A ``MembershipFactory`` for the in-memory fake and for the session's etcd."""
    endpoint = request.getfixturevalue("etcd_endpoint") if request.param == "etcd" else ""
    factory = MembershipFactory(request.param, endpoint)
    try:
        yield factory
    finally:
        factory.close()
