"""The config schema: one frozen dataclass per section, with cross-field checks.

Each field's docstring-like ``metadata["doc"]`` feeds the README's config reference.
Checks that span sections live in ``PhalanxConfig.__post_init__``; each raises
``ConfigError`` with the dotted key, and the loader adds the file and line.
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from phalanx.configs.errors import ConfigError


def doc(text: str, default: Any = None, factory: Any = None) -> Any:
    """A dataclass field carrying its documentation."""
    if factory is not None:
        return field(default_factory=factory, metadata={"doc": text})
    return field(default=default, metadata={"doc": text})


def _require(ok: bool, key: str, problem: str, hint: str) -> None:
    if not ok:
        raise ConfigError(key, problem, hint)


@dataclass(frozen=True)
class JobConfig:
    entrypoint: str = doc("what each rank runs: a script 'path/to/train.py' (as __main__ "
                          "with job.argv, like torchrun), a function 'path/to/train.py:main' "
                          "or 'module:function' (called with job.args)", "")
    argv: list[str] = doc("command-line arguments of a script entrypoint (sys.argv[1:])",
                          factory=list)
    name: str = doc("job name; etcd keys live under <etcd.prefix>/<name>/", "phalanx-job")
    world_size: int = doc("number of training ranks", 2)
    nodes: int = doc("number of nodes the ranks are spread over (round robin)", 2)
    cpus_per_worker: float = doc("Ray CPUs reserved by each worker and spare actor", 0.5)
    torch_threads: int = doc("torch intra-op threads in every worker and spare (same everywhere "
                             "for bit-identical replay)", 1)
    args: dict[str, Any] = doc("keyword arguments passed to the entrypoint (JSON values)", factory=dict)
    run_dir: str = doc("where each run gets its folder (logs, events, etcd data, disk tier)",
                       ".phalanx/runs")
    timeout_s: float = doc("the launcher stops the job after this long", 900.0)

    def __post_init__(self) -> None:
        _require(bool(self.entrypoint), "job.entrypoint", "is required",
                 "set it to 'examples/train_mlp.py:main' or 'package.module:function'")
        _require(":" in self.entrypoint or self.entrypoint.endswith(".py"), "job.entrypoint",
                 f"{self.entrypoint!r} is neither a script nor a function",
                 "write 'path/to/train.py', 'path/to/train.py:main' or 'module:function'")
        _require(all(isinstance(a, str) for a in self.argv), "job.argv",
                 f"{self.argv!r} holds a value that is not a string",
                 "write every argument as a string, e.g. ['--lr', '0.1']")
        _require(not self.argv or ":" not in self.entrypoint, "job.argv",
                 f"is set but job.entrypoint {self.entrypoint!r} names a function",
                 "give a function its arguments in job.args, or name the script alone")
        _require(self.world_size >= 1, "job.world_size", f"{self.world_size} is below 1",
                 "use 1 or more ranks")
        _require(self.nodes >= 1, "job.nodes", f"{self.nodes} is below 1", "use 1 or more nodes")
        _require(self.nodes <= self.world_size, "job.nodes",
                 f"{self.nodes} nodes for {self.world_size} ranks leaves a node without ranks",
                 "use at most world_size nodes")
        _require(self.cpus_per_worker > 0, "job.cpus_per_worker",
                 f"{self.cpus_per_worker} is not positive", "use e.g. 0.5")
        _require(self.torch_threads >= 1, "job.torch_threads", f"{self.torch_threads} is below 1",
                 "use 1 for the most reproducible runs")
        _require(self.timeout_s > 0, "job.timeout_s", f"{self.timeout_s} is not positive",
                 "use a number of seconds")
        _require(all(c.isalnum() or c in "-_" for c in self.name) and bool(self.name), "job.name",
                 f"{self.name!r} has characters other than letters, digits, '-' and '_'",
                 "it becomes part of etcd keys and S3 object names")


@dataclass(frozen=True)
class EtcdTLSConfig:
    ca_file: str = doc("CA bundle to verify the etcd server; the embedded etcd (no "
                       "endpoints) then also requires client certificates it signed", "")
    cert_file: str = doc("client certificate; the embedded etcd (no endpoints) serves TLS "
                         "with it too (needs IP 127.0.0.1 in its subjectAltName and both "
                         "serverAuth and clientAuth usages)", "")
    key_file: str = doc("private key of cert_file", "")

    def __post_init__(self) -> None:
        _require(bool(self.cert_file) == bool(self.key_file), "etcd.tls.cert_file",
                 "cert_file and key_file must be set together", "set both or neither")


@dataclass(frozen=True)
class EtcdConfig:
    endpoints: list[str] = doc("host:port of an existing etcd cluster; empty starts a private "
                               "embedded etcd on free loopback ports", factory=list)
    prefix: str = doc("key prefix of all phalanx keys", "/phalanx")
    lease_ttl_s: float = doc("member lease TTL: a silent member is gone after this long", 3.0)
    heartbeat_s: float = doc("how often members refresh their lease and progress", 0.5)
    startup_timeout_s: float = doc("how long to wait for the embedded etcd to be healthy", 15.0)
    user: str = doc("etcd user (with password_file)", "")
    password_file: str = doc("file holding the etcd password", "")
    tls: EtcdTLSConfig = doc("TLS of etcd connections (and of the embedded etcd)",
                             factory=EtcdTLSConfig)

    def __post_init__(self) -> None:
        _require(self.lease_ttl_s >= 1, "etcd.lease_ttl_s", f"{self.lease_ttl_s} is below 1 s",
                 "etcd leases are whole seconds; use 1 or more")
        _require(0 < self.heartbeat_s < self.lease_ttl_s, "etcd.heartbeat_s",
                 f"{self.heartbeat_s} must be positive and below lease_ttl_s={self.lease_ttl_s}",
                 "use at most a third of lease_ttl_s")
        _require(self.prefix.startswith("/") and not self.prefix.endswith("/"), "etcd.prefix",
                 f"{self.prefix!r} must start with '/' and not end with '/'", "e.g. /phalanx")
        for ep in self.endpoints:
            _require(":" in ep, "etcd.endpoints", f"{ep!r} has no port", "write host:port")
        _require(bool(self.user) == bool(self.password_file), "etcd.user",
                 "user and password_file must be set together", "set both or neither")
        if not self.endpoints:      # the embedded etcd: loopback, TLS only with a certificate
            _require(not self.user, "etcd.user", f"{self.user!r} is set, but the embedded etcd "
                     "(etcd.endpoints empty) has no users", "set etcd.endpoints to a cluster with "
                     "auth enabled, or drop user/password_file and use etcd.tls certificates")
            _require(bool(self.tls.cert_file) or not self.tls.ca_file, "etcd.tls.cert_file",
                     "is empty, but ca_file is set and the embedded etcd (etcd.endpoints empty) "
                     "serves TLS only with a certificate", "set cert_file and key_file (one "
                     "certificate for 127.0.0.1 with serverAuth and clientAuth), or set "
                     "etcd.endpoints")


@dataclass(frozen=True)
class RayConfig:
    address: str = doc("address of an existing Ray cluster; empty starts a local one", "")
    virtual_nodes: int = doc("raylets of the local Ray, each with resource phalanx_node_<i>", 2)
    cpus_per_node: float = doc("logical CPUs each virtual node offers", 2.0)
    object_store_mb: int = doc("object store size per virtual node, MiB", 80)
    health_check_period_ms: int = doc("how often Ray checks raylets (a killed node is declared "
                                      "dead after period x threshold)", 500)
    health_check_failure_threshold: int = doc("missed checks before a node is declared dead", 5)
    health_check_timeout_ms: int = doc(
        "how long one check may take before it counts as missed: a busy live raylet answers "
        "late (1 s made a loaded 2-core machine lose healthy nodes), a killed one refuses at "
        "once, so this does not delay noticing a dead node", 10000)

    def __post_init__(self) -> None:
        _require(self.virtual_nodes >= 1, "ray.virtual_nodes", f"{self.virtual_nodes} is below 1",
                 "use 1 or more")
        _require(self.cpus_per_node > 0, "ray.cpus_per_node", f"{self.cpus_per_node} is not positive",
                 "use e.g. 2")
        _require(self.object_store_mb >= 75, "ray.object_store_mb",
                 f"{self.object_store_mb} MiB is below Ray's minimum of 75", "use 80 or more")
        _require(self.health_check_period_ms >= 10, "ray.health_check_period_ms",
                 f"{self.health_check_period_ms} is below 10 ms", "use 100-1000")
        _require(self.health_check_failure_threshold >= 1, "ray.health_check_failure_threshold",
                 f"{self.health_check_failure_threshold} is below 1", "use 3")
        _require(self.health_check_timeout_ms >= 100, "ray.health_check_timeout_ms",
                 f"{self.health_check_timeout_ms} is below 100 ms", "use 10000")


@dataclass(frozen=True)
class SnapshotConfig:
    enabled: bool = doc("keep per-step in-memory snapshots", True)
    every_steps: int | Literal["auto"] = doc("full-snapshot interval in steps, or 'auto' (the "
                                             "most frequent interval within overhead_budget); "
                                             "per-rank state is snapshotted every step and "
                                             "replicated state heals from live peers", "auto")
    overhead_budget: float = doc("share of step time snapshots may cost with every_steps: auto", 0.03)
    slots: int = doc("snapshot buffers per rank in its node keeper: 2 double-buffer; a 3rd lets "
                     "persistence and replication read one while training writes", 3)
    shm_dir: str = doc("shared-memory folder for keeper-owned snapshot buffers", "/dev/shm")
    checksum: Literal["xxh3", "blake3", "sha256"] = doc(
        "per-tensor checksum: xxh3 (fastest; catches corruption) or blake3/sha256 "
        "(cryptographic: with the job secret the manifest HMAC then authenticates every "
        "tensor byte, not only the manifest)", "xxh3")
    rank_size_mb: float = doc("expected snapshot size per rank (MiB): the launcher refuses to "
                              "start when shared memory cannot hold slots + replicas; 0 = "
                              "checked by the keeper at the first snapshot", 0.0)
    allow_unprotected: bool = doc("train on when the snapshots measured at the first one do "
                                  "not fit shared memory (slots + replicas on every node): "
                                  "an alert event and a status line instead of failing", False)

    def __post_init__(self) -> None:
        _require(self.every_steps == "auto" or (isinstance(self.every_steps, int)
                                                 and self.every_steps >= 1),
                 "snapshot.every_steps", f"{self.every_steps!r} is neither 'auto' nor >= 1",
                 "use 1 for per-step snapshots or 'auto'")
        _require(0 < self.overhead_budget < 1, "snapshot.overhead_budget",
                 f"{self.overhead_budget} is outside (0, 1)", "use e.g. 0.03 for 3%")
        _require(self.slots >= 2, "snapshot.slots", f"{self.slots} is below 2",
                 "double buffering needs 2 slots")
        _require(self.rank_size_mb >= 0, "snapshot.rank_size_mb",
                 f"{self.rank_size_mb} is negative", "use 0 (unknown) or the size in MiB")


@dataclass(frozen=True)
class ReplicationConfig:
    enabled: bool = doc("replicate snapshots to keepers on other nodes", True)
    factor: int = doc("replicas of each rank's snapshot on other nodes", 1)
    chunk_mb: float = doc("chunk size of keeper-to-keeper transfers, MiB", 4.0)
    bind_host: str = doc("address keepers listen on and advertise in etcd: auto is the "
                         "node's own address as Ray reports it (127.0.0.1 on the launcher's "
                         "local Ray, the host's address on a multi-host Ray cluster)", "auto")
    commit_every_steps: int = doc("write the committed step to etcd at most this often", 10)
    timeout_s: float = doc("socket timeout between keepers", 10.0)

    def __post_init__(self) -> None:
        _require(self.factor >= 0, "replication.factor", f"{self.factor} is negative", "use 1")
        _require(self.chunk_mb > 0, "replication.chunk_mb", f"{self.chunk_mb} is not positive",
                 "use e.g. 4")
        _require(self.commit_every_steps >= 1, "replication.commit_every_steps",
                 f"{self.commit_every_steps} is below 1", "use e.g. 10")
        _require(self.timeout_s > 0, "replication.timeout_s", f"{self.timeout_s} is not positive",
                 "use e.g. 10")

    @property
    def copies(self) -> int:
        """Replicas each rank's snapshot gets on other nodes: ``factor``, or 0 when
        replication is off."""
        return self.factor if self.enabled else 0


# A tier at every_steps: auto persists the full snapshots snapshot.every_steps: auto takes
# (its writes count in snapshot.overhead_budget); with a fixed snapshot interval it persists
# a window of this many steps, the tier's default before auto.
AUTO_TIER_WINDOW = {"disk": 50, "s3": 200}
_TIER_EVERY_DOC = ("persist the first snapshot step of every window of this many steps, or "
                   "'auto': every full snapshot that snapshot.every_steps: auto takes, the "
                   "writes counted in snapshot.overhead_budget (with a fixed "
                   "snapshot.every_steps, auto is a window of {window})")


def _check_tier_every(value: Any, key: str, example: int) -> None:
    _require(value == "auto" or (isinstance(value, int) and value >= 1), key,
             f"{value!r} is neither 'auto' nor >= 1", f"use 'auto' or a number of steps, e.g. "
             f"{example}")


def tier_window(tier: str, every_steps: int | str, snapshot_every: int | str) -> int:
    """The steps of one window of a tier (``cadence.pick_step``): its every_steps, or for
    ``auto`` 0 (every full snapshot) when the snapshot interval is auto too, else
    ``AUTO_TIER_WINDOW``."""
    if every_steps != "auto":
        return int(every_steps)
    return 0 if snapshot_every == "auto" else AUTO_TIER_WINDOW[tier]


_EVERY_S_DOC = ("also persist once per wall-clock window of this many seconds (windows "
                "start at multiples of it, the same on every node); 0 = steps only")


def _check_every_s(value: float, key: str) -> None:
    _require(value >= 0, key, f"{value} is not a number of seconds >= 0",
             "use 0 (persist by every_steps only) or a number of seconds, e.g. 1800")


@dataclass(frozen=True)
class DiskTierConfig:
    enabled: bool = doc("persist committed steps to local disk", True)
    path: str = doc("folder of the disk tier; empty = <run dir>/checkpoints", "")
    every_steps: int | Literal["auto"] = doc(_TIER_EVERY_DOC.format(window=50), "auto")
    every_s: float = doc(_EVERY_S_DOC, 0.0)
    keep: int = doc("complete steps kept", 2)

    def __post_init__(self) -> None:
        _check_tier_every(self.every_steps, "tiers.disk.every_steps", 50)
        _check_every_s(self.every_s, "tiers.disk.every_s")
        _require(self.keep >= 1, "tiers.disk.keep", f"{self.keep} is below 1", "keep at least 1")


_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]*[a-z0-9]")
_RESERVED_PREFIXES = ("xn--", "sthree-", "amzn-s3-demo-")
_RESERVED_SUFFIXES = ("-s3alias", "--ol-s3", ".mrap", "--x-s3", "--table-s3")

def validate_bucket(bucket: str) -> str:
    """S3 bucket naming rules; raises ConfigError(key="tiers.s3.bucket")."""
    problem = ""
    if not 3 <= len(bucket) <= 63:
        problem = f"{bucket!r} is {len(bucket)} characters long, not 3-63"
    elif not _BUCKET_RE.fullmatch(bucket):
        problem = (f"{bucket!r} must use only lowercase letters, digits, '.' and '-', and start "
                   "and end with a letter or digit")
    elif ".." in bucket:
        problem = f"{bucket!r} has two adjacent periods"
    elif _is_ip_address(bucket):
        problem = f"{bucket!r} is formatted as an IP address"
    elif bucket.startswith(_RESERVED_PREFIXES) or bucket.endswith(_RESERVED_SUFFIXES):
        problem = f"{bucket!r} uses a prefix or suffix S3 reserves"
    if problem:
        raise ConfigError("tiers.s3.bucket", problem,
                          "see the S3 bucket naming rules, e.g. 'my-team-checkpoints'")
    return bucket


def _is_ip_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class S3TierConfig:
    enabled: bool = doc("persist committed steps to S3", False)
    bucket: str = doc("bucket name (3-63 chars, lowercase, digits, '.', '-')", "")
    prefix: str = doc("key prefix inside the bucket", "phalanx")
    endpoint_url: str = doc("S3 endpoint (empty = AWS)", "")
    region: str = doc("S3 region", "us-east-1")
    every_steps: int | Literal["auto"] = doc(_TIER_EVERY_DOC.format(window=200), 200)
    every_s: float = doc(_EVERY_S_DOC, 0.0)
    keep: int = doc("complete steps kept", 2)
    expected_owner: str = doc("AWS account id sent as ExpectedBucketOwner on every request", "")
    sse: str = doc("server-side encryption: '', 'AES256' or 'aws:kms'", "")
    sse_kms_key_id: str = doc("KMS key id when sse is aws:kms", "")

    def __post_init__(self) -> None:
        _check_every_s(self.every_s, "tiers.s3.every_s")
        if not self.enabled:
            return
        _require(bool(self.bucket), "tiers.s3.bucket", "is required when tiers.s3.enabled is true",
                 "set the bucket name or disable the tier")
        _require(self.sse in ("", "AES256", "aws:kms"), "tiers.s3.sse", f"{self.sse!r} is unknown",
                 "use '', 'AES256' or 'aws:kms'")
        _check_tier_every(self.every_steps, "tiers.s3.every_steps", 200)
        _require(self.keep >= 1, "tiers.s3.keep", f"{self.keep} is below 1", "keep at least 1")
        validate_bucket(self.bucket)


@dataclass(frozen=True)
class TiersConfig:
    disk: DiskTierConfig = doc("local disk tier", factory=DiskTierConfig)
    s3: S3TierConfig = doc("S3 tier", factory=S3TierConfig)

    def windows(self, snapshot_every: int | str) -> dict[str, int]:
        """Each enabled tier's window in steps (0: every full snapshot; ``tier_window``)."""
        return {name: tier_window(name, t.every_steps, snapshot_every)
                for name, t in (("disk", self.disk), ("s3", self.s3)) if t.enabled}


