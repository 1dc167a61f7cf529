"""Two ranks of a test as two real processes, one rank each as in production: a function of
the test module runs in each (forked from a forkserver that imported torch and phalanx's
group modules once), against a TCPStore master this process hosts. Two ranks as threads of
one process tore their gloo groups down at the same time and aborted the whole pytest
process now and then; here a rank that aborts fails its test only, naming the rank. One
rank per process still aborts in two known cases, which the tests of other scenarios step
around (``Rank.keep``, ``Rank.await_teardowns``)."""
from __future__ import annotations

import datetime
import faulthandler
import importlib.util
import inspect
import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, cast

import torch.distributed as dist

# imported once by the forkserver, so each forked rank starts in milliseconds
PRELOAD = ["torch", "torch.distributed", "phalanx.runtime.group.collective",
           "phalanx.runtime.group.default_group", "pytest", "tests.integration.two_ranks"]
STORE_TIMEOUT = datetime.timedelta(seconds=30)
_GRACE_AFTER_FAILURE_S = 5.0     # the other ranks' time to finish once one rank failed
REAPER = "phalanx-group-reaper"  # the threads of runtime/group/collective.py's _reap
_KEPT: list[Any] = []


class RankFailed(Exception):
    """A rank's function raised something other than an assertion (its traceback is the
    message)."""


@dataclass(frozen=True)
class Rank:
    """What a rank's function gets: its rank, the world size and the harness's TCPStore."""
    rank: int
    world_size: int
    port: int

    def connect(self) -> dist.Store:
        """A new client of the harness's TCPStore (what a Collective takes)."""
        return dist.TCPStore("127.0.0.1", self.port, is_master=False, timeout=STORE_TIMEOUT)

    def signal(self, name: str, store: dist.Store) -> None:
        """Tell the other ranks that ``name`` happened (``await_signal`` sees it)."""
        store.set(f"two_ranks/signal/{name}", "1")

    def await_signal(self, name: str, store: dist.Store) -> None:
        """Block until a rank ``signal``ed ``name`` (raises after the store timeout)."""
        store.wait([f"two_ranks/signal/{name}"], STORE_TIMEOUT)

    def meet(self, name: str, store: dist.Store) -> None:
        """A barrier of every rank on the store, named so that each is used once."""
        if store.add(f"two_ranks/meet/{name}", 1) == self.world_size:
            self.signal(f"meet/{name}", store)
        self.await_signal(f"meet/{name}", store)

    def keep(self, *objects: Any) -> None:
        """Keep ``objects`` (a Collective, a DefaultGroup) until the rank's process ends
        (``os._exit``: nothing is destroyed). Dropping them when the function returns,
        with the peer still up, aborted the rank ("Resource deadlock avoided", seemingly
        a gloo group destroyed on one of its own threads): 20 runs of 20 of the hung-peer
        test of test_default_group.py without it."""
        _KEPT.extend(objects)

    def await_teardowns(self) -> None:
        """Wait until this rank's reaper threads released the abandoned groups, then until
        every rank's did. A peer process exiting while a rank tears down a group it used
        through the DefaultGroup aborts that rank now and then ("Resource deadlock
        avoided", test_group_exit.py): the tests of other scenarios step around it."""
        deadline = time.monotonic() + STORE_TIMEOUT.total_seconds()
        for thread in threading.enumerate():
            if thread.name.startswith(REAPER):
                thread.join(max(0.0, deadline - time.monotonic()))
        self.meet("teardowns-done", self.connect())


def on_ranks(fn: Callable[..., Any], *args: Any, world_size: int = 2,
             timeout_s: float = 60.0, await_teardowns: bool = True) -> list[Any]:
    """Run ``fn(Rank(r, ...), *args)`` in one process per rank and return each rank's
    result (JSON values: tuples come back as lists). ``fn`` must be a module-level
    function. Unless ``await_teardowns`` is false, no rank exits before every rank's
    abandoned groups were torn down (``Rank.await_teardowns``). A rank's failed
    assertion is raised here as an ``AssertionError``, any other error as ``RankFailed``,
    each with the rank's traceback; a rank that crashed (signal, nonzero exit) or outlived
    ``timeout_s`` fails the test naming the rank."""
    if "<locals>" in fn.__qualname__ or "<lambda>" in fn.__qualname__:
        raise TypeError(f"on_ranks runs {fn.__qualname__} in another process: it must be a "
                        f"module-level function of {fn.__module__}")
    with tempfile.TemporaryDirectory(prefix="two-ranks-") as logs:
        return _on_ranks(fn, args, world_size, timeout_s, Path(logs), await_teardowns)


