"""torch's own DistributedDataParallel on a resilient group (comm/torch_ddp.py), in one process.

What the Hugging Face integrations rely on when Trainer and Accelerate build the DDP themselves:
it can be built on a :class:`ResilientProcessGroup` once served, a backward abandoned half-way
leaves its reducer unusable until :func:`reset_ddp`, after which the replay's gradients are
bitwise a clean run's, and the bucket layout after a reset is a fresh DDP's (what a replacement
builds). A one-rank group: the reducer still all-reduces every bucket through it.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from checkpointless.comm.handle import Handle
from checkpointless.comm.process_group import ResilientProcessGroup
from checkpointless.comm.torch_ddp import fix_layout, reset_ddp, serve_ddp
from checkpointless.comm.work import AbortableWork
from checkpointless.errors import ConfigError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture()
def pg() -> Iterator[ResilientProcessGroup]:
    group = ResilientProcessGroup(0, 1, (0,), datetime.timedelta(seconds=10))
    group.configure(0, dist.HashStore(), deadline=time.monotonic() + 10)
    try:
        yield group
    finally:
        group.close()


def model() -> nn.Module:
    torch.manual_seed(0)
    # sizes chosen so that buckets in parameter order differ from buckets in gradient order
    return nn.Sequential(nn.Linear(64, 300), nn.Tanh(), nn.Linear(300, 8), nn.Tanh(), nn.Linear(8, 600))


def ddp_of(pg: ResilientProcessGroup, net: nn.Module) -> DistributedDataParallel:
    serve_ddp(pg)
    ddp = DistributedDataParallel(net, process_group=pg, bucket_cap_mb=0.08)
    fix_layout(ddp)
    return ddp


def grads(ddp: DistributedDataParallel, x: torch.Tensor) -> list[torch.Tensor]:
    for p in ddp.parameters():
        p.grad = None
    ddp(x).square().mean().backward()
    return [p.grad.clone() for p in ddp.parameters() if p.grad is not None]


def layout(ddp: DistributedDataParallel) -> list[list[int]]:
    """Each bucket's parameters, by their index in the module, in bucket order."""
    index = {id(p): i for i, p in enumerate(ddp.parameters())}
    return [[index[id(p)] for p in b.parameters()] for b in ddp.reducer._get_zeros_like_grad_buckets()]


def test_ddp_is_built_on_a_resilient_group_only_once_served(pg: ResilientProcessGroup) -> None:
    with pytest.raises(RuntimeError, match="Could not find backend"):
        DistributedDataParallel(model(), process_group=pg)
    ddp = ddp_of(pg, model())
    issued = pg.issued
    assert len(grads(ddp, torch.randn(4, 64))) == 6
    assert pg.issued > issued, "the reducer's all-reduces go through the resilient group"
    serve_ddp(pg)  # idempotent


def test_after_a_backward_abandoned_half_way_a_reset_replays_bitwise(pg: ResilientProcessGroup) -> None:
    x = torch.randn(4, 64)
    clean = grads(ddp_of(pg, model()), x)
    ddp = ddp_of(pg, model())
    grads(ddp, x)  # regrouped as this forward began
    regrouped = layout(ddp)

    def fail(_: torch.Tensor) -> None:
        raise RuntimeError("injected mid-backward")

    # raised where the last layers' gradients are ready (their buckets reduced), the first's not
    def arm(_m: nn.Module, _i: object, out: torch.Tensor) -> None:
        out.register_hook(fail)

    hook = ddp.module[1].register_forward_hook(arm)
    with pytest.raises(RuntimeError, match="injected"):
        ddp(x).square().mean().backward()
    hook.remove()
    with pytest.raises(RuntimeError):
        grads(ddp, x)  # the reducer still waits for the abandoned backward
    reset_ddp(ddp)
    replay = grads(ddp, x)
    assert all(torch.equal(a, b) for a, b in zip(replay, clean, strict=True))
    assert layout(ddp) == regrouped, "after a reset, the same buckets again"


def test_without_the_fixed_layout_a_fresh_ddp_reduces_unlike_a_regrouped_one(
    pg: ResilientProcessGroup,
) -> None:
    """Why fix_layout: DDP's own regrouping (by the order gradients became ready) gives other
    buckets than a fresh DDP's first ones, which a replacement would reduce in while the
    survivors reduce in the regrouped ones; with it, both are the buckets in parameter order."""
    x = torch.randn(4, 64)
    serve_ddp(pg)
    plain = DistributedDataParallel(model(), process_group=pg, bucket_cap_mb=0.08)
    fresh = layout(plain)
    grads(plain, x)
    grads(plain, x)  # regrouped as this forward began
    assert layout(plain) != fresh
    a, b = ddp_of(pg, model()), ddp_of(pg, model())
    grads(a, x)
    for _ in range(3):
        grads(b, x)
    assert layout(a) == layout(b) == [[0, 1, 2], [3, 4, 5]]  # in parameter order, within the cap


def test_a_static_graph_is_refused(pg: ResilientProcessGroup) -> None:
    serve_ddp(pg)
    ddp = DistributedDataParallel(model(), process_group=pg, static_graph=True)
    with pytest.raises(ConfigError, match="static_graph=True"):
        fix_layout(ddp)


def test_an_aborted_collectives_future_is_an_error_to_cpp_callers_too() -> None:
    """DDP's reducer reads an all-reduce's result from its future in C++: an aborted one must
    fail there, not complete with the exception as its value (which crashed it with SIGSEGV)."""
    handle = Handle(None, None, lambda h: None)
    handle._done.clear()  # a collective still pending (no work: nothing else completes it)
    handle.abort("peer lost")
    fut = AbortableWork(handle, [torch.ones(2)]).get_future()
    assert fut.done()
    with pytest.raises(RuntimeError, match="CommAborted: peer lost"):
        torch._C.Future.value(fut)  # the C++ accessor, without Python's unwrapping
    done = Handle(None, None, lambda h: None)
    ok = AbortableWork(done, [torch.ones(2)]).get_future()
    assert torch.equal(torch._C.Future.value(ok)[0], torch.ones(2))
