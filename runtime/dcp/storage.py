"""torch.distributed.checkpoint storage on phalanx tiers: each rank's items become one signed
snapshot payload (safetensors layout + JSON manifest); DCP's metadata is JSON, never pickle."""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, ReadItem,
                                                  SavePlan, SavePlanner, WriteItem, WriteItemType)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from phalanx.configs.errors import ConfigError, SnapshotCorrupt, SnapshotNotFound
from phalanx.configs.loader import load_config, load_config_text
from phalanx.configs.schema import PhalanxConfig
from phalanx.runtime.base import Tier
from phalanx.runtime.context import WorkerContext
from phalanx.runtime.snapshot.checksum import DEFAULT_ALGO
from phalanx.runtime.dcp.metadata import (NON_TENSOR_HINT, TENSOR, VALUE, PayloadRef, encode_value,
                                          metadata_from_json, metadata_to_json, payload_names)
from phalanx.runtime.snapshot.format import (Manifest, SnapshotLayout, checksums, make_manifest,
                                             plan_layout, read_tensors, write_into)
from phalanx.runtime.snapshot.state_tree import SPEC_VERSION, unflatten_state
from phalanx.runtime.tiers.config import open_tier, read_job_secret

log = logging.getLogger(__name__)

DCP_FORMAT = 1
DCP_NAMESPACE = "dcp"     # from_config's steps live under <job>.dcp in the tier
_OBJECT = "dcp"

# Where one save goes (dcp.save(sd, storage_writer=TieredStorageWriter(tier, step))):
#
#   rank r != 0  write_data -> tier.write_rank(step, r, payload_r, manifest_r)
#   rank 0       write_data -> staged in memory: its manifest carries the global metadata,
#                              which exists only once DCP has gathered every rank's results
#   rank 0       finish     -> tier.write_rank(step, 0, payload_0, manifest_0 + dcp_metadata)
#                              tier.commit_step(step, [0, ..., n-1])
#
# manifest_r.tree_spec is a state-tree spec (phalanx.runtime.snapshot.state_tree) whose one object "dcp"
# maps every payload name to a tensor placeholder or to a JSON-encoded non-tensor value, so
# ``unflatten_state(read_tensors(payload, manifest), tree_spec)`` rebuilds a rank's items;
# rank 0's also holds "dcp_metadata" (phalanx.runtime.dcp.metadata's JSON of DCP's Metadata).


def _as_step(checkpoint_id: Any) -> int:
    """A step from an int or a decimal string; raises ValueError otherwise."""
    text = os.fspath(checkpoint_id) if isinstance(checkpoint_id, os.PathLike) else checkpoint_id
    if type(text) is int and text >= 0:
        return text
    if type(text) is str and text.isdecimal() and text.isascii():
        return int(text)
    raise ValueError(f"checkpoint_id {checkpoint_id!r} is not a step (a non-negative int); "
                     "tiered storage names checkpoints by training step")


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


# ----------------------------------------------------------------------------- saving

def _resolve_tensor(planner: SavePlanner, item: WriteItem) -> torch.Tensor:
    tensor = planner.resolve_data(item)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"planner resolved tensor item '{item.index.fqn}' to "
                        f"{type(tensor).__name__}, not a tensor")
    tensor = tensor.detach()
    chunk = item.tensor_data.chunk.sizes if item.tensor_data is not None else None
    if chunk is not None and tuple(tensor.shape) != tuple(chunk):
        raise ValueError(f"'{item.index.fqn}': planner resolved a {list(tensor.shape)} tensor "
                         f"for a chunk of size {list(chunk)}")
    return tensor


def _value_node(planner: SavePlanner, item: WriteItem) -> Any:
    """The JSON node of a BYTE_IO item's original Python value (never DCP's torch.save)."""
    lookup = getattr(planner, "lookup_object", None)
    if not callable(lookup):
        raise TypeError(f"'{item.index.fqn}' is a non-tensor value and {type(planner).__name__} "
                        f"has no lookup_object() to fetch it unpickled; {NON_TENSOR_HINT}")
    return encode_value(item.index.fqn, lookup(item.index))


