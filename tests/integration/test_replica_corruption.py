"""Bits flipped in flight between two real keepers (a LinkProxy in front of the holder):
a corrupted replica chunk, push header or manifest is refused by the receiver with
SnapshotCorrupt, never stored, and the sender's next push stores bytes that verify."""
from __future__ import annotations

import itertools
import json
import logging
import os
import threading
from typing import Iterator

import pytest

from phalanx.launcher.drills.link_proxy import LinkProxy
from phalanx.runtime.replication import wire as replica_wire
from phalanx.runtime.node import node_keeper
from phalanx.runtime.keeper.daemon import KeeperClient, owned_names
from phalanx.runtime.replication.pusher import Replicator
from phalanx.runtime.snapshot.format import Manifest, read_tensors
from tests.integration.test_replication import SECRET, SHM, _Events, _tensors, _wait, _Worker

pytestmark = pytest.mark.integration

CHUNK = 16 << 10
SIZES = (16384, 4096)      # 80 KiB of float32: under OFFER_MIN_BYTES, one frame per push
_names = itertools.count()


@pytest.fixture
def link() -> Iterator[dict]:
    """Keepers a and b, b behind a LinkProxy, and a Replicator on a pushing rank 0 to b
    through it; checks that nothing (shm files, threads) is left behind."""
    job = f"rc{os.getpid()}-{next(_names)}"
    keepers = {node: node_keeper(node, job, SECRET, SHM, slots=2, timeout_s=2.0).start()
               for node in "ab"}
    proxy = LinkProxy(keepers["b"].address, name="rc").start()
    worker = _Worker(keepers["a"], 0, _tensors(21, SIZES))
    events = _Events()
    rep = Replicator(keepers["a"], "a", secret=SECRET, job=job, poll_s=0.01, timeout_s=2.0,
                     chunk_bytes=CHUNK, max_backoff_s=0.1, on_event=events)
    rep.set_targets(1, {0: ["b"]}, {"b": proxy.address})
    rep.start()
    try:
        yield {"keepers": keepers, "proxy": proxy, "worker": worker, "events": events,
               "rep": rep}
    finally:
        rep.close()
        worker.close()
        proxy.close()
        for keeper in keepers.values():
            keeper.close()
        for keeper in keepers.values():
            assert owned_names(SHM, keeper.prefix) == []
        assert not [t.name for t in threading.enumerate()
                    if t.name.startswith(("replicate-", "link-rc-"))]


def _publish(ctx: dict, step: int) -> bytes:
    ctx["worker"].tensors["p0"][0] = float(step)
    return ctx["worker"].publish(step, keep=True)


def _stored(ctx: dict, step: int) -> tuple[bytes, bytes]:
    b = ctx["keepers"]["b"]
    with KeeperClient(*b.address, SECRET, b.job, generation=1) as client:
        got_step, manifest, payload = client.get(0, step)
    assert got_step == step
    return manifest, bytes(payload)


def _assert_verifies(ctx: dict, step: int, payload: bytes) -> None:
    manifest, stored = _stored(ctx, step)
    assert stored == payload
    parsed = Manifest.from_json(manifest)
    parsed.verify(SECRET)
    assert (parsed.rank, parsed.step) == (0, step)
    read_tensors(stored, verify_against=parsed)


def _frame_layout(ctx: dict, step: int) -> tuple[int, int]:
    """(header bytes incl. its 4-byte length, manifest bytes) of the push of ``step``,
    rebuilt the way ReplicaLink.push writes it (the check is 32 hex characters)."""
    a = ctx["keepers"]["a"]
    _, held = a.pin(0, step)
    try:
        manifest, size = held.manifest, held.used
    finally:
        a.unpin(held)
    header = {"op": "replica_push", "rank": 0, "step": step, "size": size, "generation": 1,
              "manifest_nbytes": len(manifest), "chunk_bytes": CHUNK, "digest": "sum64",
              "reuse": [], "nbytes": replica_wire.push_nbytes(len(manifest), [(0, size)], CHUNK),
              "check": "0" * 32}
    return 4 + len(json.dumps(header, separators=(",", ":"))), len(manifest)


