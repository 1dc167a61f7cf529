"""What a worker process learns from its launcher: the ``PHALANX_*`` and torchrun-compatible
environment, parsed once into one frozen value."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Mapping

from phalanx.configs.errors import ConfigError
from phalanx.runtime.base import node_index

ENV_KEY = "PHALANX_CONTEXT"

DEFAULT_PLAN_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class WorkerContext:
    """Everything a rank needs to join its job; ``standalone()`` when run without phalanx."""

    job: str
    rank: int
    world_size: int
    local_rank: int = 0                # torchrun's: the index among the node's processes
    local_world_size: int = 1          # how many ranks run on this node
    node: str = "node0"
    worker_id: str = "standalone"
    generation: int = 0
    # torchrun's TORCHELASTIC_RESTART_COUNT and _MAX_RESTARTS: the job's recoveries before
    # this worker started (a script without a Session restarts every rank at each) and
    # recovery.max_recoveries (`phalanx run --max-restarts`)
    restart_count: int = 0
    max_restarts: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    etcd_endpoints: tuple[str, ...] = ()
    etcd_prefix: str = "/phalanx"
    lease_ttl_s: float = 3.0
    heartbeat_s: float = 0.5
    group_timeout_s: float = 30.0
    run_dir: str = ""
    torch_threads: int = 1
    keeper_host: str = ""
    keeper_port: int = 0
    snapshot_every: str = "1"          # an integer as text, or "auto"
    overhead_budget: float = 0.03
    tier_windows: tuple[int, ...] = ()  # enabled tiers' every_steps (``SnapshotPolicy.windows``)
    checksum: str = "xxh3"
    secret_hex: str = field(default="", repr=False)
    # etcd TLS files, user and password file (``membership_etcd.client_fields``)
    etcd_client: dict[str, str] = field(default_factory=dict)
    plan_timeout_s: float = DEFAULT_PLAN_TIMEOUT_S   # how long a survivor waits for a plan
    drills: bool = False               # install the drill hooks (``runtime.worker.drill_hooks``)
    drill_gates: tuple[int, ...] = ()  # steps a drill's faults are due at: held there until fired
    log_format: str = "logfmt"         # the launcher's --log-format (``runtime.logs``)
    # the run's config.yaml as text: the run directory may be on another machine
    config_yaml: str = field(default="", repr=False)
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def secret(self) -> bytes | None:
        return bytes.fromhex(self.secret_hex) if self.secret_hex else None

    @property
    def standalone_run(self) -> bool:
        return self.master_port == 0

    def to_env(self) -> dict[str, str]:
        """torchrun's variables (same meanings: ``GROUP_RANK`` is the node's index, the
        store at ``MASTER_ADDR:MASTER_PORT`` is the launcher's, so rank 0 hosts none) plus
        the whole context as JSON."""
        return {
            "RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank), "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(_group_rank(self.node)), "ROLE_RANK": str(self.rank),
            "ROLE_WORLD_SIZE": str(self.world_size), "ROLE_NAME": "default",
            "TORCHELASTIC_RUN_ID": self.job, "TORCHELASTIC_RESTART_COUNT": str(self.restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts), "TORCHELASTIC_USE_AGENT_STORE": "True",
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port), "PHALANX_JOB": self.job,
            "PHALANX_NODE": self.node, "PHALANX_GENERATION": str(self.generation),
            ENV_KEY: json.dumps(asdict(self), sort_keys=True),
        }

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "WorkerContext":
        """The context the launcher gave us, or a one-rank standalone context."""
        env = os.environ if env is None else env
        raw = env.get(ENV_KEY)
        if raw is None:
            return cls.standalone()
        try:
            data = json.loads(raw)
            known = {f.name for f in fields(cls)}
            unknown = set(data) - known
            if unknown:
                raise ValueError(f"unknown fields {sorted(unknown)}")
            data["etcd_endpoints"] = tuple(data.get("etcd_endpoints", ()))
            data["drill_gates"] = tuple(data.get("drill_gates", ()))
            data["tier_windows"] = tuple(data.get("tier_windows", ()))
            return cls(**data)
        except (ValueError, TypeError) as exc:
            raise ConfigError(ENV_KEY, f"cannot be parsed: {exc}",
                              "it is written by `phalanx launch`; do not set it by hand",
                              source="environment") from exc

    @classmethod
    def standalone(cls) -> "WorkerContext":
        return cls(job="standalone", rank=0, world_size=1)


def _group_rank(node: str) -> int:
    """torchrun's GROUP_RANK: the node's index (0 for a node not named ``node<index>``)."""
    try:
        return node_index(node)
    except ValueError:
        return 0
