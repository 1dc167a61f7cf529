"""The default group over real gloo groups on a real TCPStore (two ranks, each in its own
process: tests/integration/two_ranks.py): collectives forwarded to the generation's group,
re-formed in place (the same object keeps working in the next generation), a collective
stuck on a hung peer completed as a no-op the moment a newer generation is announced (at
once when it was announced first), a failure raised when no Session absorbs it, and a
joining rank's set-up collectives answered locally."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from phalanx.runtime.group.collective import Collective, CollectiveAborted
from phalanx.runtime.group.default_group import DefaultGroup
from tests.integration.two_ranks import Rank, on_ranks

pytestmark = pytest.mark.integration
Seen = tuple[list[float], list[float], list[list[float]]]


def formed(rank: Rank, generation: int = 0, skip_setup: bool = False
           ) -> tuple[Collective, DefaultGroup]:
    """This rank's collective with ``generation`` formed, and a default group over it."""
    collective = Collective(rank.connect, rank=rank.rank, world_size=2, timeout_s=20.0)
    collective.form(generation)
    group = DefaultGroup(collective, skip_setup=skip_setup)
    rank.keep(collective, group)
    return collective, group


def _collectives_of(group: DefaultGroup, rank: int) -> Seen:
    summed = torch.tensor([float(rank + 1)] * 3)
    group.allreduce([summed]).wait()
    sent = torch.arange(3.0) * (rank + 1)
    group.broadcast([sent]).wait()
    gathered = [torch.zeros(2) for _ in range(2)]
    group.allgather([gathered], [torch.full((2,), float(rank))]).wait()
    group.barrier().wait()
    return summed.tolist(), sent.tolist(), [g.tolist() for g in gathered]


def _two_generations(rank: Rank) -> dict:
    collective, group = formed(rank)
    first = _collectives_of(group, rank.rank)
    collective.abandon()                # a recovery: abandon, re-form generation 1
    collective.form(1)
    second = _collectives_of(group, rank.rank)
    return {"first": first, "second": second, "generation": collective.generation,
            "fault": collective.fault}


@pytest.mark.timeout(90)
def test_collectives_run_on_each_generation_through_the_same_group_object() -> None:
    seen = on_ranks(_two_generations)
    expected = [[3.0] * 3, [0.0, 1.0, 2.0], [[0.0, 0.0], [1.0, 1.0]]]
    assert seen[0]["first"] == seen[1]["first"] == expected
    assert seen[0]["second"] == seen[1]["second"] == expected
    assert all(s["generation"] == 1 and s["fault"] is None for s in seen)


def _hung_peer(rank: Rank, announced_first: bool) -> str | None:
    collective, group = formed(rank)
    store = rank.connect()
    if rank.rank == 1:                  # "hangs": joins no call until rank 0 is done
        rank.await_signal("rank0-done", store)
        return None
    newer = threading.Event()
    collective.absorb_faults = True
    collective.superseded = newer.is_set
    tensor = torch.tensor([5.0])
    if announced_first:                 # announced before the call, nothing announced after
        newer.set()
        work = group.allreduce([tensor])
    else:
        work = group.allreduce([tensor])
        time.sleep(0.3)
        assert not work.is_completed()
        newer.set()                             # the coordinator announced generation 1
        collective.generation_announced()       # (the Session's watcher calls this)
    assert work.is_completed() and work.get_future().wait() == [tensor]
    assert tensor.tolist() == [5.0]             # untouched: the step is rolled back
    # later collectives of the faulted generation complete at once, never reaching gloo
    again = torch.tensor([1.0])
    assert group.allreduce([again]).is_completed() and again.tolist() == [1.0]
    rank.signal("rank0-done", store)
    rank.keep(collective, group, work)
    return collective.fault


@pytest.mark.timeout(90)
def test_a_collective_waiting_on_a_hung_peer_completes_as_a_no_op_on_a_newer_generation() -> None:
    fault, _ = on_ranks(_hung_peer, False)
    assert fault is not None and "newer generation" in fault


@pytest.mark.timeout(90)
def test_a_collective_started_after_a_newer_generation_was_announced_completes_at_once() -> None:
    fault, _ = on_ranks(_hung_peer, True)
    assert fault is not None and "newer generation" in fault


def _failed_without_session(rank: Rank) -> str:
    collective, group = formed(rank)
    store = rank.connect()
    if rank.rank == 1:
        rank.await_signal("rank0-done", store)
        return ""
    collective.mark_fault("peer died")
    with pytest.raises(CollectiveAborted, match="peer died") as raised:
        group.allreduce([torch.ones(1)])
    rank.signal("rank0-done", store)
    return str(raised.value)


@pytest.mark.timeout(90)
def test_without_a_session_a_failed_generation_raises() -> None:
    error, _ = on_ranks(_failed_without_session)
    assert "allreduce on the default group: peer died" in error


