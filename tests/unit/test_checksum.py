"""The checksum algorithms against independent reference computations, and the fused
copy-and-checksum against a plain copy followed by hashing."""
from __future__ import annotations

import hashlib
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import blake3
import pytest
import torch
import xxhash
from hypothesis import given, settings, strategies as st

from phalanx.runtime.snapshot import fused_copy
from phalanx.runtime.snapshot.checksum import (LEAF_BYTES, DigestJob, Span, _units, check_algo,
                                               digest_spans, finish, helpers)
from phalanx.runtime.snapshot.format import (checksums, landing_job, plan_layout, start_write,
                                             write_checksummed, write_into, write_job)


def reference(data: bytes, algo: str) -> str:
    """The documented definitions, written out independently of phalanx.runtime.snapshot.checksum."""
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


@pytest.fixture(params=["native", "python"])
def copier(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The fused copy's two paths: the native kernel (runtime/snapshot/fused_copy.c) and the
    pure-Python loop that replaces it where no C compiler is available."""
    if request.param == "python":
        monkeypatch.setattr(fused_copy, "kernel", lambda: None)
    elif shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler here: the native kernel cannot be built")
    else:
        assert fused_copy.kernel() is not None, "a C compiler is here but the kernel failed"
    return request.param


@pytest.mark.parametrize("algo", ["xxh3", "blake3", "sha256"])
@pytest.mark.parametrize("workers", [1, 2, 4])
def test_fused_copy_equals_copy_then_hash(algo: str, workers: int, copier: str) -> None:
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
        DigestJob([Span("a", 0, 16)], {"a": "xxh3"}, tensors).start(bytes(16))


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 5 * LEAF_BYTES), max_size=12),
       algo=st.sampled_from(["xxh3", "blake3", "sha256"]))
def test_units_cover_the_payload_once_largest_first(sizes: list[int], algo: str) -> None:
    spans, at = [], 0
    for i, n in enumerate(sizes):
        spans.append(Span(f"t{i}", at, at + n))
        at += n
    units = _units(spans, dict.fromkeys((s.name for s in spans), algo))
    assert sum(u.end - u.begin for u in units) == at
    assert len({(u.name, u.leaf) for u in units}) == len(units)
    lengths = [u.end - u.begin for u in units]
    assert lengths == sorted(lengths, reverse=True)
    if algo == "xxh3":
        assert all(u.end - u.begin <= LEAF_BYTES for u in units)


def test_threads_that_wait_for_the_slot_share_the_work_whenever_they_wake() -> None:
    """Helpers start before the destination exists (the slot claim runs meanwhile); one of
    them wakes only after the caller has done every unit, and the result is unchanged."""
    tensors = state()
    layout = plan_layout(tensors)
    plain = bytearray(layout.total_bytes)
    write_into(plain, layout, tensors)
    expected = checksums(plain, layout, algo="xxh3")
    late = threading.Event()

    def sleepy(job: DigestJob) -> None:
        late.wait(5)
        job.work()

    fused = bytearray(layout.total_bytes)
    with ThreadPoolExecutor(3) as pool:
        job = write_job(layout, tensors, algo="xxh3")
        futures = helpers(job, pool, 2) + [pool.submit(sleepy, job)]
        start_write(job, fused, layout, tensors)
        job.work()
        late.set()
        assert finish(job, futures) == expected
    assert fused == plain


def test_a_cancelled_job_releases_its_waiting_threads() -> None:
    tensors = {"a": torch.ones(4)}
    layout = plan_layout(tensors)
    job = write_job(layout, tensors, algo="xxh3")
    with ThreadPoolExecutor(2) as pool:
        futures = helpers(job, pool, 3)
        job.cancel()
        assert [future.result(timeout=5) for future in futures] == [None, None]


def test_a_landing_job_hashes_each_tensor_only_once_its_bytes_landed() -> None:
    """As with CUDA device-to-host copies: the slot fills tensor by tensor while the threads
    already run; hashing a tensor before it landed would hash zeros."""
    tensors = state()
    layout = plan_layout(tensors)
    full = bytearray(layout.total_bytes)
    write_into(full, layout, tensors)
    landed = {name: threading.Event() for name in layout.entries}
    slot = bytearray(layout.total_bytes)
    job = landing_job(layout, algo="xxh3", ready=lambda name: landed[name].wait(5))
    with ThreadPoolExecutor(2) as pool:
        futures = helpers(job, pool, 3)
        job.start(slot)
        for name, entry in sorted(layout.entries.items(), key=lambda kv: kv[1].begin):
            begin, end = layout.data_start + entry.begin, layout.data_start + entry.end
            slot[begin:end] = full[begin:end]
            landed[name].set()
        assert finish(job, futures) == checksums(full, layout, algo="xxh3")