@dataclass(frozen=True)
class SparesConfig:
    count: int = doc("warm spare actors kept ready", 1)
    warmup: str = doc("optional 'module:function' or 'path.py:function' run once in each spare", "")
    on_exhausted: Literal["restart", "wait", "fail"] = doc(
        "when no warm spare is left: restart (on a spare still warming up, else a fresh "
        "actor), wait for one, or fail", "restart")
    wait_timeout_s: float = doc("deadline of on_exhausted: wait", 60.0)
    resources: dict[str, float] = doc(
        "Ray resources each spare asks for besides its node's: CPU and GPU become num_cpus "
        "and num_gpus (CPU defaults to job.cpus_per_worker), other names are custom "
        "resources", factory=dict)
    placement: Literal["spread", "nodes"] = doc(
        "spread: over every live node, the least used first; nodes: only on spares.nodes "
        "(dedicated spare nodes)", "spread")
    nodes: list[int] = doc("node indices spares may use with placement: nodes", factory=list)
    replenish: bool = doc("start a replacement spare in the background after each promotion "
                          "(false: the pool shrinks; a parked 'wait' recovery still starts "
                          "the spares it needs)", True)

    def __post_init__(self) -> None:
        _require(self.count >= 0, "spares.count", f"{self.count} is negative", "use 0 or more")
        for name, amount in self.resources.items():
            _require(isinstance(amount, (int, float)) and not isinstance(amount, bool)
                     and amount > 0, f"spares.resources.{name}", f"{amount!r} is not a positive "
                     "number", "give an amount such as 1 or 0.5")
        _require(self.placement in ("spread", "nodes"), "spares.placement",
                 f"{self.placement!r} is unknown", "use spread or nodes")
        _require(self.placement != "nodes" or bool(self.nodes), "spares.nodes",
                 "empty, but spares.placement is nodes", "list the node indices for spares, "
                 "e.g. [2, 3], or use placement: spread")
        _require(self.on_exhausted in ("restart", "wait", "fail"), "spares.on_exhausted",
                 f"{self.on_exhausted!r} is unknown", "use restart, wait or fail")
        _require(self.wait_timeout_s > 0, "spares.wait_timeout_s",
                 f"{self.wait_timeout_s} is not positive", "use e.g. 60")


