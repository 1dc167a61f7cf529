"""The composition root of ``phalanx launch``: start services, place worker actors over the
nodes, watch progress and results, and tear everything down however the run ends."""
from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from rich.console import Console

from configs.errors import ConfigError, PhalanxError, WorkerFailed
from configs.loader import dump_config
from configs.schema import PhalanxConfig
from launcher.entrypoint import resolve_path
from launcher.keeper_actor import KeeperActor, build_tiers, node_name
from launcher.progress import ProgressView
from launcher.ray_cluster import node_resource
from launcher.rundir import RunDir
from launcher.services import Services, start_services
from launcher.worker import WorkerActor
from runtime.context import WorkerContext
from runtime.shm import check_capacity, memory_plan

REPLICA_KEEP = 2  # replica steps a keeper keeps per rank (Keeper's default)

log = logging.getLogger(__name__)


class JobTimeout(PhalanxError):
    """The job ran longer than ``job.timeout_s``."""


@dataclass
class JobResult:
    run_dir: Path
    results: dict[int, Any] = field(default_factory=dict)
    seconds: float = 0.0
    keepers: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Rank:
    rank: int
    node: int
    actor: Any
    ref: Any = None


class JobRunner:
    """Runs one job to completion. ``run()`` returns a ``JobResult`` or raises the root
    cause (``WorkerFailed`` with the rank's traceback, ``ServiceStartError``, ...)."""

    def __init__(self, cfg: PhalanxConfig, console: Console | None = None,
                 base_dir: Path | None = None) -> None:
        self.cfg = cfg
        self.console = console or Console(stderr=True)
        self.entrypoint = resolve_path(cfg.job.entrypoint, base_dir or Path.cwd())
        self.secret_hex = ""
        self.keepers: dict[int, tuple[Any, tuple[str, int]]] = {}

    def run(self) -> JobResult:
        started = time.monotonic()
        self._check_memory()
        self._check_tiers()
        run = RunDir.create(self.cfg)
        self.secret_hex = job_secret(self.cfg, run).hex()
        self.console.print(f"phalanx: run directory {run.path}")
        with contextlib.ExitStack() as stack:
            _install_sigterm(stack)
            services = start_services(self.cfg, run, stack)
            run.write_job({"job": self.cfg.job.name, "etcd_endpoints": services.etcd_endpoints,
                           "etcd_prefix": self.cfg.etcd.prefix, "launcher_pid": os.getpid(),
                           "world_size": self.cfg.job.world_size})
            self._start_keepers(services, run, stack)
            ranks = self._start_workers(services, run, stack)
            results = self._watch(services, ranks)
            holdings = self._keeper_holdings()
        result = JobResult(run.path, results, time.monotonic() - started, holdings)
        self.console.print(f"phalanx: job {self.cfg.job.name} finished in {result.seconds:.1f} s")
        return result

    def _check_memory(self) -> None:
        """Refuse to start when shared memory cannot hold every node's snapshots."""
        cfg = self.cfg
        if not cfg.snapshot.enabled or cfg.snapshot.rank_size_mb <= 0:
            return
        factor = cfg.replication.factor if cfg.replication.enabled else 0
        per_node = -(-cfg.job.world_size // cfg.job.nodes)
        required = cfg.job.nodes * memory_plan(int(cfg.snapshot.rank_size_mb * 2**20), per_node,
                                               cfg.snapshot.slots, factor, REPLICA_KEEP)
        check_capacity(required, cfg.snapshot.shm_dir)

    def _check_tiers(self) -> None:
        """Credentials, buckets and folders are checked at launch, not at the first upload."""
        if not self.cfg.snapshot.enabled:
            return
        for tier, _, _ in build_tiers(self.cfg, str(Path(self.cfg.job.run_dir) / "_check")):
            if tier.name != "disk" or self.cfg.tiers.disk.path:
                tier.check()

    def _start_keepers(self, services: Services, run: RunDir, stack: contextlib.ExitStack) -> None:
        """One keeper per node, pinned to it, before any worker starts."""
        if not self.cfg.snapshot.enabled:
            return
        config_yaml = dump_config(self.cfg)
        actors = {}
        for node in range(self.cfg.job.nodes):
            actor = KeeperActor.options(resources={node_resource(node): 1},
                                        name=f"{self.cfg.job.name}-keeper{node}").remote(
                node_name(node), config_yaml, self.secret_hex, services.etcd_endpoints,
                str(run.path), [r for r in range(self.cfg.job.world_size)
                                if r % self.cfg.job.nodes == node])
            stack.callback(_close_keeper, actor)
            actors[node] = actor
        addresses = ray.get([actor.address.remote() for actor in actors.values()], timeout=60)
        self.keepers = {node: (actor, tuple(addr)) for (node, actor), addr
                        in zip(actors.items(), addresses)}

    def _keeper_holdings(self) -> dict[str, Any]:
        """What each keeper holds at the end of the run (for the summary and tests)."""
        names = [node_name(node) for node in self.keepers]
        refs = [actor.holdings.remote() for actor, _ in self.keepers.values()]
        return dict(zip(names, ray.get(refs, timeout=30))) if refs else {}

    def _context(self, services: Services, run: RunDir, rank: int, node: int) -> WorkerContext:
        cfg = self.cfg
        keeper_host, keeper_port = self.keepers[node][1] if node in self.keepers else ("", 0)
        return WorkerContext(
            job=cfg.job.name, rank=rank, world_size=cfg.job.world_size,
            local_rank=rank // cfg.job.nodes, node=node_name(node), worker_id=f"w{rank}-g0",
            generation=0, master_addr=services.store_host, master_port=services.store.port,
            etcd_endpoints=tuple(services.etcd_endpoints), etcd_prefix=cfg.etcd.prefix,
            lease_ttl_s=cfg.etcd.lease_ttl_s, heartbeat_s=cfg.etcd.heartbeat_s,
            group_timeout_s=cfg.recovery.group_timeout_s, run_dir=str(run.path),
            torch_threads=cfg.job.torch_threads, keeper_host=keeper_host, keeper_port=keeper_port,
            snapshot_every=str(cfg.snapshot.every_steps),
            overhead_budget=cfg.snapshot.overhead_budget, secret_hex=self.secret_hex)

    def _start_workers(self, services: Services, run: RunDir,
                       stack: contextlib.ExitStack) -> list[_Rank]:
        cfg = self.cfg
        ranks = []
        for rank in range(cfg.job.world_size):
            node = rank % cfg.job.nodes
            actor = WorkerActor.options(
                num_cpus=cfg.job.cpus_per_worker, resources={node_resource(node): 1},
                name=f"{cfg.job.name}-rank{rank}", lifetime=None,
            ).remote(self.entrypoint, cfg.job.torch_threads)
            stack.callback(_kill_actor, actor)
            ranks.append(_Rank(rank, node, actor))
        for entry in ranks:
            ctx = self._context(services, run, entry.rank, entry.node)
            entry.ref = entry.actor.run.remote(ctx.to_env(), dict(cfg.job.args),
                                               str(run.log_path(f"rank_{entry.rank}")))
        return ranks

    def _watch(self, services: Services, ranks: list[_Rank]) -> dict[int, Any]:
        cfg = self.cfg
        deadline = time.monotonic() + cfg.job.timeout_s
        total = cfg.job.args.get("steps") if isinstance(cfg.job.args.get("steps"), int) else None
        view = ProgressView(self.console, cfg.job.world_size, total).start()
        pending = {entry.ref: entry for entry in ranks}
        results: dict[int, Any] = {}
        try:
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1, timeout=0.25)
                for ref in done:
                    entry = pending.pop(ref)
                    results[entry.rank] = _result_of(ref, entry.rank)
                    view.mark(entry.rank, "finished")
                view.update(services.membership.members())
                if time.monotonic() > deadline:
                    raise JobTimeout(f"job {cfg.job.name} ran past job.timeout_s="
                                     f"{cfg.job.timeout_s}")
        finally:
            view.close()
        return {rank: results[rank] for rank in sorted(results)}


