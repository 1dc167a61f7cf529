"""The snapshot byte format: a safetensors-layout tensor payload plus a signed JSON manifest.

Payload: 8-byte little-endian header length N, N bytes of JSON header (space-padded so the
data starts 8-byte aligned), then raw tensor bytes ordered by descending item size so every
tensor is naturally aligned and ``read_tensors`` returns zero-copy views. Any payload opens
with ``safetensors.safe_open`` / ``safetensors.torch.load``.

Checksums are per tensor, ``"<algo>:<hex>"``; ``phalanx.runtime.snapshot.checksum`` defines the algorithms
(xxh3 by default, blake3 and sha256 when the HMAC must authenticate the tensor bytes too).
"""
from __future__ import annotations

import hashlib
import hmac as hmac_lib
import json
import math
import warnings
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from functools import cache
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple

from phalanx.configs.errors import SnapshotCorrupt, SnapshotUnauthenticated
from phalanx.runtime.snapshot.checksum import (ALGOS, DEFAULT_ALGO, HEX_LEN, DigestJob, Span,
                                               byte_view, check_algo, digest_spans, finish, helpers)

if TYPE_CHECKING:      # torch is imported where tensors are made or read, not for the bytes:
    import torch       # a keeper verifies and moves snapshots without it (a faster start)

FORMAT_VERSION = 1
MAX_HEADER_BYTES = 100_000_000          # safetensors' own cap
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
DATA_ALIGN = 64      # tensor data starts on a cache line: copies into the slot run aligned

# safetensors' dtype codes: torch's name of each and its bytes per element
_DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2),
    "BF16": ("bfloat16", 2), "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2),
    "I8": ("int8", 1), "U64": ("uint64", 8), "U32": ("uint32", 4), "U16": ("uint16", 2),
    "U8": ("uint8", 1), "BOOL": ("bool", 1), "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1), "C64": ("complex64", 8),
}
_ITEMSIZE: dict[str, int] = {code: size for code, (_, size) in _DTYPES.items()}


@cache
def dtype_codes() -> dict[torch.dtype, str]:
    """torch dtype → safetensors code, for every dtype a snapshot stores."""
    import torch

    return {getattr(torch, name): code for code, (name, _) in _DTYPES.items()}


@cache
def code_dtypes() -> dict[str, torch.dtype]:
    return {code: dt for dt, code in dtype_codes().items()}


