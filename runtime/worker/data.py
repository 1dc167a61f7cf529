"""The input position of a registered DataLoader: after a rollback or a promotion the
script's own ``for batch in loader:`` resumes at the exact next batch of the restored
step, with the same shuffle order and the same worker seeds, so the replayed steps see the
batches the fault-free run saw.

    session.register(model=model, optimizer=opt, loader=loader)
    with session:
        for epoch in session.epochs(num_epochs):   # was: for epoch in range(num_epochs)
            sampler.set_epoch(epoch)
            for x, y in loader:                    # unchanged
                with session.step():
                    ...

A registered loader's iterators check, before each batch, whether a restore happened since
they last did: inside the same pass they rebuild themselves at the restored position; a
restore into a pass of an earlier epoch goes on in that pass (its sampler's epoch set
back), and the code after the loop runs as that epoch's tail before ``session.epochs``
goes on with the next epoch. A replacement's ``session.epochs`` enters the restored epoch,
whose first ``iter(loader)`` resumes mid-epoch. A failed collective outside a step
(an evaluation pass's all-reduce) is recovered there, before the next batch is fetched.

How the position is captured:
- ``torchdata.stateful_dataloader.StatefulDataLoader``: its own ``state_dict()`` (sampler
  position, worker states, base seed);
- a plain ``torch.utils.data.DataLoader`` (any map-style sampler, ``DistributedSampler``
  with shuffle, worker processes): the pass number, the batches yielded in it and the RNG
  state the pass started from (its worker seeds and a ``RandomSampler``'s order are drawn
  from it); the restored pass skips the yielded batches' indices in the sampler, without
  loading them. An iterable dataset is fast-forwarded by loading and dropping batches.

Rebuilding an iterator never moves the process's RNG: its draws are undone, so the
restored RNG state is exactly the one captured at the restored step.
"""
from __future__ import annotations

import builtins
import contextlib
import hashlib
import itertools
import logging
import random
import sys
import weakref
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from phalanx.configs.errors import PhalanxError, StateNotCapturable

log = logging.getLogger(__name__)
_CLASSES: dict[type, type] = {}


class LoaderPositionLost(PhalanxError):
    """A restore moved a registered loader back into an earlier pass (epoch) while the
    script's own epoch loop cannot follow it."""

    def __init__(self, current: int, restored: int) -> None:
        super().__init__(f"a recovery rolled the registered DataLoader back from pass "
                         f"{current} to pass {restored}, but the epoch loop is not "
                         f"session.epochs(): it would go on in the wrong epoch. Write the "
                         f"loop as `for epoch in session.epochs(num_epochs):`")


