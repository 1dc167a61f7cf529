"""Keeper-owned shared-memory files: create, pre-touch, map and unlink them, track what each
holds and which slot a writer may take next; and node capacity checks for the launcher.
Every file is ``<shm_dir>/phalanx-<job>-<node>-...``, created O_EXCL with mode 0600.
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import re
from dataclasses import dataclass, field
from typing import Callable

from phalanx.configs.errors import ConfigError

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.]{0,127}$")
_JOB_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
# What may follow the prefix in a file this keeper made: a local slot or a replica buffer.
_OWN_SUFFIX_RE = re.compile(r"^(r\d+-v\d+-s\d+|x\d+)$")
_ZERO_CHUNK = 8 << 20
# MAP_POPULATE pre-faults the keeper's page tables; absent outside Linux.
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def validate_name(value: str, key: str, allow_dash: bool = False) -> str:
    """``value`` if it is safe inside a file name; raises ConfigError naming ``key``.

    Job names may hold ``-`` (``phalanx-job``); node names may not, so that
    ``phalanx-<job>-<node>-`` splits one way only. ``/`` and ``..`` could escape shm_dir.
    """
    pattern = _JOB_RE if allow_dash else _NAME_RE
    if not isinstance(value, str) or not pattern.match(value) or ".." in value:
        allowed = "letters, digits, '_', '.'" + (" or '-'" if allow_dash else "")
        raise ConfigError(key, f"{value!r} cannot be used in shared-memory file names",
                          f"use 1-128 {allowed}, starting with a letter or digit")
    return value


def shm_prefix(job: str, node: str) -> str:
    """The file-name prefix of every shm file one keeper owns."""
    return f"phalanx-{job}-{node}-"


class ShmBuffer:
    """One sized, pre-touched, read-write mapped file in shm_dir.

    ``unlink`` removes the name (mappings stay valid); ``close`` unmaps and unlinks. If a
    memoryview of the mapping is still alive, the unmap is left to the garbage collector
    (the name is gone, so the memory is freed once the last view dies).
    """

    def __init__(self, path: str, nbytes: int, mm: mmap.mmap) -> None:
        self.path = path
        self.nbytes = nbytes
        self._mm: mmap.mmap | None = mm
        self._linked = True
        # since when it holds nothing worth keeping (the Keeper releases its pages once
        # that lasted RELEASE_AFTER_S); None while it holds a step or is being written
        self.idle_since: float | None = None
        self.released = False

    def in_use(self) -> None:
        """It holds (or is about to hold) a step: its pages stay."""
        self.idle_since, self.released = None, False

    def release_if_idle(self, now: float, after_s: float) -> None:
        """It holds nothing: note since when, and give its pages back once that lasted
        ``after_s``."""
        if self.released:
            return
        if self.idle_since is None:
            self.idle_since = now
        elif now - self.idle_since >= after_s:
            self.release_pages()

    @classmethod
    def create(cls, path: str, nbytes: int, *, allocate: bool = True) -> "ShmBuffer":
        """Create ``path`` of ``nbytes``, allocate every page now (unless not ``allocate``:
        then its writer calls ``reserve_file`` first), and map it.

        Raises ConfigError(snapshot.shm_dir) when the tmpfs is full, FileExistsError when
        the name is taken. Allocating now turns a later SIGBUS in a worker into this error.
        """
        if nbytes <= 0:
            raise ValueError(f"shm buffer size must be positive, got {nbytes}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            if allocate:
                _pretouch(fd, nbytes, path)
            # (populating a map of a file with holes would allocate them)
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | (_POPULATE if allocate else 0),
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            _unlink_quietly(path)
            raise
        os.close(fd)
        return cls(path, nbytes, mm)

    def release_pages(self) -> None:
        """Give the file's memory back (``MADV_REMOVE``: the tmpfs frees its pages; the
        size and every mapping stay, and a read sees zeros). ``reserve`` allocates them
        again before anything writes into it."""
        if self._mm is None:
            return
        try:
            self._mm.madvise(mmap.MADV_REMOVE)
        except OSError as exc:     # a file system that cannot punch holes: the pages stay
            log.debug("shm.release_unsupported path=%s error=%s", self.path, exc)
        self.released = True

    def resident(self) -> int:
        """Bytes of the file the tmpfs holds pages for (0 once it is gone)."""
        return allocated_bytes(self.path)

    def reserve(self) -> None:
        """Allocate every page again after ``release_pages`` (``reserve_file``)."""
        reserve_file(self.path, self.nbytes)

    def reserve_ranges(self, ranges: list[tuple[int, int]]) -> None:
        """Allocate the pages of these (offset, nbytes) ranges only: a replica's own bytes
        when the rest are references (the holes read as zeros and stay unallocated)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        try:
            for offset, nbytes in ranges:
                _pretouch(fd, nbytes, self.path, offset)
        finally:
            os.close(fd)

    def view(self, nbytes: int | None = None) -> memoryview:
        """A writable view of the first ``nbytes``; the caller must ``release()`` it."""
        if self._mm is None:
            raise ValueError(f"{self.path} is closed")
        return memoryview(self._mm)[: self.nbytes if nbytes is None else nbytes]

    def unlink(self) -> None:
        """Remove the file name (idempotent)."""
        if self._linked:
            self._linked = False
            _unlink_quietly(self.path)

    def close(self) -> None:
        """Unmap and unlink (idempotent)."""
        self.unlink()
        mm, self._mm = self._mm, None
        if mm is None:
            return
        try:
            mm.close()
        except BufferError:
            log.debug("shm.unmap_deferred path=%s reason=views_alive", self.path)


