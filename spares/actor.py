"""The worker actor: one Ray actor per rank and per warm spare (a spare is a worker that has
already imported torch and the entrypoint and waits for ``run``). It runs the training
entrypoint with a torchrun-compatible environment and reports its result or traceback.

The launcher imports this module to define the actor class, so the torch side of a worker
(the default group, the session) is imported in the actor's own process, at its warm-up
(``__init__``: a spare pays it before it is promoted, not after), never at import: the
launcher's import of torch held every launch 1.1 s before etcd started
(``tests/unit/test_layers.py``)."""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time
import traceback
from typing import Any

import ray

from phalanx.configs.errors import WorkerFailed
from phalanx.runtime.context import WorkerContext
from phalanx.runtime.logs import DEFAULT_FORMAT, bind_fields, configure_logging
from phalanx.runtime.worker.entrypoint import entry_source, load_entrypoint

log = logging.getLogger(__name__)


@ray.remote(max_restarts=0, max_task_retries=0)
class WorkerActor:
    """Imports torch and the entrypoint at construction (warm), then runs it on ``run()``.

    Called from the launcher's thread through Ray; only plain values cross that boundary.
    """

    def __init__(self, entrypoint: str, torch_threads: int, warmup: str = "",
                 log_format: str = DEFAULT_FORMAT) -> None:
        configure_logging(log_format, logging.INFO)   # the launcher's format, from the start
        os.register_at_fork(after_in_child=_die_with_parent)
        os.environ["OMP_NUM_THREADS"] = str(torch_threads)
        import torch  # warm-up: the import is most of a fresh worker's start-up time

        from phalanx.runtime.group.default_group import group_fault, install
        from phalanx.runtime.worker.session import last_state_digest

        self._install_group, self._state_digest = install, last_state_digest
        self._group_fault = group_fault

        torch.set_num_threads(torch_threads)
        _warm_torch()
        _warm_compiler(entry_source(entrypoint))
        self._entry = load_entrypoint(entrypoint)
        if warmup:
            load_entrypoint(warmup)()  # the user's optional spares.warmup hook
        self._rank = -1
        self._outcome: dict[str, Any] | WorkerFailed | None = None

    def ping(self) -> dict[str, Any]:
        """Who and where this actor is (pid, Ray node)."""
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    def run(self, env: dict[str, str], args: dict[str, Any], log_path: str) -> dict[str, Any]:
        """Run the entrypoint as rank ``env['RANK']``; returns its JSON result.

        Raises ``WorkerFailed`` carrying the worker's traceback when the entrypoint raises.
        """
        self._rank = int(env["RANK"])
        os.environ.update(env)
        _redirect_output(log_path)
        ctx = WorkerContext.from_env(env)
        configure_logging(ctx.log_format, logging.INFO)     # into the rank's log file
        bind_fields(rank=ctx.rank, generation=ctx.generation)   # the Session keeps it live
        log.info("event=worker_run rank=%d pid=%d", self._rank, os.getpid())
        if not ctx.standalone_run:   # the script's init_process_group() builds phalanx's
            self._install_group(ctx)
        try:
            result = self._entry(**args)
        except BaseException as exc:  # process boundary: the traceback becomes the report
            text = traceback.format_exc()
            sys.stderr.write(text)
            sys.stderr.flush()
            self._outcome = WorkerFailed(self._rank, f"{type(exc).__name__}: {exc}", text,
                                         self._group_fault())
            raise self._outcome from None
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        # finished_at (wall clock): when training ended, for the launcher's goodput
        self._outcome = {"rank": self._rank, "pid": os.getpid(), "result": result,
                         "state_digest": self._state_digest(), "finished_at": time.time()}
        return self._outcome

    def result(self) -> dict[str, Any] | None:
        """What ``run`` returned (or raise what it raised). A standby coordinator that took
        over calls this: it queues behind the ``run`` in progress, so it answers when the
        entrypoint ends, or fails with ``RayActorError`` when the actor dies. None when
        ``run`` was never called."""
        if isinstance(self._outcome, WorkerFailed):
            raise self._outcome
        return self._outcome


def _die_with_parent() -> None:
    """A process forked from a worker (a DataLoader's worker processes) is killed when the
    worker dies: else it holds the worker's inherited sockets open, so neither Ray nor the
    gloo peers see the worker die until it notices by itself (seconds later)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):   # not Linux: the child notices its parent by itself
        pass


_PR_SET_PDEATHSIG = 1


def _warm_torch() -> None:
    """Pay torch's lazy first-use costs now, not when promoted: building the first optimizer
    imports torch's compiler stack (about 1.2 s here), the first backward sets up autograd."""
    import torch

    model = torch.nn.Linear(4, 4)
    for optimizer in (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                      torch.optim.AdamW(model.parameters(), lr=0.1)):
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def _warm_compiler(source: str) -> bool:
    """An entrypoint that calls ``torch.compile``: import inductor now. A promoted spare's
    script spent 2.4 s in its ``torch.compile`` call importing it (1.9 s alone on the 2-core
    VM), between forming its group and its first step; the compilation itself is left to
    the script (it needs the model). Others skip it (about 2 CPU-s per worker). Returns
    whether it imported."""
    if "torch.compile(" not in source:
        return False
    import torch._inductor.compile_fx  # noqa: F401  (what torch.compile's first call imports)
    return True


def _redirect_output(log_path: str) -> None:
    """Send this process's stdout/stderr (Python and C level) to the rank's log file (its
    folder made on this machine: the run directory may be the launcher's, elsewhere)."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
