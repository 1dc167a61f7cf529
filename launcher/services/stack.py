"""Start or join the services a job needs (etcd, Ray, the c10d TCPStore) and own their
lifetime: everything started here is stopped on exit, error or Ctrl-C."""
from __future__ import annotations

import contextlib
import datetime
import importlib
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import ray

from phalanx.configs.errors import PlanInfeasible
from phalanx.configs.schema import PhalanxConfig
from phalanx.launcher.services.etcd_server import EmbeddedEtcd, ServerTLS
from phalanx.launcher.services.leadership import COORDINATOR_KEY, Leadership
from phalanx.launcher.services.ray_cluster import LocalRay
from phalanx.launcher.rundir import RunDir
from phalanx.runtime.membership.etcd import (EtcdClientOptions, EtcdMembership, client_fields,
                                             client_options, job_prefix)

if TYPE_CHECKING:
    import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass
class Services:
    etcd_endpoints: list[str]
    membership: EtcdMembership
    store: dist.TCPStore
    store_host: str
    local_ray: LocalRay | None
    etcd: EmbeddedEtcd | None
    leadership: Leadership
    started_s: dict[str, float] = field(default_factory=dict)   # seconds per service start


def ray_namespace(cfg: PhalanxConfig) -> str:
    """The Ray namespace of a job's named actors (a standby finds them there)."""
    return f"phalanx-{cfg.job.name}"


def start_services(cfg: PhalanxConfig, run: RunDir, stack: contextlib.ExitStack) -> Services:
    """Start (or join) etcd, Ray and the TCPStore, and take the job's coordinator lease;
    registers their teardown on ``stack``. Raises ``PlanInfeasible`` when another launcher
    leads the job."""
    prefetch_torch()
    etcd = None
    endpoints = list(cfg.etcd.endpoints)
    started_s: dict[str, float] = {}
    begun = time.monotonic()
    if not endpoints:
        etcd = EmbeddedEtcd(run.path / "etcd", cfg.etcd.startup_timeout_s,
                            tls=embedded_tls(cfg))
        stack.callback(etcd.close)
        etcd.start()
        endpoints = [etcd.endpoint]
        started_s["etcd"] = time.monotonic() - begun
    membership = _connect(cfg, endpoints, stack)
    leadership = _leadership(cfg, endpoints, stack)
    if not leadership.try_acquire():
        holder = leadership.holder() or {}
        raise PlanInfeasible(
            f"job {cfg.job.name!r} is led by the launcher with pid {holder.get('pid')} on "
            f"{holder.get('host')}: stop it first, or start this one with --standby to take "
            "over when it stops")
    for stale in membership.list_prefix(""):  # the leader owns its job's namespace
        if stale.key != COORDINATOR_KEY:
            membership.delete(stale.key)
    local_ray = None
    if cfg.ray.address:
        store_host = _join_ray(cfg, stack)
    else:
        local_ray = LocalRay(cfg.ray, log_to_driver=False, namespace=ray_namespace(cfg),
                             failed_logs=run.path / "ray-logs")
        stack.callback(local_ray.close)
        stack.push(_keep_ray_logs_on_failure(local_ray, run.path / "ray-logs"))
        begun = time.monotonic()
        local_ray.start()
        started_s["ray"] = time.monotonic() - begun
        started_s["ray_attempts"] = local_ray.attempts
        store_host = "127.0.0.1"
    return Services(endpoints, membership, _store(cfg, store_host), store_host, local_ray, etcd,
                    leadership, started_s)


def embedded_tls(cfg: PhalanxConfig) -> ServerTLS | None:
    """The embedded etcd's TLS: ``etcd.tls``'s certificate serves it (and the same files
    are every client's identity), ``ca_file`` makes it require client certificates."""
    tls = cfg.etcd.tls
    return ServerTLS(tls.cert_file, tls.key_file, tls.ca_file) if tls.cert_file else None


def join_services(cfg: PhalanxConfig, stack: contextlib.ExitStack,
                  on_waiting: Callable[[dict], None]) -> Services:
    """A standby's services: join etcd, wait until the job's leader is gone and take its
    lease, join Ray, and host a new TCPStore (the leader's went with it)."""
    endpoints = list(cfg.etcd.endpoints)
    membership = _connect(cfg, endpoints, stack)
    leadership = _leadership(cfg, endpoints, stack)
    leadership.wait(on_waiting=on_waiting)
    store_host = _join_ray(cfg, stack)
    return Services(endpoints, membership, _store(cfg, store_host), store_host, None, None,
                    leadership)


def _connect(cfg: PhalanxConfig, endpoints: list[str],
             stack: contextlib.ExitStack) -> EtcdMembership:
    membership = EtcdMembership(endpoints, job_prefix(cfg.etcd.prefix, cfg.job.name),
                                **_etcd_auth(cfg)).connect(retry_for_s=cfg.etcd.startup_timeout_s)
    stack.callback(membership.close)
    return membership


def _leadership(cfg: PhalanxConfig, endpoints: list[str],
                stack: contextlib.ExitStack) -> Leadership:
    """The coordinator lease lives on its own connection: it is this launcher's liveness."""
    leadership = Leadership(_connect(cfg, endpoints, stack), cfg.coordinator.lease_ttl_s,
                            step_down_when_silent=cfg.coordinator.standby)
    stack.callback(leadership.release)
    return leadership


def _join_ray(cfg: PhalanxConfig, stack: contextlib.ExitStack) -> str:
    ray.init(address=cfg.ray.address, log_to_driver=False, namespace=ray_namespace(cfg))
    stack.callback(ray.shutdown)
    return ray.util.get_node_ip_address()


def _store(cfg: PhalanxConfig, host: str) -> dist.TCPStore:
    """The job's c10d TCPStore, listening on ``host`` only: c10d's own server listens on
    every interface whatever host it is given, and it has no authentication, so the
    launcher binds the socket itself and hands it over."""
    return host_store(host, datetime.timedelta(seconds=cfg.recovery.group_timeout_s))


def prefetch_torch() -> None:
    """Import torch (the TCPStore's) on a thread while etcd and Ray start: the launcher
    needs it only for the store, made last, and importing it first held every launch's
    start-up 1.1 s on this 2-core machine. ``host_store``'s own import then waits for
    this one (Python's per-module import lock) or finds it done."""
    threading.Thread(target=importlib.import_module, args=("torch.distributed",),
                     name="phalanx-torch-import", daemon=True).start()


def host_store(host: str, timeout: datetime.timedelta) -> dist.TCPStore:
    """A master TCPStore on a free port of ``host`` (and no other interface)."""
    import torch.distributed as dist   # see prefetch_torch

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, 0))
        listener.listen(socket.SOMAXCONN)
        port = listener.getsockname()[1]
        store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                              timeout=timeout, master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()           # the store owns the descriptor now
    return store


def _keep_ray_logs_on_failure(local_ray: LocalRay, dest: Path) -> Callable[..., bool]:
    """An exit callback (it runs before ``local_ray.close``): when the job fails, keep the
    local Ray's raylet and GCS logs in the run directory."""
    def keep(exc_type: type[BaseException] | None, *_: object) -> bool:
        if exc_type is not None and not issubclass(exc_type, KeyboardInterrupt):
            kept = local_ray.keep_logs(dest)
            if kept:
                log.warning("event=ray_logs_kept dir=%s files=%d", dest, len(kept))
        return False
    return keep


def _etcd_auth(cfg: PhalanxConfig) -> EtcdClientOptions:
    return client_options(**client_fields(cfg.etcd))
