"""A network partition of one virtual node on one machine: for as long as it lasts, every
TCP connection between the node's processes (its raylet and everything below it: workers,
keeper, spares, agents) and any other process is destroyed by the kernel (SOCK_DESTROY,
``ss -K``), new ones within ``CUT_EVERY_S``, and its listening sockets are closed (the
others' connects are refused); connections inside the node stay. The node's processes keep
running, cut off, as behind a failed switch. After the partition heals they can reach out
again but nobody can reach them: by then phalanx must have fenced the node."""
from __future__ import annotations

import logging
import os
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from phalanx.runtime.base import node_name
from phalanx.configs.errors import ConfigError
from phalanx.launcher.drills.catalogue import FaultEnv, FaultSpec, Mechanism, register

log = logging.getLogger(__name__)
CUT_EVERY_S = 0.05
TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
LISTEN = "0A"


@dataclass(frozen=True)
class Socket:
    local_port: int
    remote_port: int
    inode: int
    listening: bool


def tcp_sockets() -> list[Socket]:
    """Every TCP socket of this network namespace (loopback and others)."""
    found = []
    for table in TCP_TABLES:
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], int(fields[9])
            found.append(Socket(int(local.rsplit(":", 1)[1], 16),
                                int(remote.rsplit(":", 1)[1], 16), inode, state == LISTEN))
    return found


def socket_inodes(pids: Iterable[int]) -> set[int]:
    """The socket inodes the processes ``pids`` hold open."""
    inodes = set()
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:     # exited
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return inodes


def crossing(sockets: list[Socket], inside: set[int]) -> list[tuple[int, int]]:
    """(local port, remote port) of every connected socket with exactly one end inside the
    node (both ends are listed: each is destroyed), and (port, 0) of the node's listening
    sockets (closed: the others' connects are refused, as to a host cut off). Pure: the
    decision of what to cut."""
    by_ports = {(s.local_port, s.remote_port): s for s in sockets if not s.listening}
    cut = [(s.local_port, 0) for s in sockets if s.listening and s.inode in inside]
    for sock in by_ports.values():
        if sock.remote_port == 0:
            continue
        peer = by_ports.get((sock.remote_port, sock.local_port))
        mine = sock.inode in inside
        theirs = peer is not None and peer.inode in inside
        if mine != theirs and (mine or peer is not None):
            cut.append((sock.local_port, sock.remote_port))
    return cut


def destroy(pairs: list[tuple[int, int]]) -> int:
    """Destroy the sockets with these (local, remote) ports ((port, 0): the listener on
    that port); returns how many were asked for."""
    pairs = pairs[:64]
    listeners = [f"sport = :{a}" for a, b in pairs if not b]
    connected = [f"( sport = :{a} and dport = :{b} )" for a, b in pairs if b]
    for state, clauses in ((["state", "listening"], listeners), ([], connected)):
        if clauses:
            subprocess.run(["ss", "-K", "-t", "-n", *state, " or ".join(clauses)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return len(pairs)


class Partition:
    """Cut node processes (``pids()``, read again every round: new ones are cut too) off
    from everything else until ``heal()``."""

    def __init__(self, name: str, pids: Callable[[], list[int]]) -> None:
        self.name = name
        self._pids = pids
        self._stop = threading.Event()
        self.cut = 0
        self.rounds = 0
        self._thread = threading.Thread(target=self._run, name=f"partition-{name}",
                                        daemon=True)

    def start(self) -> "Partition":
        if subprocess.run(["ss", "-K", "-t", "-n", "sport = :1"], capture_output=True,
                          check=False).returncode != 0:
            raise OSError("ss -K (kernel SOCK_DESTROY) is not available: partition_node "
                          "cannot cut sockets on this machine")
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                inside = socket_inodes(self._pids())
                self.cut += destroy(crossing(tcp_sockets(), inside))
            except Exception as exc:  # a round that fails is retried, never ends the cut
                log.warning("event=partition_round_failed node=%s error=%r", self.name, exc)
            self.rounds += 1
            self._stop.wait(CUT_EVERY_S)

    def heal(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join(timeout=5)
        return {"sockets_cut": self.cut, "rounds": self.rounds}


def partition_node(spec: FaultSpec, env: FaultEnv) -> Mapping[str, Any]:
    """Cut node ``spec.node`` off for ``for_s``: phalanx must notice (its workers' leases
    lapse, Ray loses the raylet), fence the node's generation and replace its ranks; the
    cut-off processes must not write anything after the fence."""
    assert spec.node is not None
    local_ray = env.service("ray")
    if local_ray is None or spec.node >= env.config().job.nodes:
        raise ConfigError(f"faults[{spec.index}].target.node", f"{spec.node} is not a "
                          "virtual node of the embedded Ray", "partition a node index of "
                          "a job with ray.address empty")
    node = spec.node
    cut = Partition(node_name(node), lambda: local_ray.node_pids(node)).start()

    def heal() -> None:
        totals = cut.heal()
        env.emit("drill_fault_end", index=spec.index, kind=spec.kind, node=node_name(node),
                 **totals)

    env.later(spec.params["for_s"], heal)
    return {"node": node_name(node), "pids": local_ray.node_pids(node),
            "for_s": spec.params["for_s"], "mechanism": "ss -K every 50 ms"}


register(Mechanism("partition_node", "communication", "node", partition_node,
                   "cut every TCP connection between the node's processes and the rest "
                   "(kernel SOCK_DESTROY) for for_s; its processes keep running",
                   params={"for_s": (float, 10.0)},
                   response=("the node is lost to the others: fenced (new "
                             "generation), its ranks replaced on other nodes")))
