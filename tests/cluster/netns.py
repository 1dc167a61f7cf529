"""Hosts made of Linux network namespaces on one machine: each namespace is a "host" with
its own private address on a bridge, processes are started inside it with ``ip netns exec``,
and teardown kills every process of every namespace and deletes them, then checks they are
gone. Needs root and ``ip``. Manual use: ``python -m tests.cluster.netns up|down|status``.

    switch namespace <prefix>-sw            host namespaces <prefix>-<i>
    +--------------------------------+      +-------------------------+
    | bridge br0                     |      | eth0 10.231.0.<i+1>/24  |
    |   <prefix>s0 <---- veth ----------->  | lo                      |
    |   <prefix>s1 <---- veth ----------->  | (another host)          |
    +--------------------------------+      +-------------------------+

The bridge lives in its own namespace, so the machine's own interfaces never see these
addresses and nothing outside the namespaces is ever contacted. Cutting a host's cable is
``link(host, up=False)`` on its switch port.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Sequence

DEFAULT_PREFIX = "phxmh"
DEFAULT_SUBNET = "10.231.0"
_CMD_TIMEOUT_S = 20.0


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no ``ip``, no kernel support)."""


@dataclass(frozen=True)
class Host:
    """One namespace host: its namespace, its address and its switch port."""

    index: int
    netns: str
    address: str
    switch_port: str


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip args``; raises RuntimeError naming the command and its stderr."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({proc.returncode}): "
                           f"{proc.stderr.strip()}")
    return proc


