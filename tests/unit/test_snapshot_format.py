"""The snapshot byte format: layout, safetensors compatibility, validation, manifest, HMAC."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import phalanx.runtime.snapshot.format as fmt
from phalanx.configs.errors import SnapshotCorrupt, SnapshotUnauthenticated
from phalanx.runtime.snapshot.format import (Manifest, SnapshotLayout, checksums, make_manifest,
                                             parse_header, plan_layout, read_tensors, write_into)

pytestmark = pytest.mark.unit
SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
          torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32,
          torch.uint64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


@st.composite
def tensor_st(draw: Any) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 5), max_size=3))
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    if dtype == torch.bool:
        raw = bytes(draw(st.lists(st.integers(0, 1), min_size=numel, max_size=numel)))
    else:
        raw = draw(st.binary(min_size=numel * dtype.itemsize, max_size=numel * dtype.itemsize))
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


tensors_st = st.dictionaries(st.text(min_size=1, max_size=12).filter(lambda n: n != "__metadata__"),
                             tensor_st(), max_size=8)


def encode(tensors: dict[str, torch.Tensor], **meta: str) -> tuple[bytearray, SnapshotLayout]:
    layout = plan_layout(tensors, meta or None)
    buf = bytearray(layout.total_bytes)
    write_into(memoryview(buf), layout, tensors)
    return buf, layout


def manifest_for(buf: bytearray, layout: SnapshotLayout, algo: str = "sha256") -> Manifest:
    return make_manifest(layout, checksums(buf, layout, algo=algo), job="job", rank=2, step=7,
                         generation=3, tree_spec={"version": 1, "objects": {}},
                         created_at=1700000000.25)


def craft(header: dict, data: bytes = b"", length: int | None = None) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return (len(text) if length is None else length).to_bytes(8, "little") + text + data


@pytest.mark.timeout(60)
@SETTINGS
@given(tensors=tensors_st)
def test_round_trip_zero_copy_and_aligned(tensors: dict[str, torch.Tensor]) -> None:
    buf, layout = encode(tensors, kind="test")
    assert layout.data_start % 8 == 0 and layout.total_bytes == len(buf)
    assert layout.matches(tensors)
    out = read_tensors(buf, manifest_for(buf, layout))
    assert set(out) == set(tensors)
    base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    for name, t in tensors.items():
        assert same_bits(t, out[name]), name
        if t.numel():
            offset = out[name].data_ptr() - base
            assert offset == layout.data_start + layout.entries[name].begin   # a view
            assert offset % t.element_size() == 0                            # aligned


@pytest.mark.timeout(60)
@SETTINGS
@given(tensors=tensors_st)
def test_safetensors_reads_our_bytes(tensors: dict[str, torch.Tensor], tmp_path_factory: Any) -> None:
    tensors = {k: v for k, v in tensors.items() if v.dtype != torch.complex64}
    buf, _ = encode(tensors, format="pt")
    loaded = safetensors.torch.load(bytes(buf))
    assert set(loaded) == set(tensors)
    assert all(same_bits(tensors[k], loaded[k]) for k in tensors)
    path = tmp_path_factory.mktemp("st") / "rank_0.safetensors"
    path.write_bytes(buf)
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert set(f.keys()) == set(tensors)
        assert all(same_bits(tensors[k], f.get_tensor(k)) for k in tensors)


@pytest.mark.timeout(10)
def test_we_read_safetensors_bytes() -> None:
    tensors = {"a": torch.arange(5, dtype=torch.int16), "b": torch.randn(2, 3),
               "c": torch.tensor(True), "d": torch.zeros(0, 2, dtype=torch.bfloat16)}
    out = read_tensors(safetensors.torch.save(tensors, metadata={"x": "y"}))
    assert all(same_bits(tensors[k], out[k]) for k in tensors)


@pytest.mark.timeout(10)
def test_non_contiguous_inputs_and_larger_slot() -> None:
    tensors = {"t": torch.arange(12.0).reshape(3, 4).t(), "s": torch.arange(10)[::3]}
    layout = plan_layout(tensors)
    slot = bytearray(layout.total_bytes + 4096)
    write_into(memoryview(slot), layout, tensors)
    out = read_tensors(memoryview(slot)[:layout.total_bytes])
    assert all(same_bits(tensors[k], out[k]) for k in tensors)
    with pytest.raises(SnapshotCorrupt, match="bytes after its last tensor"):
        read_tensors(slot)


@pytest.mark.timeout(10)
def test_layout_matches_and_write_into_guards() -> None:
    tensors = {"a": torch.ones(2, 3), "b": torch.zeros(4, dtype=torch.int8)}
    layout = plan_layout(tensors)
    assert layout.matches({"b": torch.ones(4, dtype=torch.int8), "a": torch.zeros(2, 3)})
    assert not layout.matches({"a": torch.ones(3, 2), "b": tensors["b"]})
    assert not layout.matches({"a": torch.ones(2, 3, dtype=torch.float64), "b": tensors["b"]})
    assert not layout.matches({"a": tensors["a"], "c": tensors["b"]})
    assert not layout.matches({"a": tensors["a"]})
    with pytest.raises(ValueError, match="plan_layout again"):
        write_into(memoryview(bytearray(layout.total_bytes)), layout, {"a": tensors["a"]})
    with pytest.raises(ValueError, match="needs"):
        write_into(memoryview(bytearray(layout.total_bytes - 1)), layout, tensors)
    with pytest.raises(ValueError, match="read-only"):
        write_into(bytes(layout.total_bytes), layout, tensors)
    with pytest.raises(TypeError, match="'c'.*cannot store"):
        plan_layout({"c": torch.ones(1, dtype=torch.complex128)})
    with pytest.raises(ValueError, match="reserved"):
        plan_layout({"__metadata__": torch.ones(1)})


@pytest.mark.timeout(30)
def test_checksum_algorithms() -> None:
    buf, layout = encode({"a": torch.arange(100, dtype=torch.int32), "b": torch.ones(3)})
    for algo, hex_len in (("xxh3", 32), ("blake3", 64), ("sha256", 64)):
        sums = checksums(buf, layout, algo=algo)
        assert all(s.startswith(algo + ":") and len(s) == len(algo) + 1 + hex_len
                   for s in sums.values())
        assert checksums(buf, layout, algo=algo, workers=2) == sums
        read_tensors(buf, manifest_for(buf, layout, algo))
    with pytest.raises(ValueError, match="unknown checksum"):
        checksums(buf, layout, algo="md5")


@pytest.mark.timeout(60)
@SETTINGS
@given(tensors=tensors_st.filter(lambda d: any(t.numel() for t in d.values())), data=st.data())
def test_one_flipped_byte_anywhere_is_detected(tensors: dict[str, torch.Tensor], data: Any) -> None:
    buf, layout = encode(tensors)
    manifest = manifest_for(buf, layout)
    position = data.draw(st.integers(0, len(buf) - 1))
    buf[position] ^= data.draw(st.integers(1, 255))
    if position < layout.data_start:
        try:                        # a header flip is caught, or is JSON-equivalent: other
            out = read_tensors(buf, manifest)  # whitespace, or a \u escape's hex case
        except SnapshotCorrupt:
            return
        header = slice(8, layout.data_start)
        assert json.loads(bytes(buf[header])) == json.loads(layout.header[header])
        assert out.keys() == tensors.keys() and all(same_bits(tensors[k], out[k]) for k in out)
        return
    with pytest.raises(SnapshotCorrupt) as info:
        read_tensors(buf, manifest, source="rank_2.safetensors")
    hit = [n for n, e in layout.entries.items()
           if layout.data_start + e.begin <= position < layout.data_start + e.end]
    assert f"rank_2.safetensors: tensor '{hit[0]}' checksum mismatch" in str(info.value)


@pytest.mark.timeout(10)
def test_wrong_checksum_names_the_first_bad_tensor() -> None:
    buf, layout = encode({"w": torch.ones(4), "x": torch.ones(2), "y": torch.ones(3)})
    manifest = manifest_for(buf, layout)
    tensors = dict(manifest.tensors)
    tensors["x"] = {**tensors["x"], "checksum": "sha256:" + "0" * 64}
    with pytest.raises(SnapshotCorrupt, match="tensor 'x' checksum mismatch"):
        read_tensors(buf, dataclasses.replace(manifest, tensors=tensors))
    with pytest.raises(SnapshotCorrupt, match="manifest records"):
        read_tensors(buf, dataclasses.replace(manifest, total_bytes=manifest.total_bytes + 4))
    tensors = {k: v for k, v in manifest.tensors.items() if k != "y"}
    with pytest.raises(SnapshotCorrupt, match="'y' is only in the payload"):
        read_tensors(buf, dataclasses.replace(manifest, tensors=tensors))


GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}


@pytest.mark.timeout(10)
@pytest.mark.parametrize("payload, message", [
    (b"\x01\x00", "shorter than its 8-byte header length"),
    ((2**40).to_bytes(8, "little") + b"{}", "exceeds the"),
    (craft(GOOD, bytes(8), length=500), "runs past the end"),
    (craft(GOOD, bytes(8))[:-3], "'a' ends at byte"),
    (craft(GOOD, bytes(12)), "bytes after its last tensor"),
    (b"\x08" + bytes(7) + b"not json", "not valid JSON"),
    (b"\x08" + bytes(7) + b"\xff\xfe{}    ", "not valid JSON"),
    (craft([1, 2]), "not a JSON object"),       # type: ignore[arg-type]
    (craft({"a": {"dtype": "F31", "shape": [2], "data_offsets": [0, 8]}}, bytes(8)),
     "'a': unknown dtype 'F31'"),
    (craft({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8)),
     "'a': shape \\[3\\] of F32 needs 12 bytes"),
    (craft({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8)),
     "'a': shape"),
    (craft({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, bytes(8)),
     "'a': data_offsets"),
    (craft({"a": {"dtype": "F32", "shape": [2]}}, bytes(8)), "'a': header entry"),
    (craft({**GOOD, "b": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}}, bytes(8)),
     "'b': data_offsets \\[4, 8\\] overlaps"),
    (craft({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12)),
     "'a'.*leaves a gap"),
    (craft({**GOOD, "__metadata__": {"k": 1}}, bytes(8)), "__metadata__"),
    (b"\x10" + bytes(7) + b'{"a":1,"a":2}   ', "duplicate key"),
])
def test_corrupt_headers_are_rejected(payload: bytes, message: str) -> None:
    with pytest.raises(SnapshotCorrupt, match=message):
        read_tensors(payload)


@pytest.mark.timeout(30)
def test_every_truncation_is_rejected() -> None:
    buf, _ = encode({"a": torch.ones(3), "b": torch.arange(4, dtype=torch.int8)})
    for cut in range(len(buf)):
        with pytest.raises(SnapshotCorrupt):
            parse_header(buf[:cut])


def signed_manifest() -> Manifest:
    buf, layout = encode({"a": torch.ones(3), "b": torch.zeros(2, dtype=torch.bool)})
    return manifest_for(buf, layout).sign(b"secret")


@pytest.mark.timeout(10)
def test_manifest_json_is_canonical_and_round_trips() -> None:
    manifest = signed_manifest()
    data = manifest.to_json()
    assert data == json.dumps(json.loads(data), sort_keys=True, separators=(",", ":")).encode()
    back = Manifest.from_json(data, "m.json")
    assert back == manifest and back.to_json() == data
    back.verify(b"secret", "m.json")
    assert back.format_version == 1 and len(back.hmac) == 64


@pytest.mark.timeout(10)
def test_hmac_wrong_missing_or_tampered_is_unauthenticated() -> None:
    manifest = signed_manifest()
    with pytest.raises(SnapshotUnauthenticated, match="m.json.*does not match"):
        manifest.verify(b"other", "m.json")
    with pytest.raises(SnapshotUnauthenticated, match="m.json.*unsigned"):
        dataclasses.replace(manifest, hmac="").verify(b"secret", "m.json")
    with pytest.raises(SnapshotUnauthenticated, match="does not match"):
        dataclasses.replace(manifest, step=manifest.step + 1).verify(b"secret", "m.json")
    raw = json.loads(manifest.to_json())
    raw["tensors"]["a"]["checksum"] = "sha256:" + "1" * 64
    tampered = Manifest.from_json(json.dumps(raw).encode(), "m.json")
    with pytest.raises(SnapshotUnauthenticated):
        tampered.verify(b"secret", "m.json")
    dataclasses.replace(manifest, hmac="").verify(None, "m.json")   # no secret: no check


def mutate(path: str, value: Any) -> bytes:
    raw = json.loads(signed_manifest().to_json())
    *parents, last = path.split(".")
    node = raw
    for key in parents:
        node = node[key]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return json.dumps(raw).encode()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("data, message", [
    (b"{nope", "not valid JSON"), (b"[1]", "not a JSON object"),
    (b'{"format_version": NaN}', "not valid JSON"),
    (b'{"job": "a", "job": "b"}', "duplicate key"),
    (mutate("format_version", 2), "'format_version': unknown version 2"),
    (mutate("format_version", "1"), "'format_version'"),
    (mutate("job", KeyError), "'job': missing"),
    (mutate("extra", 1), "'extra': unknown field"),
    (mutate("job", 5), "'job': wrong type"),
    (mutate("rank", -1), "'rank'"), (mutate("step", 1.5), "'step'"),
    (mutate("generation", True), "'generation'"), (mutate("total_bytes", "9"), "'total_bytes'"),
    (mutate("created_at", "now"), "'created_at'"), (mutate("tree_spec", []), "'tree_spec'"),
    (mutate("tensors", []), "'tensors'"), (mutate("hmac", "xyz"), "'hmac'"),
    (mutate("tensors.a.dtype", "F99"), "'tensors.a': has unknown dtype"),
    (mutate("tensors.a.nbytes", 4), "'tensors.a': nbytes 4 does not match"),
    (mutate("tensors.a.offset", 10**9), "'tensors.a': ends at"),
    (mutate("tensors.a.shape", [3, "x"]), "'tensors.a': shape"),
    (mutate("tensors.a.checksum", "sha256:abc"), "'tensors.a': checksum"),
    (mutate("tensors.a.checksum", "md5:" + "0" * 32), "'tensors.a': checksum"),
    (mutate("tensors.a.extra", 1), "'tensors.a': must hold exactly"),
])
def test_manifest_validation_names_source_and_field(data: bytes, message: str) -> None:
    with pytest.raises(SnapshotCorrupt, match="node-3/m.json") as info:
        Manifest.from_json(data, source="node-3/m.json")
    assert info.match(message)


@pytest.mark.timeout(10)
def test_manifest_size_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fmt, "MAX_MANIFEST_BYTES", 100)
    with pytest.raises(SnapshotCorrupt, match="over the 100-byte cap"):
        Manifest.from_json(signed_manifest().to_json(), "m.json")


@pytest.mark.timeout(10)
def test_special_floats_in_manifest_fields_are_refused() -> None:
    manifest = dataclasses.replace(signed_manifest(), created_at=float("nan"))
    with pytest.raises(ValueError):
        manifest.to_json()


@pytest.mark.gpu
@pytest.mark.timeout(60)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_on_a_side_stream_into_pinned_memory() -> None:
    tensors = {"w": torch.randn(1024, 257, device="cuda"),
               "h": torch.randn(33, device="cuda").half(),
               "t": torch.randn(64, 64, device="cuda").t(), "e": torch.empty(0, device="cuda")}
    layout = plan_layout(tensors)
    pinned = torch.empty(layout.total_bytes, dtype=torch.uint8, pin_memory=True)
    view = memoryview(pinned.numpy())
    stream = torch.cuda.Stream()
    write_into(view, layout, tensors, non_blocking=True, stream=stream)
    stream.synchronize()
    out = read_tensors(view)
    assert all(same_bits(tensors[k].cpu(), out[k]) for k in tensors)
    assert safetensors.torch.load(bytes(view))["w"].shape == (1024, 257)


@pytest.mark.timeout(10)
def test_payload_file_round_trip(tmp_path: Path) -> None:
    buf, layout = encode({"a": torch.arange(6.0).reshape(2, 3)})
    (tmp_path / "p.safetensors").write_bytes(buf)
    out = read_tensors((tmp_path / "p.safetensors").read_bytes(), manifest_for(buf, layout))
    assert torch.equal(out["a"], torch.arange(6.0).reshape(2, 3))