@dataclass(frozen=True)
class DetectionConfig:
    stall_timeout_s: float = doc("a rank whose step does not advance this long, or 3x the "
                                 "job's longest recent step if longer, is hung (only while "
                                 "inside session.step() and not session.busy())", 10.0)
    poll_interval_s: float = doc("how often the coordinator samples progress", 0.1)
    collective_grace_s: float = doc("a failed collective that no other fault explains (a cut "
                                    "link) becomes a fault after this long; a dead or lost "
                                    "peer is reported sooner and absorbs it", 2.0)
    watch_keepers: bool = doc("hold a TCP connection to every keeper: when it ends and both "
                              "the keeper's and the raylet's ports refuse, the node is lost "
                              "at once instead of after Ray's health checks", True)
    compare_replicas: bool = doc(
        "silent data corruption: at every snapshot step the ranks compare a digest of the "
        "checksums of their replicated state (replicated_state) in one small all-reduce, "
        "within each replica group (every rank under DDP; the ranks of a DDP's `new_group` "
        "group, of an HSDP replica); a rank that differs from the others of its group is "
        "repaired from a healthy peer of that group and every rank "
        "rolls back to the newest step that agreed (kept in the keepers until a newer one "
        "agrees); the commit point advances only over agreeing steps. Needs "
        "snapshot.slots >= 3", True)
    replicated_state: list[str] = doc(
        "names given to session.register() whose state is identical on every rank of a "
        "data-parallel job (model, optimizer); names a job does not register are ignored, "
        "per-rank state (RNGs, data cursors, extras) is never compared",
        factory=lambda: ["model", "optimizer"])

    def __post_init__(self) -> None:
        for name in self.replicated_state:
            _require(isinstance(name, str) and bool(name) and not name.startswith("__"),
                     "detection.replicated_state", f"{name!r} is not a registered name",
                     "list names given to session.register(), e.g. [model, optimizer]")
        _require(self.stall_timeout_s > 0, "detection.stall_timeout_s",
                 f"{self.stall_timeout_s} is not positive", "use e.g. 10")
        _require(self.collective_grace_s > 0, "detection.collective_grace_s",
                 f"{self.collective_grace_s} is not positive", "use e.g. 2")
        _require(0 < self.poll_interval_s < self.stall_timeout_s, "detection.poll_interval_s",
                 f"{self.poll_interval_s} must be positive and below stall_timeout_s",
                 "use e.g. 0.1")


