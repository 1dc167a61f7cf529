"""Fuzzing every parser that reads bytes from outside the process: the snapshot manifest,
the safetensors payload header, the peer frame decoder and handshake, error replies and the
YAML config loader. Any input must yield the value or the module's documented error
(SnapshotCorrupt / SnapshotUnauthenticated, FrameInvalid / PeerUnreachable / PeerRefused,
ConfigError), never another exception, a hang or an unbounded allocation.

Random bytes rarely pass a parser's first check, so most targets mutate a valid input:
flip, insert, delete or overwrite bytes, or replace one field with an arbitrary JSON value.

Examples per target: ``PHALANX_FUZZ_EXAMPLES`` (default 150, which keeps this file well
under a minute on 2 cores); e.g. ``PHALANX_FUZZ_EXAMPLES=20000 pytest
tests/unit/test_fuzz_parsers.py`` for a long local run. ``tests/fuzz/atheris_targets.py``
runs the same targets under coverage-guided atheris where it is installed.
"""
from __future__ import annotations

import json
import os
import socket
import struct
import threading
from typing import Any, Callable

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from phalanx.configs.errors import (ConfigError, PeerUnreachable, PhalanxError, SnapshotCorrupt,
                                    SnapshotUnauthenticated)
from phalanx.configs.loader import load_config_text
from phalanx.configs.schema import PhalanxConfig
from phalanx.runtime.transport.frames import (FrameInvalid, IncomingPayload, PeerRefused,
                                              client_handshake, raise_for_reply, recv_header,
                                              server_handshake)
from phalanx.runtime.snapshot.format import (Manifest, make_manifest, parse_header, plan_layout,
                                             read_tensors, verify_snapshot, write_checksummed)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

EXAMPLES = int(os.environ.get("PHALANX_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 1000,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])
SECRET = b"k" * 32
JOB = "fuzz-job"
MAX_PAYLOAD = 1 << 20


# ------------------------------------------------------------------ valid seeds

def _tensors() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
            "b": torch.tensor([1, -2, 3], dtype=torch.int64),
            "flag": torch.tensor([True, False]), "empty": torch.zeros(0, 5, dtype=torch.bfloat16),
            "h": torch.ones(3, dtype=torch.float16)}


def _valid_snapshot() -> tuple[bytes, Manifest]:
    tensors = _tensors()
    layout = plan_layout(tensors, {"format": "pt"})
    buf = bytearray(layout.total_bytes)
    sums = write_checksummed(buf, layout, tensors)
    manifest = make_manifest(layout, sums, job=JOB, rank=1, step=7, generation=2,
                             tree_spec={"model": {"kind": "module", "keys": ["w", "b"]},
                                        "extra": [1, 2.5, None, "x"]}, created_at=1.5)
    return bytes(buf), manifest.sign(SECRET)


PAYLOAD, MANIFEST = _valid_snapshot()
MANIFEST_BYTES = MANIFEST.to_json()
HEADER_LEN = 8 + int.from_bytes(PAYLOAD[:8], "little")
HEADER_JSON = json.loads(PAYLOAD[8:HEADER_LEN])


def _frame(header: dict[str, Any], payload: bytes = b"") -> bytes:
    body = json.dumps({**header, "nbytes": len(payload)}).encode()
    return struct.pack(">I", len(body)) + body + payload


FRAMES = (_frame({"op": "get", "rank": 1, "step": 3}) + _frame({"op": "put", "k": [1, "é"]},
                                                                b"\x00payload-bytes\xff")
          + _frame({"ok": False, "error": "SnapshotNotFound", "args": ["x"]}))

with open(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "demo.yaml"),
          encoding="utf-8") as _fh:
    DEMO_YAML = _fh.read()
RICH_YAML = """\
job: {name: fuzz, entrypoint: 'examples/train_mlp.py:main', world_size: 4, nodes: 2,
      args: {steps: 3, nested: [1, {a: b}], f: 1.5e3}}
etcd: {endpoints: ['127.0.0.1:2379'], prefix: /phalanx, user: u, password_file: /p,
       tls: {ca_file: /ca, cert_file: /c, key_file: /k}}
snapshot: {every_steps: auto, checksum: blake3}
tiers:
  s3: {enabled: true, bucket: my-bucket, expected_owner: '123456789012', sse: 'aws:kms'}
spares: {count: 1, resources: {CPU: 0.5}, placement: nodes, nodes: [1]}
ray: {virtual_nodes: 2, cpus_per_node: 4}
anchors: &a [1, 2]
"""

