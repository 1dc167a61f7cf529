#!/usr/bin/env python
"""Snapshot cost: phalanx's Snapshotter against torch.save and DCP async_save, in one run.

For each state size (an MLP-like ``nn.Module`` of 16 float32 tensors), measured in this
process, one line of progress per measurement:

* limit     — every state tensor copied (torch ``copy_``) into one preallocated, already
              touched buffer: CPU memcpy; CUDA: pinned device-to-host copy
              (``copy_(non_blocking=True)`` into pinned memory, then ``synchronize``).
* phalanx   — a real Keeper (unique job, slots in ``--shm-dir``) + KeeperClient +
              Snapshotter, once per checksum algorithm (xxh3, the default; blake3 and sha256,
              the cryptographic ones that make the HMAC-signed manifest cover every byte).
              stall = ``capture()``'s return value; landed = until the bytes are in the slot
              (``wait_for_copy()``, then ``torch.cuda.synchronize()`` on CUDA); complete =
              until ``flush()`` returns (checksummed, manifest signed, published to the
              keeper). One warm-up capture allocates the slots.
* torch.save — ``torch.save(model.state_dict())`` to a file in ``--shm-dir``
              (stall = completion = the whole save).
* dcp_async — ``torch.distributed.checkpoint.async_save({"model": model})`` into a fresh
              directory in ``--shm-dir``, no process group (a 1-rank gloo group only if that
              fails); each save is waited for before the next. stall = until async_save
              returns; complete = until its future is done.

Every system is set up once per size and warmed up once; then the limit and phalanx (per
algorithm) repeat round-robin, the order rotated by one every repeat, so load from other
processes skews all of them alike; torch.save and DCP follow in a second round-robin (their
tmpfs files, written and deleted, slowed the next copy up to 2x). Each system runs twice
back to back and the second run is measured (hot, as snapshots run in a training loop);
medians over ``--repeats``. Also measured: one core's speed for
each checksum, which bounds the completion throughput.

Writes ``<out>/snapshot[_cuda].json`` and ``.png`` (when matplotlib is importable) and prints
a markdown table and PASS/MISS per target; a missed target never fails the process. The
JSON's machine section holds the load average before and after: other processes' CPU use
skews every number here. Every shm/tmp file is removed, also on SIGTERM.
"""
from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from bench.common import (MiB, bar_chart, gbps, machine_info, markdown_table, median,  # noqa: E402
                          progress, summary, verdict, write_json)
from phalanx.runtime.snapshot import fused_copy  # noqa: E402
from phalanx.runtime.snapshot.checksum import DEFAULT_ALGO, Span, digest_spans  # noqa: E402
from phalanx.runtime.keeper.daemon import Keeper  # noqa: E402
from phalanx.runtime.keeper.wire import KeeperClient  # noqa: E402
from phalanx.runtime.snapshot.snapshotter import SnapshotPolicy, Snapshotter  # noqa: E402

SCHEMA_VERSION = 1
LAYERS = 8                      # 8 Linear layers -> 16 tensors (weight + bias each)
ALGOS = ("xxh3", "blake3", "sha256")
CPU_TARGETS = {"stall_ratio_dcp_over_phalanx_min": 20.0, "throughput_vs_limit_min": 0.70}
CUDA_TARGETS = {"stall_ms_per_4GiB_max": 5.0, "throughput_vs_limit_min": 0.85}


class MLPState(nn.Module):
    """``LAYERS`` square Linear layers sized so the parameters total about ``nbytes``."""

    def __init__(self, nbytes: int, device: str) -> None:
        super().__init__()
        width = max(8, int(math.sqrt(nbytes / 4 / LAYERS)))
        self.layers = nn.ModuleList(nn.Linear(width, width, device="meta") for _ in range(LAYERS))
        self.to_empty(device=device)
        with torch.no_grad():
            for p in self.parameters():
                p.normal_()                 # touches every page now, not during a timing

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state_dict().values())


