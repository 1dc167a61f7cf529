"""The round-trip law apply(capture(x)) == x, bit for bit, through the real byte format."""
from __future__ import annotations

import copy
import json
import math
import random
import struct
from collections import OrderedDict, namedtuple
from enum import IntEnum
from types import MappingProxyType
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from phalanx.configs.errors import SnapshotCorrupt
from phalanx.runtime.snapshot.format import (Manifest, checksums, make_manifest, plan_layout,
                                             read_tensors, write_into)
from phalanx.runtime.snapshot.state_tree import (RNGState, apply_state, flatten_state,
                                                 unflatten_state)

pytestmark = pytest.mark.unit
SETTINGS = settings(max_examples=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
SECRET = b"job-secret"

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
          torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32,
          torch.uint64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]


def capture(objects: dict[str, Any]) -> tuple[bytes, bytes]:
    """What the session does at a step boundary: payload bytes and signed manifest JSON."""
    tensors, spec = flatten_state(objects)
    layout = plan_layout(tensors)
    buf = bytearray(layout.total_bytes)
    write_into(memoryview(buf), layout, tensors)
    manifest = make_manifest(layout, checksums(buf, layout), job="j", rank=0, step=3,
                             generation=1, tree_spec=spec, created_at=12.5).sign(SECRET)
    return bytes(buf), manifest.to_json()


def restore(objects: dict[str, Any], payload: bytes, manifest_json: bytes) -> dict[str, Any]:
    manifest = Manifest.from_json(manifest_json, source="test")
    manifest.verify(SECRET, "test")
    return apply_state(objects, read_tensors(payload, manifest), manifest.tree_spec)