@dataclass(eq=False)
class Held:
    """One shm buffer and what it holds; ``pins`` counts readers streaming from it.
    Mutated only under its Keeper's lock."""

    buf: ShmBuffer
    rank: int
    state: str = "empty"  # empty | writing | ready
    step: int = -1
    manifest: bytes = b""
    used: int = 0
    pins: int = 0
    doomed: bool = False  # unlinked; unmapped once no reader pins it
    # One callback per pin that gives way to a writer (a replica push): a claim that
    # needs this slot calls them once (under the Keeper's lock) and waits for the unpins.
    yielding: list[Callable[[], None]] = field(default_factory=list)
    # A replica whose bytes other snapshots on this keeper already hold keeps those
    # ranges as references, not copies (``phalanx.runtime.keeper.shared_copies``); each
    # distinct source is pinned once for it (``ref_pins`` counts such pins of this one)
    refs: tuple["Ref", ...] = ()
    ref_pins: int = 0
    copying: int = 0        # sources whose bytes are being copied in (each holds a pin)


@dataclass(frozen=True, eq=False)
class Ref:
    """Bytes [offset, offset + nbytes) of a replica are ``source``'s bytes at ``at``: the
    same tensor of another snapshot this keeper holds (one copy per node)."""

    offset: int
    nbytes: int
    source: Held
    at: int


@dataclass(eq=False)
class RankSlots:
    """A local rank's slot files of one layout version, plus the previous layout's newest
    ready slot, served until a slot of this layout is published."""

    version: int
    slot_nbytes: int
    slots: list[Held]
    retired: list[Held] = field(default_factory=list)
    # False once a writer said it pins its maps (CUDA host registration): the pages of a
    # slot it registered must stay, so the keeper never releases them (Keeper._reclaim)
    releasable: bool = True


def map_slots(alloc: Callable[[], list[str]], nbytes: int,
              open_map: Callable[[str, int], mmap.mmap],
              close_map: Callable[[mmap.mmap], None]) -> dict[str, mmap.mmap]:
    """A worker's maps of the slot files ``alloc()`` names (``open_map(path, nbytes)``
    each). A file unlinked between the keeper's answer and the map (a clean-up of a dead
    predecessor's files racing with the alloc) makes the maps made so far close and
    ``alloc()`` run once more: the keeper then replaces the layout. A second miss raises
    ``FileNotFoundError``."""
    for attempt in (1, 2):
        maps: dict[str, mmap.mmap] = {}
        try:
            for path in alloc():
                maps[path] = open_map(path, nbytes)
            return maps
        except FileNotFoundError as exc:
            for mapping in maps.values():
                close_map(mapping)
            if attempt == 2:
                raise
            log.warning("shm.slot_file_gone path=%s action=alloc_again", exc.filename)
    raise AssertionError("unreachable")


def pick_slot(table: RankSlots, protect_step: int | None, *,
              preempt: bool = False) -> int | None:
    """The slot to overwrite: never the newest ready one, a pinned one or ``protect_step``;
    empty or half-written slots first, then the oldest step. With ``preempt``, a slot
    whose every pin gives way to writers (``Held.yielding``) counts as unpinned."""
    ready = [h for h in table.slots if h.state == "ready"]
    newest = max(ready, key=lambda h: h.step) if ready and not table.retired else None
    choices = [(h.state == "ready", h.step, i) for i, h in enumerate(table.slots)
               if h is not newest
               and (h.pins == 0 or (preempt and h.pins == len(h.yielding)))
               and not (h.state == "ready" and h.step == protect_step)]
    return min(choices)[2] if choices else None


def allocated_bytes(path: str) -> int:
    """Bytes of ``path`` its file system holds blocks for (0 once it is gone)."""
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


