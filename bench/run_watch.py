"""Watching a benchmark run from outside: per-rank progress files read as they grow, a
SIGKILL of one rank at a given step, the run's peak host memory, and small file helpers.

Used by ``bench/vs_torchrun.py`` for torchrun and phalanx alike, so both are watched,
faulted and measured the same way.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable

POLL_S = 0.005             # incremental reads of a few new lines: cheap
FAR_POLL_S = 0.1           # the Killer's poll while the fault step is far
SAMPLE_S = 0.2
# the process tree is walked again every TREE_S (every process's stat file): at every sample
# its CPU time was charged to the system sampled (a launch runs ~40 processes on 2 cores)
TREE_S = 1.0
PAGE = os.sysconf("SC_PAGE_SIZE")


class MemorySampler(threading.Thread):
    """Peak of (private memory of every process descending from ``root`` or sharing a
    session with one) + (growth of /dev/shm since the start), sampled every 0.2 s; the
    processes are found again every ``TREE_S``. ``parts``: that peak split by what holds
    it (``part_of``), so a report can say where a system's memory goes."""

    def __init__(self, root: int) -> None:
        super().__init__(daemon=True)
        self.root, self.peak, self.processes = root, 0, 0
        self.parts: dict[str, int] = {}
        self._halt = threading.Event()
        self._shm_base = _shm_used()

    def run(self) -> None:
        members: dict[int, str] = {}
        found_at = 0.0
        while not self._halt.wait(SAMPLE_S):
            if time.monotonic() - found_at >= TREE_S:
                # named again each time: a Ray worker starts as ray::IDLE, becomes an actor
                members = {pid: part_of(pid, self.root) for pid in process_tree(self.root)}
                found_at = time.monotonic()
                self.processes = max(self.processes, len(members))
            private = {pid: _private_bytes(pid) for pid in members}
            shm = max(0, _shm_used() - self._shm_base)
            total = sum(private.values()) + shm
            if total > self.peak:
                self.peak = total
                parts = {"shared memory": shm} if shm else {}
                for pid, nbytes in private.items():
                    parts[members[pid]] = parts.get(members[pid], 0) + nbytes
                self.parts = parts

    def stop(self) -> int:
        self._halt.set()
        self.join(timeout=5)
        return self.peak


# (part, words any of which its command line holds), first match wins; the rest: "workers"
_PARTS = (("ranks", ("ray::WorkerActor.run",)),
          ("spares", ("ray::WorkerActor",)),
          ("keepers", ("ray::KeeperActor",)),
          ("etcd", ("/etcd ", "etcdbin/etcd")),
          ("ray", ("ray::", "/ray/", "raylet", "gcs_server")),
          ("lighthouse", ("lighthouse",)))


def part_of(pid: int, root: int) -> str:
    """What process ``pid`` of a run is, by its command line: ``launcher`` (the run's own
    first process: torchrun, torchft's supervisor, ``phalanx launch``), ranks, spares,
    keepers, etcd, ray (Ray's own processes), lighthouse, or workers (any other: torchrun's
    and torchft's training processes)."""
    if pid == root:
        return "launcher"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmdline = fh.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return "workers"
    return next((part for part, words in _PARTS if any(w in cmdline for w in words)),
                "workers")


def _shm_used() -> int:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, session id) of every process."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            table[int(entry)] = (int(fields[1]), int(fields[3]))
        except (OSError, IndexError, ValueError):
            continue
    return table


def process_tree(root: int) -> set[int]:
    table = _proc_table()
    members, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _) in table.items():
            if ppid == parent and pid not in members:
                members.add(pid)
                frontier.append(pid)
    sessions = {table[p][1] for p in members if p in table} - {0, 1}
    return members | {pid for pid, (_, sid) in table.items() if sid in sessions}


def _private_bytes(pid: int) -> int:
    """Resident anonymous memory (statm: resident - shared pages)."""
    try:
        with open(f"/proc/{pid}/statm", encoding="ascii") as fh:
            fields = fh.read().split()
        return max(0, int(fields[1]) - int(fields[2])) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