def _refused_then_stored(ctx: dict, step: int, payload: bytes, caplog) -> dict:
    events = ctx["events"]
    failed = events.wait(lambda e: e["event"] == "replica_failed" and e["step"] == step)
    pushed = events.wait(lambda e: e["event"] == "replica_pushed" and e["step"] == step)
    assert "SnapshotCorrupt" in failed["error"] and not failed["preempted"], failed
    # the receiver logs the rank and step the (possibly flipped) header names
    refused = [r for r in caplog.records if r.getMessage().startswith("replica.refused node=b")]
    assert refused and refused[0].levelno == logging.WARNING
    assert pushed["target"] == "b" and ctx["rep"].replicated_steps(0) >= {step}
    _assert_verifies(ctx, step, payload)
    assert set(ctx["keepers"]["b"].holdings()) == {0}     # nothing stored under another rank
    return failed


@pytest.mark.timeout(60)
def test_corrupted_chunk_is_refused_and_the_next_push_verifies(link, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="phalanx.runtime.replication.receiver")
    _assert_verifies(link, 1, _stored_after(link, 1))
    header, manifest = _frame_layout(link, 1)
    link["proxy"].corrupt(1, skip_bytes=header + manifest + CHUNK + 100, bit=3)
    payload = _publish(link, 2)
    failed = _refused_then_stored(link, 2, payload, caplog)
    assert "digest" in failed["error"]
    assert link["proxy"].stats()["chunks_corrupted"] == 1
    assert link["keepers"]["b"].holdings()[0]["replica"] == [1, 2]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("region", ["rank", "step", "manifest"])
def test_corrupted_header_or_manifest_is_refused(link, caplog, region: str) -> None:
    """A flip that keeps the header valid JSON (rank 0 -> 1, step 2 -> 3) or damages the
    signed manifest: only the push's check notices it before the replica is stored."""
    caplog.set_level(logging.WARNING, logger="phalanx.runtime.replication.receiver")
    _stored_after(link, 1)
    header, manifest = _frame_layout(link, 1)
    offsets = {"rank": 4 + len('{"op":"replica_push","rank":'),
               "step": 4 + len('{"op":"replica_push","rank":0,"step":'),
               "manifest": header + manifest // 2}
    link["proxy"].corrupt(1, skip_bytes=offsets[region], bit=0)
    payload = _publish(link, 2)
    failed = _refused_then_stored(link, 2, payload, caplog)
    assert "check" in failed["error"], failed
    assert link["keepers"]["b"].holdings()[0]["replica"] == [1, 2]   # no step 3 either


@pytest.mark.timeout(120)
def test_any_flipped_bit_is_refused_or_harmless(link) -> None:
    """Flips spread over a whole push frame (length prefix, header, manifest, chunks,
    digests): whatever happens to that push, what b ends up holding verifies."""
    _stored_after(link, 1)
    header, manifest = _frame_layout(link, 1)
    total = header + manifest + 80 * 1024 + 8 * 6
    offsets = [0, 3, 10, 40, header - 20, header - 2, header + 5, header + manifest - 3,
               header + manifest + 7, header + manifest + CHUNK + 2, total - 40, total - 3]
    for n, offset in enumerate(offsets):
        step = 2 + n
        link["proxy"].corrupt(1, skip_bytes=offset, bit=(0, 4, 7)[n % 3])
        payload = _publish(link, step)
        _wait(lambda s=step: s in link["rep"].replicated_steps(0), timeout=15)
        _assert_verifies(link, step, payload)
        assert set(link["keepers"]["b"].holdings()) == {0}
    assert link["proxy"].stats()["chunks_corrupted"] == len(offsets)


def _stored_after(ctx: dict, step: int) -> bytes:
    """Publish ``step`` cleanly and wait until b acknowledged it (warms the connection)."""
    payload = _publish(ctx, step)
    _wait(lambda: step in ctx["rep"].replicated_steps(0))
    return payload
