#!/usr/bin/env python
"""The supervisor of a torchft run of ``bench/vs_torchrun.py``: what torchrun's elastic agent
is to the torchrun twin. It starts torchft's Lighthouse (the ``torchft_lighthouse`` binary of
the torchft wheel) and one ``bench/torchft_train.py`` process per replica group, restarts a
group's process that died (only that one: torchft heals it from a live group while the others
keep training), and exits 0 once every group finished, 1 otherwise.

    python bench/torchft_run.py --replicas 2 --max-restarts 3 -- \\
        --job mlp --job-args '{"steps": 100}' --progress DIR

The Lighthouse runs with the flags of torchft's README (``--min_replicas 1 --quorum_tick_ms
100 --join_timeout_ms 10000``) and its default heartbeat timeout (5 s). A group's process
learns its restart count from ``BENCH_TORCHFT_ATTEMPT``. Processes are polled every 0.1 s,
torchrun's default ``--monitor-interval``.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "bench" / "torchft_train.py"
LIGHTHOUSE_FLAGS = ("--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms",
                    "10000")
MONITOR_S = 0.1
LIGHTHOUSE_START_S = 30.0
EXIT_NO_PEER = 3      # bench/torchft_train.py: no live group left to heal from


class TorchftMissing(RuntimeError):
    """torchft (or its Lighthouse binary) is not installed next to this Python."""


def lighthouse_binary() -> str:
    """The ``torchft_lighthouse`` next to this interpreter (the venv's) or on PATH.

    Raises TorchftMissing with the command that installs it."""
    beside = Path(sys.executable).parent / "torchft_lighthouse"
    found = str(beside) if beside.exists() else shutil.which("torchft_lighthouse")
    if found is None:
        raise TorchftMissing("torchft_lighthouse not found beside " + sys.executable
                             + " nor on PATH: install torchft with `make bench-deps` "
                             "(pip install -c constraints.txt -e '.[bench]')")
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_lighthouse(port: int) -> subprocess.Popen:
    """The Lighthouse on 127.0.0.1:``port``, once it accepts connections.

    Raises TorchftMissing when the binary is missing, RuntimeError when it does not
    listen within 30 s."""
    proc = subprocess.Popen([lighthouse_binary(), *LIGHTHOUSE_FLAGS, "--bind",
                             f"127.0.0.1:{port}"])
    deadline = time.monotonic() + LIGHTHOUSE_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"torchft_lighthouse exited {proc.returncode} at start "
                               "(its output is above)")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc
        except OSError:
            time.sleep(0.05)
    stop([proc])
    raise RuntimeError(f"torchft_lighthouse did not listen on 127.0.0.1:{port} within "
                       f"{LIGHTHOUSE_START_S:.0f} s")


def spawn(replica: int, replicas: int, attempt: int, lighthouse: str,
          train_args: Sequence[str]) -> subprocess.Popen:
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": lighthouse,
           "BENCH_TORCHFT_ATTEMPT": str(attempt), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, str(TRAIN), "--replica", str(replica),
                             "--replicas", str(replicas), *train_args], env=env)


def stop(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM, then SIGKILL what is left after 10 s."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + 10
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def supervise(replicas: int, max_restarts: int, train_args: Sequence[str]) -> int:
    """0 when every replica group's process exited 0; 1 when one failed more than
    ``max_restarts`` times or found no live peer to heal from."""
    port = free_port()
    lighthouse = start_lighthouse(port)
    address = f"http://127.0.0.1:{port}"
    attempts = [0] * replicas
    procs = [spawn(r, replicas, 0, address, train_args) for r in range(replicas)]
    finished: set[int] = set()
    try:
        while len(finished) < replicas:
            time.sleep(MONITOR_S)
            for r, proc in enumerate(procs):
                code = proc.poll()
                if r in finished or code is None:
                    continue
                if code == 0:
                    finished.add(r)
                    continue
                if code == EXIT_NO_PEER or attempts[r] >= max_restarts:
                    print(f"torchft_run: replica group {r} exited {code} (attempt "
                          f"{attempts[r]}); giving up", file=sys.stderr, flush=True)
                    return 1
                attempts[r] += 1
                print(f"torchft_run: replica group {r} exited {code}; restarting it "
                      f"(attempt {attempts[r]})", file=sys.stderr, flush=True)
                procs[r] = spawn(r, replicas, attempts[r], address, train_args)
        return 0
    finally:
        stop([p for p in procs if p.poll() is None] + [lighthouse])


def _on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt   # unwinds through supervise's finally: children stopped


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--max-restarts", type=int, default=3)
    parser.add_argument("train_args", nargs=argparse.REMAINDER,
                        help="after --: the arguments of bench/torchft_train.py")
    args = parser.parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return supervise(args.replicas, args.max_restarts, train_args)
    except TorchftMissing as exc:
        print(f"torchft_run: {exc}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        return 143


if __name__ == "__main__":
    sys.exit(main())
