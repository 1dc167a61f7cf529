"""Start or join the services a job needs (etcd, Ray, the c10d TCPStore) and own their
lifetime: everything started here is stopped on exit, error or Ctrl-C."""
from __future__ import annotations

import contextlib
import datetime
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import ray
import torch.distributed as dist

from configs.schema import PhalanxConfig
from launcher.etcd_server import EmbeddedEtcd
from launcher.ray_cluster import LocalRay
from launcher.rundir import RunDir
from runtime.membership_etcd import EtcdMembership, job_prefix

log = logging.getLogger(__name__)


@dataclass
class Services:
    etcd_endpoints: list[str]
    membership: EtcdMembership
    store: dist.TCPStore
    store_host: str
    local_ray: LocalRay | None
    etcd: EmbeddedEtcd | None


def start_services(cfg: PhalanxConfig, run: RunDir, stack: contextlib.ExitStack) -> Services:
    """Start (or join) etcd, Ray and the TCPStore; registers their teardown on ``stack``."""
    etcd = None
    endpoints = list(cfg.etcd.endpoints)
    if not endpoints:
        etcd = EmbeddedEtcd(run.path / "etcd", cfg.etcd.startup_timeout_s)
        stack.callback(etcd.close)
        etcd.start()
        endpoints = [etcd.endpoint]
    membership = EtcdMembership(endpoints, job_prefix(cfg.etcd.prefix, cfg.job.name),
                                **_etcd_auth(cfg)).connect(retry_for_s=cfg.etcd.startup_timeout_s)
    stack.callback(membership.close)
    for stale in membership.list_prefix(""):  # the launcher owns its job's namespace
        membership.delete(stale.key)
    local_ray = None
    if cfg.ray.address:
        ray.init(address=cfg.ray.address, log_to_driver=False)
        stack.callback(ray.shutdown)
        store_host = ray.util.get_node_ip_address()
    else:
        local_ray = LocalRay(cfg.ray, log_to_driver=False)
        stack.callback(local_ray.close)
        stack.push(_keep_ray_logs_on_failure(local_ray, run.path / "ray-logs"))
        local_ray.start()
        store_host = "127.0.0.1"
    store = dist.TCPStore(store_host, 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=cfg.recovery.group_timeout_s))
    return Services(endpoints, membership, store, store_host, local_ray, etcd)


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


def _etcd_auth(cfg: PhalanxConfig) -> dict[str, str]:
    password = ""
    if cfg.etcd.password_file:
        with open(cfg.etcd.password_file, encoding="utf-8") as handle:
            password = handle.read().strip()
    return {"ca_file": cfg.etcd.tls.ca_file, "cert_file": cfg.etcd.tls.cert_file,
            "key_file": cfg.etcd.tls.key_file, "user": cfg.etcd.user, "password": password}
