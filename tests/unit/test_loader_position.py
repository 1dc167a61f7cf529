"""A registered DataLoader's position (phalanx.runtime.worker.data): a rollback inside a pass
and one into an earlier pass give the batches, augmentation noise drawn in worker
processes and training RNG draws of the run without the rollback, for a plain DataLoader
(DistributedSampler with shuffle and workers, RandomSampler with and without workers,
workers persistent across passes or not) and torchdata's StatefulDataLoader. The
rollback is what a Session does on recovery: load the state captured at the restored step
(loader position and RNG) into the live objects."""
from __future__ import annotations

import copy
import weakref
from typing import Any

import numpy.random  # noqa: F401  (imported before any fork: see below)
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from phalanx.configs.errors import StateNotCapturable
from phalanx.runtime.worker.data import LoaderPosition, LoaderPositionLost


# Each loader worker seeds numpy.random as it starts (torch's _worker_loop). Imported there
# for the first time, in a child forked while another thread of this process was
# importing, Python 3.11's import lock failed (KeyError in _ModuleLock.acquire) and the
# worker exited 1: seen once in a run of this module. Imported here, the child has it.


class Augmented(Dataset):
    """A sample's index plus noise drawn when it is loaded (like a random crop)."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([float(index), torch.rand(()).item()])


class Stream(IterableDataset):
    """A streaming dataset whose order is the epoch's (``set_epoch``), split between the
    loader's workers; its samples draw no randomness in the workers (a persistent worker's
    RNG runs on from pass to pass, which a replacement's fresh worker does not replay)."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Any:
        worker = get_worker_info()
        order = torch.randperm(40, generator=torch.Generator().manual_seed(self.epoch))
        for index in order.tolist()[worker.id::worker.num_workers]:
            yield torch.tensor([float(index), float(self.epoch)])


def make(kind: str) -> DataLoader:
    if kind == "stream-persistent":
        return DataLoader(Stream(), batch_size=4, num_workers=2, persistent_workers=True)
    data = Augmented()
    persistent = kind.endswith("-persistent")   # workers kept from one pass to the next
    if kind.startswith("distributed-"):
        sampler = DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=3)
        return DataLoader(data, batch_size=4, sampler=sampler, num_workers=2,
                          persistent_workers=persistent)
    if kind == "random":
        return DataLoader(data, batch_size=4, shuffle=True)
    if kind.startswith("random-"):
        return DataLoader(data, batch_size=4, shuffle=True, num_workers=2,
                          persistent_workers=persistent)
    return StatefulDataLoader(data, batch_size=4, shuffle=True, num_workers=2)


def train(kind: str, rollback: tuple[int, int] | None = None, epochs: int = 3,
          epochs_driven: bool = True, tails: list[int] | None = None,
          peek: bool = False, firsts: dict[int, int] | None = None
          ) -> list[tuple[int, int, list, float]]:
    """Steps of an epoch loop as (step, epoch, batch, a training RNG draw); ``rollback``
    (at, to): after step ``at`` the state captured after step ``to`` is restored.
    ``tails``: the step after which each epoch's code after its loop ran (an evaluation).
    ``peek``: each epoch first takes one batch of a pass of its own (PyTorch's DDP
    tutorial); ``firsts``: step -> the epoch's first pass as the captured state says."""
    torch.manual_seed(0)
    loader = make(kind)
    position = LoaderPosition(loader, lambda: None,
                              lambda: epoch if epochs_driven else None)
    captured: dict[int, Any] = {}
    seen: list[tuple[int, int, list, float]] = []
    step = epoch = 0
    rolled = False
    while epoch < epochs:
        current = epoch
        if kind.startswith("distributed-"):
            loader.sampler.set_epoch(epoch)
        if peek:
            next(iter(loader))
        for batch in loader:
            # the epoch as session.epoch says it: a rank rolled back into a pass of an
            # earlier epoch goes on in it inside the loop it is in, whose own variable
            # still names the later epoch
            seen.append((step, epoch, batch.tolist(), torch.rand(()).item()))
            step += 1
            captured[step] = (copy.deepcopy(position.state_dict()), torch.get_rng_state(), epoch)
            if firsts is not None:
                firsts[step] = captured[step][0]["first"]
            if rollback is not None and step == rollback[0] and not rolled:
                rolled = True
                state, rng, epoch = captured[rollback[1]]
                position.load_state_dict(state)
                torch.set_rng_state(rng)
                step = rollback[1]
                seen = [s for s in seen if s[0] < step]
                if tails is not None:
                    tails[:] = [t for t in tails if t < step]
        if tails is not None:
            tails.append(step)
        if position.tail_of is not None:   # what session.epochs does (Session._restored_tail)
            epoch, position.tail_of = position.tail_of + 1, None
        elif epoch == current:   # advance unless a restore moved it
            epoch += 1
    return seen


