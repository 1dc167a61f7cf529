"""The run directory's files that ranks write on their own machines (their logs), brought
to the launcher's run directory through each node's keeper at the end of the run, so a job
whose machines share no filesystem still leaves every live node's logs where the launcher
and `phalanx status` look. With a shared filesystem the keeper lists the very files the
launcher has, sizes equal, and nothing moves.

The keeper side (``list_run_files``, ``read_run_file``) answers only for paths inside the
run directory's ``logs`` folder; the launcher side (``gather_run_files``) appends what it
lacks of each file, ``CHUNK_BYTES`` per call, at most ``MAX_FILE_BYTES`` of a file (the
tail of a longer one is left where it was written, and said so in the log)."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Mapping

import ray

log = logging.getLogger(__name__)
SHIPPED = ("logs",)              # the run directory's folders that ranks write on their node
CHUNK_BYTES = 4 << 20
MAX_FILE_BYTES = 64 << 20
CALL_TIMEOUT_S = 30.0


def list_run_files(run_dir: str) -> dict[str, int]:
    """Every file under the run directory's shipped folders on this machine: relative
    path → size in bytes."""
    found: dict[str, int] = {}
    root = Path(run_dir)
    for folder in SHIPPED:
        base = root / folder
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*")):
            if path.is_file():
                found[path.relative_to(root).as_posix()] = path.stat().st_size
    return found


def read_run_file(run_dir: str, relative: str, offset: int, limit: int) -> bytes:
    """Up to ``limit`` bytes of a listed file from ``offset``. Raises ValueError for a path
    outside the shipped folders (a keeper serves nothing else)."""
    root = Path(run_dir).resolve()
    path = (root / relative).resolve()
    if path.parent == root or not any(path.is_relative_to(root / f) for f in SHIPPED):
        raise ValueError(f"{relative!r} is not a file of the run's {', '.join(SHIPPED)} folders")
    with open(path, "rb") as handle:
        handle.seek(offset)
        return handle.read(max(0, min(limit, CHUNK_BYTES)))


def gather_run_files(run_path: Path, keepers: Mapping[str, Any]) -> dict[str, int]:
    """Append to the launcher's copy of each file what it lacks of the copy a node's keeper
    lists (``keepers``: node name → keeper actor). Returns bytes written per node; a keeper
    that does not answer is logged and skipped (its node's files stay there)."""
    written: dict[str, int] = {}
    for node, actor in keepers.items():
        try:
            remote = ray.get(actor.run_files.remote(), timeout=CALL_TIMEOUT_S)
            written[node] = sum(_append_missing(run_path, actor, rel, size)
                                for rel, size in remote.items())
        except Exception as exc:  # noqa: BLE001 - a node's logs must never fail the job
            log.warning("event=run_files_not_gathered node=%s error=%s", node,
                        f"{type(exc).__name__}: {str(exc)[:200]}")
            continue
        if written[node]:
            log.info("event=run_files_gathered node=%s bytes=%d files=%d", node, written[node],
                     len(remote))
    return written


def _append_missing(run_path: Path, actor: Any, relative: str, size: int) -> int:
    local = run_path / relative
    have = local.stat().st_size if local.is_file() else 0
    wanted = min(size, MAX_FILE_BYTES)
    if have >= wanted:
        if size > MAX_FILE_BYTES and have < size:
            log.warning("event=run_file_truncated file=%s size=%d kept=%d", relative, size, have)
        return 0
    local.parent.mkdir(parents=True, exist_ok=True)
    moved = 0
    with open(local, "ab") as out:
        while have + moved < wanted:
            chunk = ray.get(actor.read_run_file.remote(relative, have + moved,
                                                       wanted - have - moved),
                            timeout=CALL_TIMEOUT_S)
            if not chunk:
                break
            out.write(chunk)
            moved += len(chunk)
        out.flush()
        os.fsync(out.fileno())
    return moved
