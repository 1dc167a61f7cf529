"""JSON form (never pickle) of torch.distributed.checkpoint's global ``Metadata``, of
``PayloadRef`` (where a saved item lives) and of non-tensor values; payload naming."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal, Mapping, overload

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from phalanx.configs.errors import SnapshotCorrupt
from phalanx.runtime.snapshot.state_tree import flatten_state, unflatten_state

METADATA_FORMAT = 1
TENSOR = "tensor"
VALUE = "value"
NON_TENSOR_HINT = ("TieredStorageWriter stores tensors and plain JSON values only (no "
                   "pickle); put other non-tensor state in the Session extras (JSON)")


@dataclass(frozen=True)
class PayloadRef:
    """One saved item: ``name`` inside rank ``rank``'s payload. For a tensor, ``offset`` and
    ``nbytes`` are its absolute byte range in the payload; a value (``kind="value"``) lives
    in that rank's manifest tree spec and has offset 0 and its JSON length as nbytes."""

    rank: int
    name: str
    kind: str
    offset: int
    nbytes: int


class _Malformed(ValueError):
    """Internal: a field failed validation; turned into SnapshotCorrupt at the boundary."""


# ------------------------------------------------------------------ names and values

def payload_names(items: list[WriteItem]) -> list[str]:
    """One unique payload name per item: the fqn, ``fqn@o1,o2`` for a shard at those
    offsets, ``~n`` appended on a clash (``__metadata__`` is safetensors')."""
    used = {"__metadata__"}
    names = []
    for item in items:
        base = item.index.fqn
        if item.type == WriteItemType.SHARD and item.index.offset is not None:
            base += "@" + ",".join(str(o) for o in item.index.offset)
        name, n = base, 0
        while name in used:
            n += 1
            name = f"{base}~{n}"
        used.add(name)
        names.append(name)
    return names


def encode_value(fqn: str, value: Any) -> Any:
    """The state-tree JSON node of a non-tensor value (None, bool, int, float, str, list,
    tuple, dict with str/int keys, torch.Size/dtype/device, numpy scalar; non-finite
    floats kept bit-exact). Raises TypeError for anything else, tensors included."""
    try:
        tensors, spec = flatten_state({fqn: value})
    except TypeError as exc:
        raise TypeError(f"'{fqn}' ({type(value).__name__}): {NON_TENSOR_HINT}; {exc}") from exc
    entry = spec["objects"][fqn]
    if tensors or entry["kind"] != "value":
        raise TypeError(f"'{fqn}' ({type(value).__name__}) holds tensors or state_dict() "
                        f"objects inside a non-tensor value; {NON_TENSOR_HINT}")
    return entry["tree"]


# ------------------------------------------------------------------------------ encode

def _torch_name(value: Any) -> str:
    return str(value).removeprefix("torch.")


def _encode_tensor_md(md: TensorStorageMetadata) -> dict[str, Any]:
    props = md.properties
    return {"type": TENSOR, "dtype": _torch_name(props.dtype), "layout": _torch_name(props.layout),
            "requires_grad": bool(props.requires_grad),
            "memory_format": _torch_name(props.memory_format),
            "pin_memory": bool(props.pin_memory), "size": list(md.size),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks]}


def _encode_entry(fqn: str, md: Any) -> dict[str, Any]:
    if isinstance(md, TensorStorageMetadata):
        return _encode_tensor_md(md)
    if isinstance(md, BytesStorageMetadata):
        return {"type": "bytes"}
    raise TypeError(f"DCP metadata for '{fqn}' is {type(md).__name__}; only tensor and bytes "
                    "storage metadata can be stored")


def _encode_planner_data(data: Any) -> Any:
    if data is None:
        return None
    try:
        tensors, spec = flatten_state({"planner_data": data})
    except TypeError as exc:
        raise TypeError(f"the save planner's planner_data cannot be stored as JSON: {exc}") from exc
    if tensors or spec["objects"]["planner_data"]["kind"] != "value":
        raise TypeError("the save planner's planner_data holds tensors or stateful objects; "
                        "only plain JSON-like values can be stored")
    return spec