@pytest.mark.parametrize("kind", ["distributed-workers", "random", "random-workers",
                                  "random-persistent", "distributed-persistent",
                                  "stateful-workers"])
def test_rollbacks_replay_the_same_batches_noise_and_rng(kind: str) -> None:
    reference = train(kind)
    per_epoch = 5 if kind.startswith("distributed-") else 10
    within = (per_epoch + 3, per_epoch + 1)         # inside the second pass
    across = (per_epoch + 2, per_epoch - 2)         # from the second pass into the first
    assert len(reference) == 3 * per_epoch
    assert train(kind, within) == reference
    assert train(kind, across) == reference


@pytest.mark.parametrize("kind", ["random-workers", "random-persistent"])
def test_a_rollback_to_the_end_of_the_last_epoch_runs_its_tail_once(kind: str) -> None:
    """A rank healed at the last step of the previous epoch (it died in the first step
    of the next, after the evaluation between them): its loop ends and the code after it
    stands for the restored epoch's tail, run once, then the next epoch starts. Before,
    the epoch was re-entered and its tail ran again (a survivor issued the evaluation's
    all-reduce twice, a replacement once: mismatched collectives)."""
    reference_tails: list[int] = []
    reference = train(kind, tails=reference_tails)
    assert reference_tails == [10, 20, 30]
    tails: list[int] = []
    assert train(kind, (11, 10), tails=tails) == reference
    assert tails == reference_tails
    # in a loop that peeks, the next epoch's captures name its own first pass (the
    # peek's), which a replacement replays from: not the restored epoch's
    firsts: dict[int, int] = {}
    reference_firsts: dict[int, int] = {}
    assert train(kind, (11, 10), peek=True, firsts=firsts) \
        == train(kind, peek=True, firsts=reference_firsts)
    assert firsts == reference_firsts and reference_firsts[15] == 2
    tails = []                 # mid-pass of an earlier epoch: that epoch is re-entered
    assert train(kind, (12, 8), tails=tails) == reference
    assert tails == reference_tails


def test_a_rollback_into_an_earlier_pass_needs_session_epochs() -> None:
    with pytest.raises(LoaderPositionLost, match="session.epochs"):
        train("random", (12, 8), epochs_driven=False)


def test_the_loader_stays_a_dataloader_of_its_own_class() -> None:
    loader = make("random-workers")
    LoaderPosition(loader, lambda: None, lambda: 0)
    assert isinstance(loader, DataLoader) and len(loader) == 10
    assert len(loader.dataset) == 40


def train_replaced(kind: str, replace: tuple[int, int] | None = None, epochs: int = 3,
                   peek: bool = True, rollback: tuple[int, int] | None = None,
                   limit: int = 0, bar: bool = False
                   ) -> list[tuple[int, int, int, int, list, float]]:
    """PyTorch's DDP tutorial loop, as (step, epoch, peeked size, i, batch, a training RNG
    draw): every epoch first peeks a batch for its size (``peek``: ``next(iter(loader))``),
    then iterates ``enumerate(loader)`` (through a tqdm-like ``ProgressBar`` with ``bar``),
    leaving the epoch at ``i == limit`` when ``limit`` is set. ``replace`` (at, to): after
    step ``at`` the process is replaced, as a promoted spare: a new loader and position
    load the state captured after step ``to``, and the epoch loop starts again at its
    epoch. ``rollback`` (at, to): a survivor's live loop restores the state captured after
    step ``to`` instead (it redoes a batch)."""
    torch.manual_seed(0)
    seen: list[tuple[int, int, int, int, list, float]] = []
    captured: dict[int, Any] = {}
    step = epoch = 0
    while True:
        loader = make(kind)
        box = {"epoch": epoch}
        position = LoaderPosition(loader, lambda: None, lambda: box["epoch"])
        if step:                                   # the replacement restores first
            state, rng, epoch = captured[step]
            position.load_state_dict(copy.deepcopy(state))
            torch.set_rng_state(rng)
        replaced = False
        while epoch < epochs and not replaced:
            box["epoch"] = epoch
            if kind.startswith("distributed-"):
                loader.sampler.set_epoch(epoch)
            if kind.startswith("stream-"):
                loader.dataset.set_epoch(epoch)
            size = len(next(iter(loader))) if peek else 0
            for i, batch in enumerate(ProgressBar(loader) if bar else loader):
                if limit and i >= limit:
                    break
                seen.append((step, epoch, size, i, batch.tolist(), torch.rand(()).item()))
                step += 1
                captured[step] = (copy.deepcopy(position.state_dict()), torch.get_rng_state(),
                                  epoch)
                if rollback is not None and step == rollback[0]:
                    state, rng, _ = captured[rollback[1]]
                    rollback, step = None, rollback[1]
                    position.load_state_dict(copy.deepcopy(state))
                    torch.set_rng_state(rng)
                    seen = [s for s in seen if s[0] < step]
                if replace is not None and step == replace[0]:
                    replace, step, replaced = None, replace[1], True
                    seen = [s for s in seen if s[0] < step]
                    break
            if not replaced:
                epoch += 1
        if not replaced:
            return seen