@dataclass(frozen=True)
class CoordinatorConfig:
    standby: bool = doc("a second launcher (`phalanx launch --standby`) may take over: worker, "
                        "keeper and spare actors are detached so they outlive the launcher, "
                        "and the leader publishes its state to etcd; needs etcd.endpoints and "
                        "ray.address (services that outlive the launcher)", False)
    lease_ttl_s: float = doc("the leader's etcd lease: a standby takes over within this long "
                             "after the leader stops", 3.0)

    def __post_init__(self) -> None:
        _require(self.lease_ttl_s >= 1, "coordinator.lease_ttl_s",
                 f"{self.lease_ttl_s} is below 1 s", "use e.g. 3")


@dataclass(frozen=True)
class RecoveryConfig:
    enabled: bool = doc("recover from faults in-process (false: a fault fails the job)", True)
    max_recoveries: int = doc("give up after this many recoveries in one run", 20)
    group_timeout_s: float = doc("timeout of the gloo process group's collectives", 30.0)
    on_worker_exception: str = doc("a rank whose entrypoint raises: replace (a spare takes it "
                                   "from the committed step; the same rank raising again at "
                                   "the same step fails the job) or fail", "replace")
    heal_from_peers: bool = doc("heal a lost rank from live survivors: they keep their state "
                                "(no rollback), the replacement receives the replicated state "
                                "from their memory and its per-rank state from its snapshot; "
                                "false: every rank restores the committed step", True)

    def __post_init__(self) -> None:
        _require(self.max_recoveries >= 0, "recovery.max_recoveries",
                 f"{self.max_recoveries} is negative", "use e.g. 20")
        _require(self.group_timeout_s >= 1, "recovery.group_timeout_s",
                 f"{self.group_timeout_s} is below 1 s", "use e.g. 30")
        _require(self.on_worker_exception in ("replace", "fail"), "recovery.on_worker_exception",
                 f"{self.on_worker_exception!r} is not replace or fail", "use replace or fail")


