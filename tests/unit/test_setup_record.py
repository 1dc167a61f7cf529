"""A rank's set-up collective results, kept for the rank that replaces it
(``runtime.group.setup_record``): raw bytes under a JSON record, one blob per distinct
result, limits that keep object payloads and leave DDP's model broadcast out, and a
replay that refuses a record whose tensors are not the call's. On torch's own in-process
store (``HashStore``), the interface the launcher's TCPStore has."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from phalanx.runtime.group.setup_record import (CALL_LIMIT, EPOCH_CALL_LIMIT, SetupRecord,
                                                decode_into, encode)

pytestmark = pytest.mark.unit


def _tensors() -> list[torch.Tensor]:
    return [torch.tensor(3.5), torch.arange(6, dtype=torch.int64).reshape(2, 3),
            torch.tensor([True, False]), torch.linspace(0, 1, 5).to(torch.bfloat16),
            torch.arange(4, dtype=torch.uint8)]


def test_a_record_round_trips_every_dtype_and_shape() -> None:
    record, digest, blob = encode(_tensors())
    assert b"pickle" not in record and digest in record.decode()
    into = [torch.zeros_like(t) for t in _tensors()]
    assert decode_into(record, {digest: blob}.get, into)
    for got, want in zip(into, _tensors()):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_a_record_of_other_tensors_or_a_lost_or_altered_blob_is_refused() -> None:
    record, digest, blob = encode(_tensors())
    other = [torch.zeros(3)]
    assert not decode_into(record, {digest: blob}.get, other)
    assert other[0].tolist() == [0.0] * 3
    assert not decode_into(record, {}.get, [torch.zeros_like(t) for t in _tensors()])
    altered = bytes([blob[0] ^ 1]) + blob[1:]
    assert not decode_into(record, {digest: altered}.get,
                           [torch.zeros_like(t) for t in _tensors()])
    assert not decode_into(b"not json", {digest: blob}.get, [torch.zeros(1)])


def test_kept_calls_replay_in_order_for_the_same_rank_with_one_blob_per_result() -> None:
    store = dist.HashStore()
    ranks = [SetupRecord(lambda: store, "world", rank) for rank in range(2)]
    seed = torch.tensor([1234])
    for record in ranks:                    # both ranks got the same broadcast result
        record.keep(record.number() or 0, [seed])
        record.number()                     # a barrier: numbered, nothing kept
        record.keep(record.number() or 0, [torch.full((2048,), 7.0)])   # 8 KB: a blob
        record.publish()
        assert record.number() is None      # set-up is over
    replacement = SetupRecord(lambda: store, "world", 1)
    got = [torch.zeros(1, dtype=torch.int64)]
    assert replacement.replay(replacement.number(), got) and got[0].tolist() == [1234]
    assert not replacement.replay(replacement.number(), [torch.zeros(1)])   # the barrier
    floats = [torch.zeros(2048)]
    assert replacement.replay(replacement.number(), floats) and bool((floats[0] == 7.0).all())
    assert not replacement.replay(replacement.number(), [torch.zeros(1)])   # never made
    assert store.num_keys() == 2 + 1     # a rank's records in one key; the seed inline, one blob


def test_an_object_payload_is_kept_past_the_call_limit_a_model_broadcast_is_not() -> None:
    store = dist.HashStore()
    record = SetupRecord(lambda: store, "world", 0)
    payload = torch.randint(0, 255, (CALL_LIMIT * 2,), dtype=torch.uint8)
    weights = torch.zeros(CALL_LIMIT // 2)            # 2 MiB of float32
    record.keep(record.number() or 0, [payload])
    record.keep(record.number() or 0, [weights])
    record.publish()
    replacement = SetupRecord(lambda: store, "world", 0)
    got = [torch.zeros_like(payload)]
    assert replacement.replay(replacement.number(), got) and torch.equal(got[0], payload)
    assert not replacement.replay(replacement.number(), [torch.ones_like(weights)])


def test_an_epoch_tops_calls_are_kept_in_a_scope_of_their_own_and_old_epochs_deleted() -> None:
    """Each epoch's top numbers its calls from 0 under ``epoch<e>``; a replacement restored
    into epoch e replays that epoch's; a rank keeps its newest two epochs' records."""
    store = dist.HashStore()
    survivor = SetupRecord(lambda: store, "world", 1)
    survivor.keep(survivor.number() or 0, [torch.tensor([5])])     # set-up
    survivor.publish()
    for epoch in range(4):
        survivor.begin(f"epoch{epoch}")
        survivor.keep(survivor.number() or 0, [torch.tensor([100 + epoch])])
        survivor.keep(survivor.number() or 0, [torch.zeros(EPOCH_CALL_LIMIT)])  # too big
        survivor.publish()
    replacement = SetupRecord(lambda: store, "world", 1)
    got = [torch.zeros(1, dtype=torch.int64)]
    assert replacement.replay(replacement.number(), got) and got[0].tolist() == [5]
    replacement.publish()
    replacement.begin("epoch3")
    assert replacement.scope == "epoch3"
    assert replacement.replay(replacement.number(), got) and got[0].tolist() == [103]
    assert not replacement.replay(replacement.number(), [torch.zeros(EPOCH_CALL_LIMIT)])
    replacement.close()
    assert replacement.number() is None
    replacement.begin("epoch2")
    assert replacement.replay(replacement.number(), got) and got[0].tolist() == [102]
    replacement.begin("epoch1")               # deleted: answered as if alone
    assert not replacement.replay(replacement.number(), got)
    assert not store.check(["phalanx-setup/world/epoch0/1"])
    assert store.check(["phalanx-setup/world/setup/1"])       # set-up's stay
