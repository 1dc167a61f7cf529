"""The node keeper as a Ray actor pinned to its node: it owns the node's snapshot memory
and lives as long as the node, so a worker crash loses nothing."""
from __future__ import annotations

import logging
import os
from typing import Any

import ray

from configs.loader import load_config_text
from runtime.keeper import Keeper

log = logging.getLogger(__name__)


def node_name(index: int) -> str:
    """The name of virtual node ``index`` in etcd keys, shm files and reports."""
    return f"node{index}"


@ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)
class KeeperActor:
    """Called from the launcher's thread through Ray with plain values only."""

    def __init__(self, node: str, config_yaml: str, secret_hex: str) -> None:
        cfg = load_config_text(config_yaml, source="keeper config")
        self._keeper = Keeper(node, cfg.job.name, bytes.fromhex(secret_hex),
                              shm_dir=cfg.snapshot.shm_dir, slots=cfg.snapshot.slots,
                              bind_host=cfg.replication.bind_host,
                              timeout_s=cfg.replication.timeout_s).start()

    def address(self) -> tuple[str, int]:
        return self._keeper.address

    def pid(self) -> int:
        return os.getpid()

    def holdings(self) -> dict[int, dict[str, Any]]:
        return self._keeper.holdings()

    def stats(self) -> dict[str, int]:
        return self._keeper.stats()

    def close(self) -> None:
        self._keeper.close()
