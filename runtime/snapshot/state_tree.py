"""Flattening training state: registered objects ⇄ named tensors plus a JSON tree spec.

Owns the tree-spec encoding, tensor naming, applying a restored tree to live objects, and
``RNGState``, the marker object that captures python/numpy/torch (CPU and CUDA) RNGs.
"""
from __future__ import annotations

import logging
import random
import struct
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Mapping, MutableMapping, Sequence

import numpy as np
import torch

from phalanx.configs.errors import SnapshotCorrupt
from phalanx.runtime.snapshot import dtensor
from phalanx.runtime.snapshot.spec_names import DTENSOR_TAG, escape_segment
from phalanx.runtime.snapshot.zero import stateful

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)

SPEC_VERSION = 1

# Tree spec grammar (one JSON value per node; order of dict items is kept):
#   str | int | finite float | bool | null      the value itself (JSON keeps 1 vs 1.0)
#   {"t":"float","bits":"<16 hex>"}             non-finite float, exact IEEE-754 bits
#   {"t":"tensor"|"ndarray","name":N}           placeholder for tensors[N]
#   {"t":"dict","items":[[key,node],...]}       key: str or int; "odict"/"meta" for
#                                               OrderedDict and its ``_metadata``
#   {"t":"list"|"tuple","items":[node,...]}     or "ints":[...] when every item is an int
#   {"t":"size"|"dtype"|"device","v":...}       torch.Size / torch.dtype / torch.device
#   {"t":"np","dtype":D,"v":node}               a numpy scalar (np.float32(1.5), ...)
#   {"t":"np_rng","kind":K,"v":node}            a numpy Generator or RandomState (K): its
#                                               bit generator's state dict (JSON + arrays)
#   {"t":"dtensor","name":N,"mesh":...}         a DTensor: tensors[N] is this rank's local
#                                               shard; placement metadata: dtensor.py
# Whole spec: {"version":1,"objects":{name:{"kind":"state_dict"|"generator"|"value",
#                                           "tree":node}}}


def _join(path: str, key: str | int) -> str:
    return f"{path}/{escape_segment(key)}" if path else escape_segment(key)


class RNGState:
    """Marker object: register it to capture python ``random``, numpy's legacy global
    RNG, torch's CPU generator and (when available) every CUDA device's generator.

    ``load_state_dict`` raises ValueError when the snapshot's CUDA device count differs
    from this process's (replay would not be bit-identical)."""

    def state_dict(self) -> dict[str, Any]:
        version, mt, gauss_next = random.getstate()
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state: dict[str, Any] = {
            # the Mersenne Twister's 625 words as a tensor: as a JSON list in the tree spec
            # they cost more to encode, sign and send than the rest of a per-rank snapshot
            "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64),
                       "gauss_next": gauss_next},
            "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.array(keys, np.uint32)),
                      "pos": int(pos), "has_gauss": int(has_gauss),
                      "cached_gaussian": float(cached)},
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["cuda"] = list(torch.cuda.get_rng_state_all())
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        py = state["python"]
        words = py["state"]     # a tensor; a list in snapshots taken before it was one
        words = words.tolist() if isinstance(words, torch.Tensor) else words
        random.setstate((py["version"], tuple(int(w) for w in words), py["gauss_next"]))
        npst = state["numpy"]
        keys = npst["keys"].cpu().numpy().astype(np.uint32)
        np.random.set_state((npst["kind"], keys, npst["pos"], npst["has_gauss"],
                             npst["cached_gaussian"]))
        torch.set_rng_state(state["torch"].cpu().contiguous())
        cuda = state.get("cuda", [])
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if cuda and len(cuda) != have:
            raise ValueError(f"snapshot holds RNG state for {len(cuda)} CUDA devices but this "
                             f"process sees {have}; restore on the same device count")
        if cuda:
            torch.cuda.set_rng_state_all([t.cpu().contiguous() for t in cuda])


