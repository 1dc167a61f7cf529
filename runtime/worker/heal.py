"""Healing a new generation from live peers: the ranks agree on one step, every rank takes
its per-rank state of that step from a snapshot, and the ranks that lack the replicated
state of that step receive it from survivors' memory over the re-formed group.

Runs on every rank of the new generation, after its group formed and before its first
collective of training (``Session._recover`` for survivors, ``Session.start`` for a
replacement); three tiny all-reduces (live steps, availability, and after each rank loaded
its per-rank state, whether every rank did) and the broadcasts:

1. **live steps**: each rank says which step its replicated state is at (its completed
   steps, plus one if its optimizer already applied the step in flight; -1 for a
   replacement, which holds none).
2. **availability**: for each candidate step (the survivors' live steps when some state is
   replicated, else the newest three), whether the rank's per-rank snapshot of it is held by
   one of its sources (its own node keeper, the replica keepers).
3. **the step**: ``choose_step``, the newest candidate every rank can restore its per-rank
   state at and, when state is replicated, some survivor holds live. None: no heal (every
   replica of some state is gone, or a lost rank's snapshot of the survivors' step is
   missing); the caller falls back to the plan's committed step and the restore ladder.

The step rule (a step is a transaction): survivors are at most one step apart (every step's
gradients are all-reduced by every rank, so no rank applies step s+1 while another has not
finished step s); a survivor that applied step s while another did not is reconciled to
whichever step the rule picks: forward (it keeps its state, the others receive it) when
every rank has its per-rank snapshot of s+1, else back (it receives the replicated state of
s from a survivor that did not apply it, and its per-rank state of s from its snapshot).
Every rank ends at the same step with the state the fault-free run had there.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from phalanx.configs.errors import PhalanxError
from phalanx.runtime.snapshot.state_tree import apply_state, flatten_state
from phalanx.runtime.snapshot.format import code_dtypes, dtype_codes

log = logging.getLogger(__name__)
CANDIDATES_WITHOUT_REPLICAS = 3
BUCKET_BYTES = 4 << 20       # a tensor this big is sent alone; smaller ones grouped


def candidates(live: Sequence[int], replicated: bool) -> list[int]:
    """Steps worth trying, newest first: with replicated state only steps some survivor
    holds live; without, every rank restores from snapshots, the newest few steps."""
    held = sorted({s for s in live if s >= 0}, reverse=True)
    if replicated or not held:
        return held
    return [s for s in range(held[0], held[0] - CANDIDATES_WITHOUT_REPLICAS, -1) if s >= 0]


def choose_step(live: Sequence[int], available: Sequence[Sequence[bool]],
                steps: Sequence[int], replicated: bool) -> int | None:
    """The newest of ``steps`` that every rank can restore (``available[rank][i]`` for
    ``steps[i]``) and, with replicated state, some rank holds live; None if none is."""
    for i, step in enumerate(steps):
        if replicated and step not in live:
            continue
        if all(row[i] for row in available):
            return step
    return None


def _gather(values: Sequence[int], rank: int, world: int,
            reduce: Callable[[torch.Tensor], torch.Tensor]) -> list[list[int]]:
    """Every rank's ``values`` (the same length on every rank), by rank: one all-reduce."""
    width = len(values)
    table = torch.zeros(world * width, dtype=torch.int64)
    table[rank * width:(rank + 1) * width] = torch.tensor(list(values), dtype=torch.int64)
    reduce(table)
    return [table[r * width:(r + 1) * width].tolist() for r in range(world)]


@dataclass(frozen=True)
class Agreement:
    step: int | None            # None: no heal; fall back to the plan's committed step
    live: tuple[int, ...]       # every rank's live replicated step, by rank
    seconds: float
    interval: int = 0           # the largest snapshot interval any rank had agreed to


def agree(*, rank: int, world: int, live_step: int, replicated: bool,
          probe: Callable[[int], bool],
          reduce: Callable[[torch.Tensor], torch.Tensor], interval: int = 0) -> Agreement:
    """Rounds 1-3 on this rank (see the module docstring): two small all-reduces; every
    rank returns the same agreement. ``probe(step)``: this rank's per-rank snapshot of
    ``step`` is held by one of its sources; ``reduce``: the new group's all-reduce (raises
    ``CollectiveAborted``); ``interval``: the snapshot interval this rank had agreed to (0:
    none, a replacement), gathered in the first round so the healed ranks go on at the
    survivors' interval instead of measuring it again from every step."""
    started = time.perf_counter()
    rows = _gather([live_step, interval], rank, world, reduce)
    live, agreed = tuple(row[0] for row in rows), max(row[1] for row in rows)
    steps = candidates(live, replicated)
    if not steps:
        return Agreement(None, live, round(time.perf_counter() - started, 4), agreed)
    mine = [int(_safe_probe(probe, s)) for s in steps]
    available = [[bool(v) for v in row] for row in _gather(mine, rank, world, reduce)]
    step = choose_step(live, available, steps, replicated)
    log.info("event=heal_agree rank=%d live=%s candidates=%s available=%s step=%s "
             "interval=%d", rank, list(live), steps, mine, step, agreed)
    return Agreement(step, live, round(time.perf_counter() - started, 4), agreed)


def finish(agreement: Agreement, *, rank: int, world: int, loaded: bool,
           replicated: Mapping[str, Any], reduce: Callable[[torch.Tensor], torch.Tensor],
           broadcast: Callable[[torch.Tensor, int], None]) -> tuple[tuple[int, ...], int] | None:
    """After every rank applied (``loaded``) or failed to apply its per-rank state of the
    agreed step: None when some rank failed (every rank then falls back), else the ranks
    that held the replicated state live and the bytes this rank received of it."""
    step = agreement.step
    assert step is not None
    if not all(row[0] for row in _gather([int(loaded)], rank, world, reduce)):
        return None
    if not replicated:
        return (), 0
    holders = tuple(r for r, s in enumerate(agreement.live) if s == step)
    if len(holders) == world:
        return holders, 0
    return holders, send_replicated(replicated, rank, holders,
                                    agreement.live[rank] == step, broadcast)