class LoaderPosition:
    """Registered in the Session's state for a DataLoader (``Session.register`` makes it):
    ``state_dict`` is the loader's position, ``load_state_dict`` a pending restore that the
    live iterator or the next ``iter(loader)`` applies."""

    def __init__(self, loader: DataLoader, on_next: Callable[[], None],
                 epoch: Callable[[], int | None],
                 on_fetch: Callable[["LoaderPosition"], None] | None = None) -> None:
        # held weakly: the loader holds this position (its iterators, its sampler), the
        # Session holds it too, and a Session is in reference cycles; a strong reference
        # put the loader in the cyclic garbage with it, where multiprocessing's finalizers
        # close the worker queues before the loader's iterator shuts its workers down: a
        # loader with persistent workers then stalled the garbage collection 5 s per
        # worker (at the script's end, or wherever the collection ran)
        self._loader = weakref.ref(loader)
        self._base: Any = type(loader)     # the loader's own class (before the swap)
        self.stateful = callable(getattr(loader, "state_dict", None))
        self.on_next = on_next          # the Session's check for a fault outside a step
        self.epoch = epoch              # the ``session.epochs`` epoch running (None: the
                                        # script's epoch loop is not ``session.epochs``)
        self.on_fetch = on_fetch        # called with this position just before each fetch
        # what ``state_dict`` reports while set: the position before the batch in hand was
        # fetched (``Session``'s first capture, taken inside the first step)
        self.reported: dict[str, Any] | None = None
        self.passes = -1                # index of the current pass (iter() calls)
        self.yielded = 0                # batches yielded in the current pass
        self.first = 0                  # index of the current epoch's first pass
        self._pass_epoch: int | None = None   # the epoch the current pass began in
        self._replay_next: int | None = None  # see begin_pass
        self.start_rng: torch.Tensor | None = None
        self.start_generator: torch.Tensor | None = None
        # persistent workers: the RNG state the first pass started from, where the
        # workers' base seed was drawn (``_persistent_iter``)
        self.persistent = (loader.persistent_workers and loader.num_workers > 0
                           and not self.stateful)
        self.first_rng: torch.Tensor | None = None
        self.first_generator: torch.Tensor | None = None
        # ... and the dataset's plain attributes then: the persistent workers keep the copy
        # of the dataset made at the first pass, whatever the script sets later
        self.first_dataset: dict[str, Any] | None = None
        if self.persistent and isinstance(loader.dataset, IterableDataset):
            # its samples come from the workers' own iterators, with no index to reseed a
            # sample by (SeededSamples): a persistent worker's RNG runs on from pass to pass
            log.warning("event=loader_worker_rng_not_replayed dataset=%s: a replacement's "
                        "persistent loader workers start their RNG afresh, so samples whose "
                        "randomness is drawn in the workers of this IterableDataset differ "
                        "after a restore into a later pass; draw it from the sample (a seed "
                        "per sample) or set persistent_workers=False",
                        type(loader.dataset).__name__)
        self.pending: dict[str, Any] | None = None   # a restore not yet applied
        # a restore moved the live loop into a pass of this (earlier) epoch: what the
        # script runs after its loop is that epoch's tail (``_ResumingIterator``;
        # ``Session.epochs`` reads and clears it)
        self.tail_of: int | None = None
        self.restores = 0               # how many restores were loaded (iterators compare)
        self._switch_at: int | None = None    # see defer_switch
        if not self.stateful:
            _wrap_index_sampler(loader, self)
        if loader.num_workers > 0 and not isinstance(loader.dataset, IterableDataset):
            # DataLoader refuses to re-set its dataset after construction
            object.__setattr__(loader, "dataset", SeededSamples(loader.dataset))
        _make_resumable(loader, self)

    @property
    def loader(self) -> DataLoader:
        loader = self._loader()
        if loader is None:
            raise StateNotCapturable(
                "the registered DataLoader no longer exists (the script dropped every "
                "reference to it): register the loader the loop iterates, and keep it")
        return loader

    # -- snapshot side ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self.reported is not None:
            return self.reported
        state: dict[str, Any] = {"pass": self.passes, "yielded": self.yielded,
                                 "first": self.first}
        if self.stateful:
            state["inner"] = self._base.state_dict(self.loader)
        else:
            sampler_epoch = getattr(self.loader.sampler, "epoch", None)
            if type(sampler_epoch) is int:     # a DistributedSampler's set_epoch
                state["sampler_epoch"] = sampler_epoch
            state["rng"] = self.start_rng if self.start_rng is not None else torch.get_rng_state()
            if self.start_generator is not None:
                state["generator"] = self.start_generator
            if self.first_rng is not None:
                state["first_rng"] = self.first_rng
                if self.first_generator is not None:
                    state["first_generator"] = self.first_generator
            if self.first_dataset is not None:
                state["first_dataset"] = self.first_dataset
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.persistent and "first_rng" in state:
            self.first_rng, self.first_generator = state["first_rng"], state.get("first_generator")
            self.first_dataset = state.get("first_dataset")
        self.pending = dict(state)
        self.restores += 1
        self._switch_at = None
        # a snapshot written before "first" existed: its pass is the epoch's first
        self._replay_next = int(self.pending.get("first", self.pending["pass"]))

    def finish_restored_pass(self) -> bool:
        """When the pending restore's position is the end of its pass (every batch of it
        yielded: the step restored was its epoch's last, as when a rank died in the first
        step of the next epoch and the ranks heal at the step before): take the restore
        as done without making an iterator for nothing and return True. False when
        batches of the restored pass are left."""
        pending = self.pending
        if pending is None or self.stateful:
            return False
        try:
            size = len(self.loader)
        except TypeError:                  # an iterable dataset without a length
            return False
        if int(pending["yielded"]) < size:
            return False
        self._take_pending()
        return True

    def defer_switch(self, current: int) -> bool:
        """A restore into an earlier epoch's pass, noticed in pass ``current`` of a later
        epoch that the epoch body makes before the one at the restored pass's place (the
        DDP tutorial's peek, ``next(iter(loader))``, when a peer died in the evaluation
        between the epochs and this survivor's collectives there all passed): that pass
        goes on, and the ``iter(loader)`` at the restored pass's place in this epoch (the
        loop's) switches to the restored pass instead, as a loop that notices it does.
        True when deferred so. (Ended at once instead, the peek raised StopIteration.)"""
        pending = self.pending
        assert pending is not None
        restored_pass = int(pending["pass"])
        place = restored_pass - int(pending.get("first", restored_pass))
        if self.stateful or current - self.first >= place:
            return False
        self._switch_at, self._replay_next = self.first + place, None
        log.info("event=loader_switch_deferred pass=%d restored_pass=%d at_pass=%d",
                 current, restored_pass, self._switch_at)
        return True

    def switch_to_restored(self, current: int) -> bool:
        """Make the pending restore's pass (of an earlier epoch) the live loop's instead of
        pass ``current``: what the script runs after the loop is that epoch's tail. True
        when nothing of that pass is left (the loop ends at once)."""
        assert self.pending is not None
        log.info("event=loader_pass_switched pass=%d restored_pass=%d epoch=%s",
                 current, int(self.pending["pass"]), self.epoch())
        self._switch_at = None
        self.tail_of = self.epoch()
        return self.finish_restored_pass()

    def _take_pending(self) -> dict[str, Any]:
        """Make the pending restore's position this loader's (its pass, batches yielded,
        the epoch's first pass, the epoch the pass belongs to) and return it."""
        state, self.pending, self._replay_next = self.pending, None, None
        assert state is not None
        self.passes, self.yielded = int(state["pass"]), int(state["yielded"])
        self.first = int(state.get("first", self.passes))
        self._pass_epoch = self.epoch()
        return state

    # -- iterator side ---------------------------------------------------------------
    def begin_pass(self) -> Iterator[Any]:
        """A new ``iter(loader)``: the pending restore's pass, else the next pass.

        A restored epoch is entered again from its top, so the script makes again the
        ``iter(loader)`` calls it made in that epoch before the restored pass (a peek such
        as ``next(iter(loader))`` to read the batch size, as PyTorch's DDP tutorial does).
        Those passes start anew, with the process's RNG left as it was, and the pending
        restore waits for the pass it was captured in."""
        pending = self.pending
        if pending is not None and self._switch_at is not None \
                and self.passes + 1 >= self._switch_at:
            if self.switch_to_restored(self.passes + 1):
                return iter(())
            return self.resume_pass()
        if pending is not None and self._replay_next is not None \
                and self._replay_next < int(pending["pass"]):
            self.passes, self._replay_next = self._replay_next, self._replay_next + 1
            self.yielded = 0
            self.first, self._pass_epoch = int(pending["first"]), self.epoch()
            return self._build(None, keep_rng=True)
        return self.resume_pass()

    def resume_pass(self) -> Iterator[Any]:
        """The pending restore's pass at its restored batch (a live iterator rebuilds
        itself with it), else the next pass."""
        if self.pending is not None:
            return self._build(self._take_pending())
        self.passes += 1
        self.yielded = 0
        epoch = self.epoch()
        if epoch is None or epoch != self._pass_epoch:
            self.first, self._pass_epoch = self.passes, epoch
        return self._build(None)

    def _build(self, restored: dict[str, Any] | None, keep_rng: bool = False) -> Iterator[Any]:
        """The underlying iterator, created without moving the process's RNG when it
        replays a pass (its seeds come from the pass's start state) or when ``keep_rng``."""
        loader = self.loader
        generator = loader.generator
        now = torch.get_rng_state()
        now_generator = generator.get_state() if generator is not None else None
        base_iter = self._persistent_iter if self.persistent else self._base.__iter__
        if restored is None and not keep_rng:
            self.start_rng = now
            self.start_generator = now_generator
            if self.persistent and self.passes == 0:
                self.first_rng, self.first_generator = now, now_generator
                self.first_dataset = _plain_attributes(_user_dataset(loader))
            return base_iter(loader)
        try:
            if restored is None:
                return base_iter(loader)
            if self.stateful:
                self._base.load_state_dict(loader, restored["inner"])
                return base_iter(loader)
            if "sampler_epoch" in restored:     # a pass of another epoch: its order
                self.loader.sampler.set_epoch(int(restored["sampler_epoch"]))  # type: ignore[attr-defined]
            self.start_rng = restored["rng"]
            self.start_generator = restored.get("generator")
            _set_rng(self.start_rng, generator, self.start_generator)
            self.skip = self.yielded     # every iter(sampler) while it is built skips
            if self.persistent and self.passes == 0 and loader._iterator is not None:
                # back into the first pass: its iterator is made anew, as it was then
                loader._iterator._shutdown_workers()     # type: ignore[attr-defined]
                loader._iterator = None
            it = base_iter(loader)
            if isinstance(loader.dataset, IterableDataset):   # no sampler to skip in
                for _ in range(self.yielded):
                    next(it)
            return it
        finally:
            self.skip = 0
            _set_rng(now, generator, now_generator)

    skip = 0   # batches the sampler skips while a replayed pass's iterator is built

    def _persistent_iter(self, loader: DataLoader) -> Iterator[Any]:
        """``iter(loader)`` of a loader with persistent workers, for a pass starting at the
        process's RNG state now. Its iterator is made at the first pass (its workers' base
        seed and its sampler drawn from that pass's RNG) and reset at every later pass
        (the sampler alone drawn). A replacement has no iterator yet: it is made from the
        first pass's RNG state (so the workers seed every sample as the fault-free run
        did) and, for a later pass, reset from this pass's RNG state, as the fault-free
        run's later passes were. Without this a restored pass drew its shuffle after a
        base seed and a second sampler draw, not first: another order (found with a GAN
        script's ``shuffle=True, persistent_workers=True``)."""
        base_iter = self._base.__iter__
        if loader._iterator is not None or self.first_rng is None:
            return base_iter(loader)
        generator = loader.generator
        now = torch.get_rng_state()
        now_generator = generator.get_state() if generator is not None else None
        _set_rng(self.first_rng, generator, self.first_generator)
        with _attributes_as(_user_dataset(loader), self.first_dataset):
            it = base_iter(loader)      # its workers start here, with the dataset as it was
        if self.passes != 0:
            _set_rng(now, generator, now_generator)
            it._reset(loader)
        return it