def _result_of(ref: Any, rank: int) -> Any:
    """A finished worker's result; raises the worker's own error as the root cause."""
    try:
        return ray.get(ref)
    except RayTaskError as exc:
        cause = exc.cause if isinstance(exc.cause, BaseException) else None
        if isinstance(cause, WorkerFailed):
            raise cause from None
        raise WorkerFailed(rank, str(exc).splitlines()[0], str(exc)) from None
    except RayActorError as exc:
        raise WorkerFailed(rank, f"worker process died: {exc}") from None


def job_secret(cfg: PhalanxConfig, run: RunDir) -> bytes:
    """The job secret (HMAC of manifests, peer auth): ``security.secret_file``'s bytes, or a
    fresh random one kept in the run directory (mode 0600) for ``phalanx ckpt verify``."""
    if cfg.security.secret_file:
        try:
            secret = Path(cfg.security.secret_file).read_bytes().rstrip(b"\r\n")
        except OSError as exc:
            raise ConfigError("security.secret_file", f"cannot be read: {exc}",
                              "point it at a readable file holding the job secret") from None
        if len(secret) < 16:
            raise ConfigError("security.secret_file", f"holds {len(secret)} bytes",
                              "use at least 16 bytes, e.g. `openssl rand -hex 32 > FILE`")
        return secret
    secret = secrets.token_hex(32).encode()
    path = run.path / "secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(secret + b"\n")
    return secret


def _close_keeper(actor: Any) -> None:
    """Let the keeper unlink its shared memory, then stop its process."""
    with contextlib.suppress(Exception):  # teardown: the keeper may already be gone
        ray.get(actor.close.remote(), timeout=10)
    _kill_actor(actor)


def _kill_actor(actor: Any) -> None:
    with contextlib.suppress(Exception):  # teardown: the actor may already be gone
        ray.kill(actor, no_restart=True)


def _install_sigterm(stack: contextlib.ExitStack) -> None:
    """SIGTERM unwinds like Ctrl-C, so every service is stopped."""
    def on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        previous = signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread: leave signals to the caller
        return
    stack.callback(signal.signal, signal.SIGTERM, previous)
