"""The default process group of a launched job: the user's own ``init_process_group()``
(env://, gloo) gets a ``torch.distributed.ProcessGroup`` whose collectives run on the
current generation's gloo group, so the objects that hold it (``dist.group.WORLD``, a
DistributedDataParallel module, a sampler) keep working after a recovery re-formed the
group in place; nobody rebuilds them. The generations' gloo groups left behind are aborted
and dropped once the next one formed (``Collective``), so their sockets are given back.

While a Session is attached, a collective that fails (a peer died) or is still waiting
when a newer generation is announced (a peer hung) completes at once as a no-op and marks
the generation faulted: DDP's backward finishes with its buckets unreduced, the Session
refuses the optimizer step that would apply them and rolls the step back
(``Session.step``). Without a Session (an unmodified torchrun script) a failed collective
raises, as plain gloo does.

A rank that joins survivors (a promoted spare, a restarted worker) does not send the
collectives its script issues before its Session has started: the survivors passed that
set-up long ago (DDP's construction-time broadcast, a ``barrier`` after data preparation,
a run name rank 0 broadcast). Each returns what the lost rank's same call returned
(``SetupRecord``; ``event=setup_collective_replayed``) or, with no record of it, is
answered as if the rank were alone (``event=setup_collective_skipped``): state it would
have synchronised is restored from the snapshot.

Groups the script makes with ``dist.new_group`` (torch hands their creation to this
group) are ``SubGroup``s, re-formed per generation like this one.
"""
from __future__ import annotations

import datetime
import functools
import itertools
import logging
import os
import threading
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.futures import Future

from phalanx.runtime.base import group_formed_key
from phalanx.runtime.context import WorkerContext
from phalanx.runtime.group.collective import Collective, CollectiveAborted
from phalanx.runtime.group.process_group import connect_store
from phalanx.runtime.group.setup_record import SETUP, SetupRecord
from phalanx.runtime.membership.etcd import EtcdMembership, client_options, job_prefix
from phalanx.runtime.membership.generation import GenerationWatcher

log = logging.getLogger(__name__)
BACKEND = "phalanx"
# ProcessGroup collectives the group forwards, with the argument a no-op completion
# returns (the tensors a caller reads back: DDP reads an all-reduce's result list)
_OPS: dict[str, int] = {
    "allreduce": 0, "allreduce_coalesced": 0, "broadcast": 0, "reduce": 0,
    "allgather": 0, "_allgather_base": 0, "allgather_coalesced": 0,
    "allgather_into_tensor_coalesced": 0, "gather": 0, "scatter": 0, "reduce_scatter": 0,
    "_reduce_scatter_base": 0, "reduce_scatter_tensor_coalesced": 0, "alltoall": 0,
    "alltoall_base": 0, "send": 0, "recv": 0, "recv_anysource": 0, "barrier": -1,
}
# torch's ``*_single`` ProcessGroup collectives (FSDP2's all-gather and reduce-scatter) and
# the gloo backend collectives they run as
_SINGLE = {"all_gather_single": "_allgather_base", "reduce_scatter_single": "_reduce_scatter_base",
           "all_to_all_single": "alltoall_base"}
_world: dict[str, Any] = {}     # this process's collective and default group
# the etcd client and generation watcher the script's init_process_group() opened, by
# (job, worker, rank, generation), until the Session takes them
_watch: dict[tuple[str, str, int, int], tuple[EtcdMembership, GenerationWatcher]] = {}


class _FutureWork(dist.Work):
    """A Work that is done when its future is (DDP waits on ``get_future()``)."""

    def __init__(self, future: Future) -> None:
        super().__init__()
        self._future = future

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._future.done()

    def get_future(self) -> Future:
        return self._future


def _future_of(work: dist.Work) -> Future:
    """``work``'s future. gloo's ``_reduce_scatter_base`` (FSDP2's reduce-scatter) returns
    a Work without one (torch 2.13): a daemon thread waits on it instead, and ends with it."""
    try:
        return work.get_future()
    except RuntimeError:
        pass
    future: Future = Future()

    def wait() -> None:
        try:
            work.wait()
        except Exception as exc:  # the waiting thread's boundary: a peer failed
            future.set_exception(exc)
            return
        future.set_result([])

    threading.Thread(target=wait, name="phalanx-work-wait", daemon=True).start()
    return future