def _safe_probe(probe: Callable[[int], bool], step: int) -> bool:
    try:
        return probe(step)
    except (PhalanxError, OSError) as exc:
        log.info("event=heal_probe_failed step=%d error=%s", step, exc)
        return False


def send_replicated(objects: Mapping[str, Any], rank: int, holders: Sequence[int],
                    holds: bool, broadcast: Callable[[torch.Tensor, int], None]) -> int:
    """Broadcast the replicated objects from ``holders`` (each sends every len(holders)-th
    bucket) to the ranks that lack them, which apply them in place; returns the bytes this
    rank received. The tree spec travels as JSON bytes from the first holder. A large
    tensor is sent as itself (a holder's live tensor, received into the tensor the
    receiver applies): no staging copy on either side."""
    tensors, own_spec = flatten_state(objects) if holds else ({}, {})
    header = _header(tensors, own_spec) if holds else b""
    spec, shapes = _parse_header(_broadcast_bytes(header, holders[0], broadcast))
    if holds:
        if sorted(tensors) != sorted(shapes):
            raise PhalanxError(f"rank {rank} holds replicated tensors {sorted(tensors)[:3]}... "
                               f"but holder {holders[0]} sent {sorted(shapes)[:3]}...")
    else:
        tensors = _targets(objects, shapes)
    received = 0
    for i, bucket in enumerate(_buckets(tensors)):
        src = holders[i % len(holders)]
        part = [tensors[n] for n in bucket]
        if rank == src:
            _send(part, src, broadcast)
        elif holds:             # a holder already has these bytes: received and dropped
            _receive([torch.empty_like(t) for t in part], src, broadcast)
        else:
            received += _receive(part, src, broadcast)
    if not holds:
        apply_state(objects, tensors, spec, owned=True)
    return received


def _targets(objects: Mapping[str, Any], shapes: Mapping[str, tuple[list[int], str]]
             ) -> dict[str, torch.Tensor]:
    """Where a rank that lacks the replicated state receives it: into the tensor its
    objects hold now at the same path when it matches the holder's (shape, dtype, a plain
    contiguous CPU tensor: a replacement's model, built by its script before its Session
    started), else into a fresh one (an optimizer whose state its first step creates). In
    place, the ``apply_state`` that follows copies nothing (a tensor into itself) and no
    fresh memory is faulted in."""
    try:
        live, _ = flatten_state(objects)
    except (TypeError, ValueError):     # not capturable as it is: fresh tensors
        live = {}
    codes, dtypes = dtype_codes(), code_dtypes()

    def fits(t: torch.Tensor | None, shape: list[int], code: str) -> bool:
        return (type(t) in (torch.Tensor, torch.nn.Parameter) and t is not None
                and t.device.type == "cpu" and t.is_contiguous()
                and list(t.shape) == shape and codes.get(t.dtype) == code)

    return {name: live[name].detach() if fits(live.get(name), shape, code)
            else torch.empty(shape, dtype=dtypes[code]) for name, (shape, code) in shapes.items()}


def _header(tensors: Mapping[str, torch.Tensor], spec: dict) -> bytes:
    codes = dtype_codes()
    shapes = {n: [list(t.shape), codes[t.dtype]] for n, t in tensors.items()}
    return json.dumps({"spec": spec, "tensors": shapes}, sort_keys=True).encode()


def _parse_header(data: bytes) -> tuple[dict, dict[str, tuple[list[int], str]]]:
    raw = json.loads(data)
    return raw["spec"], {n: (list(v[0]), str(v[1])) for n, v in raw["tensors"].items()}


def _broadcast_bytes(data: bytes, src: int, broadcast: Callable[[torch.Tensor, int], None]
                     ) -> bytes:
    size = torch.tensor([len(data)], dtype=torch.int64)
    broadcast(size, src)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
        torch.empty(int(size.item()), dtype=torch.uint8)
    broadcast(buf, src)
    return buf.numpy().tobytes()


def _buckets(tensors: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """Tensor names in sorted order: a tensor of ``BUCKET_BYTES`` or more alone, smaller
    ones grouped up to that size (per dtype: a group is sent as one flat tensor)."""
    out: list[list[str]] = []
    size, dtype = BUCKET_BYTES, None
    for name in sorted(tensors):
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        if nbytes >= BUCKET_BYTES:
            out.append([name])
            size = BUCKET_BYTES          # the next small tensor starts a new group
            continue
        if size + nbytes > BUCKET_BYTES or t.dtype != dtype:
            out.append([])
            size, dtype = 0, t.dtype
        out[-1].append(name)
        size += nbytes
    return out


def _send(tensors: list[torch.Tensor], src: int,
          broadcast: Callable[[torch.Tensor, int], None]) -> None:
    if len(tensors) == 1 and tensors[0].is_contiguous():
        broadcast(tensors[0].detach(), src)
        return
    broadcast(torch.cat([t.detach().reshape(-1) for t in tensors]), src)


def _receive(tensors: list[torch.Tensor], src: int,
             broadcast: Callable[[torch.Tensor, int], None]) -> int:
    """Receive into ``tensors`` (fresh, contiguous); returns the bytes received."""
    if len(tensors) == 1:
        broadcast(tensors[0], src)
        return tensors[0].numel() * tensors[0].element_size()
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype)
    broadcast(flat, src)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return flat.numel() * flat.element_size()
