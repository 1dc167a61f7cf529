"""A node's keeper as every keeper process runs it: the keeper with replication's receiving
ops registered through its op port. The one place that composes the two (the keeper never
imports replication); used by the keeper's Ray actor and by ``python -m phalanx.runtime.node``,
a keeper outside Ray."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Any

from phalanx.configs.errors import ConfigError
from phalanx.runtime.keeper.daemon import Keeper
from phalanx.runtime.keeper.members import NodeMembers
from phalanx.runtime.replication.receiver import ReplicaReceiver


def node_keeper(node: str, job: str, secret: bytes, *args: Any,
                members: NodeMembers | None = None, **kwargs: Any) -> Keeper:
    """A ``Keeper`` (same arguments) that also receives replicas from its peers and, given
    ``members``, holds its node's ranks' member records for its reporter."""
    ops = {**ReplicaReceiver().ops(), **(members.ops() if members is not None else {})}
    return Keeper(node, job, secret, *args, ops=ops, **kwargs)


def main(argv: list[str] | None = None) -> int:
    """``python -m phalanx.runtime.node``: serve until SIGTERM/SIGINT, then close, exit 0."""
    parser = argparse.ArgumentParser(prog="python -m phalanx.runtime.node", description=__doc__)
    for flag in ("--node", "--job", "--secret-file", "--port-file"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--shm-dir", default="/dev/shm")
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--bind-host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    with open(args.secret_file, "rb") as fh:
        secret = fh.read().rstrip(b"\r\n")  # text secrets (hex) end in a newline
    if not secret:
        raise ConfigError("security.secret_file", f"{args.secret_file} is empty",
                          "write a random secret into it")
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    keeper = node_keeper(args.node, args.job, secret, args.shm_dir, args.slots, args.bind_host,
                         port=args.port)
    keeper.start()
    try:
        tmp = f"{args.port_file}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="ascii") as fh:
            fh.write(f"{keeper.address[1]}\n")
        os.replace(tmp, args.port_file)
        while not stop.wait(0.5):
            pass
    finally:
        keeper.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