class _Flattener:
    """One pass over the registered objects; collects tensors, dedupes exact aliases."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._seen: dict[tuple, str] = {}

    def tensor(self, t: torch.Tensor, path: str, tag: str = "tensor") -> dict:
        if t.layout != torch.strided:
            raise TypeError(f"cannot snapshot {t.layout} tensor at '{path}': only dense "
                            "(strided) tensors are supported; call .to_dense() first")
        if tag == "tensor" and t.numel() > 0:
            alias = (t.device, t.dtype, t.data_ptr(), tuple(t.shape), t.stride())
            if alias in self._seen:      # tied weights: store once, reference twice
                return {"t": tag, "name": self._seen[alias]}
            self._seen[alias] = path
        self.tensors[path] = t
        return {"t": tag, "name": path}

    def encode(self, value: Any, path: str) -> Any:
        kind = type(value)
        if value is None or kind in (bool, int, str):
            return value
        if kind is float:
            return value if value - value == 0.0 else _float_bits(value)
        if dtensor.is_dtensor(value):     # its local shard, never gathered (dtensor.py)
            local, node = dtensor.describe(value, path)
            return {**node, "name": self.tensor(local, path)["name"]}
        if isinstance(value, torch.Tensor):
            return self.tensor(value, path)
        if kind is torch.Size:
            return {"t": "size", "v": list(value)}
        if kind in (dict, OrderedDict):
            return self._dict(value, path)
        if kind in (list, tuple):
            if value and all(type(v) is int for v in value):
                return {"t": kind.__name__, "ints": list(value)}
            return {"t": kind.__name__,
                    "items": [self.encode(v, _join(path, i)) for i, v in enumerate(value)]}
        if kind is torch.dtype:
            return {"t": "dtype", "v": str(value).removeprefix("torch.")}
        if kind is torch.device:
            return {"t": "device", "v": str(value)}
        if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
            return self.tensor(torch.from_numpy(np.ascontiguousarray(value)), path, "ndarray")
        if isinstance(value, np.generic) and value.dtype.kind in "biuf":
            return {"t": "np", "dtype": value.dtype.name, "v": self.encode(value.item(), path)}
        if kind in (np.random.Generator, np.random.RandomState):
            return {"t": "np_rng", "kind": kind.__name__,
                    "v": self.encode(_np_rng_state(value), path)}
        raise TypeError(f"cannot snapshot value of type {kind.__module__}.{kind.__qualname__} "
                        f"at '{path or '<root>'}': use tensors, numpy arrays or Generators, JSON values, "
                        "dicts, lists or tuples of those, or an object with state_dict()")

    def _dict(self, value: Mapping, path: str) -> dict:
        items = []
        for key, item in value.items():
            if type(key) not in (str, int):
                raise TypeError(f"cannot snapshot dict key {key!r} ({type(key).__name__}) at "
                                f"'{path or '<root>'}': keys must be str or int")
            items.append([key, self.encode(item, _join(path, key))])
        node: dict[str, Any] = {"t": "dict", "items": items}
        if type(value) is OrderedDict:
            node["odict"] = True
            meta = getattr(value, "_metadata", None)
            if meta is not None:        # nn.Module version info used by load_state_dict
                node["meta"] = _Flattener().encode(meta, path)
        return node


def _float_bits(value: float) -> dict:
    return {"t": "float", "bits": struct.pack(">d", value).hex()}


def object_kind(obj: Any) -> str:
    """How an object is captured: ``generator`` (``get_state``), ``state_dict`` (anything
    with ``state_dict()``) or ``value`` (a plain value: JSON, tensors, arrays, containers)."""
    if isinstance(obj, torch.Generator):
        return "generator"
    return "state_dict" if callable(getattr(obj, "state_dict", None)) else "value"


def flatten_state(objects: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict]:
    """Named tensors (as they are: possibly CUDA, possibly non-contiguous) and the JSON
    tree spec of every registered object. Tensors come back from ``unflatten_state`` as
    plain tensors (no Parameter wrapper, no requires_grad). Raises TypeError naming the
    path of a value that cannot be snapshotted."""
    flat = _Flattener()
    specs: dict[str, Any] = {}
    for name, obj in objects.items():
        if type(name) is not str:
            raise TypeError(f"registered object names must be str, got {name!r}")
        kind = object_kind(obj)
        if kind == "generator":
            tree = flat.encode(obj.get_state(), _join("", name))
        elif kind == "state_dict":
            tree = flat.encode(stateful(obj).state_dict(), _join("", name))
        else:
            tree = flat.encode(obj, _join("", name))
        specs[name] = {"kind": kind, "tree": tree}
    return flat.tensors, {"version": SPEC_VERSION, "objects": specs}


class _Builder:
    """Decodes spec nodes; raises SnapshotCorrupt naming the path of a malformed node."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], copy: bool,
                 into: Mapping[str, torch.Tensor] | None = None,
                 meshes: Sequence[DeviceMesh] | None = None) -> None:
        self.tensors = tensors
        self.copy = copy
        self.into = into or {}
        self.meshes = meshes        # None: a DTensor decodes to its plain local shard
        self.used: dict[str, torch.Tensor] = {}

    def decode(self, node: Any, path: str) -> Any:
        if node is None or type(node) in (bool, int, float, str):
            return node
        if type(node) is not dict or type(node.get("t")) is not str:
            raise SnapshotCorrupt(f"tree spec node at '{path}' is not a tagged object: {node!r:.80}")
        try:
            return self._tagged(node, path)
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError,
                struct.error) as exc:
            raise SnapshotCorrupt(f"tree spec node at '{path}' is malformed: {exc!r}") from exc

    def _tagged(self, node: dict, path: str) -> Any:
        tag = node["t"]
        if tag == "dict":
            return self._dict(node, path)
        if tag in ("list", "tuple"):
            if "ints" in node:
                items = [_check_int(v) for v in _check_list(node["ints"])]
            else:
                items = [self.decode(v, _join(path, i))
                         for i, v in enumerate(_check_list(node["items"]))]
            return tuple(items) if tag == "tuple" else items
        if tag in ("tensor", "ndarray"):
            t = self._tensor(node["name"], path)
            return t.numpy() if tag == "ndarray" else t
        if tag == DTENSOR_TAG:
            local = self._tensor(node["name"], path)
            return local if self.meshes is None else dtensor.rebuild(local, node, self.meshes,
                                                                     path)
        if tag == "float":
            return struct.unpack(">d", bytes.fromhex(node["bits"]))[0]
        if tag == "size":
            return torch.Size([_check_int(v) for v in _check_list(node["v"])])
        if tag == "dtype":
            dtype = getattr(torch, node["v"])
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"{node['v']!r} is not a torch dtype")
            return dtype
        if tag == "device":
            return torch.device(node["v"])
        if tag == "np":
            dtype = np.dtype(node["dtype"])
            if dtype.kind not in "biuf":
                raise ValueError(f"unsupported numpy scalar dtype {dtype}")
            return dtype.type(self.decode(node["v"], path))
        if tag == "np_rng":
            return _np_rng(node["kind"], self.decode(node["v"], path))
        raise ValueError(f"unknown tag {tag!r}")

    def _dict(self, node: dict, path: str) -> dict:
        out: dict = OrderedDict() if node.get("odict") else {}
        for key, item in _check_list(node["items"]):
            if type(key) not in (str, int):
                raise ValueError(f"dict key {key!r} is neither str nor int")
            out[key] = self.decode(item, _join(path, key))
        if "meta" in node:
            out._metadata = _Builder({}, False).decode(node["meta"], path)  # type: ignore[attr-defined]
        return out

    def _tensor(self, name: Any, path: str) -> torch.Tensor:
        if type(name) is not str or name not in self.tensors:
            raise SnapshotCorrupt(f"tree spec at '{path}' names tensor {name!r} "
                                  "that is not in the payload")
        if name not in self.used:
            t = self.tensors[name]
            dest = self.into.get(name)
            if not self.copy:
                self.used[name] = t
            elif dest is not None and (dest.shape, dest.dtype, dest.device) == (
                    t.shape, t.dtype, t.device) and dest.data_ptr() != t.data_ptr():
                with torch.no_grad():
                    dest.copy_(t)
                self.used[name] = dest
            else:
                self.used[name] = t.clone()
        return self.used[name]


