"""Replication throughput against raw loopback TCP, in one run.

    raw          one socket, ``sendall`` of a preallocated 256 MiB buffer in 4 MiB slices,
                 ``recv_into`` a preallocated (touched) buffer on a thread
    replication  a 256 MiB snapshot (16 random float32 tensors, changed every step so no
                 tensor deduplicates) published to keeper a, pushed by a Replicator to
                 keeper b: offer, chunked push from a's shm with per-chunk digests,
                 stored into b's shm. Seconds are the sender's, pin to acknowledgement.
                 b allocates a new replica buffer for each of the first three pushes
                 (it keeps 2 steps and receives before it evicts); from the fourth on
                 it recycles evicted buffers: that steady state is reported (best and
                 median), the allocating pushes as "cold".
    put_replica  the keeper's plain op (no digests, no dedup) from the same shm slot,
                 into recycled buffers too

Prints a table and one JSON line {raw_gbps, replication_gbps, ratio, ...}; target
ratio >= 0.7. ``python bench/replication_throughput.py [--mib 256] [--json-out f]``.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from phalanx.runtime.keeper.daemon import Keeper, KeeperClient  # noqa: E402
from phalanx.runtime.node import node_keeper  # noqa: E402
from phalanx.runtime.replication.pusher import Replicator  # noqa: E402
from phalanx.runtime.snapshot.format import checksums, make_manifest, plan_layout, write_into  # noqa: E402

SECRET = b"bench-replication-secret-0123456789"
CHUNK = 4 << 20
_ALLOCATING = 3  # pushes for which the receiver allocates a fresh buffer (see above)


def raw_loopback(nbytes: int, repeats: int) -> list[float]:
    """GB/s of plain sendall → recv_into over 127.0.0.1, preallocated buffers."""
    src = bytearray(os.urandom(1 << 20) * (nbytes >> 20))
    dst = bytearray(nbytes)
    listener = socket.create_server(("127.0.0.1", 0))
    rates = []
    try:
        for _ in range(repeats):
            def serve() -> None:
                conn, _ = listener.accept()
                with conn, memoryview(dst) as view:
                    got = 0
                    while got < nbytes:
                        got += conn.recv_into(view[got:got + CHUNK])
                    conn.sendall(b"k")
            thread = threading.Thread(target=serve)
            thread.start()
            with socket.create_connection(listener.getsockname()) as sock, \
                    memoryview(src) as view:
                started = time.perf_counter()
                for at in range(0, nbytes, CHUNK):
                    sock.sendall(view[at:at + CHUNK])
                assert sock.recv(1) == b"k"
                rates.append(nbytes / (time.perf_counter() - started) / 1e9)
            thread.join()
    finally:
        listener.close()
    assert dst == src
    return rates


class _Worker:
    """Publishes snapshots of ``tensors`` into keeper slots like a training process."""

    def __init__(self, keeper: Keeper, job: str, rank: int, tensors: dict[str, torch.Tensor]):
        self.keeper, self.job, self.rank, self.tensors = keeper, job, rank, tensors
        self.layout = plan_layout(tensors)
        self.maps: dict[str, mmap.mmap] = {}
        for path in keeper.alloc(rank, self.layout.total_bytes):
            fd = os.open(path, os.O_RDWR)
            self.maps[path] = mmap.mmap(fd, self.layout.total_bytes)
            os.close(fd)

    def publish(self, step: int) -> None:
        for tensor in self.tensors.values():
            tensor.view(-1)[0] += 1.0  # every tensor changes: nothing deduplicates
        slot, path = self.keeper.claim(self.rank)
        buf = self.maps[path]
        write_into(buf, self.layout, self.tensors)
        sums = checksums(buf, self.layout, workers=2)
        manifest = make_manifest(self.layout, sums, job=self.job, rank=self.rank, step=step,
                                 generation=1, tree_spec={}, created_at=time.time())
        self.keeper.publish(self.rank, step, slot, manifest.sign(SECRET).to_json(),
                            self.layout.total_bytes)

    def close(self) -> None:
        for mm in self.maps.values():
            mm.close()


def replication(nbytes: int, steps: int, digest: str) -> dict:
    job = f"bench{os.getpid()}{digest}"
    numel = nbytes // 16 // 4
    tensors = {f"t{i:02d}": torch.randn(numel) for i in range(16)}
    events: list[dict] = []
    done = threading.Condition()

    def on_event(event: dict) -> None:
        with done:
            events.append(event)
            done.notify_all()

    with node_keeper("a", job, SECRET) as a, node_keeper("b", job, SECRET) as b:
        worker = _Worker(a, job, 0, tensors)
        rep = Replicator(a, "a", secret=SECRET, job=job, chunk_bytes=CHUNK, on_event=on_event,
                         digest=digest)
        rep.set_targets(1, {0: ["b"]}, {"b": b.address})
        rep.start()
        try:
            for step in range(1, steps + 1):
                worker.publish(step)
                with done:
                    ok = done.wait_for(lambda: any(e["step"] == step for e in events), 120)
                assert ok, f"step {step} was not pushed"
            put_s = _put_replica(a, b, job)
        finally:
            rep.close()
            worker.close()
    pushed = [e for e in events if e["event"] == "replica_pushed"]
    assert len(pushed) == steps and all(e["bytes_saved"] == 0 for e in pushed), events
    size = worker.layout.total_bytes
    rates = [size / e["seconds"] / 1e9 for e in pushed]
    steady = rates[_ALLOCATING:]
    return {"bytes": size, "cold_gbps": statistics.median(rates[:_ALLOCATING]),
            "steady_gbps": max(steady), "steady_median_gbps": statistics.median(steady),
            "steady_all": steady, "bytes_sent": pushed[-1]["bytes_sent"],
            "put_replica_gbps": size / put_s / 1e9}


def _put_replica(a: Keeper, b: Keeper, job: str) -> float:
    """Seconds of the keeper's plain put_replica of a's newest slot (b's buffer warm)."""
    _, held = a.pin(0)
    try:
        with held.buf.view(held.used) as view, \
                KeeperClient(*b.address, SECRET, job, role="peer", timeout_s=60) as client:
            best = float("inf")
            for step in range(101, 101 + _ALLOCATING + 3):
                started = time.perf_counter()
                client.put_replica(9, step, held.manifest, view)
                if step >= 101 + _ALLOCATING:
                    best = min(best, time.perf_counter() - started)
    finally:
        a.unpin(held)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--steps", type=int, default=7, help="pushes per digest (>= 4)")
    parser.add_argument("--json-out")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    nbytes = args.mib << 20
    if args.steps <= _ALLOCATING:
        parser.error(f"--steps must exceed {_ALLOCATING}: the first pushes allocate buffers")
    raw = raw_loopback(nbytes, 5)
    runs = {digest: replication(nbytes, args.steps, digest) for digest in ("sum64", "crc32")}
    raw_gbps = max(raw)
    best = runs["sum64"]
    rows = [("raw loopback sendall/recv_into", raw_gbps, "best of 5: " +
             " ".join(f"{r:.2f}" for r in raw))]
    for digest, run in runs.items():
        rows.append((f"replication, {digest} chunk digests", run["steady_gbps"],
                     f"allocating {run['cold_gbps']:.2f}; recycled " +
                     " ".join(f"{r:.2f}" for r in run["steady_all"])))
    rows.append(("keeper put_replica (no digests)", best["put_replica_gbps"],
                 "best of 3, recycled"))
    print(f"\n{args.mib} MiB over loopback, {os.cpu_count()} CPUs")
    print(f"{'path':40s} {'GB/s':>6s}  {'ratio':>5s}  notes")
    for name, gbps, notes in rows:
        print(f"{name:40s} {gbps:6.2f}  {gbps / raw_gbps:5.2f}  {notes}")
    result = {"raw_gbps": round(raw_gbps, 3), "replication_gbps": round(best["steady_gbps"], 3),
              "ratio": round(best["steady_gbps"] / raw_gbps, 3),
              "replication_crc32_gbps": round(runs["crc32"]["steady_gbps"], 3),
              "ratio_crc32": round(runs["crc32"]["steady_gbps"] / raw_gbps, 3),
              "replication_median_gbps": round(best["steady_median_gbps"], 3),
              "replication_allocating_gbps": round(best["cold_gbps"], 3),
              "put_replica_gbps": round(best["put_replica_gbps"], 3),
              "snapshot_bytes": best["bytes"], "cpus": os.cpu_count(), "target_ratio": 0.7}
    print(json.dumps(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