def _plain_attributes(dataset: Any) -> dict[str, Any]:
    """The dataset's attributes that are plain values (None, bool, int, float, str), such
    as the epoch a ``set_epoch`` method stores: what a script changes between passes."""
    return {name: value for name, value in getattr(dataset, "__dict__", {}).items()
            if value is None or type(value) in (bool, int, float, str)}


@contextlib.contextmanager
def _attributes_as(dataset: Any, attributes: dict[str, Any] | None) -> Iterator[None]:
    """The dataset with ``attributes`` set while the block runs, its own values after. A
    replacement's persistent workers start from the dataset as the lost rank's did at its
    first pass (a streaming dataset's ``set_epoch`` after it never reached those workers
    under torchrun either: each epoch read the first epoch's order there, and a
    replacement's fresh workers read the restored epoch's, other parameters)."""
    now = _plain_attributes(dataset)
    for name, value in (attributes or {}).items():
        if name in now:
            setattr(dataset, name, value)
    try:
        yield
    finally:
        for name, value in now.items():
            setattr(dataset, name, value)


def _user_dataset(loader: DataLoader) -> Any:
    """The script's dataset (a multi-worker map-style one is wrapped in SeededSamples)."""
    dataset = loader.dataset
    return dataset.inner if isinstance(dataset, SeededSamples) else dataset