# numpy's bit generators a snapshot may name (their state is plain ints and uint arrays)
_BIT_GENERATORS = ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64")


def _np_rng_state(rng: np.random.Generator | np.random.RandomState) -> dict[str, Any]:
    """The bit generator's state: a dict of str keys, ints, floats and uint arrays."""
    if isinstance(rng, np.random.RandomState):
        return dict(rng.get_state(legacy=False))
    return dict(rng.bit_generator.state)


def _np_rng(kind: Any, state: Any) -> np.random.Generator | np.random.RandomState:
    """A numpy ``kind`` ("Generator" or "RandomState") in ``state``; ValueError if neither."""
    name = state.get("bit_generator") if isinstance(state, dict) else None
    if name not in _BIT_GENERATORS or kind not in ("Generator", "RandomState"):
        raise ValueError(f"unsupported numpy RNG {kind!r} with bit generator {name!r}")
    bit_generator = getattr(np.random, name)()
    try:
        bit_generator.state = state
    except (OverflowError, IndexError, KeyError, TypeError) as exc:
        raise ValueError(f"numpy {name} state does not fit: {exc}") from exc
    if kind == "Generator":
        return np.random.Generator(bit_generator)
    return np.random.RandomState(bit_generator)


def _check_list(value: Any) -> list:
    if type(value) is not list:
        raise ValueError(f"expected a list, got {value!r:.80}")
    return value