# ------------------------------------------------------------------ mutations

INTERESTING = [b'"', b"{", b"}", b"[", b"]", b",", b":", b"0", b"-1", b"1e999", b"NaN",
               b"\xff", b"\\u0000", b"\\ud800", b"9" * 30, b"null", b"true", b" ", b"\n",
               b"&a", b"*a", b"!!python/object:os.system", b"\t", b"- ", b"\x00"]
_OPS = st.tuples(st.sampled_from(["flip", "insert", "delete", "overwrite", "truncate"]),
                 st.integers(0, 1 << 16),
                 st.sampled_from(INTERESTING) | st.binary(min_size=1, max_size=8))


def _mutate(seed: bytes, ops: list[tuple[str, int, bytes]], limit: int | None = None) -> bytes:
    """Apply byte-level mutations at positions below ``limit`` (default: anywhere)."""
    data = bytearray(seed)
    for op, pos, blob in ops:
        span = max(1, min(len(data), limit or len(data)))
        i = pos % span
        if op == "flip" and data:
            data[i] ^= 1 << (pos % 8)
        elif op == "insert":
            data[i:i] = blob
        elif op == "delete":
            del data[i:i + len(blob)]
        elif op == "overwrite":
            data[i:i + len(blob)] = blob
        elif op == "truncate":
            del data[i:]
    return bytes(data)