def _on_ranks(fn: Callable[..., Any], args: tuple, world_size: int, timeout_s: float,
              logs: Path, await_teardowns: bool) -> list[Any]:
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=STORE_TIMEOUT)
    context = _context()
    target = f"{inspect.getfile(fn)}:{fn.__module__}:{fn.__qualname__}"
    readers, processes = [], []
    for rank in range(world_size):
        reader, writer = context.Pipe(duplex=False)
        process = context.Process(target=_run_rank, name=f"two-ranks-rank{rank}",
                                  args=(Rank(rank, world_size, master.port), target,
                                        json.dumps(list(args)), writer,
                                        str(logs / f"rank{rank}.log"), await_teardowns))
        process.start()
        writer.close()
        readers.append(reader)
        processes.append(process)
    try:
        reports = _collect(readers, processes, time.monotonic() + timeout_s)
    finally:
        killed = {rank for rank, process in enumerate(processes) if process.is_alive()}
        for rank in killed:
            processes[rank].kill()
        for process in processes:
            process.join(5)
        del master
    outputs = [_tail(logs / f"rank{rank}.log") for rank in range(world_size)]
    for rank, output in enumerate(outputs):   # shown by pytest when the test fails
        if output:
            print(f"--- rank {rank} of {fn.__qualname__}, output:\n{output}")
    for rank, report in reports.items():       # a rank's own error explains the most
        if report is not None and "error" in report:
            error = AssertionError if report["assertion"] else RankFailed
            raise error(f"rank {rank} failed in {fn.__qualname__}:\n{report['error']}")
    # a rank that crashed explains more than one killed while it waited for it
    for rank in sorted(range(world_size), key=lambda rank: rank in killed):
        _check_exit(f"rank {rank} of {fn.__qualname__}", processes[rank].exitcode,
                    rank in killed, timeout_s, outputs[rank])
        if reports[rank] is None:
            raise AssertionError(f"rank {rank} of {fn.__qualname__} exited 0 without a result")
    return [reports[rank]["value"] for rank in range(world_size)]


def _context() -> Any:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def _collect(readers: list[Any], processes: list[Any], deadline: float) -> dict[int, Any]:
    """Each rank's report (None when it sent none), once every rank exited; the ranks
    still running at ``deadline`` (or a short grace after another rank failed) are
    killed."""
    reports: dict[int, Any] = {rank: None for rank in range(len(processes))}
    waiting = {reader: rank for rank, reader in enumerate(readers)}
    waiting.update({process.sentinel: rank for rank, process in enumerate(processes)})
    while waiting and time.monotonic() < deadline:
        ready = multiprocessing.connection.wait(list(waiting), deadline - time.monotonic())
        for handle in ready:
            rank = waiting.pop(handle)
            if handle is readers[rank]:
                reports[rank] = _read(handle)
            elif processes[rank].exitcode is None:
                processes[rank].join(1)
            if _failed(reports[rank], processes[rank]):
                deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE_S)
    return reports


def _read(reader: Any) -> Any:
    try:
        return json.loads(reader.recv_bytes().decode())
    except EOFError:          # the rank died before it reported
        return None
    finally:
        reader.close()


def _failed(report: Any, process: Any) -> bool:
    return (report is not None and "error" in report) or process.exitcode not in (None, 0)


def _check_exit(where: str, code: int | None, killed: bool, timeout_s: float,
                output: str) -> None:
    if killed:
        raise AssertionError(f"{where} did not finish within {timeout_s} s (or a few s after "
                             f"another rank failed) and was killed; its output:\n{output}")
    if code is not None and code < 0:
        raise AssertionError(f"{where} crashed: killed by {signal.Signals(-code).name} "
                             f"(exit code {code}); its last output:\n{output}")
    if code != 0:
        raise AssertionError(f"{where} exited with code {code}; its last output:\n{output}")


def _tail(log: Path, chars: int = 4000) -> str:
    text = log.read_text(errors="replace") if log.exists() else ""
    return text[-chars:]


def _run_rank(rank: Rank, target: str, args: str, writer: Any, log: str,
              await_teardowns: bool) -> None:
    """The rank's process: run the function, send its result or its traceback as JSON.
    Its output goes to ``log`` (the forkserver's inherited stdout is an earlier test's
    capture file); a fatal signal writes the Python stacks there too."""
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    faulthandler.enable()
    try:
        fn = _load(target)
        report = json.dumps({"value": fn(rank, *json.loads(args))})
        if await_teardowns:
            rank.await_teardowns()
    except BaseException as exc:  # the process's boundary: reported to the test
        report = json.dumps({"error": traceback.format_exc(),
                             "assertion": isinstance(exc, AssertionError)})
    writer.send_bytes(report.encode())
    writer.close()


def _load(target: str) -> Callable[..., Any]:
    """The function ``path:module:qualname``, its module loaded from the file (pytest's
    importlib mode names test modules after their path: no import finds them by name)."""
    path, module_name, qualname = target.split(":")
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as {module_name} in the rank's process")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return cast(Callable[..., Any], getattr(module, qualname))