@dataclass(frozen=True)
class DrillsConfig:
    scenario: str = doc("drill scenario file (configs/drills/*.yaml) injected into this run", "")
    seed: int = doc("seed of probabilistic faults", 0)
    enabled: bool = doc("accept faults from `phalanx drill inject` (always on with a "
                        "scenario); off, a job has no drill hooks at all", False)

    @property
    def active(self) -> bool:
        """Whether this run carries drill hooks: an injector, SIGUSR1, tensor-address files."""
        return self.enabled or bool(self.scenario)


@dataclass(frozen=True)
class SecurityConfig:
    secret_file: str = doc("file holding the job secret (HMAC of manifests, peer auth); "
                           "empty = generated per job", "")


METRICS_PER_RANK_MAX = 10_000    # ranks up to which per-rank metric series may be turned on


@dataclass(frozen=True)
class MetricsConfig:
    port: int = doc("port of the launcher's Prometheus endpoint (/metrics); 0 = off", 0)
    host: str = doc("interface the endpoint listens on", "127.0.0.1")
    per_rank: bool = doc("also export one series per rank (step, heartbeat age; a rank "
                         "label); refused above 10,000 ranks", False)

    def __post_init__(self) -> None:
        _require(0 <= self.port <= 65535, "metrics.port", f"{self.port} is not a TCP port",
                 "use 0 (off) or a free port such as 9400")
        _require(bool(self.host), "metrics.host", "is empty", "use 127.0.0.1 or 0.0.0.0")


