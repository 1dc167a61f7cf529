"""Process faults: real signals to a rank's worker, a spare, a whole virtual node or the
launcher itself (SIGKILL, SIGSTOP/SIGCONT, SIGUSR1 which makes the worker raise inside
its step)."""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any, Mapping

from phalanx.runtime.base import node_name
from phalanx.configs.errors import ConfigError
from phalanx.launcher.drills.catalogue import FaultEnv, FaultSpec, Mechanism, register

log = logging.getLogger(__name__)
WORKER_EXCEPTION_SIGNAL = signal.SIGUSR1   # the session raises InjectedFault on it


def send(pid: int, sig: int) -> bool:
    """Signal ``pid``; False when it is already gone."""
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        log.warning("event=drill_signal_missed pid=%d signal=%d", pid, sig)
        return False


def rank_pid(spec: FaultSpec, env: FaultEnv) -> int:
    assert spec.rank is not None
    pid = env.rank_pid(spec.rank)
    if pid is None:
        raise ConfigError(f"faults[{spec.index}].target.rank", f"rank {spec.rank} has no "
                          "running worker", f"target a rank below the world size "
                          f"({env.config().job.world_size})")
    return pid


def kill_worker(spec: FaultSpec, env: FaultEnv) -> Mapping[str, Any]:
    pid = rank_pid(spec, env)
    return {"pid": pid, "signal": "SIGKILL", "delivered": send(pid, signal.SIGKILL)}


def worker_exception(spec: FaultSpec, env: FaultEnv) -> Mapping[str, Any]:
    pid = rank_pid(spec, env)
    return {"pid": pid, "signal": "SIGUSR1",
            "delivered": send(pid, WORKER_EXCEPTION_SIGNAL)}


def kill_node(spec: FaultSpec, env: FaultEnv) -> Mapping[str, Any]:
    assert spec.node is not None
    if spec.node >= env.config().job.nodes:
        raise ConfigError(f"faults[{spec.index}].target.node", f"{spec.node} is not a node of "
                          "this job", f"use 0..{env.config().job.nodes - 1}")
    pids = env.node_pids(spec.node)
    env.remove_node(spec.node)
    for pid in pids:     # the node's processes die with it (remove_node kills them too)
        send(pid, signal.SIGKILL)
    return {"node": node_name(spec.node), "worker_pids": pids}


def hang_worker(spec: FaultSpec, env: FaultEnv) -> Mapping[str, Any]:
    pid = rank_pid(spec, env)
    send(pid, signal.SIGSTOP)
    for_s = float(spec.params.get("for_s", 0.0))
    if for_s > 0:
        env.later(for_s, lambda: _resume(env, spec, pid))
    return {"pid": pid, "signal": "SIGSTOP", "for_s": for_s or "until killed"}


def _resume(env: FaultEnv, spec: FaultSpec, pid: int) -> None:
    resumed = send(pid, signal.SIGCONT)
    env.emit("drill_fault_end", index=spec.index, kind=spec.kind, pid=pid, resumed=resumed)


def slow_worker(spec: FaultSpec, env: FaultEnv) -> Mapping[str, Any]:
    """A straggler: the rank's process is stopped ``stop_ms`` of every ``period_ms`` for
    ``for_s`` (a thread of SIGSTOP/SIGCONT), then always left running."""
    pid = rank_pid(spec, env)
    stop_s, period_s = spec.params["stop_ms"] / 1e3, spec.params["period_ms"] / 1e3
    if not 0 < stop_s < period_s:
        raise ConfigError(f"faults[{spec.index}].params.stop_ms", f"{spec.params['stop_ms']} "
                          "is not between 0 and period_ms", "e.g. stop_ms: 60, period_ms: 200")
    until = time.monotonic() + spec.params["for_s"]
    cycles = [0]

    def duty() -> None:
        try:
            while time.monotonic() < until and send(pid, signal.SIGSTOP):
                time.sleep(stop_s)
                send(pid, signal.SIGCONT)
                cycles[0] += 1
                time.sleep(period_s - stop_s)
        finally:
            send(pid, signal.SIGCONT)

    threading.Thread(target=duty, name=f"drill-slow-{pid}", daemon=True).start()
    env.later(spec.params["for_s"] + period_s,
              lambda: env.emit("drill_fault_end", index=spec.index, kind=spec.kind,
                               cycles=cycles[0]))
    return {"pid": pid, "stop_ms": spec.params["stop_ms"], "period_ms": spec.params["period_ms"],
            "for_s": spec.params["for_s"], "slowdown": round(period_s / (period_s - stop_s), 2)}