def _set_rng(state: torch.Tensor, generator: torch.Generator | None,
             generator_state: torch.Tensor | None) -> None:
    torch.set_rng_state(state)
    if generator is not None and generator_state is not None:
        generator.set_state(generator_state)


class _ResumingIterator:
    """The iterator a registered loader hands out: one pass, repositioned by restores."""

    def __init__(self, position: LoaderPosition) -> None:
        self._position = position
        self._inner = position.begin_pass()
        self._pass = position.passes
        self._restores = position.restores

    def __iter__(self) -> "_ResumingIterator":
        return self

    def __len__(self) -> int:
        return len(self._position.loader)

    def __next__(self) -> Any:
        position = self._position
        position.on_next()
        if position.restores != self._restores:
            self._restores = position.restores
            assert position.pending is not None
            restored_pass = int(position.pending["pass"])
            if restored_pass != self._pass:
                # The loop goes on in the restored pass (of an earlier epoch) and its end
                # is that epoch's end: the code after the loop runs once, as that epoch's
                # tail, then ``session.epochs`` goes on with the next epoch, as on a
                # replacement that enters the restored epoch. (Ending the pass here and
                # re-entering the restored epoch ran the current epoch's tail too: on a
                # survivor only, so its evaluation all-reduce met a replacement's
                # training collective and gloo aborted; and a scheduler stepped twice.)
                if position.epoch() is None:
                    raise LoaderPositionLost(self._pass, restored_pass)
                if position.defer_switch(self._pass):
                    return self._fetch()                 # this pass goes on
                if position.switch_to_restored(self._pass):      # nothing of it left
                    raise StopIteration
            self._inner = position.resume_pass()
            self._pass = position.passes
        return self._fetch()

    def _fetch(self) -> Any:
        position = self._position
        if position.on_fetch is not None:
            position.on_fetch(position)
        batch = next(self._inner)
        position.yielded += 1
        return batch


