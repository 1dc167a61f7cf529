"""The local Ray the launcher starts when ``ray.address`` is empty: one head raylet that
hosts the control plane and the driver, plus ``virtual_nodes`` raylets each offering the
resource ``phalanx_node_<i>``, so node loss can be drilled on one machine."""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import ray  # the package __init__ set Ray's environment before this import
from ray._private import node as ray_node, ray_constants, services as ray_services
from ray.cluster_utils import Cluster

from phalanx.configs.errors import ServiceStartError
from phalanx.configs.schema import RayConfig

log = logging.getLogger(__name__)

NODE_RESOURCE = "phalanx_node_{}"
# Amount of the node resource each virtual node offers; an actor asks for a sliver of it.
NODE_RESOURCE_UNITS = 1000
START_ATTEMPTS = 3
FIRST_WORK_CHECK_S = 1.0   # how often a node's first work looks for a dead raylet
REGISTERED_POLL_S = 0.02   # how often a starting raylet's record is looked for in the GCS
REGISTERED_WAIT_S = 30.0   # then Ray's own lookup decides (its raylet_start_wait_time_s)
NODE_LOOKUP_S = 5.0        # one of Ray's node lookups answers within this (1-2 s normally)
# A node not registered this long after Ray first looked for it: the attempt is given up
# (all but the last attempt; the last waits Ray's own 30 s). A node registers in 0.5-2 s.
REGISTER_LIMIT_S = 10.0
SPAWN_CHECK_MS = 200   # Ray's wait for the GCS's port file looks for a dead GCS this often
# the logs a failed start keeps (``LocalRay.keep_logs``), by file name prefix
KEPT_LOGS = ("raylet", "gcs_server", "dashboard", "runtime_env_agent", "log_monitor")


class RegistrationStalled(Exception):
    """A starting node unregistered past ``REGISTER_LIMIT_S``: not a ``RuntimeError``, so
    Ray's start does not ask again for the rest of its 30 s but fails, and the launcher
    starts Ray once more."""


class RayProcessDied(Exception):
    """A GCS or raylet that Ray spawned for this start has exited: the attempt cannot
    succeed, so it is given up at once (not a ``RuntimeError``: Ray's start does not take
    it for "not registered yet" and ask again)."""


class Spawns:
    """The processes Ray spawned during one start (``_spawns_kept``): what each said before
    opening its own logs, and whether a GCS or raylet among them died."""

    VITAL = ("gcs_server", "raylet")   # without these the start cannot succeed

    def __init__(self, into: Path) -> None:
        self.into = into
        self.entries: list[tuple[str, Any, Path]] = []   # (type, ProcessInfo, output file)

    def _exited(self) -> list[tuple[str, int, str]]:
        out = []
        for kind, info, path in self.entries:
            code = info.process.poll()
            if code is None:
                continue
            try:
                said = path.read_bytes()[:300].decode("utf-8", "replace").strip()
            except OSError:
                said = ""
            out.append((kind, code, said))
        return out

    def check(self) -> None:
        """Raise ``RayProcessDied`` if a GCS or raylet spawned for this start has exited."""
        dead = [e for e in self._exited() if e[0] in self.VITAL]
        if dead:
            raise RayProcessDied(f"Ray's {dead[0][0]} exited {dead[0][1]} as it started "
                                 f"({self.report()})")

    def report(self) -> str:
        """How many spawned processes run; each exited one's type, status, first words."""
        exited = self._exited()
        return "; ".join([f"{len(self.entries) - len(exited)} of {len(self.entries)} spawned "
                          "Ray process(es) running",
                          *(f"{kind} exited {code}" + (f" saying {said!r}" if said else "")
                            for kind, code, said in exited)])