@dataclass
class _StagedRank:
    """One rank's payload, ready to store: bytes (a view of ``buf``), layout, checksums,
    tree and results."""

    buf: bytearray
    payload: memoryview
    layout: SnapshotLayout
    sums: dict[str, str]
    tree: dict[str, Any]
    results: list[WriteResult]


def _stage(plan: SavePlan, planner: SavePlanner, rank: int, algo: str, workers: int,
           reuse: bytearray | None) -> _StagedRank:
    """Copy this rank's items into one payload (into ``reuse`` when it is large enough:
    touched memory takes copies several times faster than fresh pages)."""
    names = payload_names(plan.items)
    tensors: dict[str, torch.Tensor] = {}
    nodes: dict[str, Any] = {}
    for item, name in zip(plan.items, names):
        if item.type == WriteItemType.BYTE_IO:
            nodes[name] = _value_node(planner, item)
        else:
            tensors[name] = _resolve_tensor(planner, item)
    layout = plan_layout(tensors, {"format": "pt"})
    fits = reuse is not None and len(reuse) >= layout.total_bytes
    buf = reuse if reuse is not None and fits else bytearray(layout.total_bytes)
    payload = memoryview(buf)[:layout.total_bytes]
    write_into(payload, layout, tensors)
    sums = checksums(payload, layout, algo=algo, workers=workers)
    results, items = [], []
    for item, name in zip(plan.items, names):
        if name in nodes:
            size = len(json.dumps(nodes[name], separators=(",", ":")))
            ref = PayloadRef(rank, name, VALUE, 0, size)
            items.append([name, nodes[name]])
        else:
            entry = layout.entries[name]
            size = entry.end - entry.begin
            ref = PayloadRef(rank, name, TENSOR, layout.data_start + entry.begin, size)
            items.append([name, {"t": "tensor", "name": name}])
        results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=ref))
    return _StagedRank(buf, payload, layout, sums, {"t": "dict", "items": items}, results)


