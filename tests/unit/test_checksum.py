"""The checksum algorithms against independent reference computations, and the fused
copy-and-checksum against a plain copy followed by hashing."""
from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

import blake3
import pytest
import torch
import xxhash
from hypothesis import given, settings, strategies as st

from runtime.checksum import LEAF_BYTES, Span, _share, _units, check_algo, copy_and_digest, digest_spans
from runtime.snapshot_format import checksums, plan_layout, write_checksummed, write_into


def reference(data: bytes, algo: str) -> str:
    """The documented definitions, written out independently of runtime.checksum."""
    if algo == "sha256":
        return "sha256:" + hashlib.sha256(data).hexdigest()
    if algo == "blake3":
        return "blake3:" + blake3.blake3(data).hexdigest()
    leaves = [data[i:i + LEAF_BYTES] for i in range(0, len(data), LEAF_BYTES)] or [b""]
    return "xxh3:" + xxhash.xxh3_128(b"".join(xxhash.xxh3_128_digest(x) for x in leaves)).hexdigest()


SIZES = [0, 1, 7, LEAF_BYTES - 1, LEAF_BYTES, LEAF_BYTES + 1, 3 * LEAF_BYTES + 5]


@pytest.mark.parametrize("algo", ["xxh3", "blake3", "sha256"])
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_digest_matches_the_documented_definition(algo: str, workers: int) -> None:
    gen = torch.Generator().manual_seed(1)
    blobs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).numpy().tobytes()
             for n in SIZES]
    buf = bytearray(b"".join(blobs))
    spans, at = [], 0
    for i, blob in enumerate(blobs):
        spans.append(Span(f"t{i}", at, at + len(blob)))
        at += len(blob)
    with ThreadPoolExecutor(workers) as pool:
        got = digest_spans(buf, spans, dict.fromkeys((s.name for s in spans), algo),
                           pool=pool, workers=workers)
    assert got == {f"t{i}": reference(blob, algo) for i, blob in enumerate(blobs)}


def state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return {"w": torch.randn(700, 1000, generator=gen),                    # 2.7 MiB: 3 leaves
            "half": torch.randn(513, 1024, generator=gen).to(torch.bfloat16),
            "strided": torch.randn(300, 400, generator=gen).t(),           # non-contiguous
            "step": torch.tensor(5, dtype=torch.int64), "none": torch.empty(0, 3),
            "mask": torch.rand(1000, generator=gen) > 0.5}


@pytest.mark.parametrize("algo", ["xxh3", "blake3", "sha256"])
@pytest.mark.parametrize("workers", [1, 2, 4])
def test_fused_copy_equals_copy_then_hash(algo: str, workers: int) -> None:
    tensors = state()
    layout = plan_layout(tensors)
    plain, fused = bytearray(layout.total_bytes), bytearray(layout.total_bytes)
    write_into(plain, layout, tensors)
    expected = checksums(plain, layout, algo=algo)
    with ThreadPoolExecutor(max(1, workers - 1)) as pool:
        got = write_checksummed(fused, layout, tensors, algo=algo, workers=workers, pool=pool)
    assert got == expected
    assert fused == plain
    assert checksums(plain, layout, algo=algo, workers=workers) == expected


def test_fused_copy_refuses_cuda_and_unknown_algorithms() -> None:
    tensors = {"a": torch.ones(4)}
    layout = plan_layout(tensors)
    with pytest.raises(ValueError, match="unknown checksum algorithm 'md5'"):
        write_checksummed(bytearray(layout.total_bytes), layout, tensors, algo="md5")
    with pytest.raises(ValueError, match="use one of"):
        check_algo("crc32")
    with pytest.raises(ValueError, match="read-only"):
        copy_and_digest(bytes(16), [Span("a", 0, 16)], tensors, "xxh3")


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 5 * LEAF_BYTES), max_size=12), workers=st.integers(1, 6),
       algo=st.sampled_from(["xxh3", "blake3", "sha256"]))
def test_every_unit_goes_to_exactly_one_thread_in_payload_order(sizes: list[int], workers: int,
                                                               algo: str) -> None:
    spans, at = [], 0
    for i, n in enumerate(sizes):
        spans.append(Span(f"t{i}", at, at + n))
        at += n
    units = _units(spans, dict.fromkeys((s.name for s in spans), algo))
    shares = _share(list(units), workers)
    assert sorted(u for share in shares for u in share) == sorted(units)
    assert len(shares) <= workers
    assert all(share == sorted(share, key=lambda u: u.begin) for share in shares)
    covered = sum(u.end - u.begin for u in units)
    assert covered == at
    if algo == "xxh3":
        assert all(u.end - u.begin <= LEAF_BYTES for u in units)
        loads = [sum(u.end - u.begin for u in share) for share in shares]
        assert not loads or max(loads) - min(loads) <= LEAF_BYTES or len(shares) < workers
