"""Ray and etcd on a ``NetnsCluster``, started the ordinary multi-host way: a 3-member etcd
cluster on hosts 0-2 (``--initial-cluster``), a Ray head on host 0 (``ray start --head``,
no CPUs: it hosts the launcher) and one raylet per other host (``ray start --address``)
offering ``phalanx_node_<i>``; host ``i + 1`` is phalanx node ``i``.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.cluster.netns import Host, NetnsCluster, namespace_pids

RAY_PORT = 6379
ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380
NODE_RESOURCE_UNITS = 1000   # what the launcher's own virtual nodes offer (ray_cluster.py)
ETCD_MEMBERS = 3
RAY_COMMON = ["--disable-usage-stats", "--object-store-memory", str(80 * 2**20)]


@dataclass(frozen=True)
class ClusterServices:
    """Where the services of a namespace cluster answer, and how to run a launcher there."""

    cluster: NetnsCluster
    workdir: Path
    ray_address: str
    etcd_endpoints: tuple[str, ...]
    etcd_hosts: tuple[Host, ...]
    node_hosts: tuple[Host, ...]          # phalanx node i runs on node_hosts[i]
    etcd_argv: tuple[tuple[str, ...], ...] = field(repr=False)
    etcd_procs: dict[int, subprocess.Popen[bytes]] = field(repr=False)   # member → process
    env: dict[str, str] = field(repr=False)
    cpus_per_node: int = 2

    @property
    def launcher_host(self) -> Host:
        return self.cluster.hosts[0]

    def describe(self) -> dict[str, object]:
        return {"ray_address": self.ray_address, "etcd_endpoints": list(self.etcd_endpoints),
                "nodes": {i: h.address for i, h in enumerate(self.node_hosts)},
                "launcher_host": self.launcher_host.netns, "workdir": str(self.workdir)}

    def job_overrides(self) -> dict[str, object]:
        """Config keys that point a job at this cluster."""
        return {"ray": {"address": self.ray_address},
                "etcd": {"endpoints": list(self.etcd_endpoints)}}

    def write_config(self, base: Path, dest: Path, extra: dict[str, object]) -> Path:
        """``base`` (a YAML job config) with ``extra`` and this cluster's keys merged in."""
        data = yaml.safe_load(base.read_text()) or {}
        for key, value in {**extra, **self.job_overrides()}.items():
            if isinstance(value, dict) and isinstance(data.get(key), dict):
                data[key] = {**data[key], **value}
            else:
                data[key] = value
        dest.write_text(yaml.safe_dump(data, sort_keys=False))
        return dest

    def kill_etcd(self, member: int) -> None:
        """SIGKILL etcd member ``member`` (its host lives on)."""
        proc = self.etcd_procs[member]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def restart_etcd(self, *members: int, timeout_s: float = 30.0) -> None:
        """Start killed members again on their data dirs; waits until the cluster is
        healthy."""
        for member in members:
            self.etcd_procs[member] = self.cluster.spawn(
                self.etcd_hosts[member], self.etcd_argv[member],
                log=self.workdir / "logs" / f"etcd{member}.log", env=self.env)
        wait_etcd_healthy(self.cluster, self.etcd_hosts[members[0]], self.etcd_endpoints,
                          self.env, timeout_s)

    def read_host_file(self, node: int, path: Path) -> str:
        """A file as phalanx node ``node``'s processes see it (its private ``runs``
        folder), read in its raylet's mount namespace."""
        host = self.node_hosts[node]
        raylets = [pid for pid in namespace_pids(host.netns) if "raylet/raylet" in _cmdline(pid)]
        assert raylets, f"no raylet runs in {host.netns}"
        proc = subprocess.run(["nsenter", "--target", str(raylets[0]), "--mount", "cat",
                               str(path)], capture_output=True, text=True, timeout=10)
        if proc.returncode != 0:
            raise RuntimeError(f"{path} on {host.netns}: {proc.stderr.strip()}")
        return proc.stdout

    def ensure_raylet(self, node: int, timeout_s: float = 60.0) -> bool:
        """When Ray no longer counts every node alive, start phalanx node ``node``'s raylet
        again, as an operator does on a host that Ray declared dead: its Ray processes are
        killed, then ``ray start --address``; waits until Ray counts the node alive. Not
        ``ray stop``: it would stop every host's Ray on this machine. Returns whether it
        had to."""
        if alive_nodes(self) == len(self.node_hosts) + 1:
            return False
        host = self.node_hosts[node]
        etcd = {proc.pid for proc in self.etcd_procs.values()}
        for pid in namespace_pids(host.netns):
            if pid not in etcd and "ray" in _cmdline(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        serial = len(list(self.workdir.glob(f"r{host.index}*")))
        start_raylet(self.cluster, host, node, self.ray_address,
                     self.workdir / f"r{host.index}.{serial}", self.env, self.cpus_per_node)
        deadline = time.monotonic() + timeout_s
        while alive_nodes(self) < len(self.node_hosts) + 1:
            if time.monotonic() > deadline:
                raise RuntimeError(f"Ray does not count {host.netns}'s raylet alive")
            time.sleep(0.3)
        return True


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def alive_nodes(services: ClusterServices) -> int:
    """How many Ray nodes (the head included) the GCS counts alive, asked on host 0."""
    proc = services.cluster.run(services.launcher_host, [sys.executable, "-c", (
        "import ray; ray.init(address=%r, logging_level='ERROR'); "
        "print(sum(n['Alive'] for n in ray.nodes()))") % services.ray_address],
        env=services.env, timeout_s=60)
    return int(proc.stdout.strip().splitlines()[-1])


def host_env(workdir: Path) -> dict[str, str]:
    """The environment of every process started in a namespace host: a private temp dir
    (Ray's address file lands there, not in the machine's /tmp/ray), Ray without token auth
    or usage reports, gloo on the host's own interface (the machine's hostname resolves to
    127.0.0.1, which would make gloo listen on loopback), no ETCD_* variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ETCD_", "RAY_"))}
    (workdir / "t").mkdir(parents=True, exist_ok=True)
    env.update({"TMPDIR": str(workdir / "t"), "RAY_AUTH_MODE": "disabled",
                "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0",
                "GLOO_SOCKET_IFNAME": "eth0", "PYTHONUNBUFFERED": "1"})
    return env


def _bin(name: str) -> str:
    path = Path(sys.executable).parent / name
    if not path.exists():
        raise RuntimeError(f"{name} not found next to {sys.executable}; install the test "
                           "extras (make install)")
    return str(path)


def wait_etcd_healthy(cluster: NetnsCluster, host: Host, endpoints: tuple[str, ...],
                      env: dict[str, str], timeout_s: float) -> None:
    """Until every member of ``endpoints`` answers ``etcdctl endpoint health`` from ``host``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            cluster.run(host, [_bin("etcdctl"), f"--endpoints={','.join(endpoints)}",
                               "--dial-timeout=2s", "endpoint", "health"], env=env, timeout_s=10)
            return
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def start_etcd(cluster: NetnsCluster, workdir: Path, env: dict[str, str], timeout_s: float = 30.0
               ) -> tuple[tuple[Host, ...], tuple[str, ...], list[list[str]],
                          dict[int, subprocess.Popen[bytes]]]:
    """Three etcd members on hosts 0..2; waits until the cluster answers."""
    hosts = tuple(cluster.hosts[:ETCD_MEMBERS])
    peers = ",".join(f"e{h.index}=http://{h.address}:{ETCD_PEER_PORT}" for h in hosts)
    argvs, procs = [], {}
    for host in hosts:
        client = f"http://{host.address}:{ETCD_CLIENT_PORT}"
        peer = f"http://{host.address}:{ETCD_PEER_PORT}"
        # election timeout 1 s: three members on a loaded 2-core machine must not re-elect
        # a leader every time a process starts
        argv = [_bin("etcd"), f"--name=e{host.index}", "--data-dir",
                             str(workdir / f"etcd{host.index}"),
                             f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
                             f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
                             f"--initial-cluster={peers}", "--initial-cluster-state=new",
                             "--initial-cluster-token=phxmh", "--heartbeat-interval=100",
                "--election-timeout=1000", "--log-level=warn"]
        argvs.append(argv)
        procs[host.index] = cluster.spawn(host, argv, env=env,
                                          log=workdir / "logs" / f"etcd{host.index}.log")
    endpoints = tuple(f"{h.address}:{ETCD_CLIENT_PORT}" for h in hosts)
    wait_etcd_healthy(cluster, hosts[0], endpoints, env, timeout_s)
    return hosts, endpoints, argvs, procs


def runs_dir(workdir: Path) -> Path:
    """Where the cluster's jobs keep their run directories (``job.run_dir``)."""
    return workdir / "runs"


def private_folder(folder: Path) -> list[str]:
    """A command prefix that runs the command, and every process it starts (a raylet and
    its workers), with an empty tmpfs of its own over ``folder``: a host that does not
    share the launcher's filesystem there."""
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mount -t tmpfs -o size=512m phalanx-private "$0" && exec "$@"', str(folder)]


def start_raylet(cluster: NetnsCluster, host: Host, node: int, address: str, temp_dir: Path,
                 env: dict[str, str], cpus_per_node: int) -> None:
    """``ray start --address`` on ``host``: a raylet offering ``phalanx_node_<node>``,
    whose processes see a private, empty ``runs`` folder: ranks and keepers write their
    logs and disk-tier files on their own host, as on machines without a shared
    filesystem (the launcher gathers the logs through the keepers)."""
    resources = json.dumps({f"phalanx_node_{node}": NODE_RESOURCE_UNITS})
    cluster.run(host, [*private_folder(runs_dir(temp_dir.parent)),
                       _bin("ray"), "start", "--address", address, "--node-ip-address",
                       host.address, "--num-cpus", str(cpus_per_node), "--resources",
                       resources, "--temp-dir", str(temp_dir), *RAY_COMMON], env=env)


def start_ray(cluster: NetnsCluster, workdir: Path, env: dict[str, str], cpus_per_node: int,
              system_config: dict[str, int]) -> tuple[str, tuple[Host, ...]]:
    """A Ray head on host 0 and one raylet on each other host, one at a time."""
    head = cluster.hosts[0]
    address = f"{head.address}:{RAY_PORT}"
    cluster.run(head, [_bin("ray"), "start", "--head", "--node-ip-address", head.address,
                       "--port", str(RAY_PORT), "--num-cpus", "0", "--include-dashboard",
                       "false", "--temp-dir", str(workdir / "r0"),
                       "--system-config", json.dumps(system_config), *RAY_COMMON], env=env)
    nodes = tuple(cluster.hosts[1:])
    for index, host in enumerate(nodes):
        start_raylet(cluster, host, index, address, workdir / f"r{host.index}", env,
                     cpus_per_node)
    return address, nodes


def start_services(cluster: NetnsCluster, workdir: Path, *, cpus_per_node: int = 2,
                   system_config: dict[str, int] | None = None) -> ClusterServices:
    """etcd, then Ray; raises RuntimeError naming what did not start (the caller tears the
    cluster down)."""
    if len(cluster.hosts) < ETCD_MEMBERS:
        raise ValueError(f"a cluster of {len(cluster.hosts)} hosts cannot hold "
                         f"{ETCD_MEMBERS} etcd members")
    runs_dir(workdir).mkdir(parents=True, exist_ok=True)
    env = host_env(workdir)
    etcd_hosts, endpoints, argvs, procs = start_etcd(cluster, workdir, env)
    # the launcher's own defaults (configs/schema.py RayConfig): a killed node is declared
    # dead within period x threshold
    config = system_config or {"health_check_period_ms": 500,
                               "health_check_failure_threshold": 5,
                               "health_check_initial_delay_ms": 0,
                               "health_check_timeout_ms": 10000}
    address, nodes = start_ray(cluster, workdir, env, cpus_per_node, config)
    return ClusterServices(cluster, workdir, address, endpoints, etcd_hosts, nodes,
                           tuple(tuple(a) for a in argvs), procs, env, cpus_per_node)