def _check_int(value: Any) -> int:
    if type(value) is not int:
        raise ValueError(f"expected an int, got {value!r}")
    return value


def _spec_objects(spec: Any) -> dict[str, dict]:
    """The spec's ``objects`` table, checked to be well formed (else SnapshotCorrupt)."""
    if not isinstance(spec, Mapping) or spec.get("version") != SPEC_VERSION \
            or type(spec.get("objects")) is not dict:
        raise SnapshotCorrupt(f"tree spec is not a version-{SPEC_VERSION} spec object")
    for name, entry in spec["objects"].items():
        if type(entry) is not dict or "tree" not in entry \
                or entry.get("kind") not in ("state_dict", "generator", "value"):
            raise SnapshotCorrupt(f"tree spec entry for object '{name}' is malformed")
    return spec["objects"]


def _decode_all(tensors: Mapping[str, torch.Tensor], spec: Any, copy_for: Any,
                into_for: Any = None, meshes: Sequence[DeviceMesh] | None = None,
                ) -> dict[str, tuple[str, Any]]:
    out: dict[str, tuple[str, Any]] = {}
    used: set[str] = set()
    for name, entry in _spec_objects(spec).items():
        builder = _Builder(tensors, copy_for(name), into_for(name) if into_for else None,
                           meshes)
        out[name] = (entry["kind"], builder.decode(entry["tree"], _join("", name)))
        used.update(builder.used)
    unreferenced = sorted(set(tensors) - used)
    if unreferenced:
        raise SnapshotCorrupt(f"payload holds tensors the tree spec never references: "
                              f"{unreferenced[:5]}")
    return out


def unflatten_state(tensors: Mapping[str, torch.Tensor], spec: Mapping[str, Any], *,
                    copy: bool = False) -> dict[str, Any]:
    """Rebuild ``{object name: state dict or value}`` from ``flatten_state``'s output.

    With ``copy=False`` the tensors in the result are the given ones (views over the
    snapshot buffer, when they came from ``read_tensors``). A DTensor comes back as its
    plain local shard (no live mesh to rebuild it on). Raises SnapshotCorrupt when the
    spec is malformed or does not match the tensors."""
    return {name: tree for name, (_, tree) in _decode_all(tensors, spec, lambda _: copy).items()}