def reserve_file(path: str, nbytes: int) -> None:
    """Allocate the pages of ``path``'s first ``nbytes`` not allocated yet (a slot not
    written before, or one whose pages a keeper gave back; a no-op otherwise): a full tmpfs
    is then this ConfigError(snapshot.shm_dir), not a SIGBUS in whichever process writes
    into the mapping."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_blocks * 512 < nbytes:
            _pretouch(fd, nbytes, path)
    finally:
        os.close(fd)


def _pretouch(fd: int, nbytes: int, path: str, offset: int = 0) -> None:
    """Allocate every page of the file (of its range from ``offset``) once so later copies
    into it do not fault pages in."""
    if nbytes <= 0:
        return
    try:
        os.posix_fallocate(fd, offset, nbytes)
        return
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise _no_space(path, nbytes) from exc
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
    zeros = bytes(min(_ZERO_CHUNK, nbytes))
    end = offset + nbytes
    try:
        while offset < end:
            offset += os.pwrite(fd, zeros[: end - offset], offset)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise _no_space(path, nbytes) from exc
        raise


def _no_space(path: str, nbytes: int) -> ConfigError:
    shm_dir = os.path.dirname(path) or "."
    return ConfigError("snapshot.shm_dir", f"no space for {_gib(nbytes)} in {shm_dir} "
                       f"({_gib(_free_bytes(shm_dir))} free)",
                       "enlarge the tmpfs, lower snapshot.slots or replication.factor")


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def owned_names(shm_dir: str, prefix: str) -> list[str]:
    """Names in ``shm_dir`` that a keeper with ``prefix`` creates (slots and replicas)."""
    return sorted(name for name in os.listdir(shm_dir)
                  if name.startswith(prefix) and _OWN_SUFFIX_RE.match(name[len(prefix):]))


def remove_stale(shm_dir: str, prefix: str) -> list[str]:
    """Unlink this keeper's files left in ``shm_dir`` by a predecessor that was killed."""
    removed = []
    for name in owned_names(shm_dir, prefix):
        _unlink_quietly(os.path.join(shm_dir, name))
        removed.append(name)
    return removed


def memory_plan(per_rank_bytes: int, ranks_on_node: int, slots: int,
                replication_factor: int, replicas_held: int) -> int:
    """Shared-memory bytes one node's keeper needs at most.

    ``slots`` buffers for each local rank, plus replicas: with balanced placement a node
    holds ``ranks_on_node * replication_factor`` other ranks, each kept at its newest
    ``replicas_held`` steps plus one receive buffer (a replica is received before the
    oldest is evicted, so a failed transfer never loses a held step).
    """
    for name, value in (("per_rank_bytes", per_rank_bytes), ("ranks_on_node", ranks_on_node),
                        ("slots", slots), ("replication_factor", replication_factor),
                        ("replicas_held", replicas_held)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    local = per_rank_bytes * ranks_on_node * slots
    replicated_ranks = ranks_on_node * replication_factor
    replicas = per_rank_bytes * replicated_ranks * (replicas_held + 1 if replicas_held else 0)
    return local + replicas


def check_capacity(required_bytes: int, shm_dir: str, *, what: str = "snapshots",
                   hint: str = "lower snapshot.slots or replication.factor, snapshot less "
                               "state, enlarge the tmpfs (mount -o remount,size=...) or use "
                               "nodes with more memory") -> None:
    """Raise ConfigError(snapshot.shm_dir) unless ``shm_dir`` and RAM can hold ``required_bytes``
    (``what`` names them in the message, ``hint`` is the fix).

    Compares with the tmpfs free space (statvfs) and with MemAvailable (tmpfs pages are
    RAM that cannot be reclaimed). Called by the launcher before a job starts and by a
    keeper before it creates a rank's slot files.
    """
    if not os.path.isdir(shm_dir):
        raise ConfigError("snapshot.shm_dir", f"{shm_dir} is not a directory",
                          "point snapshot.shm_dir at a tmpfs such as /dev/shm")
    limits = capacity_shortfall(required_bytes, shm_dir)
    if limits is not None:
        raise ConfigError(
            "snapshot.shm_dir",
            f"{what} need {required_bytes} bytes ({_gib(required_bytes)}) but {limits}", hint)


def capacity_shortfall(more_bytes: int, shm_dir: str) -> str | None:
    """The limits (tmpfs free space, MemAvailable) that ``more_bytes`` more in ``shm_dir``
    would exceed, as one phrase with their numbers; None when both hold them."""
    free = _free_bytes(shm_dir)
    available = mem_available()
    limits = [f"{shm_dir} has {free} bytes free ({_gib(free)})"]
    short = more_bytes > free
    if available is not None:
        limits.append(f"MemAvailable is {available} bytes ({_gib(available)})")
        short = short or more_bytes > available
    return " and ".join(limits) if short else None


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def mem_available(meminfo: str = "/proc/meminfo") -> int | None:
    """MemAvailable in bytes, or None where /proc/meminfo does not exist."""
    try:
        with open(meminfo, encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except FileNotFoundError:
        return None
    return None


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB"