def mutated(seed: bytes, limit: int | None = None) -> st.SearchStrategy[bytes]:
    return st.lists(_OPS, min_size=1, max_size=6).map(lambda ops: _mutate(seed, ops, limit))


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20)
    | st.sampled_from([0, -1, 1 << 63, (1 << 64) + 1, "", "F32", "xxh3:" + "0" * 32, [0, 0]]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            out += _paths(value, prefix + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += _paths(value, prefix + (i,))
    return out


def _replace(node: Any, path: tuple, value: Any, delete: bool) -> Any:
    if not path:
        return value
    copy = dict(node) if isinstance(node, dict) else list(node)
    if delete and len(path) == 1:
        del copy[path[0]]
        return copy
    copy[path[0]] = _replace(node[path[0]], path[1:], value, delete)
    return copy


def field_mutated(doc: Any) -> st.SearchStrategy[Any]:
    """``doc`` with one field (at any depth) replaced by, or deleted for, a JSON value."""
    paths = _paths(doc)
    return st.builds(lambda path, value, delete: _replace(doc, path, value, delete and path),
                     st.sampled_from(paths), JSON_VALUES, st.booleans())


def _expect(fn: Callable[[], Any], *allowed: type[BaseException]) -> Any:
    """``fn()``'s value, or None when it raised one of ``allowed``; anything else fails."""
    try:
        return fn()
    except allowed:
        return None


# ------------------------------------------------------------------ manifests

def _check_manifest(data: bytes) -> None:
    parsed = _expect(lambda: Manifest.from_json(data, "fuzz"), SnapshotCorrupt)
    if parsed is None:
        return
    assert isinstance(parsed, Manifest)
    verified = _expect(lambda: parsed.verify(SECRET, "fuzz") or True, SnapshotUnauthenticated)
    if verified:     # the HMAC holds only for the signed content itself
        assert parsed == MANIFEST
    _expect(lambda: verify_snapshot(PAYLOAD, data, secret=SECRET, source="fuzz"),
            SnapshotCorrupt, SnapshotUnauthenticated)


@FUZZ
@given(st.binary(max_size=2048))
@example(b"")
@example(b"[" * 100_000)
@example(MANIFEST_BYTES.replace(b'"created_at":1.5', b'"created_at":1e999'))
def test_manifest_parser_random_bytes(data: bytes) -> None:
    _check_manifest(data)


@FUZZ
@given(mutated(MANIFEST_BYTES))
def test_manifest_parser_mutated_bytes(data: bytes) -> None:
    _check_manifest(data)


@FUZZ
@given(field_mutated(json.loads(MANIFEST_BYTES)))
@example({**json.loads(MANIFEST_BYTES), "tree_spec": {"x": 1e308 * 10}})
def test_manifest_parser_mutated_fields(doc: Any) -> None:
    try:
        data = json.dumps(doc).encode()
    except ValueError:
        return
    _check_manifest(data)


# ------------------------------------------------------------------ safetensors headers

def _check_payload(data: bytes) -> None:
    layout = _expect(lambda: parse_header(data), SnapshotCorrupt)
    if layout is not None:
        assert layout.total_bytes == len(data)
        tensors = read_tensors(data)        # a parsed header must build its tensors
        assert set(tensors) == set(layout.entries)
    ok = _expect(lambda: verify_snapshot(data, MANIFEST_BYTES, secret=SECRET, source="fuzz"),
                 SnapshotCorrupt, SnapshotUnauthenticated)
    if ok is not None:        # verified: every tensor is the original, byte for byte
        got, want = read_tensors(data), _tensors()
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


@FUZZ
@given(st.binary(max_size=512))
@example(b"\xff" * 8)
@example((1 << 63).to_bytes(8, "little") + b"{}")
def test_payload_header_random_bytes(data: bytes) -> None:
    _check_payload(data)


@FUZZ
@given(mutated(PAYLOAD, limit=HEADER_LEN))
def test_payload_header_mutated_bytes(data: bytes) -> None:
    _check_payload(data)


@FUZZ
@given(field_mutated(HEADER_JSON), st.integers(-64, 64))
@example({"a": {"dtype": "U8", "shape": [0, 1 << 70], "data_offsets": [0, 0]}}, 0)
@example({"a": {"dtype": "F32", "shape": [1 << 62, 0, 1 << 62], "data_offsets": [0, 0]}}, 0)
def test_payload_header_mutated_fields(doc: Any, data_delta: int) -> None:
    text = json.dumps(doc).encode()
    data = PAYLOAD[HEADER_LEN:]
    data = data[:len(data) + data_delta] if data_delta < 0 else data + b"\0" * data_delta
    _check_payload(len(text).to_bytes(8, "little") + text + data)


# ------------------------------------------------------------------ peer frames

class _Fed:
    """A socket pair whose writer sent ``data`` and shut its sending side: ``reader``
    sees exactly those bytes then EOF, and may still write back (a server's hello)."""

    def __init__(self, data: bytes) -> None:
        self.writer, self.reader = socket.socketpair()
        self.reader.settimeout(5.0)
        self._thread: threading.Thread | None = None
        if len(data) <= 32 << 10:           # fits the socket buffer: no thread needed
            self._send(data)
        else:
            self._thread = threading.Thread(target=self._send, args=(data,), daemon=True)
            self._thread.start()

    def _send(self, data: bytes) -> None:
        try:
            self.writer.sendall(data)
            self.writer.shutdown(socket.SHUT_WR)
        except OSError:
            pass                # the reader stopped early (an error): nothing to deliver

    def close(self) -> None:
        self.reader.close()             # unblocks a sender still writing
        if self._thread is not None:
            self._thread.join(5)
        self.writer.close()


def _decode_all(data: bytes) -> list[dict[str, Any]]:
    """Every frame in ``data``, read as a server does (header, then its payload)."""
    fed = _Fed(data)
    frames: list[dict[str, Any]] = []
    try:
        while True:
            header = recv_header(fed.reader, where="fuzz", max_payload=MAX_PAYLOAD)
            if header is None:
                return frames
            assert isinstance(header, dict) and 0 <= header["nbytes"] <= MAX_PAYLOAD
            IncomingPayload(fed.reader, header["nbytes"], "fuzz").read()
            frames.append(header)
    finally:
        fed.close()


def _check_frames(data: bytes) -> None:
    frames = _expect(lambda: _decode_all(data), FrameInvalid, PeerUnreachable)
    if data == FRAMES:
        assert frames is not None and len(frames) == 3


@FUZZ
@given(st.binary(max_size=4096))
@example(struct.pack(">I", 0xFFFFFFFF))
@example(_frame({"nbytes": 1 << 40}))
@example(struct.pack(">I", 2) + b"{}" + struct.pack(">I", 11) + b'{"nbytes":1')
@example(FRAMES)
def test_frame_decoder_random_bytes(data: bytes) -> None:
    _check_frames(data)


@FUZZ
@given(mutated(FRAMES))
def test_frame_decoder_mutated_bytes(data: bytes) -> None:
    _check_frames(data)


@FUZZ
@given(field_mutated({"op": "get", "rank": 1, "step": 3, "nbytes": 4}))
def test_frame_decoder_mutated_headers(doc: Any) -> None:
    body = json.dumps(doc).encode()
    _check_frames(struct.pack(">I", len(body)) + body + b"abcd")


AUTH = {"op": "auth", "job": JOB, "role": "worker", "generation": 3, "mac": "ab" * 32,
        "cnonce": "cd" * 32}


@FUZZ
@given(field_mutated(AUTH) | JSON_VALUES, st.binary(max_size=64))
@example(AUTH, b"")
def test_server_handshake_never_accepts_a_forged_auth(doc: Any, tail: bytes) -> None:
    try:
        body = json.dumps(doc).encode()
    except ValueError:
        return
    fed = _Fed(struct.pack(">I", len(body)) + body + tail)
    try:
        result = _expect(lambda: server_handshake(fed.reader, "fuzz", SECRET, JOB,
                                                  lambda g: g >= 0),
                         FrameInvalid, PeerUnreachable)
    finally:
        fed.close()
    if doc == AUTH:                 # well formed: it reached the MAC check and failed it
        assert result is not None and result[1] == "auth"
    if result is not None:
        peer, code, reason = result
        assert peer is None and code and reason      # no secret, no entry


HELLO = {"op": "hello", "ok": True, "proto": 1, "nonce": "00" * 32}
ANSWER = {"ok": True, "mac": "11" * 32}


@FUZZ
@given(field_mutated(HELLO), field_mutated(ANSWER) | JSON_VALUES)
@example(HELLO, ANSWER)
def test_client_handshake_refuses_any_forged_server(hello: Any, answer: Any) -> None:
    try:
        data = b"".join(struct.pack(">I", len(b)) + b for b in
                        (json.dumps(hello).encode(), json.dumps(answer).encode()))
    except ValueError:
        return
    fed = _Fed(data)
    try:
        with pytest.raises((PeerRefused, PeerUnreachable, FrameInvalid)) as info:
            client_handshake(fed.reader, "fuzz", SECRET, JOB, "worker", 3)
    finally:
        fed.close()
    if (hello, answer) == (HELLO, ANSWER):    # well formed: refused for its guessed proof
        assert isinstance(info.value, PeerRefused) and info.value.code == "server-auth"


@FUZZ
@given(field_mutated({"ok": False, "error": "ConfigError", "message": "m",
                      "args": ["k", "p", "h", "s", 3]}),
       st.sampled_from(["ConfigError", "WorkerFailed", "PeerRefused", "RemoteError",
                        "SnapshotCorrupt", "StaleGeneration", "NoSuchClass", "__init__"]))
def test_error_replies_raise_only_phalanx_errors(header: Any, kind: str) -> None:
    if isinstance(header, dict) and "error" in header:
        header = {**header, "error": kind}
    if not isinstance(header, dict):
        return
    try:
        raise_for_reply(header, "fuzz")
    except PhalanxError:
        assert header.get("ok") is False
    else:
        assert header.get("ok") is not False


# ------------------------------------------------------------------ config loader

def _check_config(text: str) -> None:
    cfg = _expect(lambda: load_config_text(text, source="fuzz.yaml"), ConfigError)
    assert cfg is None or isinstance(cfg, PhalanxConfig)


@FUZZ
@given(st.text(max_size=400))
@example("[" * 3000)
@example("job:\n  args:\n    a: &a [x, x, x, x, x, x, x, x, x, x]\n"
         + "".join(f"    a{i}: &a{i} [{', '.join(['*a' if i == 1 else f'*a{i - 1}'] * 10)}]\n"
                   for i in range(1, 9)))
@example("job: !!python/object/apply:os.system ['true']\n")
def test_config_loader_random_text(text: str) -> None:
    _check_config(text)


@FUZZ
@given(mutated(DEMO_YAML.encode()) | mutated(RICH_YAML.encode()))
def test_config_loader_mutated_yaml(data: bytes) -> None:
    _check_config(data.decode("utf-8", "replace"))


@FUZZ
@given(field_mutated(json.loads(json.dumps({
    "job": {"name": "f", "entrypoint": "a.py:main", "world_size": 2, "nodes": 2, "args": {}},
    "etcd": {"endpoints": ["h:1"], "tls": {"cert_file": "c", "key_file": "k"}},
    "tiers": {"s3": {"enabled": True, "bucket": "my-bucket"}},
    "spares": {"count": 0, "resources": {"CPU": 1}}}))))
def test_config_loader_mutated_fields(doc: Any) -> None:
    _check_config(json.dumps(doc))      # JSON is YAML: every field gets every type
