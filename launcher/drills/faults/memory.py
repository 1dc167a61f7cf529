"""Numerical faults: silent data corruption, a bit flipped in one rank's parameters in the
worker process's memory, written from outside through ``/proc/<pid>/mem`` at the address
the worker's session published (``phalanx.runtime.worker.drill_hooks``). Nothing in the worker is told:
phalanx must find it by comparing replica digests across ranks and repair it."""
from __future__ import annotations

import logging
from typing import Any, Mapping

from phalanx.configs.errors import ConfigError, FatalError
from phalanx.launcher.drills.catalogue import FaultEnv, FaultSpec, Mechanism, register
from phalanx.runtime.worker.drill_hooks import read_memory_maps

log = logging.getLogger(__name__)


class MemoryFaultFailed(FatalError):
    """The worker's memory could not be read or written (the process is gone, or the
    launcher may not ptrace it: run as root or with CAP_SYS_PTRACE)."""


def worker_memory(env: FaultEnv, rank: int, index: int) -> tuple[int, dict[str, Any]]:
    """(pid, memory map) of ``rank``'s running worker."""
    pid = env.rank_pid(rank)
    if pid is None:
        raise ConfigError(f"faults[{index}].target.rank", f"rank {rank} has no running worker",
                          "target a rank below the world size")
    for found in read_memory_maps(env.run_dir, rank):
        if found.get("pid") == pid:
            return pid, found
    raise MemoryFaultFailed(f"rank {rank} (pid {pid}) published no memory map under "
                            f"{env.run_dir}/memory: its session has not started yet")


def pick_tensor(tensors: Mapping[str, Mapping[str, Any]], name: str,
                index: int) -> tuple[str, Mapping[str, Any]]:
    """The tensor named ``name``, or (empty name) the first floating-point tensor of the
    first registered object that has one (the model, in registration order)."""
    if name:
        if name not in tensors:
            raise ConfigError(f"faults[{index}].params.tensor", f"{name!r} is not a tensor of "
                              "the rank's registered state",
                              f"use one of {sorted(tensors)[:6]} (or leave it empty)")
        return name, tensors[name]
    for key, entry in tensors.items():
        if str(entry.get("dtype", "")).startswith(("float", "bfloat")):
            return key, entry
    raise ConfigError(f"faults[{index}].params.tensor", "the rank registered no floating-point "
                      "CPU tensor", "register the model with session.register(model=...)")


def flip_bit(pid: int, address: int, bit: int) -> tuple[int, int]:
    """XOR bit ``bit`` (0-7) of the byte at ``address`` in process ``pid``; returns the byte
    before and after. Raises ``MemoryFaultFailed``."""
    try:
        with open(f"/proc/{pid}/mem", "r+b", buffering=0) as memory:
            memory.seek(address)
            before = memory.read(1)[0]
            after = before ^ (1 << bit)
            memory.seek(address)
            memory.write(bytes([after]))
    except (OSError, IndexError) as exc:
        raise MemoryFaultFailed(f"cannot flip bit {bit} at {address:#x} in pid {pid}: "
                                f"{exc}") from exc
    return before, after


def corrupt_params(spec: FaultSpec, env: FaultEnv) -> Mapping[str, Any]:
    """Flip bit ``params.bit`` of tensor ``params.tensor`` (bit 0 = the least significant
    bit of its first byte; little-endian, so bits 0-22 of a float32 tensor are element 0's
    mantissa, 23-30 its exponent, 31 its sign) in rank ``spec.rank``'s worker."""
    assert spec.rank is not None
    pid, found = worker_memory(env, spec.rank, spec.index)
    name, entry = pick_tensor(found.get("tensors", {}), str(spec.params.get("tensor") or ""),
                              spec.index)
    bit, nbytes = int(spec.params.get("bit", 0)), int(entry["nbytes"])
    if not 0 <= bit < nbytes * 8:
        raise ConfigError(f"faults[{spec.index}].params.bit", f"{bit} is outside tensor "
                          f"{name!r} ({nbytes} bytes)", f"use 0..{nbytes * 8 - 1}")
    offset = bit // 8
    address = int(entry["address"]) + offset
    before, after = flip_bit(pid, address, bit % 8)
    log.warning("event=params_corrupted rank=%d pid=%d tensor=%s offset=%d bit=%d address=%#x",
                spec.rank, pid, name, offset, bit, address)
    return {"pid": pid, "tensor": name, "offset": offset, "bit": bit, "address": address,
            "byte_before": before, "byte_after": after}


register(Mechanism(
    kind="corrupt_params", family="numerical", target="rank", fire=corrupt_params,
    summary="flip one bit of one rank's parameters in the worker's memory (silent data "
            "corruption): found by comparing replica digests across ranks, repaired from "
            "a healthy peer after every rank rolls back to the newest agreeing step",
    params={"bit": (int, 0), "tensor": (str, "")}, recovers="rollback", chaos=True,
    response=("the ranks compare replica digests at every snapshot; the odd rank is "
              "repaired from a healthy peer and every rank rolls back to the last "
              "agreeing step")))