def _ddp_peer_dies_in_backward(rank: Rank) -> str:
    """An unmodified script's DDP (no Session): rank 1 leaves after its forward, so rank
    0's backward all-reduce fails when the peer's process is gone."""
    from torch.nn.parallel import DistributedDataParallel

    _, group = formed(rank)
    torch.manual_seed(0)
    ddp = DistributedDataParallel(torch.nn.Linear(8, 8), process_group=group)
    ddp(torch.ones(2, 8)).sum().backward()
    loss = ddp(torch.ones(2, 8)).sum()
    if rank.rank == 1:
        return ""                       # its process exits: its gloo sockets close
    with pytest.raises(RuntimeError, match="Connection closed by peer|Connection reset"
                       ) as raised:
        loss.backward()
    return str(raised.value)


@pytest.mark.timeout(90)
def test_without_a_session_a_peer_lost_in_ddps_backward_raises_from_backward() -> None:
    """As plain gloo under torchrun: ``backward()`` raises the peer's failure. The failure
    was the value of a future DDP's C++ reducer read as its bucket: the survivor died of
    SIGSEGV (``parseCppCommHookResult``) with a fatal-error dump in its log."""
    error, _ = on_ranks(_ddp_peer_dies_in_backward, await_teardowns=False)
    assert "peer" in error


def _joining(rank: Rank) -> dict:
    if rank.rank == 0:
        _, group = formed(rank)
        group.allreduce([summed := torch.ones(1)]).wait()
        return {"summed": summed.item()}
    _, joining = formed(rank, skip_setup=True)
    gathered = [torch.zeros(2) for _ in range(2)]
    joining.allgather([gathered], [torch.full((2,), 7.0)]).wait()   # DDP's shape check
    weights = torch.tensor([1.0, 2.0])
    joining.broadcast([weights]).wait()           # DDP's state broadcast: restored instead
    joining.started()                              # the Session started: real from now on
    joining.allreduce([summed := torch.ones(1)]).wait()
    return {"gathered": [g.tolist() for g in gathered], "weights": weights.tolist(),
            "summed": summed.item()}


@pytest.mark.timeout(90)
def test_a_joining_rank_answers_set_up_collectives_alone_until_started() -> None:
    rank0, joining = on_ranks(_joining)
    assert joining["gathered"] == [[7.0, 7.0], [7.0, 7.0]]
    assert joining["weights"] == [1.0, 2.0]
    assert rank0["summed"] == joining["summed"] == 2.0


def _restored_top(rank: Rank) -> dict:
    if rank.rank == 0:                    # a survivor: its next collective is a step's
        _, group = formed(rank)
        group.allreduce([summed := torch.ones(1)]).wait()
        return {"summed": summed.item()}
    _, joining = formed(rank, skip_setup=True)
    joining.answer_epoch_top_locally(False)     # set-up stays local until started
    seen = {"setup_local": joining.answering_locally}
    joining.started()
    joining.answer_epoch_top_locally(True)      # entered the epoch it was restored into
    joining.barrier().wait()                    # the epoch's top: the survivor ran it
    joining.allreduce([count := torch.full((1,), 5.0)]).wait()
    joining.started()                           # a set-up end does not end the top
    seen["top_local"] = joining.answering_locally
    joining.answer_epoch_top_locally(False)     # its restored pass resumed
    joining.allreduce([summed := torch.ones(1)]).wait()
    return {**seen, "count": count.item(), "summed": summed.item(),
            "local_after": joining.answering_locally}


@pytest.mark.timeout(90)
def test_a_restored_epochs_top_is_answered_locally_until_its_pass_resumes() -> None:
    """A replacement that joined mid-epoch runs the epoch's top again (its ``barrier``, an
    ``all_reduce`` of a count): the survivors ran it before the fault, so it is answered
    locally, and the next collective (the step's) meets the survivor's."""
    rank0, joining = on_ranks(_restored_top)
    assert joining["setup_local"] and joining["top_local"] and not joining["local_after"]
    assert joining["count"] == 5.0                 # as if alone
    assert rank0["summed"] == joining["summed"] == 2.0


def _bucket_sizes(ddp: torch.nn.Module) -> list[int]:
    """The elements of each of the DDP reducer's buckets, in launch order."""
    return [bucket.buffer().numel() for bucket in ddp.reducer._get_zeros_like_grad_buckets()]