def _tc(netns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``tc args`` in ``netns``; raises RuntimeError naming the command and its stderr."""
    proc = subprocess.run(["tc", "-n", netns, *args], capture_output=True, text=True,
                          timeout=_CMD_TIMEOUT_S)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`tc -n {netns} {' '.join(args)}` failed ({proc.returncode}): "
                           f"{proc.stderr.strip()}")
    return proc


def unavailable_reason() -> str:
    """Why namespaces cannot be made here, or "" when they can (tries one and deletes it)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing"
    probe = f"{DEFAULT_PREFIX}-probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return ""


def namespaces(prefix: str) -> list[str]:
    """Namespaces whose name is ``<prefix>-...`` (a cluster's hosts and its switch)."""
    out = _ip("netns", "list").stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return sorted(n for n in names if n.startswith(prefix + "-"))


def namespace_pids(netns: str) -> list[int]:
    """Every process whose network namespace is ``netns``."""
    out = _ip("netns", "pids", netns, check=False).stdout
    return [int(tok) for tok in out.split() if tok.isdigit()]


class NetnsCluster:
    """``count`` namespace hosts on one bridge. ``create()`` raises ``NetnsUnavailable`` or
    RuntimeError; ``destroy()`` is idempotent and checks everything is gone."""

    def __init__(self, count: int, prefix: str = DEFAULT_PREFIX,
                 subnet: str = DEFAULT_SUBNET) -> None:
        if not 1 <= count <= 200:
            raise ValueError(f"NetnsCluster count {count} is outside 1..200")
        if len(prefix) > 8:
            raise ValueError(f"prefix {prefix!r} is longer than 8 (interface names max 15)")
        self.prefix = prefix
        self.switch = f"{prefix}-sw"
        self.hosts = [Host(i, f"{prefix}-{i}", f"{subnet}.{i + 1}", f"{prefix}s{i}")
                      for i in range(count)]
        self._procs: list[subprocess.Popen[bytes]] = []

    def create(self) -> "NetnsCluster":
        reason = unavailable_reason()
        if reason:
            raise NetnsUnavailable(reason)
        if namespaces(self.prefix):
            raise RuntimeError(f"namespaces {namespaces(self.prefix)} exist already; run "
                               f"`python -m tests.cluster.netns down --prefix {self.prefix}`")
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for host in self.hosts:
                self._plug(host)
        except BaseException:
            self.destroy()
            raise
        return self

    def _plug(self, host: Host) -> None:
        _ip("netns", "add", host.netns)
        _ip("-n", host.netns, "link", "set", "lo", "up")
        _ip("link", "add", host.switch_port, "netns", self.switch, "type", "veth",
            "peer", "name", "eth0", "netns", host.netns)
        _ip("-n", self.switch, "link", "set", host.switch_port, "master", "br0")
        _ip("-n", self.switch, "link", "set", host.switch_port, "up")
        _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _ip("-n", host.netns, "link", "set", "eth0", "up")

    # -- processes ------------------------------------------------------------------------

    def spawn(self, host: Host, argv: Sequence[str], *, log: Path,
              env: dict[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside ``host``'s namespace (its own session), output to ``log``."""
        log.parent.mkdir(parents=True, exist_ok=True)
        out: IO[bytes] = open(log, "ab")  # noqa: SIM115 - the child holds it; closed below
        try:
            proc = subprocess.Popen(["ip", "netns", "exec", host.netns, *argv],
                                    stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                    start_new_session=True)
        finally:
            out.close()
        self._procs.append(proc)
        return proc

    def run(self, host: Host, argv: Sequence[str], *, env: dict[str, str] | None = None,
            timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside ``host`` to completion; RuntimeError with its output if it fails."""
        proc = subprocess.run(["ip", "netns", "exec", host.netns, *argv], capture_output=True,
                              text=True, env=env, timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} in {host.netns} failed ({proc.returncode}):\n"
                               f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return proc

    def link(self, host: Host, up: bool) -> None:
        """Plug (``up``) or cut ``host``'s cable at the switch."""
        _ip("-n", self.switch, "link", "set", host.switch_port, "up" if up else "down")

    def degrade(self, host: Host) -> str:
        """Make ``host``'s cable slow and lossy, both ways: ``tc netem`` (20 ms +- 5 ms delay,
        1 % loss) where the kernel has it, else a token bucket (1 Mbit/s with a 16 KiB
        queue: queueing delay, and tail drops that TCP meets as loss; this machine's kernel
        has tbf and htb but no netem). Returns the qdisc in use."""
        kinds = (["netem", "delay", "20ms", "5ms", "loss", "1%"],
                 ["tbf", "rate", "1mbit", "burst", "16kb", "limit", "16kb"])
        for kind in kinds:
            done = [_tc(ns, "qdisc", "replace", "dev", dev, "root", *kind, check=False)
                    for ns, dev in self._cable(host)]
            if all(proc.returncode == 0 for proc in done):
                return " ".join(kind)
            self.restore(host)
        raise RuntimeError(f"neither netem nor tbf can shape {host.netns}'s link: "
                           f"{done[0].stderr.strip()}")

    def restore(self, host: Host) -> None:
        """Take ``degrade`` back: the cable is clean again."""
        for ns, dev in self._cable(host):
            _tc(ns, "qdisc", "del", "dev", dev, "root", check=False)

    def dropped(self, host: Host) -> int:
        """Packets the qdiscs on ``host``'s cable dropped (``tc -s``), both ways."""
        total = 0
        for ns, dev in self._cable(host):
            out = _tc(ns, "-s", "qdisc", "show", "dev", dev, check=False).stdout
            total += sum(int(n) for n in re.findall(r"dropped (\d+)", out))
        return total

    def _cable(self, host: Host) -> list[tuple[str, str]]:
        """Both ends of ``host``'s cable: the switch's port and the host's eth0."""
        return [(self.switch, host.switch_port), (host.netns, "eth0")]

    def power_off(self, host: Host) -> int:
        """A host losing power: its cable cut and SIGKILL to every process in it at once.
        Returns how many processes were killed."""
        self.link(host, up=False)
        return _kill_namespace(host.netns)

    def destroy(self, timeout_s: float = 20.0) -> None:
        """Kill every process of every namespace of this prefix, delete them, check gone."""
        destroy_prefix(self.prefix, timeout_s)
        for proc in self._procs:
            try:
                proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()

    def __enter__(self) -> "NetnsCluster":
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.destroy()


def _kill_namespace(netns: str) -> int:
    pids = namespace_pids(netns)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(pids)


def destroy_prefix(prefix: str, timeout_s: float = 20.0) -> None:
    """Kill every process in the namespaces of ``prefix``, delete the namespaces, and
    raise RuntimeError naming what is still there after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = namespaces(prefix)
        alive = {ns: namespace_pids(ns) for ns in left}
        for ns, pids in alive.items():
            if pids:
                _kill_namespace(ns)
            else:
                _ip("netns", "del", ns, check=False)
        if not left:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"namespaces of {prefix!r} still there after {timeout_s} s: "
                               f"{ {ns: pids for ns, pids in alive.items()} }; kill those pids "
                               f"and run `ip netns del <name>`")
        time.sleep(0.1)


def status(prefix: str) -> dict[str, object]:
    """Each namespace of ``prefix`` with its addresses and process count."""
    found: dict[str, object] = {}
    for ns in namespaces(prefix):
        addrs = _ip("-n", ns, "-4", "-o", "addr", "show", check=False).stdout
        found[ns] = {"addresses": [line.split()[3] for line in addrs.splitlines()
                                   if " lo " not in line],
                     "processes": len(namespace_pids(ns))}
    return found


def main(argv: list[str] | None = None) -> int:
    """``up`` creates the namespaces and starts Ray and etcd in them (``tests.cluster.
    services``), prints the endpoints as JSON and returns (the services keep running);
    ``down`` tears everything of the prefix down; ``status`` lists it."""
    parser = argparse.ArgumentParser(prog="python -m tests.cluster.netns")
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--prefix", default=DEFAULT_PREFIX)
    parser.add_argument("--workdir", default="/tmp/phxmh")
    parser.add_argument("--no-services", action="store_true",
                        help="up: only the namespaces, no Ray or etcd")
    args = parser.parse_args(argv)
    if args.action == "down":
        destroy_prefix(args.prefix)
        print(json.dumps({"down": args.prefix}))
        return 0
    if args.action == "status":
        print(json.dumps(status(args.prefix), indent=2))
        return 0
    cluster = NetnsCluster(args.hosts, prefix=args.prefix).create()
    if args.no_services:
        print(json.dumps({h.netns: h.address for h in cluster.hosts}))
        return 0
    from tests.cluster.services import start_services
    try:
        services = start_services(cluster, Path(args.workdir))
    except BaseException:
        cluster.destroy()
        raise
    print(json.dumps(services.describe(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