@contextlib.contextmanager
def _spawns_kept(spawns: Spawns) -> Iterator[Spawns]:
    """While Ray starts: each process Ray spawns with its output sent to /dev/null (the
    GCS, raylets, the log monitor: each redirects its own output once running) writes it
    to ``<spawns.into>/<type>-spawn-<n>.err`` instead, until it opens its own log files; and Ray's
    wait for the GCS's port file gives up as soon as that GCS has died (``Spawns.check``),
    not after Ray's 30 s. Found so: Ray's start-up "stalls" were processes that died at
    once and silently. A GCS aborted (exit -6) within a millisecond of its start, saying
    only ``Epoll1Poller ... epoll_wait error: Bad file descriptor`` (gRPC's poller), and
    Ray waited 30 s for its port file; in other stalls no raylet of the cluster ran and
    none had written a log."""
    original = ray_services.start_ray_process
    original_wait = ray_node.wait_for_persisted_port

    def start_ray_process(command: list[str], process_type: str, *args: Any,
                          **kwargs: Any) -> Any:
        if kwargs.get("stderr_file") is not subprocess.DEVNULL:
            return original(command, process_type, *args, **kwargs)
        path = spawns.into / f"{process_type}-spawn-{len(spawns.entries)}.err"
        with path.open("ab") as sink:     # the child keeps its own copy of the descriptor
            info = original(command, process_type, *args,
                            **{**kwargs, "stdout_file": sink, "stderr_file": sink})
        spawns.entries.append((process_type, info, path))
        return info

    def wait_for_persisted_port(*args: Any, timeout_ms: int, **kwargs: Any) -> Any:
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            spawns.check()
            left_ms = int((deadline - time.monotonic()) * 1000)
            try:
                return original_wait(*args, timeout_ms=max(1, min(SPAWN_CHECK_MS, left_ms)),
                                     **kwargs)
            except RuntimeError:   # "Timed out waiting for file": Ray's own limit decides
                if left_ms <= SPAWN_CHECK_MS:
                    raise

    ray_services.start_ray_process = start_ray_process
    ray_node.wait_for_persisted_port = wait_for_persisted_port
    try:
        yield spawns
    finally:
        ray_services.start_ray_process = original
        ray_node.wait_for_persisted_port = original_wait


@contextlib.contextmanager
def _registration_polled(limit_s: float | None = None,
                         cluster_dir: Path | None = None,
                         spawns: Spawns | None = None) -> Any:
    """While virtual nodes start: Ray's ``Node`` start asks the GCS for the new raylet's
    record (``services.get_node``), and Ray 2.60's lookup sleeps one whole second after a
    miss. Its first look comes 0.1 s after the raylet was spawned, before the raylet
    registered, so every virtual node took 1.1 s to start where it registers in about
    0.5 s. Here the driver's own GCS connection (``ray.nodes()``) is polled every
    ``REGISTERED_POLL_S`` first, and Ray's lookup then finds the record at once. The
    head's lookup (before the driver connects) is left to Ray (bounded: ``bounded_lookup``):
    a first version that polled the starting head with a GCS client of its own met Ray's
    60 s lookup stall in 2 of 13 launches, which says little, as the stall comes without
    it too.

    ``limit_s``: a node still unregistered this long after the first look for it raises
    ``RegistrationStalled`` (None: Ray's own 30 s decide). Ray's start-up stall — the head's
    lookup unanswered, then every fresh lookup too, until Ray's 30 s ran out — hit 3 of 58
    launches of one suite run on this 2-core VM (30-35 s each, where a start takes 4 s);
    it is a dead attempt from its first seconds, so it is given up after ``limit_s``. The
    error says how many raylets of the cluster (processes naming ``cluster_dir``) run: in
    the three stalls whose logs were kept, the head's raylet had written no log at all."""
    original = ray_services.get_node
    first_look: dict[str, float] = {}

    def get_node(gcs_address: str, node_id: str) -> Any:
        if spawns is not None:
            spawns.check()     # a dead raylet never registers: no wait, on any attempt
        now = time.monotonic()
        since = first_look.setdefault(node_id, now)
        if limit_s is not None and now - since > limit_s:
            log.warning("event=ray_node_unregistered node=%s seconds=%.1f", node_id[:12],
                        now - since)
            raylets = "" if cluster_dir is None else (
                f" ({len(running_raylets(cluster_dir))} raylet process(es) of the cluster "
                "running" + ("" if spawns is None else f": {spawns.report()}") + ")")
            raise RegistrationStalled(f"node {node_id[:12]} not registered with Ray's GCS "
                                      f"{now - since:.0f} s after Ray started it{raylets}")
        deadline = now + REGISTERED_WAIT_S
        if limit_s is not None:
            deadline = min(deadline, since + limit_s)
        while ray.is_initialized() and time.monotonic() < deadline \
                and node_id not in {node["NodeID"] for node in ray.nodes()}:
            if spawns is not None:
                spawns.check()
            time.sleep(REGISTERED_POLL_S)
        return bounded_lookup(original, gcs_address, node_id, NODE_LOOKUP_S)

    ray_services.get_node = get_node
    try:
        yield
    finally:
        ray_services.get_node = original