class _Failure:
    """A collective's failure, carried as the value of its inner future to
    ``_raise_failure``. ``Future.set_exception`` would not do: it completes the future
    *successfully* with the exception object as its value, raised only by a Python reader;
    DDP's C++ reducer reads that value as its bucket's tensor and crashed the process
    (SIGSEGV in ``parseCppCommHookResult``: a survivor of an unmodified script whose peer
    died in the backward pass). Raised in a ``then`` callback instead, the failure is the
    future's error, which the reducer raises from ``backward()`` as plain gloo's does."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _raise_failure(inner: Future) -> Any:
    value = inner.value()
    if isinstance(value, _Failure):
        raise value.error
    return value


def _done(value: Any) -> _FutureWork:
    future: Future = Future()
    future.set_result(value)
    return _FutureWork(future)


class _Forwarding(dist.ProcessGroup):
    """A Python ProcessGroup whose collectives run on a gloo group of the generation this
    rank is in (``_gloo``), answered locally while ``_local`` says so, and completed as
    no-ops when they fail or a newer generation supersedes them under a Session."""

    _what = "default group"     # in errors

    def __init__(self, collective: Collective, rank: int, size: int, name: str) -> None:
        # the (rank, size) constructor of a Python-defined group; the stubs list only the
        # store-taking one
        super().__init__(rank, size)  # type: ignore[call-arg]
        self._collective = collective
        self._lock = threading.Lock()
        # future, no-op (the result argument), generation, set-up call number
        self._pending: dict[int, tuple[Future, Any, int, int | None]] = {}
        self._tokens = itertools.count()
        self._setup = SetupRecord(lambda: collective.store, name, collective.rank)
        self._in_ddp_forward = False     # a DistributedDataParallel forward runs (_patch_ddp)
        # why collectives are answered locally, if they are: "setup" (a joining rank, until
        # its Session started) or "epoch_top" (DefaultGroup.answer_epoch_top_locally)
        self._answering: str | None = None
        collective.on_announced(self._abort_if_superseded)

    def getBackendName(self) -> str:  # noqa: N802  (torch's name)
        # not "gloo": DDP's logger would look up a C++ gloo backend inside this group
        # (dist.get_backend() still answers gloo: see install)
        return BACKEND

    @property
    def group_name(self) -> c10d.GroupName:
        """The name torch registered this group under (a C++ ProcessGroup reads its name
        from its backends, and this group has none): a DeviceMesh over the group
        (``init_device_mesh``, FSDP2) stores this name and resolves it back to this same
        group object, so the mesh keeps working after a re-form."""
        return c10d._world.pg_names[self]

    @property
    def _device_types(self) -> list[torch.device]:
        """The devices this group serves (``dcp.async_save`` asks for the CPU)."""
        return [torch.device("cpu")]

    @property
    def fault_tolerant(self) -> bool:
        """A Session is attached: failures roll steps back (an unmodified script's group
        behaves as torchrun's: DDP keeps its own bucket rebuild, failures raise)."""
        return self._collective.absorb_faults

    @property
    def generation(self) -> int:
        """The generation whose group this rank is in (it moves at every recovery)."""
        return self._collective.generation

    @property
    def _local(self) -> str | None:
        """Why collectives are answered locally now, if they are (the default group's
        reason; a ``SubGroup`` reads its parent's)."""
        return self._answering

    def _gloo(self) -> dist.ProcessGroup | None:
        """This generation's gloo group for these ranks (None: none formed); the default
        group's is the generation's own."""
        return self._collective.group

    @property
    def answering_locally(self) -> bool:
        """Whether collectives are answered locally now (set-up or a restored epoch top)."""
        return self._local is not None

    def _forward(self, name: str, noop_at: int, *args: Any) -> dist.Work:
        collective = self._collective
        noop = args[noop_at] if noop_at >= 0 else []
        # DDP's own calls in a forward (its buffer broadcast) are not an epoch top's to
        # keep: whether a forward makes one differs between a survivor and a replacement,
        # and the buffers it would set were restored with the step
        call = None if self._in_ddp_forward and self._setup.scope != SETUP \
            else self._setup.number()
        local = self._local
        if local is not None:
            if self._setup.replay(call, noop):
                log.info("event=%s_collective_replayed op=%s rank=%d call=%s", local, name,
                         collective.rank, call)
                return _done(noop)
            log.info("event=%s_collective_skipped op=%s rank=%d", local, name,
                     collective.rank)
            return _done(_as_if_alone(name, args, noop))
        group = self._gloo() if collective.fault is None else None
        if collective.fault is not None or group is None:
            return self._refused(name, noop, collective.fault or "no group formed yet")
        try:
            work = getattr(group, name)(*args)
        except RuntimeError as exc:
            collective.mark_fault(f"{name} could not start: {exc}")
            return self._refused(name, noop, str(exc))
        future: Future = Future()
        token = next(self._tokens)
        with self._lock:
            self._pending[token] = (future, noop, collective.generation, call)
        _future_of(work).then(functools.partial(self._settle, token, name))
        self._abort_if_superseded()     # announced before this call was pending
        return _FutureWork(future.then(_raise_failure))

    def _refused(self, name: str, noop: Any, reason: str) -> dist.Work:
        if self._collective.absorb_faults:
            return _done(noop)
        raise CollectiveAborted(f"{name} on the {self._what}: {reason}")

    def _settle(self, token: int, name: str, inner: Future) -> None:
        with self._lock:
            entry = self._pending.pop(token, None)
        if entry is None:          # already completed by an abort
            return
        future, noop, generation, call = entry
        try:
            value = inner.value()
        except Exception as exc:  # the gloo thread's boundary: a peer failed
            # an abandoned generation's call failing late (its group reaped) is no fault
            # of the current one
            if generation == self._collective.generation:
                self._collective.mark_fault(f"{name} failed: {exc}")
            future.set_result(noop if self._collective.absorb_faults else _Failure(exc))
            return
        if call is not None:
            self._setup.keep(call, noop)
        future.set_result(value)

    def _setup_over(self) -> None:
        """The Session started: the set-up calls this rank made are kept for a rank that
        replaces it (``SetupRecord``)."""
        self._setup.publish()

    def _abort_if_superseded(self) -> None:
        """Complete every pending collective as a no-op once a newer generation is
        announced (a hung peer never fails the call itself): called by the collective when
        a generation is announced and after each call starts, so an announcement that
        came first is not missed."""
        collective = self._collective
        if not collective.absorb_faults or not collective.superseded():
            return
        with self._lock:
            aborted = [(f, n) for f, n, _, _ in self._pending.values()]
            self._pending.clear()
        if not aborted:
            return
        collective.mark_fault("a newer generation began while a collective waited")
        for future, noop in aborted:
            future.set_result(noop)


class DefaultGroup(_Forwarding):
    """The job's default group; every collective goes to ``collective.group``, the gloo
    group of the generation this rank is in."""

    def __init__(self, collective: Collective, skip_setup: bool) -> None:
        super().__init__(collective, collective.rank, collective.world_size, "world")
        self._subgroups: list[weakref.ref[SubGroup]] = []
        self._answering = "setup" if skip_setup else None

    def started(self) -> None:
        """The Session joined the job: set-up is over, collectives are real from now on."""
        if self._answering == "setup":
            self._answering = None
        for group in self._groups():
            group._setup_over()

    def _groups(self) -> list[_Forwarding]:
        """This group and its live subgroups."""
        self._subgroups = [ref for ref in self._subgroups if ref() is not None]
        return [self, *(g for ref in self._subgroups if (g := ref()) is not None)]

    def epoch_top(self, epoch: int | None) -> None:
        """An epoch's top begins on this rank (``epoch``) or ends (None: its first step
        starts): the calls in between are kept for a rank restored into that epoch later
        (``SetupRecord``)."""
        for group in self._groups():
            if epoch is None:
                group._setup.publish()
            else:
                group._setup.begin(f"epoch{epoch}")

    def answer_epoch_top_locally(self, active: bool, epoch: int = -1) -> None:
        """While ``active``: this rank runs again the top of ``epoch``, whose steps it was
        restored into (a replacement that joined mid-epoch, or every rank re-entering the
        epoch whose evaluation a peer died in), up to where the restored pass of its loader
        resumes. The ranks it joins ran that code before the fault, so its collectives
        are answered locally, as set-up collectives are, with what the rank's same call
        returned then when it was kept (a ``broadcast_object_list``, an ``all_reduce`` of a
        count), else as if alone (a ``barrier``); a collective sent to the group would meet
        another rank's step."""
        if active and self._answering is None:
            self._answering = "epoch_top"
            for group in self._groups():
                group._setup.begin(f"epoch{epoch}")
        elif not active and self._answering == "epoch_top":
            self._answering = None
            for group in self._groups():
                group._setup.close()

    def monitored_barrier(self, *args: Any) -> None:
        group = self._collective.group
        if group is not None and self._answering is None:
            getattr(group, "monitored_barrier")(*args)   # gloo's own, not in the stubs

    def new_group(self, ranks: list[int], timeout: datetime.timedelta | None = None,
                  pg_options: Any = None, group_name: str = "", group_desc: str = "",
                  ) -> SubGroup | None:
        """torch's ``new_group`` (and ``new_subgroups``, a DeviceMesh's dimensions) over this
        group: a ``SubGroup`` for a member of ``ranks``, None for any other rank. Nothing
        is exchanged here (torch delegates the whole creation to a default group that has
        this method), so a replacement running its set-up again makes it alone."""
        if self._collective.rank not in ranks:
            return None
        group = SubGroup(self, list(ranks), group_name or f"unnamed{next(_unnamed)}", timeout)
        if not self._setup.open:        # made after set-up: nothing of it to keep
            group._setup_over()
        elif self._setup.scope != SETUP:        # made in an epoch's top: kept with it
            group._setup.begin(self._setup.scope)
        self._groups()                  # (drops the dead ones)
        self._subgroups.append(weakref.ref(group))
        return group


_unnamed = itertools.count()     # names of groups torch gave none


class SubGroup(_Forwarding):
    """A group of some ranks of the job made by the script (``dist.new_group``), re-formed
    like the default group: its collectives run on a gloo group of these ranks formed for
    the current generation at its first collective there (on a fresh prefix of the
    launcher's store), are answered locally while the default group's are, and fail or
    complete as no-ops as the default group's do. A gloo group made by torch itself would
    keep the lost rank's connections for good, and a replacement's ``new_group`` would
    wait for ranks that made theirs long ago."""

    _what = "group made by new_group"

    def __init__(self, parent: DefaultGroup, ranks: list[int], name: str,
                 timeout: datetime.timedelta | None) -> None:
        collective = parent._collective
        super().__init__(collective, ranks.index(collective.rank), len(ranks), name)
        self._parent = parent
        self._ranks = ranks
        self._name = name
        self._timeout_s = timeout.total_seconds() if timeout else collective.timeout_s
        self._formed: tuple[int, dist.ProcessGroup] | None = None

    @property
    def _local(self) -> str | None:
        return self._parent._local

    def _gloo(self) -> dist.ProcessGroup | None:
        collective = self._collective
        generation = collective.generation
        if self._formed is not None and self._formed[0] == generation:
            return self._formed[1]
        if self._formed is not None:
            collective.park(self._formed[1])
            self._formed = None          # no reference left here: the reaper drops it
            collective.release_parked()
        try:
            group = collective.form_subgroup(f"sub/{self._name}", self.rank(), self.size(),
                                             self._timeout_s)
        except CollectiveAborted as exc:
            collective.mark_fault(f"the group of ranks {self._ranks}: {exc}")
            return None
        self._formed = (generation, group)
        return group


def _forwarder(name: str, noop_at: int, exposed: str = "") -> Callable[..., dist.Work]:
    def op(self: _Forwarding, *args: Any, **kwargs: Any) -> dist.Work:
        return self._forward(name, noop_at, *args, *kwargs.values())
    op.__name__ = exposed or name
    return op


for _name, _at in _OPS.items():
    setattr(_Forwarding, _name, _forwarder(_name, _at))
for _name, _gloo in _SINGLE.items():
    setattr(_Forwarding, _name, _forwarder(_gloo, _OPS[_gloo], _name))


def _as_if_alone(name: str, args: tuple, noop: Any) -> Any:
    """A skipped set-up collective's result as if every rank held this rank's values: an
    all-gather's outputs are copies of its input (DDP's parameter-shape check passes)."""
    if name == "allgather":
        outputs, inputs = args[0], args[1]
        for slots, tensor in zip(outputs, inputs):
            for slot in slots:
                slot.copy_(tensor)
    elif name == "_allgather_base":
        output, tensor = args[0], args[1]
        output.copy_(tensor.reshape(1, -1).expand(output.numel() // max(tensor.numel(), 1), -1)
                     .reshape(output.shape))
    return noop


class _InitialBuckets:
    """A DDP reducer, seen by ``DistributedDataParallel._pre_forward``, that never rebuilds
    its buckets. DDP re-buckets once, in its second iteration, by the order gradients
    became ready on rank 0, and broadcasts that layout: a rank that joins survivors later
    would start from the construction-time layout while they use the rebuilt one, and its
    first all-reduce would sum misaligned buckets. Every rank of a phalanx job keeps the
    layout ``_capped_buckets`` gave it, the same on every rank in every generation. The
    reducer's record of ready parameters, which only a rebuild would consume, is cleared
    instead of growing."""

    def __init__(self, reducer: Any) -> None:
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        self._reducer._reset_state()
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)


class _CappedLimits:
    """A DDP bucket configuration that sizes buckets as DDP does for
    ``find_unused_parameters=True``: a 1 MiB first bucket, then ``bucket_cap_mb`` each."""

    def __init__(self, config: Any) -> None:
        self._config = config

    def compute_bucket_size_limits(self, static_graph: bool,
                                   find_unused_parameters: bool) -> tuple[list[int], list[int]]:
        return self._config.compute_bucket_size_limits(static_graph=False,
                                                       find_unused_parameters=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def _capped_buckets(ddp: Any) -> None:
    """Give a DDP module the bucket layout it would have been built with under
    ``find_unused_parameters=True`` (parameters in reverse order, a 1 MiB first bucket,
    then ``bucket_cap_mb`` each), once, before its first fault-tolerant forward. Without
    ``find_unused_parameters`` DDP builds one bucket for the whole model and only splits it
    by rank 0's gradient order at its second iteration, a layout a joining rank cannot
    know; one bucket all-reduces only after the whole backward pass (measured on the
    bench's transformer: 9% of the step). This layout depends only on the parameters, so
    every rank of every generation computes the same one without a collective. The new
    reducer is built as DDP's own ``__setstate__`` builds one, and what DDP's constructor
    set on the old one (comm hooks, mixed precision, optimizers in backward) is set again."""
    config = ddp._bucket_config
    parameters, expect_sparse = ddp._build_params_for_reducer()
    ddp._bucket_config = _CappedLimits(config)
    try:
        ddp._ddp_init_helper(parameters, expect_sparse,
                             ddp._build_debug_param_to_name_mapping(parameters),
                             ddp.static_graph)
    finally:
        ddp._bucket_config = config
    # what DDP's __init__ sets on its reducer after building it
    if ddp.mixed_precision is not None:
        ddp.reducer._set_mixed_precision_param_dtype(ddp.mixed_precision.param_dtype)
    for hook, state in ddp._comm_hooks:
        dist._register_comm_hook(ddp.reducer, state, hook)
    if any(hasattr(p, "_in_backward_optimizers") for p in ddp._module_parameters):
        ddp.reducer._set_optimizer_in_backward()
    builtin = getattr(ddp, "_phalanx_builtin_hook", None)
    if builtin is not None:
        dist._register_builtin_comm_hook(ddp.reducer, builtin)
    if ddp.static_graph:        # as DDP's __setstate__ does for its new reducer
        ddp.reducer._set_static_graph()
        ddp.logger._set_static_graph()
        ddp._static_graph_delay_allreduce_enqueued = False     # its first iteration again


def _patch_ddp_sink() -> None:
    """DDP's ``_DDPSink`` (the autograd node a static graph's first iteration, and
    ``find_unused_parameters``, put on the forward's outputs) reaches its DDP module in
    backward through a weak reference; seen dead with the module alive (a fresh clone's
    DDP drill: ``'NoneType' object has no attribute 'reducer'`` in its backward, the rank
    lost to a worker exception; reported upstream too, Lightning #20706). The node also
    keeps the module strongly for its backward, which uses it when the weak reference is
    dead. Idempotent."""
    from torch.nn.parallel.distributed import _DDPSink

    if getattr(_DDPSink, "_phalanx_strong", False):
        return
    forward, backward = _DDPSink.forward, _DDPSink.backward

    @functools.wraps(forward)
    def sink_forward(ctx: Any, ddp_weakref: Any, *inputs: Any) -> Any:
        ctx.phalanx_ddp = ddp_weakref()
        return forward(ctx, ddp_weakref, *inputs)

    @functools.wraps(backward)
    def sink_backward(ctx: Any, *grad_outputs: Any) -> Any:
        ddp = getattr(ctx, "phalanx_ddp", None)
        if ddp is not None and ctx.ddp_weakref() is None:
            log.warning("event=ddp_sink_weakref_dead module=%s: DDP's backward reaches the "
                        "module through the reference phalanx kept", type(ddp.module).__name__)
            ctx.ddp_weakref = lambda: ddp
        return backward(ctx, *grad_outputs)

    _DDPSink.forward = staticmethod(sink_forward)     # type: ignore[method-assign]
    _DDPSink.backward = staticmethod(sink_backward)   # type: ignore[method-assign]
    _DDPSink._phalanx_strong = True                   # type: ignore[attr-defined]


def _patch_ddp() -> None:
    """DDP modules on the default group of a fault-tolerant script (a Session attached)
    get a bucket layout every rank can compute alone (``_capped_buckets``) and keep it
    (``_InitialBuckets``). Without a Session, and with ``find_unused_parameters`` (whose
    layout is already that one) or DDP's Python reducer, DDP is left as it is: its rebuilt
    layout changes the summation order of a ring all-reduce over 3+ ranks, so an
    unmodified script ends bit for bit as under torchrun.

    ``static_graph`` too, and its reducer is built again at the first forward of every
    generation on every rank: a static graph's first iteration is unlike the others (it
    all-reduces every bucket after the backward pass and then the map of the parameters
    it used, to find unused ones). A replacement's first iteration met the survivors'
    later one, gloo read a message of another size and aborted the replacement again and
    again (5 times, then every rank fell back to its snapshot); now every rank's next
    iteration is a first one."""
    from torch.nn.parallel import DistributedDataParallel

    _patch_ddp_sink()
    original = getattr(DistributedDataParallel._pre_forward, "__wrapped__",
                       DistributedDataParallel._pre_forward)
    register_builtin = getattr(DistributedDataParallel._register_builtin_comm_hook,
                               "__wrapped__",
                               DistributedDataParallel._register_builtin_comm_hook)

    @functools.wraps(original)
    def _pre_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        group = getattr(self, "process_group", None)
        if (not isinstance(group, _Forwarding) or not group.fault_tolerant
                or self.find_unused_parameters or self._use_python_reducer):
            return original(self, *args, **kwargs)    # DDP as under torchrun
        if not getattr(self, "_phalanx_capped", False):
            _capped_buckets(self)
            self._phalanx_capped = True
        if getattr(self, "_phalanx_generation", group.generation) != group.generation:
            # the first forward since a recovery restored the state at a step boundary:
            # DDP's flag is as after a step (a replacement's new module has it too), so
            # the next forward broadcasts the buffers on every rank alike. A survivor
            # whose last forward was an evaluation's (no_grad: DDP cleared the flag)
            # skipped that broadcast while the replacement made it, and gloo matched the
            # replacement's broadcast with the survivor's evaluation all-reduce.
            self.require_forward_param_sync = True
            if self.static_graph:
                _capped_buckets(self)
        # a forward whose broadcast is answered locally (an evaluation at a restored
        # epoch's top) leaves the next one to make it, as the other ranks' first forward
        # since the recovery does
        self._phalanx_generation = -1 if group.answering_locally else group.generation
        reducer = self.reducer
        self.reducer = _InitialBuckets(reducer)
        group._in_ddp_forward = True
        try:
            return original(self, *args, **kwargs)
        finally:
            group._in_ddp_forward = False
            self.reducer = reducer

    @functools.wraps(register_builtin)
    def _register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> None:
        register_builtin(self, comm_hook_type)
        self._phalanx_builtin_hook = comm_hook_type      # for _capped_buckets

    # torch.compile(DDP(model)) runs DDP's own frames eagerly (dynamo skips torch's DDP
    # file) and compiles the module under it; this wrapper is not in torch, so dynamo
    # traced it and failed on the process group it reads (`UnsafeScriptObjectError`, the
    # script's first forward). Run eagerly, as DDP's own `_pre_forward` is.
    eager = torch._disable_dynamo(_pre_forward)
    eager.__wrapped__ = original  # type: ignore[attr-defined]  # (torch's wrapper is untyped)
    _register_builtin_comm_hook.__wrapped__ = register_builtin
    DistributedDataParallel._pre_forward = eager   # type: ignore[method-assign]
    DistributedDataParallel._register_builtin_comm_hook = (   # type: ignore[method-assign]
        _register_builtin_comm_hook)


def process_collective(ctx: WorkerContext) -> Collective:
    """This process's collective (one per worker, shared by the default group and the
    Session), created on first use."""
    key = (ctx.job, ctx.worker_id, ctx.rank, ctx.master_addr, ctx.master_port)
    if _world.get("key") != key:      # another rank in this process (tests): a new one
        _world.clear()
        _world.update(key=key, context=ctx,
                      collective=Collective(lambda: connect_store(ctx, ctx.group_timeout_s),
                                            ctx.rank, ctx.world_size, ctx.group_timeout_s))
    return _world["collective"]


def take_job_watch(ctx: WorkerContext, keep: bool = False,
                   ) -> tuple[EtcdMembership, GenerationWatcher] | None:
    """This process's etcd client and generation watcher, or None without etcd. The
    script's ``init_process_group()`` opens them (``keep``) to follow a newer plan while its
    group forms; the Session takes them over (one connection, not two, on a replacement's
    way to its first step)."""
    if not ctx.etcd_endpoints:
        return None
    key = (ctx.job, ctx.worker_id, ctx.rank, ctx.generation)
    kept = _watch.pop(key, None)
    for membership, watcher in _watch.values():   # another rank's in this process (tests)
        watcher.close()
        membership.close()
    _watch.clear()
    if kept is None:
        membership = EtcdMembership(list(ctx.etcd_endpoints), job_prefix(ctx.etcd_prefix, ctx.job),
                                    **client_options(**ctx.etcd_client)).connect(
            retry_for_s=ctx.group_timeout_s)
        kept = (membership, GenerationWatcher(membership).start())
    if keep:
        _watch[key] = kept
    return kept


def _form_or_follow(ctx: WorkerContext, collective: Collective, joining: bool) -> None:
    """Form this generation's group for the script's ``init_process_group()``. A newer
    generation fenced meanwhile (another fault while this replacement started) ends the
    wait at once: a joining rank leaves its group unformed (its set-up collectives are
    skipped anyway) and its Session, formed next, follows the newer plan; any other rank
    raises, as a group that never forms does."""
    watch = take_job_watch(ctx, keep=True)
    if watch is None:            # no etcd: no newer generation to hear of
        collective.form(ctx.generation)
        return
    watcher = watch[1]
    try:
        collective.form(ctx.generation,
                        should_abort=lambda: watcher.newer_than(ctx.generation))
    except CollectiveAborted:
        if not (joining and watcher.newer_than(ctx.generation)):
            raise
        log.warning("event=init_group_superseded rank=%d generation=%d newest=%d: the "
                    "Session follows the newer plan", ctx.rank, ctx.generation,
                    watcher.latest)


def default_group() -> DefaultGroup | None:
    """The default group built by the user's ``init_process_group()``, or None."""
    return _world.get("group")


def group_fault() -> str:
    """Why this process's default group failed in its current generation (a collective
    met a dead or departed peer), "" when it has not or none was made."""
    collective = _world.get("collective")
    return (collective.fault or "") if collective is not None else ""


def reset() -> None:
    """Forget this process's collective and group (a worker actor runs one rank per
    process; tests reuse processes)."""
    _world.clear()


def install(ctx: WorkerContext) -> None:
    """Make the worker's ``torch.distributed.init_process_group`` build the default group
    on phalanx (gloo or no backend, env:// or no init method); any other backend keeps
    torch's own path, a client of the launcher's store (``TORCHELASTIC_USE_AGENT_STORE``)
    with no recovery in place. Sets torchrun's environment for those paths."""
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
    original = getattr(c10d.init_process_group, "__wrapped__", c10d.init_process_group)

    @functools.wraps(original)
    def init_process_group(backend: str | None = None, init_method: str | None = None,
                           timeout: datetime.timedelta | None = None, world_size: int = -1,
                           rank: int = -1, store: dist.Store | None = None,
                           **kwargs: Any) -> None:
        if not _ours(backend, init_method, store):
            log.warning("event=default_group_not_resilient backend=%s init_method=%s: only "
                        "gloo over env:// is re-formed in place after a fault", backend,
                        init_method)
            original(backend, init_method, timeout, world_size, rank, store, **kwargs)
            return
        if init_method not in (None, "env://"):
            log.info("event=init_method_replaced init_method=%s: the launcher's rendezvous "
                     "serves the default group", init_method)
        if (world_size not in (-1, ctx.world_size)) or (rank not in (-1, ctx.rank)):
            raise ValueError(f"init_process_group(rank={rank}, world_size={world_size}) "
                             f"disagrees with the launcher's RANK={ctx.rank} WORLD_SIZE="
                             f"{ctx.world_size}; leave them out (env:// reads them)")
        collective = process_collective(ctx)
        if collective.generation < 0:
            _form_or_follow(ctx, collective, _joining(ctx))
        kwargs.pop("device_id", None)     # a CPU group binds no device
        original(BACKEND, None, timeout, ctx.world_size, ctx.rank, collective.store, **kwargs)
        group = c10d._get_default_group()
        _, group_store = c10d._world.pg_map[group]
        # shown as gloo (dist.get_backend, subgroups made with the default backend)
        c10d._world.pg_map[group] = ("gloo", group_store)
        _world["group"] = group
        collective.store.add(group_formed_key(collective.generation), 1)

    init_process_group.__wrapped__ = original
    for module in _callers_of_init():
        setattr(module, "init_process_group", init_process_group)
    _patch_ddp()
    process_collective(ctx)


def _callers_of_init() -> list[Any]:
    """The modules whose ``init_process_group`` a script reaches: ``torch.distributed``,
    its ``distributed_c10d``, and ``device_mesh``, which imported the name for itself:
    ``init_device_mesh`` with no group yet (the DTensor and tensor-parallel tutorials,
    FSDP2 scripts that make only a mesh) calls it through that binding."""
    import torch.distributed.device_mesh as device_mesh

    modules: list[Any] = [dist, c10d]
    if hasattr(device_mesh, "init_process_group"):
        modules.append(device_mesh)
    return modules


def _ours(backend: str | None, init_method: str | None, store: dist.Store | None) -> bool:
    """Whether phalanx's re-formable group serves this call: gloo, with no store of the
    script's own. Any ``init_method`` (``env://``, ``tcp://host:port``, ``file://``) names
    a rendezvous, which the launcher's store replaces: a script that spells out
    ``tcp://{MASTER_ADDR}:{MASTER_PORT}`` or a fixed port, as PyTorch's ImageNet example
    does, then runs as with ``env://`` (its own rendezvous, the launcher's store's port or
    another, hung a launched job at start or at its end)."""
    name = (backend or "gloo").lower()
    return (name in ("gloo", "cpu:gloo", BACKEND) and store is None
            and (init_method is None or init_method.startswith(("env://", "tcp://",
                                                                "file://"))))


def _create(store: dist.Store, rank: int, world_size: int,
            timeout: datetime.timedelta) -> DefaultGroup:
    """The backend's creator: the default group over this process's collective."""
    ctx: WorkerContext = _world["context"]
    collective = process_collective(ctx)
    return DefaultGroup(collective, skip_setup=_joining(ctx) and not collective.absorb_faults)


def _joining(ctx: WorkerContext) -> bool:
    """This rank replaces a lost one and joins ranks that kept their state."""
    restore = ctx.extra.get("restore")
    return isinstance(restore, dict) and bool(restore.get("joins_survivors"))

