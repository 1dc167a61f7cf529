"""Service faults: the embedded etcd stopped and started again on its port and data (the
job rides it out), and a node's keeper process SIGKILLed while its node lives (the launcher
starts another, the node's workers move to it)."""
from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any, Mapping

from phalanx.runtime.base import node_name
from phalanx.configs.errors import ConfigError, ServiceStartError
from phalanx.launcher.services.etcd_server import STOP_SIGNALS
from phalanx.launcher.drills.catalogue import FaultEnv, FaultSpec, Mechanism, register

log = logging.getLogger(__name__)


def etcd_restart(spec: FaultSpec, env: FaultEnv) -> Mapping[str, Any]:
    """Stop the embedded etcd (``signal``: kill = SIGKILL, a crash; term = SIGTERM, a clean
    stop) and start it again ``down_s`` later on the same client port and data dir."""
    etcd = env.service("etcd")
    where = f"faults[{spec.index}]"
    if etcd is None:
        raise ConfigError(f"{where}.kind", "etcd_restart needs the launcher's embedded etcd",
                          "leave etcd.endpoints empty to drill an etcd restart")
    how, down_s = str(spec.params.get("signal", "kill")), float(spec.params.get("down_s", 2.0))
    if how not in STOP_SIGNALS or down_s < 0:
        raise ConfigError(f"{where}.params", f"signal={how!r} down_s={down_s!r}",
                          f"signal is one of {list(STOP_SIGNALS)}, down_s >= 0")
    endpoint, stopped_at = etcd.endpoint, time.monotonic()
    pid = etcd.stop(how)
    env.emit("etcd_down", pid=pid, signal=how, endpoint=endpoint, down_s=down_s)
    env.later(down_s, lambda: _start_again(env, etcd, spec, stopped_at))
    return {"pid": pid, "signal": how, "down_s": down_s, "endpoint": endpoint}


def _start_again(env: FaultEnv, etcd: Any, spec: FaultSpec, stopped_at: float) -> None:
    began = time.monotonic()
    try:
        etcd.start()
    except ServiceStartError as exc:
        env.emit("etcd_start_failed", index=spec.index, error=str(exc)[:500])
        raise
    env.emit("etcd_up", index=spec.index, pid=etcd.pid, endpoint=etcd.endpoint,
             startup_s=round(time.monotonic() - began, 3),
             down_s=round(time.monotonic() - stopped_at, 3))


def kill_keeper(spec: FaultSpec, env: FaultEnv) -> Mapping[str, Any]:
    """SIGKILL node ``spec.node``'s keeper process; the node and its workers stay up."""
    assert spec.node is not None
    nodes = env.config().job.nodes
    if spec.node >= nodes:
        raise ConfigError(f"faults[{spec.index}].target.node", f"{spec.node} is not a node "
                          "of this job", f"use 0..{nodes - 1}")
    pid = env.keeper_pid(spec.node)
    if pid is None:
        raise ConfigError(f"faults[{spec.index}].target.node", f"node{spec.node} runs no "
                          "keeper", "kill_keeper needs snapshot.enabled: true")
    try:
        os.kill(pid, signal.SIGKILL)
        delivered = True
    except ProcessLookupError:
        delivered = False
        log.warning("event=drill_signal_missed pid=%d signal=SIGKILL", pid)
    return {"node": node_name(spec.node), "pid": pid, "signal": "SIGKILL", "delivered": delivered}


register(Mechanism("etcd_restart", "communication", "role", etcd_restart,
                   "stop the embedded etcd (SIGKILL or SIGTERM) and start it again on the "
                   "same port and data after down_s; the job rides it out",
                   params={"signal": (str, "kill"), "down_s": (float, 2.0)},
                   roles=("etcd",), recovers="none", chaos=True,
                   response=("heartbeats and leases ride it out; lease signals are "
                             "not trusted until 2 TTLs after etcd is back; no rank "
                             "is replaced")))
register(Mechanism("kill_keeper", "availability", "node", kill_keeper,
                   "SIGKILL the node's keeper; a new keeper starts there and its workers "
                   "move to it (the node's in-memory snapshots are lost, replicas remain)",
                   recovers="none", chaos=True,
                   response=("a new keeper starts on that node, replicas are placed "
                             "again and the node's workers reconnect to it through "
                             "etcd; no rank is replaced, no rollback")))