class ProgressBar:
    """tqdm's shape: keeps what it wraps as ``.iterable`` and yields from it."""

    def __init__(self, iterable: Any) -> None:
        self.iterable = iterable

    def __iter__(self) -> Any:
        yield from self.iterable


@pytest.mark.parametrize("kind", ["distributed-workers", "random-workers", "random-persistent",
                                  "distributed-persistent", "stateful-workers"])
def test_a_replacement_whose_epochs_peek_a_batch_resumes_at_the_restored_batch(
        kind: str) -> None:
    """The peek's ``iter(loader)`` in the restored epoch starts a pass of its own and
    leaves the RNG alone; the loop's iterator resumes at the restored batch. (Before, the
    peek took the restored position and the loop ran the whole epoch again: a spare ran
    more steps than the survivors and the job hung in its last all-reduce.)"""
    reference = train_replaced(kind)
    per_epoch = 5 if kind.startswith("distributed-") else 10
    assert len(reference) == 3 * per_epoch
    assert train_replaced(kind, (per_epoch + 3, per_epoch + 2)) == reference
    assert train_replaced(kind, (2 * per_epoch + 1, per_epoch - 2)) == reference


def test_a_replacements_persistent_workers_start_from_the_dataset_of_the_first_pass() -> None:
    """Persistent workers keep the copy of the dataset made at the first pass: the script's
    ``set_epoch`` on a streaming dataset never reaches them, so under torchrun every epoch
    reads the first epoch's order. A replacement restored into a later epoch starts its
    workers with the dataset's plain attributes as they were at the lost rank's first pass
    (carried in the loader's position) and reads what the lost rank would have read.
    (Before, its fresh workers read the restored epoch's order: a DDP script with a
    streaming dataset and persistent workers ended with other parameters than torchrun's.)"""
    reference = train_replaced("stream-persistent", peek=False)
    assert len(reference) == 30
    def order(epoch: int) -> list[list[float]]:    # the epoch's samples, in its order
        return [sample for _, e, _, _, batch, _ in reference if e == epoch for sample in batch]
    assert order(2) == order(0) != sorted(order(0))     # the first epoch's, again
    assert train_replaced("stream-persistent", (13, 12), peek=False) == reference
    assert train_replaced("stream-persistent", (25, 21), peek=False) == reference


def train_noticing_in_the_peek(kind: str, notice: tuple[int, int] | None = None,
                               epochs: int = 3) -> tuple[list, list[int]]:
    """A survivor of the DDP tutorial's loop (a peek, the loop, a tail per epoch).
    ``notice`` (epoch, to): in that epoch's peek the Session notices a recovery (its check
    before a batch) that restores the state captured after step ``to``, the last step of
    the epoch before, as when a peer died in the evaluation between them after this
    rank's collectives there had passed. Returns the steps and the steps after which a
    tail ran (a tail restored past is dropped, as its collectives were no-ops)."""
    torch.manual_seed(0)
    loader = make(kind)
    box = {"epoch": 0, "armed": False, "noticed": False, "step": 0}
    captured: dict[int, Any] = {}
    seen: list[tuple[int, int, list, float]] = []
    tails: list[int] = []

    def on_next() -> None:
        if box["armed"]:
            assert notice is not None
            box["armed"] = False
            state, rng, box["epoch"] = captured[notice[1]]
            position.load_state_dict(copy.deepcopy(state))
            torch.set_rng_state(rng)
            box["step"] = notice[1]
            seen[:] = [s for s in seen if s[0] < notice[1]]
            tails[:] = [t for t in tails if t < notice[1]]

    position = LoaderPosition(loader, on_next, lambda: box["epoch"])
    while box["epoch"] < epochs:
        epoch = box["epoch"]
        if kind.startswith("distributed-"):
            loader.sampler.set_epoch(epoch)
        if notice is not None and epoch == notice[0] and not box["noticed"]:
            box["armed"] = box["noticed"] = True
        size = len(next(iter(loader)))
        for batch in loader:
            seen.append((box["step"], box["epoch"], size, batch.tolist(), torch.rand(()).item()))
            box["step"] += 1
            captured[box["step"]] = (copy.deepcopy(position.state_dict()),
                                     torch.get_rng_state(), box["epoch"])
        tails.append(box["step"])
        if position.tail_of is not None:     # Session.epochs
            box["epoch"], position.tail_of = position.tail_of + 1, None
        elif box["epoch"] == epoch:
            box["epoch"] += 1
    return seen, tails