def _encode_storage_meta(meta: StorageMeta | None) -> Any:
    if meta is None:
        return None
    ckpt = meta.checkpoint_id
    return {"checkpoint_id": None if ckpt is None else os.fspath(ckpt), "save_id": meta.save_id,
            "load_id": meta.load_id, "modules": list(meta.modules)}


def _encode_ref(index: MetadataIndex, ref: PayloadRef) -> list[Any]:
    offset = None if index.offset is None else list(index.offset)
    return [{"fqn": index.fqn, "offset": offset, "index": index.index},
            {"rank": ref.rank, "name": ref.name, "kind": ref.kind, "offset": ref.offset,
             "nbytes": ref.nbytes}]


def metadata_to_json(metadata: Metadata, storage: Mapping[MetadataIndex, PayloadRef]) -> dict:
    """A JSON-ready dict of ``metadata`` (its ``storage_data`` replaced by ``storage``).
    Raises TypeError when the metadata holds something JSON cannot carry exactly."""
    return {
        "format": METADATA_FORMAT,
        "version": metadata.version,
        "state_dict": [[fqn, _encode_entry(fqn, md)]
                       for fqn, md in metadata.state_dict_metadata.items()],
        "planner_data": _encode_planner_data(metadata.planner_data),
        "storage_meta": _encode_storage_meta(metadata.storage_meta),
        "storage": [_encode_ref(index, ref) for index, ref in storage.items()],
    }


# ------------------------------------------------------------------------------ decode

def _need(ok: bool, what: str) -> None:
    if not ok:
        raise _Malformed(what)


def _obj(raw: Any, keys: set[str], what: str) -> dict[str, Any]:
    _need(type(raw) is dict and set(raw) == keys, f"{what} must be an object with exactly "
          f"{sorted(keys)}, got {raw!r:.120}")
    return raw


@overload
def _ints(raw: Any, what: str, *, allow_none: Literal[False] = False) -> list[int]: ...


@overload
def _ints(raw: Any, what: str, *, allow_none: bool) -> list[int] | None: ...


def _ints(raw: Any, what: str, *, allow_none: bool = False) -> list[int] | None:
    if raw is None and allow_none:
        return None
    _need(type(raw) is list and all(type(v) is int and v >= 0 for v in raw),
          f"{what} must be a list of non-negative ints, got {raw!r:.80}")
    return raw


def _opt_str(raw: Any, what: str) -> str | None:
    _need(raw is None or type(raw) is str, f"{what} must be a string or null")
    return raw


def _torch_attr(name: Any, kind: type, what: str) -> Any:
    value = getattr(torch, name, None) if type(name) is str else None
    _need(isinstance(value, kind), f"{what} {name!r:.40} is not a torch {kind.__name__}")
    return value


def _decode_entry(fqn: str, raw: Any) -> TensorStorageMetadata | BytesStorageMetadata:
    if type(raw) is dict and raw.get("type") == "bytes":
        _obj(raw, {"type"}, f"'{fqn}'")
        return BytesStorageMetadata()
    keys = {"type", "dtype", "layout", "requires_grad", "memory_format", "pin_memory", "size",
            "chunks"}
    raw = _obj(raw, keys, f"'{fqn}'")
    _need(raw["type"] == TENSOR, f"'{fqn}' has unknown type {raw['type']!r:.40}")
    _need(type(raw["requires_grad"]) is bool and type(raw["pin_memory"]) is bool,
          f"'{fqn}': requires_grad and pin_memory must be booleans")
    props = TensorProperties(
        dtype=_torch_attr(raw["dtype"], torch.dtype, f"'{fqn}' dtype"),
        layout=_torch_attr(raw["layout"], torch.layout, f"'{fqn}' layout"),
        requires_grad=raw["requires_grad"],
        memory_format=_torch_attr(raw["memory_format"], torch.memory_format,
                                  f"'{fqn}' memory_format"),
        pin_memory=raw["pin_memory"])
    size = _ints(raw["size"], f"'{fqn}' size")
    _need(type(raw["chunks"]) is list, f"'{fqn}' chunks must be a list")
    chunks = []
    for chunk in raw["chunks"]:
        chunk = _obj(chunk, {"offsets", "sizes"}, f"a chunk of '{fqn}'")
        offsets = _ints(chunk["offsets"], f"'{fqn}' chunk offsets")
        sizes = _ints(chunk["sizes"], f"'{fqn}' chunk sizes")
        _need(len(offsets) == len(sizes) == len(size)
              and all(o + s <= d for o, s, d in zip(offsets, sizes, size)),
              f"'{fqn}' chunk {offsets}+{sizes} does not fit its tensor size {size}")
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
    return TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=chunks)