class TensorEntry(NamedTuple):
    """One tensor in a payload: safetensors dtype code, shape, [begin, end) in the data area."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class SnapshotLayout:
    """Where every tensor goes in a payload; plan once, reuse while ``matches``.

    ``header`` is the full prefix (8 length bytes + padded JSON), ``data_start`` its
    length; a tensor's absolute offset is ``data_start + entry.begin``."""

    header: bytes
    entries: Mapping[str, TensorEntry]
    data_start: int
    total_bytes: int

    def matches(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Whether ``tensors`` has exactly these names, dtypes and shapes."""
        if len(tensors) != len(self.entries):
            return False
        for name, t in tensors.items():
            entry = self.entries.get(name)
            if entry is None or entry.dtype != dtype_codes().get(t.dtype) \
                    or entry.shape != tuple(t.shape):
                return False
        return True


def _code(name: str, t: torch.Tensor) -> str:
    code = dtype_codes().get(t.dtype)
    if code is None:
        raise TypeError(f"tensor '{name}' has dtype {t.dtype}, which the snapshot format "
                        f"cannot store; supported: {sorted(str(d) for d in dtype_codes())}")
    return code


def plan_layout(tensors: Mapping[str, torch.Tensor],
                metadata: Mapping[str, str] | None = None) -> SnapshotLayout:
    """Plan a payload for ``tensors``. Raises TypeError for an unsupported dtype or a
    non-str metadata value, ValueError for a reserved or too long header."""
    header: dict[str, Any] = {}
    if metadata:
        if not all(type(k) is str and type(v) is str for k, v in metadata.items()):
            raise TypeError("safetensors metadata must map str to str")
        header["__metadata__"] = dict(metadata)
    if not all(type(name) is str for name in tensors):
        raise TypeError("tensor names must be str")
    if "__metadata__" in tensors:
        raise ValueError("'__metadata__' is reserved by safetensors; rename that tensor")
    order = sorted(tensors, key=lambda n: -_ITEMSIZE[_code(n, tensors[n])])
    entries: dict[str, TensorEntry] = {}
    offset = 0
    for name in order:
        t = tensors[name]
        code = dtype_codes()[t.dtype]
        nbytes = t.numel() * t.element_size()
        entries[name] = TensorEntry(code, tuple(t.shape), offset, offset + nbytes)
        header[name] = {"dtype": code, "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % DATA_ALIGN)
    if len(text) > MAX_HEADER_BYTES:
        raise ValueError(f"snapshot header would be {len(text)} bytes, over the "
                         f"{MAX_HEADER_BYTES}-byte cap; snapshot fewer, larger tensors")
    prefix = len(text).to_bytes(8, "little") + text
    return SnapshotLayout(prefix, entries, len(prefix), len(prefix) + offset)


def _writable(buf: Any, layout: SnapshotLayout,
              tensors: Mapping[str, torch.Tensor]) -> memoryview:
    view = byte_view(buf)
    if view.readonly:
        raise ValueError("snapshot buffer is read-only")
    if len(view) < layout.total_bytes:
        raise ValueError(f"snapshot buffer holds {len(view)} bytes, layout needs "
                         f"{layout.total_bytes}; plan a larger buffer")
    if not layout.matches(tensors):
        raise ValueError("tensors do not match the planned layout (names, dtypes or "
                         "shapes changed); call plan_layout again")
    return view


def write_into(buf: Any, layout: SnapshotLayout, tensors: Mapping[str, torch.Tensor], *,
               non_blocking: bool = False, stream: Any = None,
               after: Callable[[str, int], None] | None = None) -> None:
    """Write header and tensor bytes into a preallocated writable buffer, one copy per
    tensor. CUDA tensors are copied on ``stream`` (after it waits for the current stream);
    with ``non_blocking=True`` (``buf`` pinned or cudaHostRegister-ed) the caller must
    synchronize ``stream`` (the current stream when None) before reading ``buf``,
    computing ``checksums`` or changing the tensors; ``after(name, nbytes)`` runs once each
    tensor's copy is issued (to record CUDA events). Called on the training thread. Raises
    ValueError when the buffer is read-only or too small, or the tensors do not match."""
    import torch

    view = _writable(buf, layout, tensors)
    view[:layout.data_start] = layout.header
    dest = torch.frombuffer(view, dtype=torch.uint8, count=layout.total_bytes)
    waited = False
    for name, entry in layout.entries.items():
        if entry.end == entry.begin:
            continue
        src = tensors[name].detach()
        out = dest[layout.data_start + entry.begin:layout.data_start + entry.end]
        if src.is_cuda and stream is not None:
            if not waited:
                stream.wait_stream(torch.cuda.current_stream(src.device))
                waited = True
            with torch.cuda.stream(stream):
                out.copy_(src.contiguous().view(-1).view(torch.uint8), non_blocking=non_blocking)
        else:
            out.copy_(src.contiguous().view(-1).view(torch.uint8), non_blocking=non_blocking)
        if after is not None:
            after(name, entry.end - entry.begin)


def _spans(layout: SnapshotLayout) -> list[Span]:
    return [Span(name, layout.data_start + e.begin, layout.data_start + e.end)
            for name, e in layout.entries.items()]


def _digest_parallel(view: memoryview, layout: SnapshotLayout, algos: Mapping[str, str],
                     workers: int, pool: Executor | None) -> dict[str, str]:
    if pool is not None or workers <= 1:
        return digest_spans(view, _spans(layout), algos, pool=pool, workers=workers)
    with ThreadPoolExecutor(max_workers=workers - 1, thread_name_prefix="checksum") as own:
        return digest_spans(view, _spans(layout), algos, pool=own, workers=workers)


def checksums(buf: Any, layout: SnapshotLayout, *, algo: str = DEFAULT_ALGO,
              workers: int = 1, pool: Executor | None = None) -> dict[str, str]:
    """Per-tensor ``"<algo>:<hex>"`` over the tensor bytes in ``buf``, on ``workers``
    threads (the caller's plus ``pool``'s, or a temporary pool)."""
    check_algo(algo)
    return _digest_parallel(byte_view(buf), layout, dict.fromkeys(layout.entries, algo),
                            workers, pool)


def write_job(layout: SnapshotLayout, tensors: Mapping[str, torch.Tensor], *,
              algo: str = DEFAULT_ALGO) -> DigestJob:
    """The fused copy + checksums of CPU ``tensors`` into a slot of ``layout``, to be
    ``start_write``-ed once the slot is known (threads may already wait in ``work``)."""
    if any(t.is_cuda for t in tensors.values()):
        raise ValueError("the fused copy takes CPU tensors; use write_into for CUDA")
    algos = dict.fromkeys(layout.entries, check_algo(algo))
    return DigestJob(_spans(layout), algos, tensors)


def landing_job(layout: SnapshotLayout, *, algo: str = DEFAULT_ALGO,
                ready: Callable[[str], None]) -> DigestJob:
    """Checksums of a slot whose tensors are still landing (CUDA device-to-host copies):
    each tensor is hashed, in payload order, once ``ready(name)`` returns, so hashing
    follows the copies instead of waiting for the last one."""
    return DigestJob(_spans(layout), dict.fromkeys(layout.entries, check_algo(algo)),
                     ready=ready)


def start_write(job: DigestJob, buf: Any, layout: SnapshotLayout,
                tensors: Mapping[str, torch.Tensor]) -> None:
    """Write ``layout``'s header into ``buf`` and let ``job``'s threads copy and hash."""
    view = _writable(buf, layout, tensors)
    view[:layout.data_start] = layout.header
    job.start(view)


def write_checksummed(buf: Any, layout: SnapshotLayout, tensors: Mapping[str, torch.Tensor],
                      *, algo: str = DEFAULT_ALGO, workers: int = 1,
                      pool: Executor | None = None) -> dict[str, str]:
    """``write_into`` and ``checksums`` fused for CPU tensors: each chunk is hashed right
    after it is copied, on ``workers`` threads. Returns the per-tensor checksums."""
    job = write_job(layout, tensors, algo=algo)
    start_write(job, buf, layout, tensors)
    return finish(job, helpers(job, pool, workers))


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):    # 1e999: the canonical form (HMAC) could not hold it
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _strict_json(data: bytes | memoryview) -> Any:
    return json.loads(bytes(data).decode("utf-8"), object_pairs_hook=_no_duplicates,
                      parse_constant=_reject_constant, parse_float=_finite_float)


_MAX_DIM = (1 << 63) - 1      # torch sizes are int64


def _is_shape(value: Any) -> bool:
    return type(value) is list and all(type(d) is int and 0 <= d <= _MAX_DIM for d in value)


def _header_entry(name: str, raw: Any) -> TensorEntry:
    if type(raw) is not dict or set(raw) != {"dtype", "shape", "data_offsets"}:
        raise SnapshotCorrupt(f"tensor '{name}': header entry must hold exactly dtype, "
                              f"shape and data_offsets, got {raw!r:.120}")
    code, shape, offs = raw["dtype"], raw["shape"], raw["data_offsets"]
    if type(code) is not str or code not in _ITEMSIZE:     # a list is not even hashable
        raise SnapshotCorrupt(f"tensor '{name}': unknown dtype {code!r:.40}")
    if not _is_shape(shape):
        raise SnapshotCorrupt(f"tensor '{name}': shape {shape!r:.80} is not a list of "
                              "non-negative ints below 2**63")
    if type(offs) is not list or len(offs) != 2 or not all(type(o) is int for o in offs) \
            or not 0 <= offs[0] <= offs[1]:
        raise SnapshotCorrupt(f"tensor '{name}': data_offsets {offs!r:.80} is not [begin, end] "
                              "with 0 <= begin <= end")
    if math.prod(shape) * _ITEMSIZE[code] != offs[1] - offs[0]:
        raise SnapshotCorrupt(f"tensor '{name}': shape {shape} of {code} needs "
                              f"{math.prod(shape) * _ITEMSIZE[code]} bytes but data_offsets "
                              f"span {offs[1] - offs[0]}")
    return TensorEntry(code, tuple(shape), offs[0], offs[1])


def parse_header(buf: Any) -> SnapshotLayout:
    """Validate a payload's header against the buffer; raises SnapshotCorrupt naming the
    tensor and the problem (truncation, bad JSON, dtype, size, overlap or gap)."""
    view = byte_view(buf)
    if len(view) < 8:
        raise SnapshotCorrupt(f"payload is {len(view)} bytes, shorter than its 8-byte "
                              "header length (truncated)")
    n = int.from_bytes(view[:8], "little")
    if n > MAX_HEADER_BYTES:
        raise SnapshotCorrupt(f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte cap")
    if 8 + n > len(view):
        raise SnapshotCorrupt(f"header length {n} runs past the end of the {len(view)}-byte "
                              "payload (truncated)")
    try:
        raw = _strict_json(view[8:8 + n])
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise SnapshotCorrupt(f"header is not valid JSON: {exc}") from exc
    if type(raw) is not dict:
        raise SnapshotCorrupt("header is not a JSON object")
    meta = raw.pop("__metadata__", {})
    if type(meta) is not dict or not all(type(v) is str for v in meta.values()):
        raise SnapshotCorrupt("header __metadata__ is not an object of strings")
    entries = {name: _header_entry(name, value) for name, value in raw.items()}
    end = 0
    for name, e in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if e.begin != end:
            problem = "overlaps the previous tensor" if e.begin < end else "leaves a gap"
            raise SnapshotCorrupt(f"tensor '{name}': data_offsets [{e.begin}, {e.end}] "
                                  f"{problem} (previous ends at {end})")
        end = e.end
        if 8 + n + end > len(view):
            raise SnapshotCorrupt(f"tensor '{name}' ends at byte {8 + n + end}, past the end "
                                  f"of the {len(view)}-byte payload (truncated)")
    if 8 + n + end != len(view):
        raise SnapshotCorrupt(f"payload has {len(view) - 8 - n - end} bytes after its last "
                              "tensor (pass exactly total_bytes of a larger slot)")
    return SnapshotLayout(bytes(view[:8 + n]), entries, 8 + n, 8 + n + end)


def read_tensors(buf: Any, verify_against: Manifest | None = None, *, source: str = "",
                 workers: int = 1) -> dict[str, torch.Tensor]:
    """Zero-copy tensors over a payload (a misaligned foreign tensor is copied). With a
    manifest, the header must agree with it and every checksum must match; the HMAC is the
    caller's to check first (``Manifest.verify``). Raises SnapshotCorrupt naming the
    tensor. Tensors over a read-only buffer (bytes) must not be written to. ``buf``
    must be exactly the payload: slice a larger slot to ``total_bytes`` first."""
    import torch

    layout = parse_header(buf)
    view = byte_view(buf)
    if verify_against is not None:
        _verify_payload(view, layout, verify_against, source or "<payload>", workers)
    with warnings.catch_warnings():     # read-only buffers are documented above
        warnings.simplefilter("ignore", UserWarning)
        base = torch.frombuffer(view, dtype=torch.uint8, count=layout.total_bytes)
    out: dict[str, torch.Tensor] = {}
    for name, e in layout.entries.items():
        dtype = code_dtypes()[e.dtype]
        if e.end == e.begin:
            out[name] = torch.empty(e.shape, dtype=dtype)
            continue
        raw = base[layout.data_start + e.begin:layout.data_start + e.end]
        if (layout.data_start + e.begin) % dtype.itemsize:
            raw = raw.clone()
        out[name] = raw.view(dtype).view(e.shape)
    return out


def verify_snapshot(buf: Any, manifest: bytes, *, secret: bytes | None, source: str,
                    workers: int = 1) -> Manifest:
    """Check a stored snapshot without building tensors: the manifest parses, its HMAC
    matches ``secret`` (when given), and the payload's header and every tensor checksum
    agree with it. Returns the manifest; raises SnapshotCorrupt / SnapshotUnauthenticated
    naming ``source`` and the first bad tensor."""
    parsed = Manifest.from_json(manifest, source)
    parsed.verify(secret, source)
    view = byte_view(buf)
    try:
        layout = parse_header(view)
    except SnapshotCorrupt as exc:
        raise SnapshotCorrupt(f"{source}: {exc}") from exc
    _verify_payload(view, layout, parsed, source, workers)
    return parsed


def _verify_payload(view: memoryview, layout: SnapshotLayout, manifest: Manifest,
                    where: str, workers: int) -> None:
    if manifest.total_bytes != layout.total_bytes:
        raise SnapshotCorrupt(f"{where}: payload is {layout.total_bytes} bytes, manifest "
                              f"records {manifest.total_bytes}")
    for name in sorted(set(manifest.tensors) ^ set(layout.entries)):
        side = "manifest" if name in manifest.tensors else "payload"
        raise SnapshotCorrupt(f"{where}: tensor '{name}' is only in the {side}")
    ordered = sorted(layout.entries, key=lambda n: layout.entries[n].begin)
    for name in ordered:
        e, rec = layout.entries[name], manifest.tensors[name]
        if (rec["dtype"], tuple(rec["shape"]), rec["offset"], rec["nbytes"]) != \
                (e.dtype, e.shape, layout.data_start + e.begin, e.end - e.begin):
            raise SnapshotCorrupt(f"{where}: tensor '{name}': header says {e.dtype} "
                                  f"{list(e.shape)} at {layout.data_start + e.begin}, manifest "
                                  f"says {rec['dtype']} {rec['shape']} at {rec['offset']}")
    algos = {name: rec["checksum"].split(":", 1)[0] for name, rec in manifest.tensors.items()}
    got = _digest_parallel(view, layout, algos, workers, None)
    for name in ordered:
        if not hmac_lib.compare_digest(got[name], manifest.tensors[name]["checksum"]):
            raise SnapshotCorrupt(f"{where}: tensor '{name}' checksum mismatch: manifest "
                                  f"{manifest.tensors[name]['checksum']}, bytes {got[name]}")


_HEXDIGITS = frozenset("0123456789abcdef")


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _is_hex(text: str, length: int) -> bool:
    return len(text) == length and set(text) <= _HEXDIGITS


def _tensor_problem(rec: Any, total: int) -> str | None:
    if type(rec) is not dict or set(rec) != {"dtype", "shape", "offset", "nbytes", "checksum"}:
        return "must hold exactly dtype, shape, offset, nbytes and checksum"
    if type(rec["dtype"]) is not str or rec["dtype"] not in _ITEMSIZE:
        return f"has unknown dtype {rec['dtype']!r:.40}"
    if not _is_shape(rec["shape"]):
        return "shape is not a list of non-negative ints below 2**63"
    if not (_is_count(rec["offset"]) and _is_count(rec["nbytes"])):
        return "offset and nbytes must be non-negative ints"
    if rec["nbytes"] != math.prod(rec["shape"]) * _ITEMSIZE[rec["dtype"]]:
        return f"nbytes {rec['nbytes']} does not match shape {rec['shape']} of {rec['dtype']}"
    if rec["offset"] + rec["nbytes"] > total:
        return f"ends at {rec['offset'] + rec['nbytes']}, past total_bytes {total}"
    algo, _, digest = str(rec["checksum"]).partition(":")
    if type(rec["checksum"]) is not str or not _is_hex(digest, HEX_LEN.get(algo, -1)):
        return f"checksum {rec['checksum']!r:.80} is not '<algo>:<hex>' with algo in {list(ALGOS)}"
    return None


def _mac(secret: bytes, body: bytes) -> str:
    return hmac_lib.new(secret, body, hashlib.sha256).hexdigest()


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """The JSON record beside a payload: identity, tree spec, per-tensor checksums, HMAC.

    ``tensors[name]["offset"]`` is the absolute byte offset in the payload. ``hmac`` is
    the hex HMAC-SHA256 over ``to_json()`` of every other field, "" when unsigned."""

    format_version: int = FORMAT_VERSION
    job: str
    rank: int
    step: int
    generation: int
    tree_spec: dict[str, Any]
    tensors: dict[str, dict[str, Any]]
    total_bytes: int
    created_at: float
    hmac: str = ""

    def _canonical(self, with_hmac: bool) -> bytes:
        body = {f.name: getattr(self, f.name) for f in fields(self)
                if with_hmac or f.name != "hmac"}
        return json.dumps(body, sort_keys=True, separators=(",", ":"),
                          allow_nan=False).encode()

    def to_json(self) -> bytes:
        """Canonical JSON bytes (sorted keys, compact separators, ASCII)."""
        return self._canonical(True)

    def sign(self, secret: bytes) -> Manifest:
        """A copy carrying the HMAC of its other fields under ``secret``."""
        return replace(self, hmac=_mac(secret, self._canonical(False)))

    def verify(self, secret: bytes | None, source: str = "") -> None:
        """No-op without a secret; else raises SnapshotUnauthenticated when the HMAC is
        missing or does not match (another job's, or a tampered, snapshot)."""
        if secret is None:
            return
        where = source or "<manifest>"
        if not self.hmac:
            raise SnapshotUnauthenticated(f"{where}: manifest is unsigned but the job has a "
                                          "secret; refusing it (written without the secret?)")
        if not hmac_lib.compare_digest(_mac(secret, self._canonical(False)), self.hmac):
            raise SnapshotUnauthenticated(f"{where}: manifest HMAC does not match the job "
                                          "secret (tampered, or another job's snapshot)")

    @classmethod
    def from_json(cls, data: bytes, source: str = "") -> Manifest:
        """Parse and strictly validate; raises SnapshotCorrupt naming source and field."""
        where = source or "<manifest>"
        if len(data) > MAX_MANIFEST_BYTES:
            raise SnapshotCorrupt(f"{where}: manifest is {len(data)} bytes, over the "
                                  f"{MAX_MANIFEST_BYTES}-byte cap")
        try:
            raw = _strict_json(data)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise SnapshotCorrupt(f"{where}: manifest is not valid JSON: {exc}") from exc
        if type(raw) is not dict:
            raise SnapshotCorrupt(f"{where}: manifest is not a JSON object")
        problem = _manifest_problem(raw, {f.name for f in fields(cls)})
        if problem is not None:
            raise SnapshotCorrupt(f"{where}: manifest field {problem}")
        return cls(**raw)


def _manifest_problem(raw: dict[str, Any], names: set[str]) -> str | None:
    version = raw.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:
        return f"'format_version': unknown version {version!r:.40}; this reads {FORMAT_VERSION}"
    odd = sorted(names ^ set(raw))
    if odd:
        return f"'{odd[0]}': " + ("missing" if odd[0] in names else "unknown field")
    checks = {"job": type(raw["job"]) is str, "rank": _is_count(raw["rank"]),
              "step": _is_count(raw["step"]), "generation": _is_count(raw["generation"]),
              "total_bytes": _is_count(raw["total_bytes"]),
              "created_at": type(raw["created_at"]) in (int, float),
              "tree_spec": type(raw["tree_spec"]) is dict,
              "tensors": type(raw["tensors"]) is dict,
              "hmac": type(raw["hmac"]) is str and (raw["hmac"] == "" or _is_hex(raw["hmac"], 64))}
    for name, ok in checks.items():
        if not ok:
            return f"'{name}': wrong type or value {raw[name]!r:.80}"
    for name, rec in raw["tensors"].items():
        problem = _tensor_problem(rec, raw["total_bytes"])
        if problem is not None:
            return f"'tensors.{name}': {problem}"
    return None


def make_manifest(layout: SnapshotLayout, sums: Mapping[str, str], *, job: str, rank: int,
                  step: int, generation: int, tree_spec: dict[str, Any],
                  created_at: float) -> Manifest:
    """The unsigned manifest of a payload written with ``layout`` and its ``checksums``."""
    tensors = {name: {"dtype": e.dtype, "shape": list(e.shape),
                      "offset": layout.data_start + e.begin, "nbytes": e.end - e.begin,
                      "checksum": sums[name]} for name, e in layout.entries.items()}
    return Manifest(job=job, rank=rank, step=step, generation=generation, tree_spec=tree_spec,
                    tensors=tensors, total_bytes=layout.total_bytes, created_at=created_at)