_ENUMERATE = builtins.enumerate


class _Enumerates(type):
    """``isinstance(x, enumerate)`` and ``issubclass`` keep answering for every
    ``enumerate`` object once ``_BatchesEnumerated`` stands in for the builtin."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _ENUMERATE)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, _ENUMERATE)


class _BatchesEnumerated(_ENUMERATE, metaclass=_Enumerates):
    """``builtins.enumerate`` in a process with a registered loader. Over a registered
    loader (or its iterator) each batch is numbered by its place in its pass, not by how
    many this loop saw (also through a wrapper that keeps the loader as ``.iterable``, as
    tqdm does): a replacement's loop resumes mid-pass and a survivor's redoes the
    batch of the step in flight, and a loop that breaks at ``i == limit`` or steps its
    optimizer when ``(i + 1) % accumulation == 0`` must see the numbers of the run without
    the fault (counted from 0 at the resumed batch, a spare ran more batches of the epoch
    than the survivors: mismatched collectives, then other parameters). Over anything
    else it is the builtin's own object. torch.compile traces through it
    (``fullgraph=True`` included)."""

    _batches: Iterator[Any]
    _position: LoaderPosition
    _start: int

    def __new__(cls, iterable: Any, start: int = 0) -> Any:
        inner = iter(iterable)
        # the loader's position: its own iterator's, or a progress bar's over it (tqdm
        # keeps what it wraps as .iterable)
        position = (inner._position if isinstance(inner, _ResumingIterator) else
                    getattr(getattr(iterable, "iterable", None), "_phalanx_position", None))
        if not isinstance(position, LoaderPosition):
            return _ENUMERATE(inner, start)
        self = super().__new__(cls, inner, start)
        self._batches, self._position, self._start = inner, position, start
        return self

    def __next__(self) -> tuple[int, Any]:
        batch = next(self._batches)
        return self._start + self._position.yielded - 1, batch


def _make_resumable(loader: DataLoader, position: LoaderPosition) -> None:
    """Give this loader object an ``__iter__`` that returns a ``_ResumingIterator`` (a
    subclass of its own class made once per class; nothing else about it changes)."""
    cls = type(loader)
    sub = _CLASSES.get(cls)
    if sub is None:
        def __iter__(self: DataLoader) -> Iterator[Any]:
            return _ResumingIterator(getattr(self, "_phalanx_position"))
        sub = type(cls.__name__, (cls,), {"__iter__": __iter__,
                                          "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__})
        _CLASSES[cls] = sub
    object.__setattr__(loader, "_phalanx_position", position)
    object.__setattr__(loader, "__class__", sub)
    builtins.enumerate = _BatchesEnumerated     # type: ignore[misc]


class _SkippingSampler:
    """The loader's index sampler (its batch sampler, or its sampler without batching),
    skipping the indices of the batches a restored pass already yielded. It draws the
    wrapped sampler's first element when the pass starts (so a ``RandomSampler``'s order is
    drawn at ``iter(loader)``, inside the replay's RNG window)."""

    def __init__(self, inner: Any, position: LoaderPosition) -> None:
        self.inner = inner
        self._position = position

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":            # not set yet (copy, unpickling)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.inner)
        skip = self._position.skip   # a multi-worker iterator calls iter() twice
        if skip:
            it = itertools.islice(it, skip, None)
        first = list(itertools.islice(it, 1))
        return itertools.chain(first, it)