@pytest.mark.parametrize("kind", ["distributed-workers", "random-workers", "random-persistent"])
def test_a_restore_noticed_in_the_next_epochs_peek_reruns_the_restored_epochs_tail(
        kind: str) -> None:
    """The peek goes on (before, it raised StopIteration: the script crashed); the loop
    after it switches to the restored epoch's finished pass and ends at once, so the code
    after the loop runs once more as the restored epoch's tail, as on the replacement;
    then the epoch that was interrupted runs from its top with the fault-free batches."""
    reference, reference_tails = train_noticing_in_the_peek(kind)
    per_epoch = 5 if kind.startswith("distributed-") else 10
    assert reference_tails == [per_epoch, 2 * per_epoch, 3 * per_epoch]
    seen, tails = train_noticing_in_the_peek(kind, (2, 2 * per_epoch))
    assert seen == reference and tails == reference_tails
    # a restore to the middle of the epoch before: the loop finishes that epoch's pass
    seen, tails = train_noticing_in_the_peek(kind, (2, 2 * per_epoch - 2))
    assert seen == reference and tails == reference_tails


def test_a_dropped_loader_is_freed_at_once_though_its_session_is_in_a_cycle() -> None:
    """The position holds its loader weakly: a loader the script drops is freed at once
    (its persistent workers shut down with their queues intact) although the Session that
    holds the position sits in a reference cycle. Held strongly, the loader waited for the
    cycle collector, which closed the workers' queues first: each worker's join timed out
    (5 s), and this module took 114 s instead of 19."""
    class Session:        # a session's callbacks refer back to it: a cycle
        def __init__(self, loader: DataLoader) -> None:
            self.position = LoaderPosition(loader, self.check, lambda: 0)

        def check(self) -> None:
            pass

    loader = make("random-persistent")
    session = Session(loader)
    for _ in range(2):
        next(iter(loader))
        for _ in loader:
            pass
    workers = list(loader._iterator._workers)
    freed = weakref.ref(loader)
    del loader
    assert freed() is None                            # no collection needed
    assert all(w.exitcode == 0 for w in workers)      # shut down, not killed
    with pytest.raises(StateNotCapturable, match="keep it"):
        session.position.state_dict()


@pytest.mark.parametrize("kind", ["random-workers", "distributed-persistent",
                                  "stateful-workers"])
def test_enumerate_numbers_a_resumed_passs_batches_by_their_place_in_it(kind: str) -> None:
    """A loop that leaves each epoch at ``i == 7`` (or steps its optimizer every k-th
    ``i``): a replacement resumes mid-pass and a survivor redoes a batch, and both number
    each batch as the run without the fault did (before, the replacement counted from 0
    at its resumed batch, ran more of the epoch than the survivors and the job ended with
    other parameters)."""
    reference = train_replaced(kind, peek=False, epochs=2, limit=7)
    per_epoch = min(7, 5 if kind.startswith("distributed-") else 10)
    assert [s[3] for s in reference] == list(range(per_epoch)) * 2
    for bar in (False, True):       # through a progress bar (tqdm keeps it as .iterable)
        def run(**fault: tuple[int, int]) -> list:
            return train_replaced(kind, peek=False, epochs=2, limit=7, bar=bar, **fault)
        assert run(replace=(per_epoch + 4, per_epoch + 2)) == reference
        assert run(replace=(3, 2)) == reference
        assert run(rollback=(per_epoch + 3, per_epoch + 2)) == reference
    # the builtin stands in everywhere else, and stays what isinstance knows
    assert isinstance(enumerate([1]), enumerate) and list(enumerate("ab", 1)) == [(1, "a"),
                                                                                 (2, "b")]