def _decode_planner_data(raw: Any) -> Any:
    if raw is None:
        return None
    try:
        return unflatten_state({}, raw)["planner_data"]
    except (SnapshotCorrupt, KeyError, TypeError) as exc:
        raise _Malformed(f"planner_data is not a valid value spec: {exc}") from exc


def _decode_storage_meta(raw: Any) -> StorageMeta | None:
    if raw is None:
        return None
    raw = _obj(raw, {"checkpoint_id", "save_id", "load_id", "modules"}, "storage_meta")
    _need(type(raw["modules"]) is list and all(type(m) is str for m in raw["modules"]),
          "storage_meta modules must be a list of strings")
    return StorageMeta(checkpoint_id=_opt_str(raw["checkpoint_id"], "checkpoint_id"),
                       save_id=_opt_str(raw["save_id"], "save_id"),
                       load_id=_opt_str(raw["load_id"], "load_id"), modules=list(raw["modules"]))


def _decode_ref(pair: Any, ranks: int | None) -> tuple[MetadataIndex, PayloadRef]:
    _need(type(pair) is list and len(pair) == 2, f"storage entry {pair!r:.80} is not a pair")
    key = _obj(pair[0], {"fqn", "offset", "index"}, "storage key")
    _need(type(key["fqn"]) is str, "storage key fqn must be a string")
    _need(key["index"] is None or type(key["index"]) is int, "storage key index must be an int")
    offset = _ints(key["offset"], f"storage key '{key['fqn']}' offset", allow_none=True)
    ref = _obj(pair[1], {"rank", "name", "kind", "offset", "nbytes"}, f"'{key['fqn']}' location")
    _need(type(ref["rank"]) is int and ref["rank"] >= 0 and (ranks is None or ref["rank"] < ranks)
          and type(ref["name"]) is str and ref["kind"] in (TENSOR, VALUE)
          and all(type(ref[k]) is int and ref[k] >= 0 for k in ("offset", "nbytes")),
          f"'{key['fqn']}' location {ref!r:.120} is malformed")
    return MetadataIndex(key["fqn"], offset, key["index"]), PayloadRef(**ref)


def metadata_from_json(raw: Any, where: str, ranks: int | None = None) -> Metadata:
    """Rebuild ``Metadata`` (``storage_data``: MetadataIndex → PayloadRef) from
    ``metadata_to_json``'s output. Raises SnapshotCorrupt naming ``where`` and the field;
    ``ranks``, when known, bounds the ranks a location may name."""
    try:
        raw = _obj(raw, {"format", "version", "state_dict", "planner_data", "storage_meta",
                         "storage"}, "dcp_metadata")
        _need(raw["format"] == METADATA_FORMAT,
              f"format {raw['format']!r:.20} is unknown; this reads {METADATA_FORMAT}")
        _need(type(raw["state_dict"]) is list and type(raw["storage"]) is list,
              "state_dict and storage must be lists")
        entries: dict[str, Any] = {}
        for pair in raw["state_dict"]:
            _need(type(pair) is list and len(pair) == 2 and type(pair[0]) is str,
                  f"state_dict entry {pair!r:.80} is not a [fqn, entry] pair")
            entries[pair[0]] = _decode_entry(pair[0], pair[1])
        storage = dict(_decode_ref(pair, ranks) for pair in raw["storage"])
        return Metadata(state_dict_metadata=entries,
                        planner_data=_decode_planner_data(raw["planner_data"]),
                        storage_data=storage,
                        storage_meta=_decode_storage_meta(raw["storage_meta"]),
                        version=_opt_str(raw["version"], "version"))
    except _Malformed as exc:
        raise SnapshotCorrupt(f"{where}: dcp_metadata: {exc}") from exc