def _wrap_index_sampler(loader: DataLoader, position: LoaderPosition) -> None:
    if isinstance(loader.dataset, IterableDataset):
        return
    name = "batch_sampler" if loader.batch_sampler is not None else "sampler"
    # DataLoader refuses to re-set its samplers after construction; this keeps the same
    # sampler object inside (set_epoch and attributes reach it through __getattr__)
    object.__setattr__(loader, name, _SkippingSampler(getattr(loader, name), position))


class SeededSamples(Dataset):
    """A map-style dataset whose samples, loaded in a worker process, draw their randomness
    (torch, ``random``, numpy) from a seed of the pass and the sample index alone: a
    replayed pass, whose skipped batches no worker loads, sees every sample augmented as
    the fault-free run did, whichever worker loads it. In the main process
    (``num_workers=0``) nothing is reseeded: the samples draw from the training RNG, which
    the restore already put back."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":            # not set yet (unpickling in a worker)
            raise AttributeError(name)
        if name == "__getitems__":     # a batched fetch: seeded by the batch's indices
            batched = getattr(self.inner, name)

            def getitems(indices: list) -> Any:
                _seed_sample(tuple(indices))
                return batched(indices)
            return getitems
        return getattr(self.inner, name)

    def __getitem__(self, index: Any) -> Any:
        _seed_sample(index)
        return self.inner[index]


def _seed_sample(index: Any) -> None:
    info = get_worker_info()
    if info is None:
        return
    pass_seed = info.seed - info.id       # the pass's base seed, the same in every worker
    seed = int.from_bytes(hashlib.blake2b(f"{pass_seed}:{index}".encode(),
                                          digest_size=8).digest(), "little") >> 1
    torch.manual_seed(seed)
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)