@dataclass(frozen=True)
class PhalanxConfig:
    job: JobConfig = doc("the training job", factory=JobConfig)
    etcd: EtcdConfig = doc("control plane", factory=EtcdConfig)
    ray: RayConfig = doc("process placement", factory=RayConfig)
    snapshot: SnapshotConfig = doc("in-memory snapshots", factory=SnapshotConfig)
    replication: ReplicationConfig = doc("copies on other nodes", factory=ReplicationConfig)
    tiers: TiersConfig = doc("persistent checkpoints", factory=TiersConfig)
    spares: SparesConfig = doc("warm spare pool", factory=SparesConfig)
    detection: DetectionConfig = doc("fault detection", factory=DetectionConfig)
    recovery: RecoveryConfig = doc("recovery policy", factory=RecoveryConfig)
    coordinator: CoordinatorConfig = doc("leader election and standby launchers",
                                         factory=CoordinatorConfig)
    drills: DrillsConfig = doc("fault injection", factory=DrillsConfig)
    security: SecurityConfig = doc("secrets", factory=SecurityConfig)
    metrics: MetricsConfig = doc("the launcher's Prometheus endpoint", factory=MetricsConfig)

    def __post_init__(self) -> None:
        if self.coordinator.standby:
            _require(bool(self.etcd.endpoints) and bool(self.ray.address), "coordinator.standby",
                     "true, but the job starts its own etcd and Ray, which end with its "
                     "launcher", "set etcd.endpoints and ray.address to services that outlive "
                     "the launcher, or set coordinator.standby: false")
        if not self.ray.address:
            _require(self.job.nodes <= self.ray.virtual_nodes, "job.nodes",
                     f"{self.job.nodes} nodes but ray.virtual_nodes is {self.ray.virtual_nodes}",
                     "raise ray.virtual_nodes or lower job.nodes")
            spare_cpus = self.spares.resources.get("CPU", self.job.cpus_per_worker)
            need = self.job.world_size * self.job.cpus_per_worker + self.spares.count * spare_cpus
            have = self.ray.virtual_nodes * self.ray.cpus_per_node
            _require(need <= have, "job.world_size",
                     f"{self.job.world_size} workers + {self.spares.count} spares x "
                     f"{self.job.cpus_per_worker} CPUs = {need} CPUs, the Ray cluster offers {have}",
                     "lower job.cpus_per_worker or spares.count, or raise ray.cpus_per_node")
        bad = [n for n in self.spares.nodes if not 0 <= n < self.job.nodes]
        _require(not bad, "spares.nodes", f"{bad} are not node indices of a {self.job.nodes}-node "
                 "job", f"use indices 0..{self.job.nodes - 1}")
        if self.replication.enabled and self.replication.factor > 0:
            _require(self.replication.factor <= self.job.nodes - 1, "replication.factor",
                     f"{self.replication.factor} replicas need {self.replication.factor + 1} nodes, "
                     f"job.nodes is {self.job.nodes}",
                     "raise job.nodes or lower replication.factor (or disable replication)")
        _require(not (self.detection.compare_replicas and self.snapshot.enabled)
                 or self.snapshot.slots >= 3, "detection.compare_replicas",
                 f"true, but snapshot.slots is {self.snapshot.slots}: the newest verified "
                 "step needs a slot of its own", "use snapshot.slots: 3 or more, or set "
                 "detection.compare_replicas: false")
        _require(not self.metrics.per_rank or self.job.world_size <= METRICS_PER_RANK_MAX,
                 "metrics.per_rank", f"true, but job.world_size is {self.job.world_size}: "
                 f"per-rank series are bounded at {METRICS_PER_RANK_MAX:,} ranks",
                 "set metrics.per_rank: false (the job-wide series stay)")
        _require(self.detection.stall_timeout_s > self.etcd.heartbeat_s * 2,
                 "detection.stall_timeout_s",
                 f"{self.detection.stall_timeout_s} is not above 2 x etcd.heartbeat_s",
                 "progress is reported at the heartbeat; allow at least two heartbeats")
