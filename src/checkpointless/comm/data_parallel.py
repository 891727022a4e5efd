"""Data-parallel gradient averaging that survives an aborted backward.

Why our own wrapper instead of ``torch.nn.parallel.DistributedDataParallel``: DDP's C++ reducer
is left in a broken state by an exception in the middle of backward ("Expected to have finished
reduction in the prior iteration"), it holds one process group for life, and it regroups its
buckets after the first iteration, so a freshly started replacement would reduce in a different
grouping than the survivors (wrong, or off in the last bit). This wrapper keeps a fixed bucket
layout that is a pure function of the module's parameters, issues one asynchronous all-reduce per
bucket as soon as its gradients are ready (overlapping backward), and keeps no state across
iterations that an exception could corrupt: :meth:`reset` makes it new again.

Degraded mode (docs/fault-model.md): a process may hold several data-parallel *slots*, and trains
each slot's micro-batch as one pass of the same step. :meth:`hold` gives it the width-N group of
every slot it holds (the process is that slot's rank in it); an earlier pass keeps its slot's
gradient aside, and the last pass all-reduces every slot's gradient on its own group, all at
once. Every group then sums exactly the per-slot gradients the full-width job would have summed,
in the same algorithm and order, so the result is bitwise the same; it is divided by the width.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from checkpointless.comm.communicator import Communicator
from checkpointless.comm.handle import Handle

__all__ = ["DataParallel", "plan_buckets"]


def plan_buckets(
    sizes_bytes: list[int], cap_bytes: int, first_cap_bytes: int | None = None
) -> list[list[int]]:
    """Group parameter indices, in reverse order (roughly the order backward produces their
    gradients), into buckets of at most ``cap_bytes`` (a parameter larger than the cap gets a
    bucket of its own). The first bucket may be capped smaller (``first_cap_bytes``) so that
    communication starts early in backward and overlaps the rest of it, as DDP does. Pure, so
    every rank and every replacement computes the same layout."""
    buckets: list[list[int]] = []
    cur: list[int] = []
    cur_bytes = 0
    for i in reversed(range(len(sizes_bytes))):
        cap = first_cap_bytes if (first_cap_bytes is not None and not buckets) else cap_bytes
        if cur and cur_bytes + sizes_bytes[i] > cap:
            buckets.append(cur)
            cur, cur_bytes = [], 0
        cur.append(i)
        cur_bytes += sizes_bytes[i]
    if cur:
        buckets.append(cur)
    return buckets


class _Bucket:
    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        numel = sum(p.numel() for p in params)
        self.buffer = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
        # Each parameter's slice of the buffer, shaped like it, made once: the per-step copies
        # in and out are then one fused foreach call each, not three small ops per parameter.
        self.views: list[torch.Tensor] = []
        self.offsets: list[int] = []  # where each parameter's slice begins
        off = 0
        for p in params:
            self.views.append(self.buffer[off : off + p.numel()].view_as(p))
            self.offsets.append(off)
            off += p.numel()
        self.ready = 0
        self.handle: Handle | None = None
        self.held_handles: list[Handle] = []  # degraded mode: the other slots' all-reduces


class DataParallel(nn.Module):
    """Average gradients over the job's data-parallel ranks, like DDP, but abortable.

    ``comm`` is usually ``job.comm``. Parameters must have one dtype per bucket; all ranks must
    hold the same parameters in the same order (the job verifies the replicas at start-up).
    """

    def __init__(
        self,
        module: nn.Module,
        comm: Communicator,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = 1.0,
    ) -> None:
        super().__init__()
        self.module = module
        self._comm = comm
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError("DataParallel: the module has no parameters that require gradients")
        cap = int(bucket_cap_mb * 1024 * 1024)
        layout = plan_buckets(
            [p.numel() * p.element_size() for p in params], cap, int(first_bucket_cap_mb * 1024 * 1024)
        )
        self._buckets: list[_Bucket] = []
        for idx in layout:
            group = [params[i] for i in idx]
            # one dtype per flat buffer; split a mixed-dtype bucket by dtype, keeping order
            by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
            for p in group:
                by_dtype.setdefault(p.dtype, []).append(p)
            self._buckets.extend(_Bucket(g) for g in by_dtype.values())
        self._where: dict[nn.Parameter, int] = {}
        for bi, b in enumerate(self._buckets):
            for p in b.params:
                self._where[p] = bi
        self._next_launch = 0
        self._callback_queued = False
        self._sync = True  # require_backward_grad_sync
        self._reduce = True  # what the last forward decided for its backward
        # degraded mode (hold): the group of each slot this process holds, in pass order, the
        # pass running now, and the gradients of the passes before it (per pass, per bucket)
        self._slot_comms: list[Communicator] = []
        self._pass = 0
        self._kept: list[list[torch.Tensor]] = []
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._callback_queued or self._next_launch:
            # a backward was abandoned half-way (an exception in a hook): start clean, or this
            # rank would issue its collectives out of step with the others
            self.reset()
        # As in DDP, the forward decides: a backward reduces when its forward ran with sync on,
        # so `with no_sync(): loss = model(x)` then `loss.backward()` outside still accumulates.
        self._reduce = self._sync
        return self.module(*args, **kwargs)

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's switch for gradient accumulation: False makes the following forward/backward
        accumulate gradients locally, without an all-reduce (what ``no_sync()`` sets)."""
        return self._sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._sync = bool(value)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (gradient accumulation); the next backward outside
        this block reduces the sum, as DDP's ``no_sync()``."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    @contextmanager
    def local_backward(self) -> Iterator[None]:
        """Backward passes inside this block accumulate locally, whatever their forward decided:
        for a caller that runs the wrapped module's code without this wrapper's forward (the
        Lightning strategy calls ``training_step`` directly) and accumulates micro-batches; the
        first backward after the block reduces the sum, as after ``no_sync()``."""
        old, self._reduce = self._reduce, False
        try:
            yield
        finally:
            self._reduce = old

    def reset(self) -> None:
        """Forget a half-finished iteration (after an abort)."""
        for b in self._buckets:
            b.ready = 0
            b.handle = None
            b.held_handles = []
        self._next_launch = 0
        self._callback_queued = False

    # -- degraded mode: several slots per process ----------------------------------------------
    def hold(self, comms: Sequence[Communicator]) -> None:
        """Hold the slots whose groups are ``comms``, in pass order (at full width: none, or only
        this process's own). Each is a group of the job's full width in which this process is
        that slot's rank; the last is the one the last pass reduces on."""
        self._slot_comms = list(comms) if len(comms) > 1 else []
        self._pass = 0
        self._kept = []

    @property
    def passes(self) -> int:
        """Passes per step: one per slot this process holds."""
        return max(1, len(self._slot_comms))

    def begin_pass(self, index: int) -> None:
        """The pass about to run (0 first): the passes before the last only keep their gradient;
        the first starts the step afresh (a replayed step too)."""
        if not 0 <= index < self.passes:
            raise ValueError(f"pass {index} of a step with {self.passes} pass(es)")
        if index == 0:
            self._kept = []
        self._pass = index

    def _keeping(self) -> bool:
        return bool(self._slot_comms) and self._pass < len(self._slot_comms) - 1

    # -- the backward pass ---------------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._reduce:
            return
        if self._keeping():
            # an earlier slot's pass: its gradient is put aside once backward ends (_keep)
            if not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._keep)
            return
        if self._comm.world_size == 1:
            return
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        b = self._buckets[self._where[p]]  # type: ignore[index]
        b.ready += 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        # Launch strictly in bucket order: gloo matches collectives by issue order, and a rank
        # whose autograd happened to finish bucket 2 first must not cross bucket 1 on the wire.
        while self._next_launch < len(self._buckets):
            b = self._buckets[self._next_launch]
            if b.ready < len(b.params):
                return
            self._launch(b)
            self._next_launch += 1

    def _launch(self, b: _Bucket) -> None:
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for p, v in zip(b.params, b.views, strict=True):
            if p.grad is None:  # unused in this iteration: contributes zeros, like DDP
                v.zero_()
            else:
                dst.append(v)
                src.append(p.grad)
        if dst:
            torch._foreach_copy_(dst, src)
        if self._slot_comms:
            # every slot's gradient on its own group, issued together (each group waits for
            # the full width, this process included once per slot it holds)
            i = self._buckets.index(b)
            b.held_handles = [
                comm.allreduce(kept[i]) for comm, kept in zip(self._slot_comms[:-1], self._kept, strict=True)
            ]
            b.handle = self._slot_comms[-1].allreduce(b.buffer)
            return
        b.handle = self._comm.allreduce(b.buffer)

    def _keep(self) -> None:
        """The end of an earlier slot's backward: its gradient, bucket by bucket, kept for the
        last pass; the parameters' gradients cleared so the next slot's backward starts from
        none, as that slot's process would have."""
        try:
            kept: list[torch.Tensor] = []
            for b in self._buckets:
                # straight into a flat buffer of the pass's own, one fused copy per bucket (not
                # through the bucket's buffer and a clone of it: that read every gradient twice)
                flat = torch.empty_like(b.buffer)
                dst: list[torch.Tensor] = []
                src: list[torch.Tensor] = []
                for p, off in zip(b.params, b.offsets, strict=True):
                    view = flat[off : off + p.numel()].view_as(p)
                    if p.grad is None:
                        view.zero_()  # unused in this pass: contributes zeros, as in _launch
                    else:
                        dst.append(view)
                        src.append(p.grad)
                    p.grad = None
                if dst:
                    torch._foreach_copy_(dst, src)
                kept.append(flat)
            self._kept.append(kept)
        finally:
            self.reset()

    def _finish(self) -> None:
        # Parameters that received no gradient never fired their hook; launch what is left.
        while self._next_launch < len(self._buckets):
            self._launch(self._buckets[self._next_launch])
            self._next_launch += 1
        world = float(self._comm.world_size)
        try:
            for b in self._buckets:
                assert b.handle is not None
                for h in b.held_handles:  # every group ends with the same sum: wait, keep one
                    self._comm.wait(h)
                self._comm.wait(b.handle)
                b.buffer.div_(world)
                dst: list[torch.Tensor] = []
                src: list[torch.Tensor] = []
                for p, v in zip(b.params, b.views, strict=True):
                    if p.grad is None:
                        p.grad = v.clone()
                    else:
                        dst.append(p.grad)
                        src.append(v)
                if dst:
                    torch._foreach_copy_(dst, src)
        finally:
            self.reset()