class Killer(threading.Thread):
    """SIGKILLs rank ``target``'s process once ``latest(rank)`` (its last completed step
    and its pid) says it completed ``fault_step``; records when, and how far every rank
    had got (``reached``: steps completed by the furthest rank, read 50 ms after)."""

    def __init__(self, latest: Callable[[int], tuple[int, int | None]], world: int,
                 fault_step: int, target: int) -> None:
        super().__init__(daemon=True)
        self.latest, self.world, self.fault_step = latest, world, fault_step
        self.target = target
        self.killed_at: float | None = None
        self.reached: int | None = None
        self.pid: int | None = None
        self._halt = threading.Event()
        self._seen = (-1, 0.0)              # the last step read, when it was first read
        self._per_step: float | None = None

    def run(self) -> None:
        pause = POLL_S
        while not self._halt.wait(pause):
            step, pid = self.latest(self.target)
            pause = self._pause(step)
            if step >= self.fault_step and pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                self.killed_at, self.pid = time.time(), pid
                time.sleep(0.05)   # let in-flight records land before reading progress
                self.reached = max(self.latest(r)[0] for r in range(self.world)) + 1
                return

    def _pause(self, step: int) -> float:
        """The next poll's wait: ``POLL_S`` from the step before the fault step on, else
        half the time the remaining steps take at the rate seen (at most ``FAR_POLL_S``).
        A watcher waking every 5 ms for a whole run pre-empted the training processes of
        a 2-core host (~5% of the transformer's step time), charged to the system watched."""
        now = time.monotonic()
        if step > self._seen[0]:
            if self._seen[0] >= 0:
                self._per_step = (now - self._seen[1]) / (step - self._seen[0])
            self._seen = (step, now)
        remaining = self.fault_step - step - 1
        if remaining <= 0 or self._per_step is None:
            return POLL_S
        return min(FAR_POLL_S, max(POLL_S, remaining * self._per_step / 2))

    def stop(self) -> None:
        self._halt.set()


class Tail:
    """The JSON lines of a file another process appends to, read incrementally."""

    def __init__(self, path: Path) -> None:
        self.path, self.records = path, []
        self._offset = 0

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except OSError:
            return self.records
        end = data.rfind(b"\n") + 1        # only complete lines
        self._offset += end
        for line in data[:end].splitlines():
            try:
                self.records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return self.records


def json_lines(path: Path) -> list[dict[str, Any]]:
    return Tail(path).read()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def steady_step_s(ends: list[tuple[int, float]], first: int, end: int) -> float | None:
    """Mean seconds per step over steps ``first`` .. ``end - 1`` (each step's time is from
    the previous step's end to its own, so a save between steps counts) of the first pass
    through them (``ends``: (step, epoch end) in the order they ran)."""
    seen: dict[int, float] = {}
    for step, t in ends:
        seen.setdefault(step, t)
    window = [s for s in range(max(1, first), end) if s in seen and s - 1 in seen]
    if not window:
        return None
    return (seen[window[-1]] - seen[window[0] - 1]) / len(window)


def du(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, name))
            except OSError:
                pass
    return total


class Supervised:
    """A run launched as one process tree (torchrun, torchft's supervisor) whose ranks write
    ``<progress>/rank<r>.jsonl`` (``{"event": "start"|"step", "pid", "step", "attempt"}``):
    watched for peak memory and, when ``fault_step`` is set, SIGKILLed at rank ``target``
    once it completed that step of its first attempt."""

    def __init__(self, progress: Path, world: int) -> None:
        self._tails = {r: Tail(progress / f"rank{r}.jsonl") for r in range(world)}
        self.world = world
        self.code: int | None = None
        self.peak = 0
        self.parts: dict[str, int] = {}
        self.processes = 0
        self.killer: Killer | None = None

    def latest(self, rank: int) -> tuple[int, int | None]:
        """(the newest first-attempt step ``rank`` completed or -1, its newest pid)."""
        records = self._tails[rank].read()
        pid = next((r["pid"] for r in reversed(records) if r["event"] == "start"), None)
        steps = [r["step"] for r in records if r["event"] == "step" and r["attempt"] == 0]
        return (steps[-1] if steps else -1), pid

    def run(self, cmd: list[str], cwd: Path, log_path: Path, timeout_s: float,
            stop: Callable[[Any], None], fault_step: int | None = None,
            target: int = 1) -> None:
        """Run ``cmd`` to its end (or ``timeout_s``, then ``stop(proc)``: ``code`` None)."""
        with open(log_path, "w", encoding="utf-8") as log:
            proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
            sampler = MemorySampler(proc.pid)
            sampler.start()
            if fault_step is not None:
                self.killer = Killer(self.latest, self.world, fault_step, target)
                self.killer.start()
            try:
                self.code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.code = None
                stop(proc)
            finally:
                if self.killer is not None:
                    self.killer.stop()
                self.peak = sampler.stop()
                self.parts, self.processes = sampler.parts, sampler.processes