def kill_spare(spec: FaultSpec, env: FaultEnv) -> Mapping[str, Any]:
    spares = env.spare_pids()
    if not spares:
        raise ConfigError(f"faults[{spec.index}].target.role", "the job has no spare to kill",
                          "set spares.count >= 1 (e.g. overrides: {spares.count: 1})")
    spare_id = sorted(spares)[min(spec.params["which"], len(spares) - 1)]
    pid = spares[spare_id]
    return {"spare": spare_id, "pid": pid, "delivered": send(pid, signal.SIGKILL)}


def kill_coordinator(spec: FaultSpec, env: FaultEnv) -> Mapping[str, Any]:
    """SIGKILL the launcher (this process; the injector wrote the event first); the
    standby launcher (``coordinator.standby``) takes the job over."""
    if not env.config().coordinator.standby:
        raise ConfigError(f"faults[{spec.index}].kind", "kill_coordinator without a standby "
                          "would end the job", "set coordinator.standby: true and run a "
                          "standby (phalanx drill run starts one for scenarios with "
                          "needs: [standby])")
    os.kill(os.getpid(), signal.SIGKILL)
    return {}   # not reached


register(Mechanism("kill_worker", "availability", "rank", kill_worker,
                   "SIGKILL the rank's worker process", chaos=True,
                   response="a warm spare takes the rank from the committed step"))
register(Mechanism("worker_exception", "availability", "rank", worker_exception,
                   "the rank raises InjectedFault inside its current step (SIGUSR1)",
                   chaos=True,
                   response=("the failed worker is killed and replaced "
                             "(recovery.on_worker_exception: replace); the same "
                             "rank raising at the same step again fails the job "
                             "with its traceback")))
register(Mechanism("kill_node", "availability", "node", kill_node,
                   "stop the virtual node: its raylet, workers, keeper and shared memory",
                   chaos=True,
                   response=("the node's ranks restart on spares elsewhere from "
                             "their replicas on other nodes")))
register(Mechanism("kill_spare", "availability", "role", kill_spare,
                   "SIGKILL a warm spare; the pool replaces it", params={"which": (int, 0)},
                   roles=("spare",), recovers="none", chaos=True,
                   response=("the pool's health ping notices and starts a "
                             "replacement; a dead spare is never promoted")))
register(Mechanism("kill_coordinator", "availability", "role", kill_coordinator,
                   "SIGKILL the launcher; the standby takes the job over", roles=("coordinator",),
                   recovers="none", needs=("standby",), ends_launcher=True,
                   response=("the standby launcher takes the job over (same "
                             "workers, keepers and spares)")))
register(Mechanism("hang_worker", "liveness", "rank", hang_worker,
                   "SIGSTOP the rank's process (SIGCONT after for_s; 0 = never)",
                   params={"for_s": (float, 0.0)}, chaos=True,
                   response=("a lapsed lease or stalled progress: the rank is "
                             "killed and a spare takes it")))
register(Mechanism("slow_worker", "liveness", "rank", slow_worker,
                   "a straggler: SIGSTOP/SIGCONT duty cycle on the rank's process",
                   params={"stop_ms": (float, 60.0), "period_ms": (float, 200.0),
                           "for_s": (float, 5.0)}, recovers="none", chaos=True,
                           response=("nothing to recover: a straggler is slow, not "
                                     "dead")))