class TieredStorageWriter(StorageWriter):
    """DCP ``StorageWriter`` that saves step ``step`` into a phalanx ``Tier``.

    One instance per rank; one save at a time per instance (a new step per save through
    ``checkpoint_id=`` or ``reset``; the payload buffer is reused, so wait for an
    ``async_save`` future before the next save with it). DCP calls it on the thread that
    runs the save (``async_save``'s executor thread). ``secret`` signs every manifest
    (HMAC-SHA256). Rank 0 stores its payload and commits the step in ``finish``. Raises
    TypeError for a non-tensor value JSON cannot hold exactly, ValueError when ``step`` is
    already committed, TierUnavailable / SnapshotNotFound from the tier; DCP wraps each in
    ``CheckpointException`` (a BaseException) holding the original per rank.
    """

    def __init__(self, tier: Tier, step: int, *, secret: bytes | None = None, job: str = "dcp",
                 generation: int = 0, checksum_algo: str = DEFAULT_ALGO,
                 checksum_workers: int = 1) -> None:
        self._tier = tier
        self._step = _as_step(step)
        self._secret = secret
        self._job = job
        self._generation = generation
        self._algo = checksum_algo
        self._workers = checksum_workers
        self._rank = 0
        self._is_coordinator = True
        self._pending: _StagedRank | None = None
        self._buffer: bytearray | None = None      # reused by the next save of this instance

    @classmethod
    def from_config(cls, config: PhalanxConfig | str | os.PathLike | None, step: int, *,
                    tier: str = "disk", run_dir: str | os.PathLike | None = None,
                    generation: int = 0, namespace: str = DCP_NAMESPACE) -> "TieredStorageWriter":
        """A writer on the tier ``tier`` of a phalanx config (a path, a loaded config, or
        None inside a launched job: that job's own config and run directory): the same
        root, checksum and secret as the job's own persisted snapshots, under the job's
        ``<job>.dcp`` namespace, which its own checkpoints and retention never touch
        (``phalanx ckpt ls|verify|export --job <job>.dcp`` shows it)."""
        cfg, run_dir, secret = _job_config(config, run_dir)
        return cls(open_tier(cfg, tier, run_dir=run_dir, namespace=namespace), step,
                   secret=secret, job=cfg.job.name, generation=generation,
                   checksum_algo=cfg.snapshot.checksum,
                   checksum_workers=max(1, torch.get_num_threads()))

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Start a new save; a ``checkpoint_id`` (a step number) replaces the step."""
        if checkpoint_id is not None:
            self._step = _as_step(checkpoint_id)
        self._pending = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        try:
            _as_step(checkpoint_id)
        except ValueError:
            return False
        return True

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=f"{self._tier.name}:step_{self._step}")

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Called by DCP on every rank with ``rank=`` and ``use_collectives=``."""
        if kwargs.get("use_collectives") is False:
            raise ValueError("TieredStorageWriter needs use_collectives=True: the coordinator "
                             "stores the global metadata gathered from every rank")
        rank = kwargs.get("rank", 0 if is_coordinator else None)
        if rank is None:
            raise RuntimeError("this torch.distributed.checkpoint version does not pass the "
                               "rank to set_up_storage_writer; use torch>=2.5")
        if is_coordinator and rank != 0:
            raise ValueError(f"the DCP coordinator is rank {rank}; TieredStorageWriter "
                             "keeps the global metadata with rank 0, so use coordinator 0")
        self._rank, self._is_coordinator, self._pending = int(rank), is_coordinator, None

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator only: refuse to overwrite a committed step (torn on a crash)."""
        if self._step in self._tier.committed_steps():
            raise ValueError(f"step {self._step} is already committed in tier "
                             f"{self._tier.name}; save under a new step or delete it first "
                             "(tier.delete_step)")
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Stage this rank's items into one payload and store it (rank 0: in ``finish``)."""
        started = time.monotonic()
        staged = _stage(plan, planner, self._rank, self._algo, self._workers, self._buffer)
        self._buffer = staged.buf
        if self._is_coordinator:
            self._pending = staged
        else:
            self._store(staged, None)
        log.info("dcp_write tier=%s step=%d rank=%d items=%d bytes=%d elapsed_s=%.3f",
                 self._tier.name, self._step, self._rank, len(plan.items),
                 staged.layout.total_bytes, time.monotonic() - started)
        return _done(staged.results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator only: store rank 0 with the JSON global metadata, then commit."""
        if self._pending is None:
            raise RuntimeError("finish() called before write_data() on the coordinator")
        storage: dict[MetadataIndex, PayloadRef] = {}
        for rank_results in results:
            for result in rank_results:
                if not isinstance(result.storage_data, PayloadRef):
                    raise TypeError(f"write result for '{result.index.fqn}' was not produced "
                                    "by TieredStorageWriter")
                storage[result.index] = result.storage_data
        metadata.storage_data = storage
        self._store(self._pending, metadata_to_json(metadata, storage))
        self._tier.commit_step(self._step, list(range(len(results))))
        self._pending = None
        log.info("dcp_commit tier=%s step=%d ranks=%d items=%d", self._tier.name, self._step,
                 len(results), len(storage))

    def _store(self, staged: _StagedRank, dcp_metadata: dict | None) -> None:
        spec: dict[str, Any] = {"version": SPEC_VERSION, "dcp_format": DCP_FORMAT,
                                "objects": {_OBJECT: {"kind": "value", "tree": staged.tree}}}
        if dcp_metadata is not None:
            spec["dcp_metadata"] = dcp_metadata
        manifest = make_manifest(staged.layout, staged.sums, job=self._job, rank=self._rank,
                                 step=self._step, generation=self._generation,
                                 tree_spec=spec, created_at=time.time())
        if self._secret is not None:
            manifest = manifest.sign(self._secret)
        self._tier.write_rank(self._step, self._rank, staged.payload, manifest.to_json())


# ---------------------------------------------------------------------------- loading

def _narrow(stored: torch.Tensor, item: ReadItem, where: str) -> torch.Tensor:
    offsets, lengths = tuple(item.storage_offsets), tuple(item.lengths)
    if len(offsets) != stored.dim() or len(lengths) != stored.dim() or any(
            o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, lengths, stored.shape)):
        raise SnapshotCorrupt(f"{where}: '{item.storage_index.fqn}' is stored as "
                              f"{list(stored.shape)}, but the metadata asks for {list(lengths)} "
                              f"at {list(offsets)}")
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        if length < stored.shape[dim]:
            stored = stored.narrow(dim, offset, length)
    return stored


def _copy_tensor(planner: LoadPlanner, item: ReadItem, stored: Any, where: str) -> None:
    if not isinstance(stored, torch.Tensor):
        raise SnapshotCorrupt(f"{where}: '{item.storage_index.fqn}' is recorded as a tensor "
                              "but the payload holds a value")
    src = _narrow(stored, item, where)
    target = planner.resolve_tensor(item).detach()
    if target.shape != src.shape:
        raise ValueError(f"'{item.dest_index.fqn}': the checkpoint chunk is {list(src.shape)}, "
                         f"the target wants {list(target.shape)}")
    target.copy_(src)
    planner.commit_tensor(item, target)


def _deliver_value(planner: LoadPlanner, item: ReadItem, value: Any) -> None:
    """Hand a JSON-decoded value to the planner (DefaultLoadPlanner.load_bytes would
    torch.load a pickle; this does what it does after that, without one)."""
    hook = getattr(planner, "load_value", None)     # phalanx extension point
    fqn = item.dest_index.fqn
    if callable(hook):
        hook(item, value)
    elif isinstance(planner, DefaultLoadPlanner):
        if planner.flatten_state_dict:
            set_element(planner.original_state_dict, planner.mappings[fqn], value)
        else:
            planner.state_dict[fqn] = value
    else:
        raise TypeError(f"'{fqn}' is a non-tensor value and {type(planner).__name__} is not a "
                        "DefaultLoadPlanner and has no load_value(read_item, value); "
                        "TieredStorageReader never unpickles (load_bytes)")


@dataclass
class _RankObjects:
    """One rank's fetched, HMAC-checked manifest and payload; entries once verified."""

    manifest: Manifest
    payload: bytes
    entries: dict[str, Any] | None = None


class TieredStorageReader(StorageReader):
    """DCP ``StorageReader`` that loads a step written by ``TieredStorageWriter``.

    ``read_metadata`` checks the step is committed, reads rank 0's manifest and verifies
    its HMAC (with ``secret``); ``read_data`` reads each needed rank's payload once,
    verifies its HMAC and every checksum, then copies into the planner's tensors.
    Raises SnapshotCorrupt (naming rank and tensor), SnapshotUnauthenticated,
    SnapshotNotFound, TierUnavailable; ``dcp.load`` wraps them in CheckpointException (and
    turns a ``read_metadata`` error into an AssertionError carrying its message).
    """

    def __init__(self, tier: Tier, step: int, *, secret: bytes | None = None,
                 checksum_workers: int = 1) -> None:
        self._tier = tier
        self._step = _as_step(step)
        self._secret = secret
        self._workers = checksum_workers
        self._ranks: dict[int, _RankObjects] = {}
        self._storage: dict[MetadataIndex, PayloadRef] = {}

    @classmethod
    def from_config(cls, config: PhalanxConfig | str | os.PathLike | None, step: int, *,
                    tier: str = "disk", run_dir: str | os.PathLike | None = None,
                    namespace: str = DCP_NAMESPACE) -> "TieredStorageReader":
        """A reader on the tier ``tier`` of a phalanx config (see the writer's)."""
        cfg, run_dir, secret = _job_config(config, run_dir)
        return cls(open_tier(cfg, tier, run_dir=run_dir, namespace=namespace), step,
                   secret=secret,
                   checksum_workers=max(1, torch.get_num_threads()))

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Start a new load; a ``checkpoint_id`` (a step number) replaces the step."""
        if checkpoint_id is not None:
            self._step = _as_step(checkpoint_id)
        self._ranks.clear()
        self._storage = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return TieredStorageWriter.validate_checkpoint_id(checkpoint_id)

    def _where(self, rank: int) -> str:
        return f"tier {self._tier.name} step {self._step} rank {rank}"

    def _fetch(self, rank: int) -> _RankObjects:
        if rank not in self._ranks:
            where = self._where(rank)
            payload, raw = self._tier.read_rank(self._step, rank)
            manifest = Manifest.from_json(raw, where)
            manifest.verify(self._secret, where)
            if (manifest.rank, manifest.step) != (rank, self._step):
                raise SnapshotCorrupt(f"{where}: manifest is for step {manifest.step} rank "
                                      f"{manifest.rank} (misplaced object)")
            if manifest.tree_spec.get("dcp_format") != DCP_FORMAT:
                raise SnapshotCorrupt(f"{where}: not written by TieredStorageWriter (no "
                                      f"dcp_format {DCP_FORMAT} in its tree spec)")
            self._ranks[rank] = _RankObjects(manifest, payload)
        return self._ranks[rank]

    def _entries(self, rank: int) -> dict[str, Any]:
        fetched = self._fetch(rank)
        if fetched.entries is None:
            where = self._where(rank)
            tensors = read_tensors(fetched.payload, fetched.manifest, source=where,
                                   workers=self._workers)
            tree = unflatten_state(tensors, fetched.manifest.tree_spec).get(_OBJECT)
            if type(tree) is not dict:
                raise SnapshotCorrupt(f"{where}: tree spec object '{_OBJECT}' is not a dict")
            fetched.entries = tree
        return fetched.entries

    def read_metadata(self) -> Metadata:
        """The step's global metadata from rank 0's manifest (JSON)."""
        if self._step not in self._tier.committed_steps():
            raise SnapshotNotFound(f"tier {self._tier.name}: step {self._step} is not committed "
                                   "(its save did not finish, or no such step)")
        where = self._where(0)
        raw = self._fetch(0).manifest.tree_spec.get("dcp_metadata")
        if raw is None:
            raise SnapshotCorrupt(f"{where}: manifest has no dcp_metadata")
        metadata = metadata_from_json(raw, where)
        self._storage = dict(metadata.storage_data)
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self._storage = dict(metadata.storage_data or {})

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Copy every planned item out of its rank's verified payload, rank by rank."""
        by_rank: dict[int, list[tuple[ReadItem, PayloadRef]]] = {}
        for item in plan.items:
            ref = self._storage.get(item.storage_index)
            if ref is None:
                raise SnapshotCorrupt(f"tier {self._tier.name} step {self._step}: metadata "
                                      f"records no location for {item.storage_index}")
            by_rank.setdefault(ref.rank, []).append((item, ref))
        for rank in sorted(by_rank):
            entries, where = self._entries(rank), self._where(rank)
            for item, ref in by_rank[rank]:
                if ref.name not in entries:
                    raise SnapshotCorrupt(f"{where}: '{ref.name}' is not in the payload")
                if item.type == LoadItemType.BYTE_IO:
                    _deliver_value(planner, item, entries[ref.name])
                else:
                    _copy_tensor(planner, item, entries[ref.name], where)
            del self._ranks[rank]               # free the payload as soon as it is used
        self._ranks.clear()                     # rank 0's, fetched for metadata only
        return _done(None)


def _job_config(config: PhalanxConfig | str | os.PathLike | None,
                run_dir: str | os.PathLike | None
                ) -> tuple[PhalanxConfig, str | os.PathLike | None, bytes | None]:
    """The config, run directory and secret a DCP storage uses: inside a launched job the
    run's (its ``config.yaml``, its folder, the job secret the workers hold) unless given;
    outside one, the named config and ``security.secret_file``."""
    ctx = WorkerContext.from_env()
    in_job = bool(ctx.run_dir) and not ctx.standalone_run
    if config is None:
        if not in_job:
            raise ConfigError("config", "is None outside a launched job",
                              "name the job's YAML config, e.g. from_config('job.yaml', step)")
        path = Path(ctx.run_dir) / "config.yaml"
        config = (load_config_text(ctx.config_yaml, source=str(path)) if ctx.config_yaml
                  else path)
    cfg = config if isinstance(config, PhalanxConfig) else load_config(config)
    if run_dir is None and in_job:
        run_dir = ctx.run_dir
    secret = read_job_secret(cfg)
    if secret is None and in_job and ctx.job == cfg.job.name:
        secret = ctx.secret
    return cfg, run_dir, secret