def float_bits(x: float) -> bytes:
    return struct.pack("<d", x)


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Exact equality: types, key types and order, tensor dtype/shape/bits, float bits."""
    assert type(a) is type(b), f"{path}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                           b.contiguous().reshape(-1).view(torch.uint8)), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), path
    elif isinstance(a, np.generic):
        assert a.tobytes() == b.tobytes(), f"{path}: {a!r} vs {b!r}"
    elif isinstance(a, float):
        assert float_bits(a) == float_bits(b), f"{path}: {a!r} vs {b!r}"
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        assert [type(k) for k in a] == [type(k) for k in b], path
        for key in a:
            assert_same(a[key], b[key], f"{path}/{key!r}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def make_mlp(widths: list[int], seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i, (w_in, w_out) in enumerate(zip(widths, widths[1:])):
        layers.append(torch.nn.Linear(w_in, w_out, bias=i % 2 == 0))
        layers.append(torch.nn.LayerNorm(w_out) if i % 2 else torch.nn.BatchNorm1d(w_out))
        layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int,
          sched: Any = None) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, model[0].in_features, generator=gen)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if sched is not None:
            sched.step()


widths_st = st.lists(st.integers(1, 6), min_size=2, max_size=4)


@pytest.mark.timeout(60)
@SETTINGS
@given(widths=widths_st, seed=st.integers(0, 2**16))
def test_mlp_round_trip_keeps_bits_and_parameter_identity(widths: list[int], seed: int) -> None:
    src, dst = make_mlp(widths, seed), make_mlp(widths, seed + 1)
    params_before = [id(p) for p in dst.parameters()]
    restore({"model": dst}, *capture({"model": src}))
    assert_same(src.state_dict(), dst.state_dict())
    assert [id(p) for p in dst.parameters()] == params_before


OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
}


@pytest.mark.timeout(60)
@settings(SETTINGS, max_examples=20)
@given(name=st.sampled_from(sorted(OPTIMIZERS)), widths=widths_st,
       steps=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_optimizer_round_trip_then_identical_training(name: str, widths: list[int],
                                                      steps: int, seed: int) -> None:
    model_a, model_b = make_mlp(widths, seed), make_mlp(widths, seed + 7)
    opt_a, opt_b = OPTIMIZERS[name](model_a.parameters()), OPTIMIZERS[name](model_b.parameters())
    train(model_a, opt_a, steps, seed)
    payload, manifest = capture({"model": model_a, "optim": opt_a})
    restore({"model": model_b, "optim": opt_b}, payload, manifest)
    state_a, state_b = opt_a.state_dict(), opt_b.state_dict()
    assert all(type(k) is int for k in state_b["state"])
    assert_same(state_a, state_b)
    train(model_a, opt_a, 2, seed + 1)
    train(model_b, opt_b, 2, seed + 1)
    assert_same(model_a.state_dict(), model_b.state_dict())


SCHEDULERS = {
    "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=7),
    "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=20),
}


@pytest.mark.timeout(60)
@settings(SETTINGS, max_examples=20)
@given(name=st.sampled_from(sorted(SCHEDULERS)), steps=st.integers(0, 8),
       seed=st.integers(0, 2**16))
def test_lr_scheduler_round_trip(name: str, steps: int, seed: int) -> None:
    model_a, model_b = make_mlp([3, 2], seed), make_mlp([3, 2], seed)
    opt_a = torch.optim.SGD(model_a.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(model_b.parameters(), lr=0.1, momentum=0.9)
    sched_a, sched_b = SCHEDULERS[name](opt_a), SCHEDULERS[name](opt_b)
    train(model_a, opt_a, steps, seed, sched_a)
    restore({"model": model_b, "optim": opt_b, "sched": sched_b},
            *capture({"model": model_a, "optim": opt_a, "sched": sched_a}))
    assert_same(sched_a.state_dict(), sched_b.state_dict())
    assert_same(opt_a.state_dict(), opt_b.state_dict())
    train(model_a, opt_a, 2, seed, sched_a)
    train(model_b, opt_b, 2, seed, sched_b)
    assert sched_a.get_last_lr() == sched_b.get_last_lr()
    assert_same(model_a.state_dict(), model_b.state_dict())


def draw_all() -> list[Any]:
    return [random.random(), random.gauss(0, 1), random.getrandbits(70),
            np.random.rand(3).tolist(), np.random.randn(3).tolist(),
            torch.rand(4).tolist(), torch.randint(0, 1000, (3,)).tolist()]


@pytest.mark.timeout(60)
@SETTINGS
@given(seed=st.integers(0, 2**31), warmup=st.integers(0, 5))
def test_rng_round_trip_replays_the_same_numbers(seed: int, warmup: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    for _ in range(warmup):
        draw_all()
    if warmup % 2:                       # leave python's and numpy's gauss caches full
        random.gauss(0, 1)
        np.random.randn(1)
    payload, manifest = capture({"rng": RNGState()})
    expected = draw_all()
    draw_all()
    restore({"rng": RNGState()}, payload, manifest)
    assert draw_all() == expected


def test_rng_state_dict_shape() -> None:
    state = RNGState().state_dict()
    assert state["python"]["version"] == 3 and len(state["python"]["state"]) == 625
    assert state["numpy"]["keys"].dtype == torch.uint32
    assert state["numpy"]["keys"].shape == (624,)
    assert state["torch"].dtype == torch.uint8


class DataCursor:
    """A sampler-like object: epoch, position and a permutation."""

    def __init__(self, n: int, seed: int) -> None:
        self.epoch, self.index = 0, 0
        self.order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))

    def advance(self, k: int) -> None:
        self.index += k
        self.epoch, self.index = self.epoch + self.index // len(self.order), \
            self.index % len(self.order)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "order": self.order}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.index, self.order = state["epoch"], state["index"], state["order"]


@pytest.mark.timeout(60)
@SETTINGS
@given(n=st.integers(1, 50), seed=st.integers(0, 100), k=st.integers(0, 200))
def test_data_cursor_and_generator_round_trip(n: int, seed: int, k: int) -> None:
    cursor_a, cursor_b = DataCursor(n, seed), DataCursor(n, seed + 1)
    cursor_a.advance(k)
    gen_a, gen_b = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(0)
    restore({"cursor": cursor_b, "gen": gen_b},
            *capture({"cursor": cursor_a, "gen": gen_a}))
    assert_same(cursor_a.state_dict(), cursor_b.state_dict())
    assert torch.equal(torch.rand(5, generator=gen_a), torch.rand(5, generator=gen_b))


@st.composite
def tensors_st(draw: Any) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    if dtype == torch.bool:
        raw = bytes(draw(st.lists(st.integers(0, 1), min_size=numel, max_size=numel)))
    else:
        size = numel * dtype.itemsize
        raw = draw(st.binary(min_size=size, max_size=size))   # any bits, NaN payloads too
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
    return t.t() if t.dim() == 2 and draw(st.booleans()) else t   # non-contiguous too


SPECIAL_FLOATS = [math.nan, -math.nan, math.inf, -math.inf, -0.0, 5e-324,
                  struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000001))[0]]  # signalling
scalars_st = (st.none() | st.booleans() | st.integers(-2**100, 2**100) | st.text(max_size=8)
              | st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(SPECIAL_FLOATS)
              | st.sampled_from([torch.float16, torch.int64, torch.bool])
              | st.builds(torch.Size, st.lists(st.integers(0, 9), max_size=3))
              | st.builds(np.float32, st.floats(width=32)) | st.builds(np.int64, st.integers(-9, 9))
              | st.builds(lambda xs: np.array(xs, dtype=np.float64).reshape(-1, 1),
                          st.lists(st.floats(), max_size=4))
              | tensors_st())
keys_st = st.integers(-5, 5) | st.text(alphabet="0~/s1a-", max_size=4)
values_st = st.recursive(
    scalars_st,
    lambda inner: (st.lists(inner, max_size=4) | st.lists(inner, max_size=4).map(tuple)
                   | st.dictionaries(keys_st, inner, max_size=4)),
    max_leaves=12)


@pytest.mark.timeout(60)
@SETTINGS
@given(extras=st.dictionaries(keys_st, values_st, max_size=5), leaf=values_st)
@example(extras={"nan": SPECIAL_FLOATS, 0: {"0": (1, [2.5])}, "0": ()}, leaf=math.inf)
@example(extras={}, leaf=torch.tensor(float("nan"), dtype=torch.bfloat16))
def test_user_extras_round_trip(extras: dict, leaf: Any) -> None:
    registered: dict[str, Any] = {"extras": extras, "leaf": leaf}
    payload, manifest = capture(registered)
    json.dumps(Manifest.from_json(manifest).tree_spec, allow_nan=False)
    expected = {"extras": extras, "leaf": leaf}
    holder: dict = {"stale": 1}
    values = restore({"extras": holder, "leaf": None}, payload, manifest)
    assert_same(expected["extras"], values["extras"])
    assert values["extras"] is holder                      # dicts are refilled in place
    assert_same(expected["leaf"], values["leaf"])


def test_int_and_str_keys_never_collide_in_names() -> None:
    value = {0: torch.ones(1), "0": torch.zeros(1), "a/b": torch.ones(2), "a~1b": torch.ones(3),
             "": torch.ones(4), "~s": torch.ones(5), -1: torch.ones(6), "-1": torch.ones(7)}
    tensors, spec = flatten_state({"x": value})
    assert len(tensors) == len(value)
    assert "x/0" in tensors and "x/~s0" in tensors and "x/a~1b" in tensors
    assert_same(value, unflatten_state(tensors, spec)["x"])


def test_optimizer_names_and_tied_weights() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight                       # tied
    opt = torch.optim.Adam(model.parameters())
    model(torch.tensor([1, 2])).sum().backward()
    opt.step()
    tensors, spec = flatten_state({"model": model, "optim": opt})
    assert "optim/state/0/exp_avg" in tensors and "model/0.weight" in tensors
    assert "model/1.weight" not in tensors                  # stored once, referenced twice
    rebuilt = unflatten_state(tensors, spec)["model"]
    assert rebuilt["1.weight"] is rebuilt["0.weight"]
    assert type(rebuilt) is OrderedDict and rebuilt._metadata == model.state_dict()._metadata


Point = namedtuple("Point", "x y")


class Color(IntEnum):
    RED = 1


@pytest.mark.timeout(10)
@pytest.mark.parametrize("value, where", [
    ({"a": [1, object()]}, "x/a/1"), ({"a": {1.5: 2}}, "x/a"), ({"p": Point(1, 2)}, "x/p"),
    ({"c": Color.RED}, "x/c"), ({"s": torch.eye(2).to_sparse()}, "x/s"),
    ({"b": {True: 1}}, "x/b"), ({"z": np.array(["a"])}, "x/z"),
])
def test_unsupported_values_name_their_path(value: Any, where: str) -> None:
    with pytest.raises(TypeError, match=f"'{where}'"):
        flatten_state({"x": value})


@pytest.mark.timeout(10)
def test_flatten_keeps_cuda_or_noncontiguous_tensors_as_they_are() -> None:
    t = torch.arange(6.0).reshape(2, 3).t()
    tensors, _ = flatten_state({"x": {"t": t}})
    assert tensors["x/t"] is t


@pytest.mark.timeout(10)
@pytest.mark.parametrize("spec", [
    {"version": 2, "objects": {}}, {"version": 1, "objects": []},
    {"version": 1, "objects": {"x": {"kind": "magic", "tree": 1}}},
    {"version": 1, "objects": {"x": {"kind": "value", "tree": [1]}}},
    {"version": 1, "objects": {"x": {"kind": "value", "tree": {"t": "nope"}}}},
    {"version": 1, "objects": {"x": {"kind": "value", "tree": {"t": "list", "items": 3}}}},
    {"version": 1, "objects": {"x": {"kind": "value", "tree": {"t": "dtype", "v": "nn"}}}},
    {"version": 1, "objects": {"x": {"kind": "value", "tree": {"t": "float", "bits": "zz"}}}},
    {"version": 1, "objects": {"x": {"kind": "value",
                                     "tree": {"t": "dict", "items": [[True, 1]]}}}},
    {"version": 1, "objects": {"x": {"kind": "value", "tree": {"t": "tensor", "name": "y"}}}},
])
def test_malformed_spec_is_corrupt(spec: dict) -> None:
    with pytest.raises(SnapshotCorrupt):
        unflatten_state({}, spec)


@pytest.mark.timeout(10)
def test_unreferenced_tensor_and_object_mismatch() -> None:
    tensors, spec = flatten_state({"x": torch.ones(2)})
    with pytest.raises(SnapshotCorrupt, match="never references"):
        unflatten_state({**tensors, "extra": torch.ones(1)}, spec)
    with pytest.raises(ValueError, match="register the same objects"):
        apply_state({"y": 1}, tensors, spec)
    with pytest.raises(ValueError, match="captured as value"):
        apply_state({"x": torch.nn.Linear(1, 1)}, tensors, spec)


@pytest.mark.timeout(10)
def test_registered_tensor_and_list_are_updated_in_place() -> None:
    t, items = torch.zeros(3), [0]
    tensors, spec = flatten_state({"t": torch.arange(3.0), "items": [1, 2]})
    values = apply_state({"t": t, "items": items}, tensors, spec)
    assert values["t"] is t and torch.equal(t, torch.arange(3.0))
    assert values["items"] is items and items == [1, 2]
    tensors["t"].fill_(9)                                   # no aliasing of the payload
    assert torch.equal(t, torch.arange(3.0))


@pytest.mark.timeout(10)
def test_restored_state_does_not_alias_the_snapshot_buffer() -> None:
    model_a, model_b = make_mlp([3, 4, 2], 0), make_mlp([3, 4, 2], 1)
    opt_a, opt_b = torch.optim.Adam(model_a.parameters()), torch.optim.Adam(model_b.parameters())
    train(model_a, opt_a, 2, 0)
    tensors, spec = flatten_state({"model": model_a, "optim": opt_a})
    layout = plan_layout(tensors)
    buf = bytearray(layout.total_bytes)
    write_into(memoryview(buf), layout, tensors)
    apply_state({"model": model_b, "optim": opt_b}, read_tensors(buf), spec)
    expected_opt, expected_model = copy.deepcopy(opt_b.state_dict()), copy.deepcopy(model_b.state_dict())
    buf[layout.data_start:] = bytes(len(buf) - layout.data_start)   # the slot is reused
    assert_same(expected_opt, opt_b.state_dict())
    assert_same(expected_model, model_b.state_dict())


@pytest.mark.timeout(10)
def test_plain_values_are_rebound_in_the_registered_dict() -> None:
    tensors, spec = flatten_state({"epoch": 7, "name": "warm", "best": 0.25, "ids": [1, 2]})
    ids = [0]
    registered: dict[str, Any] = {"epoch": 0, "name": "", "best": math.inf, "ids": ids}
    values = apply_state(registered, tensors, spec)
    assert registered == {"epoch": 7, "name": "warm", "best": 0.25, "ids": [1, 2]}
    assert registered["ids"] is ids                         # mutable values keep identity
    assert values == registered
    read_only = MappingProxyType({"epoch": 0})             # cannot be rebound: returned only
    assert apply_state(read_only, *flatten_state({"epoch": 7})) == {"epoch": 7}
    assert read_only["epoch"] == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_rollback_restores_optimizer_state_into_the_tensors_it_already_holds(name: str) -> None:
    """A survivor rolling back keeps its optimizer's state tensors (no fresh memory), and
    nothing it holds afterwards aliases the snapshot buffer."""
    model = make_mlp([5, 4, 3], 1)
    opt = OPTIMIZERS[name](model.parameters())
    train(model, opt, 2, 1)
    payload, manifest = capture({"model": model, "optim": opt})
    expected = copy.deepcopy(opt.state_dict())
    train(model, opt, 3, 2)                     # the survivor ran ahead
    held = {id(t): t.data_ptr() for s in opt.state.values() for t in s.values()
            if isinstance(t, torch.Tensor) and t.numel() > 1}
    buffer = bytearray(payload)
    restore({"model": model, "optim": opt}, buffer, manifest)
    assert_same(expected, opt.state_dict())
    now = [t for s in opt.state.values() for t in s.values()
           if isinstance(t, torch.Tensor) and t.numel() > 1]
    assert now and all(held.get(id(t)) == t.data_ptr() for t in now)
    buffer[:] = bytes(len(buffer))               # the buffer is reused: state unchanged
    assert_same(expected, opt.state_dict())
