"""Healing a new generation from live peers: the ranks agree on one step, every rank takes
its per-rank state of that step from a snapshot, and the ranks that lack the replicated
state of that step receive it from survivors' memory over the re-formed group.

Runs on every rank of the new generation, after its group formed and before its first
collective of training (``Session._recover`` for survivors, ``Session.start`` for a
replacement); three tiny all-reduces (live steps, availability, and after each rank loaded
its per-rank state, whether every rank did) and the broadcasts:

1. **live steps**: each rank says which step its replicated state is at (its completed
   steps, plus one if its optimizer already applied the step in flight; -1 for a
   replacement, which holds none), and its replica group (``StateClasses.group``: every
   rank under DDP; the ranks along HSDP's replicate dimension, which hold the same shards).
2. **availability**: for each candidate step (the survivors' live steps when some state is
   replicated, else the newest three), whether the rank's per-rank snapshot of it is held by
   one of its sources (its own node keeper, the replica keepers).
3. **the step**: ``choose_step``, the newest candidate every rank can restore its per-rank
   state at and, when state is replicated, some survivor of every replica group holds
   live. None: no heal (every replica of some state is gone, or a lost rank's snapshot of
   the survivors' step is missing); the caller falls back to the plan's committed step and
   the restore ladder.

Then each replica group whose members do not all hold the step receives it from those that
do (``send_replicated``), group after group, over the whole re-formed group: ranks outside
the group take part in its broadcasts and drop what they receive.

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
                steps: Sequence[int], replicated: bool,
                groups: Sequence[int] | None = None) -> int | None:
    """The newest of ``steps`` that every rank can restore (``available[rank][i]`` for
    ``steps[i]``) and, with replicated state, some rank of every replica group holds live
    (``groups[rank]``: its group's key; None: one group of every rank); None if none is."""
    keys = list(groups) if groups is not None else [0] * len(live)
    for i, step in enumerate(steps):
        if replicated and {k for k, s in zip(keys, live) if s == step} != set(keys):
            continue
        if all(row[i] for row in available):
            return step
    return None


def group_key(group: Sequence[int]) -> int:
    """The key a rank's replica group is gathered by: its lowest rank; -1 for every rank."""
    return min(group) if group else -1


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
    groups: tuple[int, ...] = ()    # every rank's replica group key (group_key), by rank


def agree(*, rank: int, world: int, live_step: int, replicated: bool,
          probe: Callable[[int], bool],
          reduce: Callable[[torch.Tensor], torch.Tensor], interval: int = 0,
          group: Sequence[int] = ()) -> Agreement:
    """Rounds 1-3 on this rank (see the module docstring): two small all-reduces; every
    rank returns the same agreement. ``probe(step)``: this rank's per-rank snapshot of
    ``step`` is held by one of its sources; ``reduce``: the new group's all-reduce (raises
    ``CollectiveAborted``); ``interval``: the snapshot interval this rank had agreed to (0:
    none, a replacement), gathered in the first round so the healed ranks go on at the
    survivors' interval instead of measuring it again from every step; ``group``: the
    ranks its replicated state is alike on (``StateClasses.group``; (): every rank)."""
    started = time.perf_counter()
    rows = _gather([live_step, interval, group_key(group)], rank, world, reduce)
    live, agreed = tuple(row[0] for row in rows), max(row[1] for row in rows)
    groups = tuple(row[2] for row in rows)
    steps = candidates(live, replicated)
    if not steps:
        return Agreement(None, live, round(time.perf_counter() - started, 4), agreed, groups)
    mine = [int(_safe_probe(probe, s)) for s in steps]
    available = [[bool(v) for v in row] for row in _gather(mine, rank, world, reduce)]
    step = choose_step(live, available, steps, replicated, groups)
    log.info("event=heal_agree rank=%d live=%s groups=%s candidates=%s available=%s step=%s "
             "interval=%d", rank, list(live), list(groups), steps, mine, step, agreed)
    return Agreement(step, live, round(time.perf_counter() - started, 4), agreed, groups)


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
    keys = agreement.groups or (-1,) * world
    received = 0
    for key in sorted(set(keys)):      # the same order on every rank
        members = [r for r in range(world) if keys[r] == key]
        sources = [r for r in members if r in holders]
        if len(sources) < len(members):
            received += send_replicated(replicated, rank, sources, broadcast,
                                        member=keys[rank] == key)
    return holders, received


def _safe_probe(probe: Callable[[int], bool], step: int) -> bool:
    try:
        return probe(step)
    except (PhalanxError, OSError) as exc:
        log.info("event=heal_probe_failed step=%d error=%s", step, exc)
        return False


def send_replicated(objects: Mapping[str, Any], rank: int, holders: Sequence[int],
                    broadcast: Callable[[torch.Tensor, int], None], member: bool = True) -> int:
    """Broadcast one replica group's replicated objects from its ``holders`` (each sends
    every len(holders)-th bucket) to its members that lack them, which apply them in place;
    returns the bytes this rank received. Every rank of the re-formed group takes part:
    a holder and a rank outside the group (``member`` false) receive and drop. The tree
    spec travels as JSON bytes from the first holder. A large tensor is sent as itself (a
    holder's live tensor, received into the tensor the receiver applies): no staging copy
    on either side."""
    holds = rank in holders
    tensors, own_spec = flatten_state(objects) if holds else ({}, {})
    header = _header(tensors, own_spec) if holds else b""
    spec, shapes = _parse_header(_broadcast_bytes(header, holders[0], broadcast))
    receives = member and not holds
    if holds:
        if sorted(tensors) != sorted(shapes):
            raise PhalanxError(f"rank {rank} holds replicated tensors {sorted(tensors)[:3]}... "
                               f"but holder {holders[0]} sent {sorted(shapes)[:3]}...")
    elif receives:
        tensors = _targets(objects, shapes)
    else:                       # only the sizes: each bucket is received into fresh memory
        codes = code_dtypes()
        tensors = {name: torch.empty(shape, dtype=codes[code], device="meta")
                   for name, (shape, code) in shapes.items()}
    received = 0
    for i, bucket in enumerate(_buckets(tensors)):
        src = holders[i % len(holders)]
        part = [tensors[n] for n in bucket]
        if rank == src:
            _send(part, src, broadcast)
        elif receives:
            received += _receive(part, src, broadcast)
        else:                   # a holder already has these bytes, an outsider needs none
            _receive([torch.empty_like(t, device="cpu" if t.is_meta else t.device)
                      for t in part], src, broadcast)
    if receives:
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
