"""The worker's drill hooks, installed only when the run has drills on (``drills.enabled`` or
a scenario; ``WorkerContext.drills``):

- SIGUSR1 raises ``InjectedFault`` in the training thread (the ``worker_exception`` drill);
- where the registered CPU tensors live in the address space, written as a small JSON file
  in the run directory (``memory/rank<r>-<worker>.json``) at start and after every restore,
  so the ``corrupt_params`` drill can flip a bit in them from outside the process
  (``phalanx.launcher.drills.faults.memory``). The file names only addresses and sizes,
  never contents;
- a gate at each step a scenario's fault is due at (``WorkerContext.drill_gates``): the rank
  finishes publishing its snapshots, tells the launcher it is held (``busy`` =
  ``gate_reason(step)``) and waits before running the step until the launcher, having
  fired that step's faults, puts ``gate_key(step)``; so ``at_step: N`` hits every rank at
  exactly step N, with no newer snapshot written between a fault and the next."""
from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from phalanx.configs.errors import InjectedFault, MembershipUnavailable
from phalanx.runtime.base import Membership

log = logging.getLogger(__name__)
MEMORY_DIR = "memory"
MAP_FORMAT = 1
GATE_PREFIX = "drills/gate/"
GATE_WAIT_S = 20.0     # a rank held longer goes on (a launcher gone): logged, not raised
GATE_POLL_S = 0.01
# the drill's SIGUSR1 raised while phalanx's own I/O runs (see signals_deferred)
_deferring = 0
_pending: InjectedFault | None = None


def gate_reason(step: int) -> str:
    """What a rank held at ``step``'s gate shows as ``busy`` in its member record."""
    return f"drill gate {step}"


def gate_key(step: int) -> str:
    return f"{GATE_PREFIX}{step}"


def hold_at_gate(membership: Membership, step: int, give_up: Callable[[], bool],
                 wait_s: float = GATE_WAIT_S, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> bool:
    """Wait for the launcher to release ``step``'s gate; True once released, False when
    ``give_up()`` (a newer generation started: the fault already hit) or after ``wait_s``.
    etcd unreachable (an etcd drill at that step): asked again until the deadline."""
    deadline = clock() + wait_s
    while clock() < deadline:
        try:
            with signals_deferred():
                released = membership.get(gate_key(step)) is not None
            if released:
                return True
        except MembershipUnavailable:
            pass
        if give_up():
            return False
        sleep(GATE_POLL_S)
    log.warning("event=drill_gate_timeout step=%d waited_s=%.1f", step, wait_s)
    return False


def map_path(run_dir: str | Path, rank: int, worker_id: str) -> Path:
    return Path(run_dir) / MEMORY_DIR / f"rank{rank}-{worker_id}.json"


def tensor_table(objects: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """{tensor name: address, nbytes, dtype, shape, object} of the registered objects'
    contiguous CPU tensors (the session's own ``__*`` objects left out), in registration
    order. Raises TypeError like a capture would for state that cannot be flattened."""
    # imported here: the launcher imports this module (gate keys) and stays torch-free
    from phalanx.runtime.snapshot.state_tree import flatten_state

    tensors, _ = flatten_state({n: o for n, o in objects.items() if not n.startswith("__")})
    return {name: {"address": t.data_ptr(), "nbytes": t.numel() * t.element_size(),
                   "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                   "object": name.split("/", 1)[0]}
            for name, t in tensors.items()
            if t.device.type == "cpu" and t.is_contiguous() and t.numel() > 0}


def write_memory_map(run_dir: str | Path, rank: int, worker_id: str, generation: int,
                     objects: Mapping[str, Any]) -> Path | None:
    """Write (atomically) this process's map; None when it cannot (logged, not raised: a
    drill aid must never fail training)."""
    path = map_path(run_dir, rank, worker_id)
    try:
        doc = {"format": MAP_FORMAT, "pid": os.getpid(), "rank": rank, "worker_id": worker_id,
               "generation": generation, "written_at": time.time(),
               "tensors": tensor_table(objects)}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(doc, separators=(",", ":")), encoding="utf-8")
        os.replace(tmp, path)
    except (OSError, TypeError) as exc:
        log.warning("event=memory_map_not_written rank=%d path=%s error=%r", rank, path, exc)
        return None
    return path


def read_memory_maps(run_dir: str | Path, rank: int) -> list[dict[str, Any]]:
    """Every map written for ``rank`` in the run (one per worker that held it), newest
    first; unreadable files are skipped."""
    found = []
    for path in (Path(run_dir) / MEMORY_DIR).glob(f"rank{rank}-*.json"):
        try:
            found.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    return sorted((d for d in found if isinstance(d, dict) and d.get("rank") == rank),
                  key=lambda d: float(d.get("written_at", 0)), reverse=True)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """The drill's ``InjectedFault`` raised at the block's end, not inside it: phalanx's
    own waits at a drill gate (an etcd read over gRPC, a snapshot's publish) are where the
    signal lands, and raised inside them it left their state half-changed (the publish's
    wait kept the exception as the publish's error and went on; the rank then stalled and
    the other ranks' all-reduce timed out after 30 s: a fresh clone's ``mixed`` drill).
    A script's own code, where a real bug raises, is never inside this block."""
    global _deferring, _pending
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
        if not _deferring and _pending is not None:
            pending, _pending = _pending, None
            raise pending


def raise_on_sigusr1() -> None:
    """A drill's ``worker_exception`` fault: SIGUSR1 makes the training thread raise
    ``InjectedFault`` wherever it is in its step, as a real bug or a device error would
    (after phalanx's own I/O under way: ``signals_deferred``). Only from the main thread
    (where Python runs signal handlers)."""
    def handler(signum: int, frame: object) -> None:
        global _pending
        fault = InjectedFault(f"drill: worker_exception injected with signal {signum}")
        if _deferring:
            _pending = fault
            return
        raise fault

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, handler)