def bounded_lookup(lookup: Callable[[str, str], Any], gcs_address: str, node_id: str,
                   timeout_s: float) -> Any:
    """Ray's node lookup on a thread of its own, given up after ``timeout_s``. Now and then
    the head's lookup gets no answer for its whole 60 s RPC deadline (Ray's start then
    fails and begins again: a minute lost; seen in about one launch in 50 of the suite and
    in 2 of 6 launches of ``bench/startup.py`` before this bound, with or without the
    changes to Ray's start above). Given up, it raises the ``RuntimeError`` that Ray's
    ``Node`` start takes for "not registered yet": Ray asks again with a fresh GCS client,
    until its own 30 s limit (then Ray's start begins again, half a minute sooner). The
    abandoned lookup ends at its deadline on its daemon thread."""
    answer: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            answer["node"] = lookup(gcs_address, node_id)
        except BaseException as exc:  # handed to the caller as it is
            answer["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name="ray-node-lookup", daemon=True).start()
    if not done.wait(timeout_s):
        log.warning("event=ray_node_lookup_stuck node=%s timeout_s=%g", node_id[:12], timeout_s)
        raise RuntimeError(f"no answer to the node lookup within {timeout_s:g} s")
    if "error" in answer:
        raise answer["error"]
    return answer["node"]


def ray_address_dir() -> Path:
    """Where Ray writes its ``ray_current_cluster`` address file whatever the cluster's own
    temp dir: ``<system temp dir>/ray``. Ray never creates that folder, so on a machine that
    never ran Ray (a fresh CI machine, a fresh ``TMPDIR``) every start fails without it."""
    try:
        from ray._common.utils import get_default_ray_temp_dir
        return Path(get_default_ray_temp_dir())
    except ImportError:  # moved between Ray versions: Ray's own rule, written out
        return Path(os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp") / "ray"


def node_resource(index: int) -> str:
    return NODE_RESOURCE.format(index)


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` in the process tree (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited while we looked
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found, frontier = [], [pid]
    while frontier:
        below = children.get(frontier.pop(), [])
        found.extend(below)
        frontier.extend(below)
    return found


def processes_naming(text: str) -> list[int]:
    """Live processes (not this one) that name ``text`` in their command line or hold an
    open file (or their working directory) under it (read from /proc): a Ray process started
    for a cluster names that cluster's temp dir in its arguments
    (``--log_dir=<temp dir>/session_.../logs``), and an agent, which retitles itself
    ``ray::DashboardAgent``, keeps its log files there open (an agent whose raylet was
    SIGKILLed while starting it outlived the launcher: CI, stop 47)."""
    found, needle = [], text.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "cmdline").read_bytes() or _holds_file_under(entry, text):
                found.append(int(entry.name))
        except OSError:  # exited while we looked
            continue
    return found


def _holds_file_under(proc: Path, directory: str) -> bool:
    """Whether the process at ``/proc/<pid>`` has its cwd or an open file under ``directory``."""
    prefix = directory.rstrip("/") + "/"
    links = [proc / "cwd", *(proc / "fd").iterdir()]
    for link in links:
        with contextlib.suppress(OSError):   # an fd closed while we looked
            if (os.readlink(link) + "/").startswith(prefix):
                return True
    return False


def running_raylets(cluster_dir: Path) -> list[int]:
    """Live raylet processes of the cluster whose temp dir is ``cluster_dir``."""
    found = []
    for pid in processes_naming(str(cluster_dir)):
        try:
            argv0 = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0", 1)[0]
        except OSError:  # exited while we looked
            continue
        if argv0.endswith(b"/raylet"):
            found.append(pid)
    return found


def node_indices(node: dict[str, Any], count: int) -> list[int]:
    """The virtual node indices a ``ray.nodes()`` entry offers (by its resources)."""
    return [i for i in range(count) if node_resource(i) in node.get("Resources", {})]


def raylet_addresses(count: int) -> dict[int, tuple[str, int]]:
    """Node index → (host, port) of its live raylet, from Ray's node table."""
    found = {}
    for node in ray.nodes():
        if node.get("Alive") and node.get("NodeManagerPort"):
            for index in node_indices(node, count):
                found[index] = (node["NodeManagerAddress"], int(node["NodeManagerPort"]))
    return found


class LocalRay:
    """Owns a local multi-raylet Ray cluster and this process's driver connection.

    ``start()`` raises ``ServiceStartError``; ``close()`` stops every raylet and removes
    the Ray temp dir. ``remove_node(i)`` kills virtual node ``i`` (drills).
    """

    def __init__(self, cfg: RayConfig, log_to_driver: bool = True,
                 namespace: str | None = None, failed_logs: Path | None = None) -> None:
        self._cfg = cfg
        self._failed_logs = failed_logs   # where a failed start attempt's logs are kept
        self._log_to_driver = log_to_driver
        self._namespace = namespace
        self._cluster: Cluster | None = None
        self._nodes: dict[int, Any] = {}
        self._temp_dir: Path | None = None
        self.attempts = 0   # start-ups begun by the last ``start()`` (1: no retry)
        self.failures: list[str] = []   # why each failed attempt of it failed

    @property
    def address(self) -> str:
        assert self._cluster is not None, "LocalRay not started"
        return self._cluster.address

    @property
    def node_count(self) -> int:
        return len(self._nodes)

    def start(self) -> "LocalRay":
        """Start the cluster; up to ``START_ATTEMPTS`` attempts, each from scratch, when
        Ray's own start-up times out (seen on a loaded 2-core machine: the GCS misses the
        30 s node-info deadline Ray hard-codes; twice in a row once in CI)."""
        self.failures = []
        for attempt in range(1, START_ATTEMPTS + 1):
            self.attempts = attempt
            try:
                return self._start_once(attempt)
            except ServiceStartError as exc:
                self.failures.append(str(exc).splitlines()[0][:300])
                if attempt == START_ATTEMPTS:
                    raise
                log.warning("event=ray_start_retry error=%s", self.failures[-1][:200])
        raise AssertionError("unreachable")

    def _start_once(self, attempt: int) -> "LocalRay":
        # Ray's unix socket paths must stay short: a private dir directly under /tmp.
        self._temp_dir = Path(tempfile.mkdtemp(prefix="phx-ray-", dir="/tmp"))
        ray_address_dir().mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        spawns = Spawns(self._temp_dir)
        try:
            with _spawns_kept(spawns), \
                    _registration_polled(REGISTER_LIMIT_S if attempt < START_ATTEMPTS else None,
                                         self._temp_dir, spawns):
                self._start_raylets()
        except Exception as exc:  # process boundary: any Ray failure becomes one typed error
            if self._failed_logs is not None:   # why Ray's start failed: its own logs
                self.keep_logs(self._failed_logs / f"attempt-{attempt}")
            report = "" if isinstance(exc, RayProcessDied) else f" ({spawns.report()})"
            self.close()
            raise ServiceStartError(f"local Ray did not start: {exc}{report}") from exc
        log.info("event=ray_started nodes=%d seconds=%.2f address=%s", self._cfg.virtual_nodes,
                 time.monotonic() - started, self.address)
        return self

    def _start_raylets(self) -> None:
        """The head (and the driver's connection to it), then each virtual node."""
        self._cluster = Cluster(initialize_head=True, connect=False,
                                head_node_args=self._head_args())
        # connect while the head is the only raylet on 127.0.0.1, so the driver attaches
        # to it and not to whichever virtual node answers first
        ray.init(address=self._cluster.address, log_to_driver=self._log_to_driver,
                 namespace=self._namespace,
                 _node_ip_address="127.0.0.1", logging_level=logging.WARNING,
                 configure_logging=False, include_dashboard=False)
        for index in range(self._cfg.virtual_nodes):
            # one raylet at a time: each starts its own agents, and starting them all at
            # once on a 2-core machine can starve the GCS past Ray's start-up deadlines
            self._nodes[index] = self._cluster.add_node(wait=True, **self._node_args(index))
        self._cluster.wait_for_nodes(timeout=60)

    def first_work(self, refs: list[Any], what: str, timeout_s: float = 60.0) -> list[Any]:
        """The results of the first work the job places on the virtual nodes (its keepers'
        start), looking every ``FIRST_WORK_CHECK_S`` for a raylet that died meanwhile. A
        raylet fate-shares with its agents, and an agent that fails as the node's first
        worker starts takes the raylet with it (seen on a loaded 2-core machine: "the
        raylet exited immediately because one Ray agent failed"); found here within
        seconds, it is one more start-up attempt (``StartupLost``), where waiting on work
        that can never run cost a minute. (A probe task on every node did this before the
        keepers started: 0.9 s of every launch, and a worker process per node.)"""
        deadline = time.monotonic() + timeout_s
        while True:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=FIRST_WORK_CHECK_S)
            dead = [n["NodeID"] for n in ray.nodes() if not n["Alive"]]
            if dead:
                raise ServiceStartError(f"{len(dead)} raylet(s) died while their first "
                                        f"worker started ({what}): "
                                        f"{', '.join(n[:12] for n in dead)} (exit status by "
                                        f"node: {self.raylet_exits()})")
            if len(done) == len(refs):
                return ray.get(refs)
            if time.monotonic() > deadline:
                raise ServiceStartError(f"{len(refs) - len(done)} of {len(refs)} {what} did "
                                        f"not start within {timeout_s:g} s")

    def _head_args(self) -> dict[str, Any]:
        return {
            "num_cpus": 0, "temp_dir": str(self._temp_dir), "include_dashboard": False,
            # no autoscaler: a fixed local cluster has nothing to scale, and its monitor is
            # one more Python process importing Ray on the start-up's two cores
            "no_monitor": True,
            "object_store_memory": self._cfg.object_store_mb * 1024 * 1024,
            "node_ip_address": "127.0.0.1",
            "_system_config": {
                "health_check_period_ms": self._cfg.health_check_period_ms,
                "health_check_failure_threshold": self._cfg.health_check_failure_threshold,
                "health_check_initial_delay_ms": 0,
                "health_check_timeout_ms": self._cfg.health_check_timeout_ms,
            },
        }

    def _node_args(self, index: int) -> dict[str, Any]:
        return {"num_cpus": self._cfg.cpus_per_node, "node_ip_address": "127.0.0.1",
                "resources": {node_resource(index): NODE_RESOURCE_UNITS},
                "object_store_memory": self._cfg.object_store_mb * 1024 * 1024}

    def raylet_exits(self) -> dict[int, int]:
        """The exit status of every virtual node's raylet that has ended (negative: the
        signal that ended it, -9 for SIGKILL), by node index: what a start-up that lost a
        node says about how (a raylet of a loaded 2-core machine dies now and then at its
        node's first worker, with nothing in its own log)."""
        found: dict[int, int] = {}
        for index, node in self._nodes.items():
            for info in node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, []):
                code = info.process.poll()
                if code is not None:
                    found[index] = code
        return found

    def node_pids(self, index: int) -> list[int]:
        """The raylet of virtual node ``index`` and every process below it."""
        node = self._nodes.get(index)
        if node is None:
            return []
        raylets = [info.process.pid for info in
                   node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, [])]
        return raylets + [pid for raylet in raylets for pid in descendants(raylet)]

    def remove_node(self, index: int) -> None:
        """Kill virtual node ``index`` at once, as a machine that loses power: SIGKILL to its
        raylet and, in the same instant, to every process the raylet started (workers,
        keeper, agents). Ray alone kills only the raylet; its workers then notice within
        about a second and exit, later than a real node's processes would."""
        assert self._cluster is not None
        node = self._nodes.pop(index)
        raylets = [info.process.pid for info in
                   node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, [])]
        doomed = [pid for raylet in raylets for pid in descendants(raylet)]
        for pid in raylets + doomed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._cluster.remove_node(node, allow_graceful=False)
        log.info("event=ray_node_removed node=%d processes=%d", index, len(raylets + doomed))

    def close(self) -> None:
        """Disconnect the driver, stop every raylet, kill any process left that names the
        cluster's temp dir, remove the temp dir. Idempotent."""
        if ray.is_initialized():
            ray.shutdown()
        if self._cluster is not None:
            for index in list(self._nodes):   # every process below each raylet, at once:
                for pid in self.node_pids(index):   # one cut off (a drill) may not exit
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            try:
                for node in list(self._cluster.worker_nodes):
                    self._cluster.remove_node(node, allow_graceful=False)
                self._cluster.shutdown()
            except Exception as exc:  # best effort at teardown; report, never mask the cause
                log.warning("event=ray_shutdown_error error=%r", exc)
            self._cluster = None
            self._nodes.clear()
        try:
            getattr(ray._private.utils, "reset_ray_address")()   # absent in some Ray versions
        except Exception:  # noqa: BLE001 - helper moved between Ray versions
            pass
        if self._temp_dir is not None:
            # what no Cluster object owns: a head whose start timed out inside Cluster()
            # left its GCS and raylet running (seen: a retried start's first GCS lived on
            # until the launcher exited)
            for pid in processes_naming(str(self._temp_dir)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None

    def keep_logs(self, dest: Path, tail_bytes: int = 1 << 20) -> list[Path]:
        """Copy the tails of the Ray processes' logs (``KEPT_LOGS``) and of what each wrote
        before opening them (``_spawns_kept``) to ``dest`` (the temp dir with the originals
        goes at ``close``): why Ray declared a node dead, or a raylet died."""
        if self._temp_dir is None:
            return []
        kept = []
        for log_file in sorted([*self._temp_dir.glob("session_latest/logs/*"),
                                *self._temp_dir.glob("*-spawn-*.err")]):
            if not log_file.is_file() or (log_file.parent.name == "logs"
                                          and not log_file.name.startswith(KEPT_LOGS)):
                continue
            dest.mkdir(parents=True, exist_ok=True)
            with log_file.open("rb") as src:
                src.seek(max(0, log_file.stat().st_size - tail_bytes))
                (dest / log_file.name).write_bytes(src.read())
            kept.append(dest / log_file.name)
        return kept

    def __enter__(self) -> "LocalRay":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m phalanx.launcher.services.ray_cluster``: hold a local multi-raylet Ray for jobs that join
    it with ``ray.address`` (a standby launcher needs a Ray that outlives the leader).
    Prints ``{"address": ...}`` as one JSON line, then runs until SIGTERM or Ctrl-C."""
    import argparse
    import json
    import sys

    parser = argparse.ArgumentParser(prog="python -m phalanx.launcher.services.ray_cluster")
    parser.add_argument("--nodes", type=int, default=2, help="virtual nodes")
    parser.add_argument("--cpus-per-node", type=float, default=4.0)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    cfg = RayConfig(virtual_nodes=args.nodes, cpus_per_node=args.cpus_per_node)
    with LocalRay(cfg, log_to_driver=False) as cluster:
        print(json.dumps({"address": cluster.address}), flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
