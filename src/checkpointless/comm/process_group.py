"""Process groups that outlive a generation: the same Python object, the next communicator.

FSDP2 and DTensor hold on to their process groups: ``fully_shard`` stores the mesh's groups in
every parameter group, and DTensor resolves a mesh dimension's group by name from c10d's
registry. After a recovery the same objects must therefore carry the next generation's
communicator; rebuilding them would mean re-running ``fully_shard`` and rebuilding the model.

:class:`ResilientProcessGroup` is a ``torch.distributed.ProcessGroup`` subclass that c10d's
Python front end (``dist.all_reduce``, ``dist.all_gather_single``, ``dist.reduce_scatter_single``,
...), FSDP2, DTensor, functional collectives and DCP call like any other group: every c10d
collective, send and receive is here. Each is forwarded to the current generation's gloo group
and returned as an :class:`~checkpointless.comm.work.AbortableWork`, whose ``wait()`` is a
:class:`~checkpointless.comm.handle.Handle`'s (as the data-parallel communicator's), so
:meth:`ResilientProcessGroup.abort` from another thread wakes a waiter with
:class:`~checkpointless.errors.CommAborted` within 10 ms (at once after its first 10 ms). Between an abort and the next
:meth:`~ResilientProcessGroup.configure` every collective is refused. Aborted gloo groups are
parked, never destroyed under a waiting thread.

On a CUDA host (the job's backend NCCL) each generation also forms an NCCL group, and a
collective on CUDA tensors goes there (FSDP2's all-gathers, reduce-scatters and HSDP
all-reduces of a model on the GPU). An asynchronous one completes through its future and is
ordered on the waiting thread's stream as the data-parallel communicator does; a synchronous one
(``async_op=False``, which is how FSDP2 issues its collectives) runs on the caller's stream and
NCCL returns no work for it, so it is complete as issued (handle.py). CPU tensors (a metric, the
job's own checks) still go to gloo. An abort aborts the NCCL group's kernels, which is what ends
a host wait (``loss.item()``, say) on a collective that a dead peer left hanging. Run on one GPU
with one rank (``benchmarks/gpu_check.py``); never yet with several NCCL ranks.

The groups are made through c10d's backend-plugin path (``init_process_group`` and
``new_group`` with ``c10d_backend.BACKEND_NAME``), so torch does its own bookkeeping: the group name,
the registry that ``DeviceMesh.get_group`` and functional collectives resolve names in, and
the global-to-group rank map.

Forming, aborting and parking each generation's communicators, and issuing one collective on
the current one, are the base class's (:class:`~checkpointless.comm.generations.GenerationGroup`,
``generations.py``); this module is what c10d sees: the group's identity and every collective.
The backend's registration, which makes these groups, is ``c10d_backend.py``.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.distributed as dist

# torch does not re-export this one from torch.distributed (the others it does)
from torch._C._distributed_c10d import AllgatherOptions

from checkpointless.comm.folded import fold_all_reduce, folded_refusal
from checkpointless.comm.generations import GenerationGroup, on_cuda
from checkpointless.comm.handle import Handle
from checkpointless.comm.work import AbortableWork, ChainWork, clamp_timeout
from checkpointless.errors import ConfigError

__all__ = ["ResilientProcessGroup"]


class ResilientProcessGroup(GenerationGroup):
    """One group of fixed members (global ranks), carried across generations.

    ``key`` names the group inside each generation's store prefix (the same on every member,
    derived from its members), so each generation's gloo group forms from
    ``<prefix>/<key>/`` with fixed rank numbers: reductions keep their order and results stay
    bitwise reproducible from one generation to the next.
    """

    # torch 2.13's new_group hands the call to the default group when it has a callable
    # new_group: the job's default group gets one (comm/script_groups.py); None elsewhere, so that
    # c10d makes every other group itself
    new_group: Callable[..., ResilientProcessGroup | None] | None = None
    # called by shutdown() (``dist.destroy_process_group(group)``) for a group the script made
    on_shutdown: Callable[[ResilientProcessGroup], None] | None = None
    # collectives issued on this group so far: whether the script has communicated through it
    # (a fault before the job's first state sync, recovery/first_generation.py)
    issued = 0
    # for every group at once: while set, a collective on a group that has never formed
    # completes at once without communicating, its outputs left as they are (an all-gather's
    # filled with this rank's input: _gather_own). Set in a
    # replacement until job.steps(): its start-up's collectives have no partners (its peers are
    # in the recovery round) and what they would bring is replaced by the state it receives.
    local_until_formed: ClassVar[bool] = False
    # while set, every collective on this group raises a ConfigError with this reason: torch's
    # default group in a process that holds lost slots (degraded mode, recovery/slots.py), whose
    # held slots' parts of a collective would never come, so every rank would wait in it
    refused: str | None = None
    # degraded HSDP: every member of this replicate group is this process (comm/folded.py)
    folded = False
    # torch's DDP can be built on it (comm/torch_ddp.py's serve_ddp)
    ddp_served = False

    # -- identity: what FSDP2, DeviceMesh and c10d ask ----------------------------------------
    def rank(self) -> int:
        return self._group_rank

    def size(self) -> int:
        return self._group_size

    def getBackendName(self) -> str:
        # "gloo" on a CUDA host too: FSDP2 then reduces with SUM and divides itself, which both
        # backends do (gloo has no AVG), so a rank's reductions are the same whichever carries them
        return "gloo"

    # c10d keeps a group's name in its backends, and this group has none of c10d's kind: the
    # name that c10d assigns (and DeviceMesh and functional collectives look up) lives here.
    @property
    def group_name(self) -> str:
        if self._name is None:
            raise RuntimeError(
                f"ResilientProcessGroup {self.key}: no name yet; create it with dist.new_group"
            )
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_desc(self) -> str:
        return self._desc

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    def name_as(self, name: str, desc: str) -> None:
        """The name and description torch gave the group (c10d's own path sets them itself)."""
        self._name = name
        self._desc = desc

    def shutdown(self) -> None:
        if self.on_shutdown is not None:
            self.on_shutdown(self)
        else:
            super().shutdown()

    def __repr__(self) -> str:
        return f"ResilientProcessGroup({self.key}, rank {self._group_rank}, gen {self.generation})"

    # -- collectives ----------------------------------------------------------------------------
    def _issue(
        self,
        fn: Callable[[Any], Any],
        result: Any,
        on: Any = None,
        p2p: bool = False,
        local: Callable[[], None] | None = None,
    ) -> AbortableWork:
        if self.refused is not None or self.folded:
            raise ConfigError(self.refused or folded_refusal(self.key))
        if ResilientProcessGroup.local_until_formed and self.generation < 0:
            # completes at once; an all-gather brings this rank's own input (_gather_own)
            if local is not None:
                local()
            return AbortableWork(Handle(None, result, _forget_nothing), result)  # done as issued
        self.issued += 1
        return AbortableWork(self.handle(fn, result, on, p2p), result)

    def _before(self, kind: str) -> None:
        if self.before_collective is not None:
            self.before_collective(kind)

    def allreduce(self, tensors: Any, opts: Any = None) -> AbortableWork:  # type: ignore[override]
        if isinstance(opts, dist.ReduceOp | dist.ReduceOp.RedOpType) or opts is None:
            op = dist.ReduceOp.SUM if opts is None else opts
            opts = dist.AllreduceOptions()
            opts.reduceOp = op
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        self._before("allreduce")
        if self.folded and self.refused is None:  # finished here: comm/folded.py
            fold_all_reduce(tensors, opts.reduceOp, self._group_size, self.key)
            return AbortableWork(Handle(None, tensors, _forget_nothing), tensors)
        return self._issue(lambda pg: pg.allreduce(tensors, opts), tensors, tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> AbortableWork:  # type: ignore[override]
        opts = dist.AllreduceCoalescedOptions() if opts is None else opts
        return self._issue(lambda pg: pg.allreduce_coalesced(tensors, opts), tensors, tensors)

    def broadcast(self, tensors: Any, opts: Any = None) -> AbortableWork:  # type: ignore[override]
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        if isinstance(opts, int):
            root, opts = opts, dist.BroadcastOptions()
            opts.rootRank = root
        opts = dist.BroadcastOptions() if opts is None else opts
        return self._issue(lambda pg: pg.broadcast(tensors, opts), tensors, tensors)

    def barrier(self, opts: Any = None) -> AbortableWork:  # type: ignore[override]
        # An all-reduce of one element: gloo's barrier has no bounded wait of its own.
        t = torch.zeros(1)
        aopts = dist.AllreduceOptions()
        return self._issue(lambda pg: pg.allreduce([t], aopts), None)

    def monitored_barrier(  # type: ignore[override]
        self, timeout: datetime.timedelta | None = None, wait_all_ranks: bool = False
    ) -> None:
        """gloo's barrier that names the late rank (Lightning's ``prepare_data`` group calls it):
        here our barrier, waited at most ``timeout`` (clamped), aborted like any collective."""
        self.barrier().wait(clamp_timeout(timeout))

    def allgather(  # type: ignore[override]
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> AbortableWork:
        opts = AllgatherOptions() if opts is None else opts
        return self._issue(
            lambda pg: pg.allgather(output_tensors, input_tensors, opts),
            output_tensors,
            input_tensors,
            local=lambda: _gather_own(output_tensors, input_tensors),
        )

    def all_gather_single(  # type: ignore[override]
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> AbortableWork:
        opts = AllgatherOptions() if opts is None else opts
        return self._issue(
            lambda pg: pg._allgather_base(output, input, opts),
            output,
            input,
            local=lambda: _gather_own([list(output.chunk(self._group_size))], [input]),
        )

    _allgather_base = all_gather_single  # type: ignore[assignment]

    def allgather_into_tensor_coalesced(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> AbortableWork:
        opts = AllgatherOptions() if opts is None else opts
        return self._chain("_allgather_base", outputs, inputs, opts)

    def reduce_scatter_single(  # type: ignore[override]
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> AbortableWork:
        opts = dist.ReduceScatterOptions() if opts is None else opts
        self._before("reduce_scatter")
        return self._reduce_scatter_one(output, input, opts)

    def _reduce_scatter_one(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> AbortableWork:
        if self._dev_pg is not None and on_cuda(input):
            return self._issue(lambda pg: pg._reduce_scatter_base(output, input, opts), output, input)
        # gloo's reduce-scatter is an all-reduce of a copy of the input followed by a copy of this
        # rank's part (checked bit for bit in tests/unit/comm/test_process_group_collectives.py), done in
        # the work's wait(), so its work has no future and ignores a bounded wait: a thread of
        # ours had to wait for it, and its completion then hopped to the training thread (the
        # single largest cost of our groups under FSDP2 on two cores). The same all-reduce issued
        # here is pollable like every other collective, and the part is copied out as the
        # training thread's wait returns: the same bytes travel and the same sums are made.
        n = output.numel()
        if input.numel() != n * self._group_size:
            raise ValueError(
                f"reduce_scatter: input of {input.numel()} elements, output of {n} in a group of "
                f"{self._group_size}; the input must hold {n * self._group_size} (size x output)"
            )
        if input.dtype != output.dtype:
            raise ValueError(f"reduce_scatter: input is {input.dtype}, output {output.dtype}; use one dtype")
        flat = input.detach().reshape(-1).clone()
        aopts = dist.AllreduceOptions()
        aopts.reduceOp = opts.reduceOp
        start = self._group_rank * n

        def take_part() -> None:
            with torch.no_grad():
                output.copy_(flat.narrow(0, start, n).view(output.shape))

        self.issued += 1
        h = self.handle(lambda pg: pg.allreduce([flat], aopts), output, flat)
        return AbortableWork(h, output, then=take_part)

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def reduce_scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> AbortableWork:
        opts = dist.ReduceScatterOptions() if opts is None else opts
        self._before("reduce_scatter")
        return self._issue(lambda pg: pg.reduce_scatter(outputs, inputs, opts), outputs, outputs)

    def reduce_scatter_tensor_coalesced(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> AbortableWork:
        opts = dist.ReduceScatterOptions() if opts is None else opts
        self._before("reduce_scatter")
        # issued one after another, matched by the peers in that order (as _chain)
        works = [self._reduce_scatter_one(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return ChainWork(works, outputs)

    # The rest of c10d's collectives, for code beside FSDP2 on the same groups: DTensor
    # (``distribute_tensor`` scatters or broadcasts, ``redistribute`` all-to-alls), DCP's
    # ``save``/``load`` (gather and scatter of objects on the default group), pipeline stages
    # (send/recv). Each is one gloo call (or NCCL's for CUDA tensors) under the same abortable wait.
    def reduce(self, tensors: Any, opts: Any = None) -> AbortableWork:  # type: ignore[override]
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        opts = dist.ReduceOptions() if opts is None else opts
        return self._issue(lambda pg: pg.reduce(tensors, opts), tensors, tensors)

    def gather(  # type: ignore[override]
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> AbortableWork:
        opts = dist.GatherOptions() if opts is None else opts
        return self._issue(
            lambda pg: pg.gather(output_tensors, input_tensors, opts), output_tensors, input_tensors
        )

    def scatter(  # type: ignore[override]
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None
    ) -> AbortableWork:
        opts = dist.ScatterOptions() if opts is None else opts
        return self._issue(
            lambda pg: pg.scatter(output_tensors, input_tensors, opts), output_tensors, output_tensors
        )

    def allgather_coalesced(  # type: ignore[override]
        self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor], opts: Any = None
    ) -> AbortableWork:
        opts = AllgatherOptions() if opts is None else opts
        return self._issue(
            lambda pg: pg.allgather_coalesced(output_lists, input_list, opts), output_lists, input_list
        )

    def alltoall(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> AbortableWork:
        opts = dist.AllToAllOptions() if opts is None else opts
        return self._issue(lambda pg: pg.alltoall(outputs, inputs, opts), outputs, inputs)

    def alltoall_base(  # type: ignore[override]
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> AbortableWork:
        opts = dist.AllToAllOptions() if opts is None else opts
        return self._issue(
            lambda pg: pg.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts),
            output,
            input,
        )

    # c10d's newer name, which C++ callers (functional collectives) look up first
    all_to_all_single = alltoall_base  # type: ignore[assignment]

    # Every point-to-point path of c10d ends here on this group: dist.send/recv, isend/irecv,
    # and batch_isend_irecv (which issues them one by one on a group that is not c10d's own
    # ProcessGroup type), so any pipeline schedule's sends and receives pass the "send"/"recv"
    # hook, the fault site inside a stage's send or receive (faults/inject.py's "p2p"). It runs
    # before the op is posted: a fault there leaves the peer stage waiting in its matching op.
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> AbortableWork:  # type: ignore[override]
        self._before("send")
        return self._issue(lambda pg: pg.send(tensors, dst, tag), tensors, tensors, p2p=True)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> AbortableWork:  # type: ignore[override]
        self._before("recv")
        return self._issue(lambda pg: pg.recv(tensors, src, tag), tensors, tensors, p2p=True)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> AbortableWork:  # type: ignore[override]
        self._before("recv")
        works: list[Any] = []

        def issue(pg: Any) -> Any:
            works.append(pg.recv_anysource(tensors, tag))
            return works[0]

        out = self._issue(issue, tensors, tensors, p2p=True)
        # ``dist.recv(src=None)`` asks the work who sent; gloo's work knows, after the wait
        out.set_source(works[0])
        return out

    def _chain(
        self, method: str, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any
    ) -> AbortableWork:
        # Issued one after another on the same group (gloo matches them in issue order); the
        # returned work waits on each, so an error in any of them is not lost.
        works = [
            self._issue(functools.partial(_call, method, o, i, opts), None, i)
            for o, i in zip(outputs, inputs, strict=True)
        ]
        return ChainWork(works, outputs)


def _gather_own(outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor]) -> None:
    """A replacement's all-gather before its group forms: its own input in every place, so a
    start-up check that the ranks agree passes (DDP's on the parameters' shapes)."""
    with torch.no_grad():
        for out, inp in zip(outputs, inputs, strict=True):
            for o in (o for o in out if o.numel() == inp.numel()):
                o.copy_(inp.reshape(o.shape))


def _forget_nothing(handle: Handle) -> None:
    pass  # a collective completed locally was never pending anywhere


def _call(method: str, output: torch.Tensor, input: torch.Tensor, opts: Any, pg: Any) -> Any:
    return getattr(pg, method)(output, input, opts)