def apply_state(objects: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
                spec: Mapping[str, Any], *, owned: bool = False) -> dict[str, Any]:
    """Load a snapshot into the registered objects in place; returns the plain values.

    Stateful objects get ``load_state_dict`` (an nn.Module copies into its existing
    parameters, so parameter identity is kept), generators ``set_state``. A plain value is
    restored with ``assign_in_place`` (a dict or list is refilled, a tensor of the same
    shape and dtype is ``copy_``-ed into, so references the user holds see the restored
    content) and, when ``objects`` is mutable (a dict), rebound there: afterwards
    ``objects[name]`` holds the restored value even for an int or a str. Every plain value
    is also returned as ``{name: value}``. Nothing in the objects aliases ``tensors``
    afterwards, so the snapshot buffer may be reused at once: a module copies into its
    parameters; other objects get their restored tensors copied into the tensors they hold
    now at the same path (same shape, dtype and device: an optimizer's state after a
    rollback; fresh memory would cost page faults, slower here than the copy), else
    clones. A DTensor is rebuilt over the live DeviceMesh of the registered objects'
    DTensors, its local shard copied into the live one at the same path when there is one
    (an optimizer's) or into the module's parameter by ``load_state_dict``. Raises
    ValueError when the registered names differ from the snapshot's, SnapshotCorrupt when
    the spec is malformed, ReshardUnsupported when a DTensor's mesh or coordinate differs
    from the live one (another world size or mesh shape).
    """
    names = _spec_objects(spec)
    if set(names) != set(objects):
        raise ValueError(f"snapshot holds objects {sorted(names)} but {sorted(objects)} are "
                         "registered; register the same objects as at capture")
    # ``owned``: the tensors are the caller's to give away (received, not views of a
    # snapshot buffer): an object with nothing live to copy into keeps them as they are
    decoded = _decode_all(tensors, spec,
                          lambda name: not owned and not isinstance(objects[name],
                                                                    torch.nn.Module),
                          lambda name: _live_tensors(name, objects[name]),
                          dtensor.live_meshes(objects.values()))
    values: dict[str, Any] = {}
    for name, obj in objects.items():
        kind, tree = decoded[name]
        if kind != object_kind(obj):
            raise ValueError(f"object '{name}' was captured as {kind} but is now "
                             f"{object_kind(obj)} ({type(obj).__name__})")
        if kind == "generator":
            obj.set_state(tree)
        elif kind == "state_dict":
            stateful(obj).load_state_dict(tree)
        else:
            values[name] = assign_in_place(obj, tree)
    if isinstance(objects, MutableMapping):  # after the loop: never mutate while iterating
        objects.update(values)
    log.debug("event=state_applied objects=%d tensors=%d", len(objects), len(tensors))
    return values


def _live_tensors(name: str, obj: Any) -> dict[str, torch.Tensor]:
    """The tensors a non-module object holds now, by snapshot path (``apply_state``)."""
    if isinstance(obj, torch.nn.Module) or object_kind(obj) == "generator":
        return {}
    try:
        return flatten_state({name: obj})[0]
    except (TypeError, ValueError):     # a value that was never capturable: nothing to reuse
        return {}


def assign_in_place(old: Any, new: Any) -> Any:
    """``new``, written into ``old`` when it can be (same-type dict or list: refilled; tensor
    of the same shape and dtype: copied into) so references to ``old`` see the new content;
    returns the object that now holds the value (``old`` or ``new``); a numpy Generator or
    RandomState is set to the new one's state."""
    if type(old) is type(new) and isinstance(old, dict):
        old.clear()
        old.update(new)
        return old
    if type(old) is list and type(new) is list:
        old[:] = new
        return old
    if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) \
            and old.shape == new.shape and old.dtype == new.dtype:
        with torch.no_grad():
            old.copy_(new)
        return old
    if type(old) is type(new) and type(old) in (np.random.Generator, np.random.RandomState) \
            and _np_rng_state(old)["bit_generator"] == _np_rng_state(new)["bit_generator"]:
        if isinstance(old, np.random.RandomState):   # the script's generator, rewound
            old.set_state(_np_rng_state(new))
        else:
            old.bit_generator.state = new.bit_generator.state
        return old
    return new
