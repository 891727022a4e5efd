"""torch's own DistributedDataParallel on a resilient group (comm/torch_ddp.py), in one process.

What the Hugging Face integrations rely on when Trainer and Accelerate build the DDP themselves:
it can be built on a :class:`ResilientProcessGroup` once served, a backward abandoned half-way
leaves its reducer unusable until :func:`reset_ddp`, after which the replay's gradients are
bitwise a clean run's, and the bucket layout after a reset is a fresh DDP's (what a replacement
builds). A one-rank group: the reducer still all-reduces every bucket through it.

Then three real processes: the futures the reducer waits for complete without waiting in its
hook (its all-reduces overlap backward), and a peer killed, or stopped and aborted, while
buckets are in flight fails them in C++, so backward raises; after :func:`reset_ddp` and the next
generation (a replacement's fresh DDP for the killed rank) the replay is bitwise the clean step's.
"""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from checkpointless.comm.handle import Handle
from checkpointless.comm.process_group import ResilientProcessGroup
from checkpointless.comm.torch_ddp import fix_layout, reset_ddp, serve_ddp
from checkpointless.comm.work import AbortableWork, in_flight, waiting_since
from checkpointless.errors import CommAborted, ConfigError
from tests.helpers.ranks import spawn_ranks

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


def test_a_pending_collectives_future_completes_later_without_a_wait() -> None:
    """get_future() returns at once for a collective still in flight (DDP's hook goes on with
    backward), and its future completes, or fails in C++, when the collective does."""
    pending = [Handle(None, None, lambda h: None) for _ in range(2)]
    for h in pending:
        h._done.clear()  # still in flight: only _finish or an abort completes it
    before = in_flight()
    ok, lost = (AbortableWork(h, [torch.ones(2)]).get_future() for h in pending)
    assert not ok.done() and not lost.done() and in_flight() == before + 2
    assert waiting_since() is not None, "a future in flight reads as waiting (hang triage)"
    pending[0]._finish(None)
    assert ok.done() and torch.equal(torch._C.Future.value(ok)[0], torch.ones(2))
    pending[1].abort("peer lost")
    with pytest.raises(RuntimeError, match=r"CommAborted: .*peer lost"):
        torch._C.Future.value(lost)
    assert in_flight() == before


WORLD = 3
VICTIM = 2  # killed (its slot taken by process 3, a replacement) or stopped mid-backward


def _batch(slot: int) -> torch.Tensor:
    return torch.randn(4, 64, generator=torch.Generator().manual_seed(slot))


def _digest(gs: list[torch.Tensor]) -> list[bytes]:
    return [g.contiguous().view(torch.uint8).numpy().tobytes() for g in gs]


def _peer_lost_mid_backward(rank: int, port: int, mode: str) -> dict[str, Any]:
    """One process of the test below: ranks 0 and 1 survive; VICTIM is killed (``kill``; process
    3 replaces it) or stopped and then rejoins (``stop``) after its last layers' buckets are
    issued and before its first layer's are."""
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, WORLD + (mode == "kill"), rank == 0, timeout=timeout)
    slot = min(rank, VICTIM)
    x = _batch(slot)
    if rank == WORLD:  # the replacement: built before generation 1 forms, as a spare's is
        store.wait(["replace"])
        ResilientProcessGroup.local_until_formed = True  # its DDP's start-up collectives
        pg = ResilientProcessGroup(slot, WORLD, range(WORLD), timeout)
        ddp = ddp_of(pg, model())
        ResilientProcessGroup.local_until_formed = False
        pg.configure(1, dist.PrefixStore("gen1", store), deadline=time.monotonic() + 30)
        return {"replay": _digest(grads(ddp, x))}
    pg = ResilientProcessGroup(slot, WORLD, range(WORLD), timeout)
    pg.configure(0, dist.PrefixStore("gen0", store), deadline=time.monotonic() + 30)
    ddp = ddp_of(pg, model())
    clean = grads(ddp, x)
    info: dict[str, Any] = {}
    if rank == VICTIM:

        def stop(_: torch.Tensor) -> None:
            store.set("victim", str(os.getpid()))
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            store.wait([f"caught{r}" for r in range(VICTIM)])
            pg.abort("stopped, then taken back")  # as its recovery does

        def arm(_m: nn.Module, _i: object, out: torch.Tensor) -> None:
            out.register_hook(stop)

        armed = ddp.module[1].register_forward_hook(arm)
        # its next bucket's all-reduce is refused by its aborted group
        with pytest.raises((RuntimeError, CommAborted), match="aborted"):
            ddp(x).square().mean().backward()
        armed.remove()
    else:
        seen: dict[str, Any] = {}

        def aborter() -> None:  # the launcher's part: the peer is dead or stopped
            store.wait(["victim"])
            time.sleep(0.3)  # the training thread is now waiting at the end of its backward
            seen["in_flight"], seen["waiting"] = in_flight(), waiting_since() is not None
            seen["t"] = time.monotonic()
            pg.abort("peer lost")

        th = threading.Thread(target=aborter, daemon=True)
        th.start()
        with pytest.raises(RuntimeError, match="CommAborted") as e:
            grads(ddp, x)
        left = time.monotonic()
        th.join(10)
        # a killed peer's gloo error may fail backward before the abort: then left_s <= 0
        info.update(seen, left_s=left - seen.get("t", left), raised=str(e.value)[:300])
        store.set(f"caught{rank}", "1")
        if rank == 0:
            store.set("replace", "1")
    reset_ddp(ddp)  # the reducer was left mid-backward
    pg.configure(1, dist.PrefixStore("gen1", store), deadline=time.monotonic() + 30)
    replay = _digest(grads(ddp, x))
    pg.close()
    return {**info, "clean": _digest(clean), "replay": replay}


@pytest.mark.timeout(150)  # the first spawn starts the fork server: ~30 s of imports at load 15
@pytest.mark.parametrize("mode", ["kill", "stop"])
def test_a_peer_lost_while_buckets_are_in_flight_fails_backward_and_the_replay_is_bitwise(mode: str) -> None:
    lost = (VICTIM,) if mode == "kill" else ()
    res = spawn_ranks(
        _peer_lost_mid_backward, WORLD + (mode == "kill"), (mode,), timeout=120, what=mode, lost=lost
    )
    want = res[0]["clean"]
    for rank, got in res.items():
        assert got["replay"] == want, f"rank {rank}'s replayed gradients differ from the clean step's"
        if rank < VICTIM:
            assert got["clean"] == want
            if mode == "stop":
                # waiting in DDP's reducer with the first layer's bucket in flight, not in our hook
                assert got["waiting"] and got["in_flight"] >= 1, got
            assert got["left_s"] < 5, f"rank {rank} left backward {got['left_s']:.1f} s after the abort"