class _Collect(logging.Handler):
    """Keeps WARNING+ records of the runtime (e.g. a failed cudaHostRegister) for the JSON."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.name}: {record.getMessage()}")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _label(size_mib: int) -> str:
    return f"{size_mib // 1024} GiB" if size_mib >= 1024 and size_mib % 1024 == 0 else f"{size_mib} MiB"


# ----- the four systems ---------------------------------------------------------------------
# Each is set up once per size, warmed up once, then the repeats run round-robin in a
# rotating order (see the module docstring) so that load from other processes on the
# machine skews every system alike rather than one of them.

class CopyLimit:
    """The copy ceiling for this state: every tensor of the state copied (torch ``copy_``,
    all intra-op threads) into a preallocated, already-touched buffer — anonymous memory
    on CPU, pinned memory for CUDA (device-to-host, then ``synchronize``).

    Two destination buffers take turns, as the keeper's two slots do for phalanx: with one
    buffer, a copy right after another landed in a destination the first had left in the
    CPU cache (64 MiB here: 4.6 ms after a copy into the same buffer, 6.0 ms after
    phalanx's copy into its slot), which measured the cache rather than the machine's
    memcpy, and no snapshot in a training loop finds its slot cache-hot.
    """

    def __init__(self, state: dict[str, torch.Tensor], device: str) -> None:
        self.state, self.device = state, device
        self.nbytes = sum(t.numel() * t.element_size() for t in state.values())
        self.dsts = [torch.zeros(self.nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
                     for _ in range(2)]
        self.kind = "pinned_d2h" if device == "cuda" else "memcpy"
        self.turn = 0

    def run(self) -> float:
        dst = self.dsts[self.turn]
        self.turn ^= 1
        started = time.perf_counter()
        offset = 0
        for t in self.state.values():
            n = t.numel() * t.element_size()
            dst[offset:offset + n].copy_(t.view(-1).view(torch.uint8),
                                         non_blocking=self.device == "cuda")
            offset += n
        _sync(self.device)
        return time.perf_counter() - started

    def close(self) -> None:
        del self.state, self.dsts


class PhalanxRun:
    """A Snapshotter (one rank of the shared in-process Keeper) with one checksum algo."""

    def __init__(self, keeper: Keeper, secret: bytes, rank: int, algo: str,
                 objects: dict[str, Any], device: str) -> None:
        self.algo, self.rank, self.objects, self.device = algo, rank, objects, device
        self.client = KeeperClient(*keeper.address, secret, keeper.job)
        self.snap = Snapshotter(self.client, job=keeper.job, rank=rank, generation=0,
                                secret=secret, policy=SnapshotPolicy(every_steps=1),
                                checksum_algo=algo)
        self.step = -1

    def run(self) -> tuple[float, float, float]:
        """(stall, landed, complete) seconds of one capture + flush."""
        self.step += 1
        started = time.perf_counter()
        stall = self.snap.capture(self.step, self.objects)
        # until the bytes are out of the live tensors: CPU, the background thread's copy
        # (wait_for_copy blocks); CUDA, the side-stream D2H copy (wait + synchronize)
        self.snap.wait_for_copy()
        _sync(self.device)
        landed = time.perf_counter() - started
        self.snap.flush()
        return stall, landed, time.perf_counter() - started

    def published(self) -> int | None:
        return self.client.latest(self.rank)

    def close(self) -> None:
        try:
            self.snap.close()
        finally:
            self.client.close()


def torch_save_once(model: nn.Module, path: str) -> float:
    started = time.perf_counter()
    torch.save(model.state_dict(), path)
    took = time.perf_counter() - started
    os.remove(path)
    return took


_PG_STATE = {"initialized_here": False}


def dcp_once(model: nn.Module, path: str) -> tuple[float, float]:
    """(stall, complete) of one DCP async_save, waited for; its directory is removed."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    started = time.perf_counter()
    try:
        response = dcp.async_save({"model": model}, checkpoint_id=path)
    except (RuntimeError, ValueError, AssertionError):
        if not dist.is_available() or dist.is_initialized():
            raise
        # Not needed with torch 2.13 (single process, no group); kept for other versions.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        _PG_STATE["initialized_here"] = True
        shutil.rmtree(path, ignore_errors=True)
        started = time.perf_counter()
        response = dcp.async_save({"model": model}, checkpoint_id=path)
    returned = time.perf_counter() - started
    future = getattr(response, "upload_completion", response)
    try:
        future.result()
    except BaseException:
        # interrupted (SIGTERM): let the writer thread finish before the caller removes
        # the directory, so no file is created after the cleanup
        _ = future.exception()
        raise
    complete = time.perf_counter() - started
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise RuntimeError(f"DCP async_save wrote no .metadata into {path}")
    shutil.rmtree(path)
    return returned, complete


def checksum_speed(nbytes: int = 16 * MiB, repeats: int = 3) -> dict[str, float]:
    """GB/s of one core hashing an in-memory buffer (best of ``repeats``), per algorithm."""
    data = bytearray(os.urandom(nbytes))
    spans = [Span("x", 0, nbytes)]
    speed = {}
    for algo in ALGOS:
        best = math.inf
        for _ in range(repeats):
            started = time.perf_counter()
            digest_spans(data, spans, {"x": algo})
            best = min(best, time.perf_counter() - started)
        speed[algo] = gbps(nbytes, best)
    return speed


# ----- one size, whole run ------------------------------------------------------------------

def _algos_that_fit(nbytes: int, shm_dir: str, tag: str) -> tuple[str, ...]:
    """Each checksum algo needs 2 slots in shm_dir, plus a torch.save file and a DCP
    checkpoint; with too little room only xxh3 (the default) is measured."""
    free = shutil.disk_usage(shm_dir).free

    def need(algos: int) -> float:
        return (2 * algos + 2) * nbytes * 1.05 + (16 << 20)

    if free >= need(len(ALGOS)):
        return ALGOS
    if free >= need(1):
        progress(f"{tag} only {free / MiB:.0f} MiB free in {shm_dir}: measuring xxh3 only")
        return ALGOS[:1]
    raise SystemExit(f"{shm_dir} has {free / MiB:.0f} MiB free, the {nbytes / MiB:.0f} MiB "
                     f"state needs {need(1) / MiB:.0f} MiB; pass --shm-dir on a larger tmpfs")


def _discard(key: str, value: float) -> None:
    """The ``add`` of a warm-up run: its numbers are not kept."""


def _measure(kind: str, run: PhalanxRun | None, rep: str, model: nn.Module, limit: CopyLimit,
             tmp: str, i: int, add: Callable[[str, float], None], nbytes: int) -> None:
    if kind == "limit":
        took = limit.run()
        add("limit", took)
        if run is not None:                 # the limit of that algorithm's phase
            add(f"limit_{run.algo}", took)
        progress(f"{rep} {limit.kind:<15} {took * 1e3:9.1f} ms ({gbps(nbytes, took):6.2f} GB/s)")
    elif kind == "phalanx":
        stall, landed, done = run.run()
        add(f"{run.algo}_stall", stall), add(f"{run.algo}_landed", landed)
        add(f"{run.algo}_complete", done)
        progress(f"{rep} phalanx/{run.algo:<7} {done * 1e3:9.1f} ms "
                 f"({gbps(nbytes, done):6.2f} GB/s), stall {stall * 1e3:.2f} ms")
    elif kind == "torch_save":
        took = torch_save_once(model, os.path.join(tmp, "state.pt"))
        add("torch_save", took)
        progress(f"{rep} torch.save      {took * 1e3:9.1f} ms ({gbps(nbytes, took):6.2f} GB/s)")
    else:
        stall, done = dcp_once(model, os.path.join(tmp, f"dcp{i}"))
        add("dcp_stall", stall), add("dcp_complete", done)
        progress(f"{rep} dcp.async_save  {done * 1e3:9.1f} ms ({gbps(nbytes, done):6.2f} "
                 f"GB/s), stall {stall * 1e3:.2f} ms")


def bench_size(size_mib: int, device: str, repeats: int, shm_dir: str) -> dict[str, Any]:
    tag = f"{_label(size_mib):>8}"
    model = MLPState(size_mib * MiB, device)
    nbytes = model.nbytes()
    objects = {"model": model}
    progress(f"{tag} state: {len(model.state_dict())} float32 tensors, {nbytes / MiB:.1f} MiB "
             f"on {device}")
    result: dict[str, Any] = {"size_mib": size_mib, "bytes": nbytes,
                              "tensors": len(model.state_dict()), "device": device}
    job = f"bench-snap-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    secret = os.urandom(32)
    algos = _algos_that_fit(nbytes, shm_dir, tag)
    result["checksum_algos"] = list(algos)
    tmp = tempfile.mkdtemp(prefix=f"phalanx-bench-{os.getpid()}-", dir=shm_dir)
    limit: CopyLimit | None = None
    keeper: Keeper | None = None
    runs: list[PhalanxRun] = []
    s: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        s.setdefault(key, []).append(value)

    try:
        limit = CopyLimit(model.state_dict(), device)
        keeper = Keeper("bench", job, secret, shm_dir, slots=2).start()
        # every Snapshotter stays open until the end, so no slot mapping (CUDA-registered
        # on GPUs) is unmapped and mapped again at the same address
        for rank, algo in enumerate(algos):
            runs.append(PhalanxRun(keeper, secret, rank, algo, objects, device))
        warm: dict[str, float] = {"limit": limit.run()}
        for run in runs:
            warm[f"phalanx_{run.algo}"] = run.run()[2]   # allocates and maps the slots
        warm["torch_save"] = torch_save_once(model, os.path.join(tmp, "state.pt"))
        warm["dcp_async"] = dcp_once(model, os.path.join(tmp, "dcp-warmup"))[1]
        progress(f"{tag} warm-up (keeper slots {len(runs) * 2} x {nbytes / MiB:.0f} MiB, first "
                 f"save of each): " + ", ".join(f"{k} {v:.2f} s" for k, v in warm.items()))
        # one phase per checksum algorithm: the copy limit and that algorithm's phalanx
        # run, alternating (in the same phase, so each ratio pairs neighbours; interleaving
        # all algorithms' slots, 6 x the state, slowed the 1 GiB copies by up to 20%); then
        # torch.save and DCP, which write and delete tmpfs files whose aftermath (pages
        # freed and zeroed) slowed whichever copy ran next by up to 2x here
        phases = [[("limit", run), ("phalanx", run)] for run in runs]
        for phase in phases + [[("torch_save", None), ("dcp", None)]]:
            for i in range(1, repeats + 1):
                rep = f"{tag} rep {i}/{repeats}"
                shift = (i - 1) % len(phase)
                for kind, run in phase[shift:] + phase[:shift]:
                    # back to back, the second one measured: every system runs hot, on a
                    # cache its own first run filled, as snapshots do in a training loop
                    # (after an idle gap, or right after torch's OpenMP workers ran, a copy
                    # measured up to 2x slower: idle virtual CPUs wake slowly, and OpenMP
                    # workers spin for a while, taking a core)
                    _measure(kind, run, f"{rep} (warm-up)", model, limit, tmp, i, _discard,
                             nbytes)
                    _measure(kind, run, rep, model, limit, tmp, i, add, nbytes)
        result["limit"] = {"kind": limit.kind, "seconds": summary(s["limit"]),
                           "gbps": gbps(nbytes, median(s["limit"])),
                           "best_gbps": gbps(nbytes, min(s["limit"])),
                           "torch_threads": torch.get_num_threads(), "warmup_s": warm["limit"]}
        result["phalanx"] = {"job": job, "slots": 2}
        for run in runs:
            published = run.published()
            if published != run.step:
                raise RuntimeError(f"keeper holds step {published} for rank {run.rank}, "
                                   f"expected {run.step}")
            a = run.algo
            result["phalanx"][a] = {
                "stall_s": summary(s[f"{a}_stall"]), "landed_s": summary(s[f"{a}_landed"]),
                "complete_s": summary(s[f"{a}_complete"]),
                "warmup_s": warm[f"phalanx_{a}"],
                "throughput_gbps": gbps(nbytes, median(s[f"{a}_complete"])),
                "copy_gbps": gbps(nbytes, median(s[f"{a}_landed"])),
                "published_step": published, "snapshot_bytes": run.snap.stats.bytes,
                "limit_s": summary(s[f"limit_{a}"])}    # the limit measured beside it
        result["torch_save"] = {"seconds": summary(s["torch_save"]),
                                "throughput_gbps": gbps(nbytes, median(s["torch_save"])),
                                "warmup_s": warm["torch_save"]}
        import torch.distributed as dist
        result["dcp_async"] = {"stall_s": summary(s["dcp_stall"]),
                               "complete_s": summary(s["dcp_complete"]),
                               "throughput_gbps": gbps(nbytes, median(s["dcp_complete"])),
                               "warmup_s": warm["dcp_async"],
                               "process_group": "gloo(1 rank)" if dist.is_initialized() else None}
    finally:
        for run in runs:
            run.close()
        if keeper is not None:
            keeper.close()
        if limit is not None:
            limit.close()
        shutil.rmtree(tmp, ignore_errors=True)
        del model, objects
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    result.update(judge(result, device))
    return result


def _paired(numerators: list[float], denominators: list[float]) -> float:
    """Median over repeats of the per-repeat ratio: the repeats ran round-robin, so a
    ratio within one repeat cancels most of the drift in the machine's load."""
    return median(a / b for a, b in zip(numerators, denominators))


def judge(r: dict[str, Any], device: str) -> dict[str, Any]:
    """Ratios (paired medians, see ``_paired``; ratios of the medians alongside) and
    PASS/MISS per checksum algorithm."""
    ratios, verdicts = {}, {}
    dcp_stall = r["dcp_async"]["stall_s"]["samples"]
    for algo in r["checksum_algos"]:
        ph = r["phalanx"][algo]
        limit_s = ph["limit_s"]["samples"]
        stall = ph["stall_s"]["samples"]
        tput = _paired(limit_s, ph["complete_s"]["samples"])
        stall_ratio = _paired(dcp_stall, stall)
        ratios[algo] = {"throughput_vs_limit": tput,
                        "copy_vs_limit": _paired(limit_s, ph["landed_s"]["samples"]),
                        "stall_dcp_over_phalanx": stall_ratio,
                        "of_medians": {
                            "throughput_vs_limit": median(limit_s) / median(ph["complete_s"]["samples"]),
                            "stall_dcp_over_phalanx": median(dcp_stall) / median(stall)}}
        if device == "cuda":
            per_4gib_ms = median(stall) * 1e3 * (4 << 30) / r["bytes"]
            ratios[algo]["stall_ms_per_4GiB"] = per_4gib_ms
            stall_ok = per_4gib_ms <= CUDA_TARGETS["stall_ms_per_4GiB_max"]
            tput_ok = tput >= CUDA_TARGETS["throughput_vs_limit_min"]
        else:
            stall_ok = stall_ratio >= CPU_TARGETS["stall_ratio_dcp_over_phalanx_min"]
            tput_ok = tput >= CPU_TARGETS["throughput_vs_limit_min"]
        verdicts[algo] = {"stall": verdict(stall_ok), "throughput": verdict(tput_ok),
                          "default_checksum": algo == DEFAULT_ALGO}
    return {"ratios": ratios, "verdicts": verdicts}


def table(results: list[dict[str, Any]], device: str) -> str:
    limit = "pinned D2H GB/s" if device == "cuda" else "memcpy GB/s"
    headers = ["state", "checksum", "phalanx stall ms", "DCP async stall ms", "torch.save s",
               "phalanx GB/s (complete)", "phalanx copy GB/s", limit, "phalanx/limit*",
               "stall DCP/phalanx*", "stall target", "throughput target"]
    rows = []
    for r in results:
        for algo in r["checksum_algos"]:
            ph, ra, ve = r["phalanx"][algo], r["ratios"][algo], r["verdicts"][algo]
            rows.append([_label(r["size_mib"]), algo, ph["stall_s"]["median"] * 1e3,
                         r["dcp_async"]["stall_s"]["median"] * 1e3,
                         r["torch_save"]["seconds"]["median"], ph["throughput_gbps"],
                         ph["copy_gbps"], r["limit"]["gbps"], ra["throughput_vs_limit"],
                         ra["stall_dcp_over_phalanx"], ve["stall"], ve["throughput"]])
    return markdown_table(headers, rows) + ("\n\nms, s and GB/s: medians over the repeats; "
                                            "* median of the per-repeat ratios")


def fused_copy_used() -> str:
    """Which fused copy + xxh3 the CPU captures of this run used."""
    native = fused_copy.kernel()
    return f"native ({native.path})" if native is not None else "python (no native kernel)"


def notes(device: str, hash_gbps: dict[str, float]) -> list[str]:
    common = [
        "complete = capture start until flush() returns: the copy into the keeper's slot "
        "fused with the per-tensor checksums (on as many threads as torch's intra-op "
        "threads), the manifest (HMAC-signed) and the publish RPC to the keeper.",
        "CPU xxh3 capture, fused copy used in this run: " + fused_copy_used() + ". The "
        "native kernel (runtime/snapshot/fused_copy.c) hashes each 32 KiB piece of the source while it "
        "is in L1 and streams it to the slot with non-temporal stores (no read-for-ownership "
        "of the slot), which is why its copy can outrun the memcpy limit (torch copy_, "
        "regular stores); blake3 and sha256 copy with numpy and hash the copied chunk.",
        "xxh3 (the default) vs blake3 vs sha256: the manifest HMAC authenticates the "
        "checksums, so only a cryptographic checksum (blake3, sha256) makes every tensor byte "
        "tamper-evident; xxh3 (128-bit) catches corruption but not deliberate forgery. The "
        "training stall is the same for all (checksums run in the background); completion "
        "throughput follows the hash speed (one core, measured in this run: "
        + ", ".join(f"{a} {v:.2f} GB/s" for a, v in hash_gbps.items()) + ").",
        "torch.save and DCP write fresh tmpfs pages on every save (page faults); phalanx "
        "reuses two pre-faulted slots.",
        "The copy limit alternates between two destination buffers, as phalanx alternates "
        "between its two slots: a copy into the buffer the previous copy had just filled "
        "finds it in the CPU cache and measures the cache, not memory.",
        "The throughput targets apply to the default checksum (xxh3); blake3 and sha256 are "
        "opt-in for tamper evidence and are bounded by their hash speed.",
    ]
    if device == "cuda":
        return common + [
            "CUDA: stall = flatten + claim RPC + enqueueing the device-to-host copies on a side "
            "stream into the cudaHostRegister-ed slot; 'copy GB/s' is until the copy has "
            "landed (torch.cuda.synchronize()), compare it with pinned D2H.",
            "DCP async_save stages GPU tensors into CPU memory before it returns (default "
            "stager, pageable memory), so its stall grows with the state.",
        ]
    return common + [
        "CPU: the copy into the slot runs on the snapshotter's background thread while the "
        "next step's forward and backward run (the optimizer step and buffer-updating "
        "forwards wait for it), so the stall is flattening the state plus waking those "
        "threads (the slot claim RPC runs on them); "
        "'copy GB/s' is bytes / (capture start until wait_for_copy() returns), compare it "
        "with memcpy. DCP async_save's stall is its own synchronous staging copy into freshly "
        "allocated memory plus planning.",
    ]


def chart(results: list[dict[str, Any]], device: str, path: Path) -> bool:
    groups = [_label(r["size_mib"]) for r in results]
    limit = "pinned D2H" if device == "cuda" else "memcpy"

    def col(fn: Any) -> list[float]:
        return [fn(r) for r in results]

    algos = [a for a in ALGOS if all(a in r["checksum_algos"] for r in results)]
    stall = {f"phalanx {a}": col(lambda r, a=a: r["phalanx"][a]["stall_s"]["median"] * 1e3)
             for a in algos}
    stall["DCP async_save"] = col(lambda r: r["dcp_async"]["stall_s"]["median"] * 1e3)
    stall["torch.save"] = col(lambda r: r["torch_save"]["seconds"]["median"] * 1e3)
    tput = {f"phalanx {a}": col(lambda r, a=a: r["phalanx"][a]["throughput_gbps"]) for a in algos}
    tput["DCP async_save"] = col(lambda r: r["dcp_async"]["throughput_gbps"])
    tput["torch.save"] = col(lambda r: r["torch_save"]["throughput_gbps"])
    tput[f"{limit} limit"] = col(lambda r: r["limit"]["gbps"])
    return bar_chart(path, [
        {"title": "training stall per snapshot (lower is better)", "ylabel": "ms (log)",
         "groups": groups, "series": stall, "log": True},
        {"title": "completion throughput (higher is better)", "ylabel": "GB/s",
         "groups": groups, "series": tput},
    ], title=f"phalanx snapshot vs torch.save vs DCP async_save ({device})")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", help="state sizes in MiB, comma-separated "
                        "(default 64,256,1024 on cpu, 4096 on cuda)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--shm-dir", default="/dev/shm")
    parser.add_argument("--quick", action="store_true", help="16 MiB, 2 repeats (for tests)")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.repeats = "16", 2
    if args.sizes is None:
        args.sizes = "4096" if args.device == "cuda" else "64,256,1024"
    try:
        args.sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--sizes takes integers (MiB), got {args.sizes!r}")
    if not args.sizes or min(args.sizes) <= 0 or args.repeats < 1:
        parser.error("need positive --sizes and --repeats >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device visible to torch")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds through the finally blocks, which remove every shm/tmp file.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    warnings.filterwarnings("ignore", module=r"torch\.distributed.*")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    collected = _Collect()
    logging.getLogger().addHandler(collected)
    out = Path(args.out)
    stem = "snapshot_cuda" if args.device == "cuda" else "snapshot"
    load_before = os.getloadavg()
    progress(f"snapshot bench: device={args.device} sizes(MiB)={args.sizes} "
             f"repeats={args.repeats} shm_dir={args.shm_dir} torch threads="
             f"{torch.get_num_threads()} cpus={os.cpu_count()} load average "
             f"{load_before[0]:.2f} (other processes' CPU use skews every number)")
    hash_gbps = checksum_speed()
    progress("one core's checksum speed: " + ", ".join(f"{a} {v:.2f} GB/s"
                                                       for a, v in hash_gbps.items()))
    results = []
    try:
        for size in args.sizes:
            results.append(bench_size(size, args.device, args.repeats, args.shm_dir))
    finally:
        if _PG_STATE["initialized_here"]:
            import torch.distributed as dist
            dist.destroy_process_group()
    report: dict[str, Any] = {
        "bench": "snapshot", "schema_version": SCHEMA_VERSION, "device": args.device,
        "quick": args.quick, "repeats": args.repeats, "sizes_mib": args.sizes,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {**machine_info(), "loadavg_before": load_before,
                    "loadavg_after": os.getloadavg()},
        "targets": CUDA_TARGETS if args.device == "cuda" else CPU_TARGETS,
        "systems": ["phalanx", "torch_save", "dcp_async", "limit"], "checksum_algos": list(ALGOS),
        "checksum_gbps_one_core": hash_gbps, "fused_copy": fused_copy_used(),
        "results": results, "notes": notes(args.device, hash_gbps), "warnings": collected.messages,
    }
    png = out / f"{stem}.png"
    report["png"] = str(png) if chart(results, args.device, png) else None
    json_path = write_json(out / f"{stem}.json", report)
    print()
    print(table(results, args.device))
    print()
    if args.device == "cuda":
        targets = (f"targets: phalanx stall <= {CUDA_TARGETS['stall_ms_per_4GiB_max']} ms per "
                   f"4 GiB; completion >= {CUDA_TARGETS['throughput_vs_limit_min']:.0%} of pinned D2H")
    else:
        targets = (f"targets: phalanx stall <= 1/{CPU_TARGETS['stall_ratio_dcp_over_phalanx_min']:.0f}"
                   f" of DCP async_save's; completion >= "
                   f"{CPU_TARGETS['throughput_vs_limit_min']:.0%} of memcpy")
    print(targets + f" (the default checksum, {DEFAULT_ALGO}; the cryptographic ones are "
          "opt-in and hash slower than memcpy)")
    for r in results:
        for algo in r["checksum_algos"]:
            v = r["verdicts"][algo]
            role = "default" if v["default_checksum"] else "opt-in, for comparison"
            print(f"  {_label(r['size_mib']):>8} {algo:<7} stall {v['stall']}  "
                  f"throughput {v['throughput']}  ({role})")
    print("notes:")
    for note in report["notes"]:
        print(f"  - {note}")
    for message in collected.messages:
        print(f"  warning: {message}")
    print(f"load average before {load_before[0]:.2f}, after {report['machine']['loadavg_after'][0]:.2f}"
          f" on {os.cpu_count()} cpus")
    print(f"wrote {json_path}" + (f" and {png}" if report["png"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