def _ddp_buckets(rank: Rank) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    from phalanx.runtime.group.default_group import _patch_ddp

    collective, group = formed(rank)
    collective.absorb_faults = True         # as a Session does when it starts
    _patch_ddp()

    def model() -> torch.nn.Module:
        torch.manual_seed(0)                # 4 x 1 MiB weights: more than DDP's 1 MiB bucket
        return torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])

    ddp = DistributedDataParallel(model(), process_group=group)
    built = _bucket_sizes(ddp)
    reference = DistributedDataParallel(model(), process_group=group,
                                        find_unused_parameters=True)
    layouts = []
    for step in range(3):       # DDP would rebuild its buckets in the second iteration
        x = torch.full((2, 512), float(rank.rank + step))
        ddp(x).sum().backward()
        layouts.append(_bucket_sizes(ddp))
    hooked = DistributedDataParallel(model(), process_group=group)
    calls = {"group": group, "buckets": 0}

    def counting_hook(state, bucket):      # type: ignore[no-untyped-def]  # DDP checks real annotations
        state["buckets"] += 1
        return default_hooks.allreduce_hook(state["group"], bucket)

    hooked.register_comm_hook(calls, counting_hook)
    hooked(torch.ones(2, 512)).sum().backward()
    local = model()
    for step in range(3):
        local(torch.full((2, 512), 0.5 + step)).sum().backward()   # both ranks' mean input
    return {"built": built, "layouts": layouts, "reference": _bucket_sizes(reference),
            "hooked": [_bucket_sizes(hooked), calls["buckets"]],
            "grad_error": max(float((p.grad - q.grad).abs().max() / q.grad.abs().max())
                              for p, q in zip(ddp.module.parameters(), local.parameters()))}


@pytest.mark.timeout(90)
def test_ddp_on_a_fault_tolerant_group_gets_a_layout_every_rank_computes_alone() -> None:
    """DDP builds one bucket for the whole model and rebuilds it by rank 0's gradient order
    in its second iteration; a rank joining later could not know that layout. On a
    fault-tolerant default group each DDP module gets, before its first forward, the
    layout ``find_unused_parameters=True`` would build (reverse parameter order, a 1 MiB
    first bucket): several buckets, so all-reduces overlap the backward pass, the same on
    every rank, and kept from then on. A comm hook the user registered runs on it."""
    results = on_ranks(_ddp_buckets)
    for seen in results:
        assert seen["built"] == [sum(seen["reference"])]       # DDP's single bucket
        assert len(seen["reference"]) > 1
        assert seen["layouts"] == [seen["reference"]] * 3
        assert seen["grad_error"] < 1e-5      # gradients averaged over both ranks
        assert seen["hooked"] == [seen["reference"], len(seen["reference"])]   # kept its hook
    assert results[0]["layouts"] == results[1]["layouts"]


def _compiled_ddp(rank: Rank) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from phalanx.runtime.group.default_group import _patch_ddp

    collective, group = formed(rank)
    collective.absorb_faults = True         # as a Session does when it starts
    _patch_ddp()
    torch.manual_seed(0)
    ddp = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)),
                                  process_group=group)     # linear: the mean input's gradient
    compiled = torch.compile(ddp, backend="eager")      # dynamo's tracing, no code generation
    torch.manual_seed(0)
    local = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
    errors = []
    for step in range(3):
        compiled(torch.full((4, 8), float(rank.rank + step))).sum().backward()
        local(torch.full((4, 8), 0.5 + step)).sum().backward()      # both ranks' mean input
        errors.append(max(float((p.grad - q.grad).abs().max() / q.grad.abs().max())
                          for p, q in zip(ddp.module.parameters(), local.parameters())))
    return {"errors": errors, "capped": getattr(ddp, "_phalanx_capped", False)}


@pytest.mark.timeout(120)
def test_torch_compile_of_a_ddp_module_on_a_fault_tolerant_group_trains() -> None:
    """``torch.compile(DDP(model))``, the order PyTorch's DDP + compile notes give: dynamo
    runs DDP's own frames eagerly and compiles the module under it. phalanx's wrapper of
    DDP's ``_pre_forward`` lives outside torch, so dynamo traced it and the script's first
    forward failed (``UnsafeScriptObjectError: Attempted to access unregistered member on
    an OpaqueObject``, the process group); it runs eagerly now, with its bucket layout,
    and the gradients are averaged over both ranks."""
    for seen in on_ranks(_compiled_ddp):
        assert seen["capped"]
        assert max(seen["errors"]) < 1e-5, seen


def _subgroups(rank: Rank) -> dict:
    """Groups the script makes with ``new_group`` over the default group: one of both
    ranks and one of rank 0 alone, used in two generations through the same objects."""
    collective, group = formed(rank)
    pair = group.new_group([0, 1], group_name="pair")
    alone = group.new_group([0], group_name="alone")
    seen: dict = {"alone": None if alone is None else [alone.rank(), alone.size()],
                  "pair": [pair.rank(), pair.size()]}
    for generation in (0, 1):
        if generation:
            collective.abandon()       # a recovery: the next generation's group forms
            collective.form(generation)
        pair.allreduce([summed := torch.tensor([float(rank.rank + 1)])]).wait()
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 1, 0          # the group's rank 1
        pair.broadcast([sent := torch.tensor([float(rank.rank)])], opts).wait()
        if alone is not None:
            alone.allreduce([single := torch.tensor([3.0])]).wait()
            seen[f"alone{generation}"] = single.item()
        seen[f"gen{generation}"] = [summed.item(), sent.item()]
    seen["fault"] = collective.fault
    return seen


@pytest.mark.timeout(90)
def test_groups_made_by_new_group_are_formed_again_in_each_generation() -> None:
    """torch delegates ``new_group`` to the default group; the group it makes runs its
    collectives on a gloo group of its ranks formed for the generation they run in, so the
    same object keeps working after a re-form; a rank outside it gets none."""
    rank0, rank1 = on_ranks(_subgroups)
    assert rank0["pair"] == [0, 2] and rank1["pair"] == [1, 2]
    assert rank0["alone"] == [0, 1] and rank1["alone"] is None
    for seen in (rank0, rank1):
        assert seen["gen0"] == seen["gen1"] == [3.0, 1.0]
        assert seen["fault"] is None
    assert rank0["alone0"] == rank0["alone1"] == 3.0


def _joining_subgroup(rank: Rank) -> dict:
    if rank.rank == 0:                    # a survivor: made its group long ago
        _, group = formed(rank)
        pair = group.new_group([0, 1], group_name="metrics")
        pair.allreduce([summed := torch.ones(1)]).wait()
        return {"summed": summed.item()}
    _, joining = formed(rank, skip_setup=True)
    pair = joining.new_group([0, 1], group_name="metrics")   # its set-up: made alone
    pair.barrier().wait()                                    # answered locally
    local = pair.answering_locally
    joining.started()
    pair.allreduce([summed := torch.ones(1)]).wait()
    return {"local": local, "summed": summed.item(), "after": pair.answering_locally}


@pytest.mark.timeout(90)
def test_a_joining_rank_makes_its_groups_alone_and_answers_their_set_up_locally() -> None:
    """A replacement runs its set-up again, ``new_group`` included: nothing is exchanged
    there (before, a torch gloo group waited for the survivors' long-made ones), its
    set-up collectives are answered locally as the default group's are, and its first real
    collective meets the survivor's."""
    survivor, joining = on_ranks(_joining_subgroup)
    assert joining["local"] and not joining["after"]
    assert survivor["summed"] == joining["summed"] == 2.0


def _setup_replayed(rank: Rank) -> dict:
    """Generation 0: both ranks run a set-up (a seed broadcast from rank 0, an all-gather)
    and start their Sessions. Then rank 1 is replaced: the new process's set-up gets what
    the lost rank's got, call by call; a call with no record, or with other shapes, is
    answered as if alone."""
    collective, group = formed(rank)
    seed = torch.tensor([1234 if rank.rank == 0 else 0], dtype=torch.int64)
    group.broadcast([seed]).wait()
    gathered = [torch.zeros(2) for _ in range(2)]
    group.allgather([gathered], [torch.full((2,), 10.0 + rank.rank)]).wait()
    seed += 1                               # the script's own use after the call
    group.barrier().wait()
    group.started()                         # the Session started: set-up is kept
    store = rank.connect()
    rank.meet("kept", store)
    if rank.rank == 0:
        return {}
    replacement = Collective(rank.connect, rank=1, world_size=2, timeout_s=20.0)
    joining = DefaultGroup(replacement, skip_setup=True)   # not formed: nobody to meet
    rank.keep(replacement, joining)
    again = torch.zeros(1, dtype=torch.int64)
    joining.broadcast([again]).wait()
    regathered = [torch.zeros(2) for _ in range(2)]
    joining.allgather([regathered], [torch.full((2,), 99.0)]).wait()
    joining.barrier().wait()
    unrecorded = [torch.zeros(3) for _ in range(2)]
    joining.allgather([unrecorded], [torch.full((3,), 5.0)]).wait()
    return {"seed": again.tolist(), "gathered": [g.tolist() for g in regathered],
            "unrecorded": [g.tolist() for g in unrecorded]}


@pytest.mark.timeout(90)
def test_a_replacement_gets_what_the_lost_ranks_set_up_collectives_returned() -> None:
    """Before, a replacement's set-up collectives were all answered as if alone: a seed
    broadcast from rank 0 stayed the replacement's own, and ``broadcast_object_list``
    unpickled an unset buffer (EOFError)."""
    _, replaced = on_ranks(_setup_replayed)
    assert replaced["seed"] == [1234]                     # rank 0's, as the call returned it
    assert replaced["gathered"] == [[10.0, 10.0], [11.0, 11.0]]
    assert replaced["unrecorded"] == [[5.0] * 3, [5.0] * 3]   # no such call: as if alone
