"""checkpointless's DataParallel averages gradients exactly as torch's DistributedDataParallel does.

Three real processes over gloo on the CPU. Each rank holds two identical copies of a small model:
one wrapped in ``torch.nn.parallel.DistributedDataParallel`` on the default process group, one in
``checkpointless.comm.DataParallel`` over a :class:`Communicator` of its own. Every rank feeds both
copies the same batch, and each rank a different batch, so the local gradients differ between ranks
and only a correct average makes them agree. The bucket cap is tiny, so the model's gradients go
out in several buckets: a skipped bucket, a sum instead of a mean, or a bucket reduced into the
wrong parameters all show up. After a few optimizer steps the parameters must match too.

Then gradient accumulation, both DDP idioms on both wrappers: ``with model.no_sync():`` on one
step, ``model.require_backward_grad_sync = False`` on the next. A micro-batch inside must leave
the local (unreduced) gradient; the last one reduces the sum, and both must agree again.

The comparison is against DDP within float tolerance, not bitwise: DDP divides before it sums, we
divide after, and the two roundings differ in the last bits.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import queue
import socket
import time
import traceback
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(120)

WORLD = 3
STEPS = 4
ACCUM_STEPS = 2  # then steps of gradient accumulation over MICRO micro-batches each
MICRO = 3
SEED = 99


def _model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(SEED)  # the same initial weights on every rank and in both copies
    return nn.Sequential(
        nn.Embedding(50, 16),
        nn.Flatten(),
        nn.Linear(16 * 6, 64),
        nn.GELU(),
        nn.LayerNorm(64),
        nn.Linear(64, 64),
        nn.Tanh(),
        nn.Linear(64, 10),
    )


def _compare(ours: list[Any], theirs: list[Any]) -> float:
    """The largest absolute difference between two lists of tensors; raises if any is not close."""
    import torch

    worst = 0.0
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a is not None and b is not None, f"tensor {i}: missing (ours {a is None}, DDP {b is None})"
        worst = max(worst, (a - b).abs().max().item())
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, i=i: f"tensor {i}: {m}")
    return worst


def _rank_main(rank: int, port: int, out: Any) -> None:
    try:
        out.put((rank, "ok", _train_and_compare(rank, port)))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))


def _train_and_compare(rank: int, port: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from checkpointless.comm.communicator import Communicator
    from checkpointless.comm.data_parallel import DataParallel

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("ddp/", store),
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    comm = Communicator(rank, WORLD, datetime.timedelta(seconds=60), backend="gloo")
    comm.rebuild(0, dist.PrefixStore("ours/", store), rank, WORLD, time.monotonic() + 60)

    theirs_net, ours_net = _model(), _model()
    theirs = DistributedDataParallel(theirs_net, bucket_cap_mb=0.004)
    # ~4 KB buckets: the 6.4k-parameter model is reduced in several of them
    ours = DataParallel(ours_net, comm, bucket_cap_mb=0.004, first_bucket_cap_mb=0.002)
    n_buckets = len(ours._buckets)
    # SGD with momentum, not Adam: Adam divides by the gradient's own magnitude, which blows the
    # last-bit rounding differences of near-zero gradients up past any sensible tolerance
    opt_theirs = torch.optim.SGD(theirs_net.parameters(), lr=0.1, momentum=0.9)
    opt_ours = torch.optim.SGD(ours_net.parameters(), lr=0.1, momentum=0.9)

    worst_grad = worst_param = 0.0
    local_differs = False
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * step + rank)  # different data on every rank
        x = torch.randint(0, 50, (8, 6), generator=g)
        y = torch.randint(0, 10, (8,), generator=g)
        # this rank's own gradient, unreduced, to prove the average changed something
        local_net = _model()
        local_net.load_state_dict(ours_net.state_dict())
        F.cross_entropy(local_net(x), y).backward()
        local = [p.grad.clone() for p in local_net.parameters() if p.grad is not None]

        for net, opt in ((theirs, opt_theirs), (ours, opt_ours)):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(x), y).backward()
        g_theirs = [p.grad for p in theirs_net.parameters()]
        g_ours = [p.grad for p in ours_net.parameters()]
        worst_grad = max(worst_grad, _compare(g_ours, g_theirs))
        local_differs = local_differs or any(
            not torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(local, g_ours, strict=True)
        )
        opt_theirs.step()
        opt_ours.step()
        worst_param = max(worst_param, _compare(list(ours_net.parameters()), list(theirs_net.parameters())))

    accum_local = True
    for step in range(ACCUM_STEPS):
        micro = []
        for m in range(MICRO):
            g = torch.Generator().manual_seed(7000 + 100 * step + 10 * m + rank)
            micro.append((torch.randint(0, 50, (4, 6), generator=g), torch.randint(0, 10, (4,), generator=g)))
        local_net = _model()
        local_net.load_state_dict(ours_net.state_dict())
        F.cross_entropy(local_net(micro[0][0]), micro[0][1]).backward()
        local = [p.grad.clone() for p in local_net.parameters() if p.grad is not None]
        for net, opt in ((theirs, opt_theirs), (ours, opt_ours)):
            opt.zero_grad(set_to_none=True)
            for m, (x, y) in enumerate(micro):
                if m == MICRO - 1:  # the last micro-batch reduces the accumulated sum
                    F.cross_entropy(net(x), y).backward()
                elif step % 2 == 0:
                    with net.no_sync():
                        F.cross_entropy(net(x), y).backward()
                else:
                    net.require_backward_grad_sync = False
                    F.cross_entropy(net(x), y).backward()
                    net.require_backward_grad_sync = True
                if m == 0 and net is ours:  # no all-reduce yet: the gradient is this rank's own
                    accum_local = accum_local and all(
                        torch.equal(a, p.grad) for a, p in zip(local, ours_net.parameters(), strict=True)
                    )
        worst_grad = max(
            worst_grad,
            _compare([p.grad for p in ours_net.parameters()], [p.grad for p in theirs_net.parameters()]),
        )
        opt_theirs.step()
        opt_ours.step()
        worst_param = max(worst_param, _compare(list(ours_net.parameters()), list(theirs_net.parameters())))

    # ours must also leave every replica with bitwise the same weights: gather one checksum each
    flat = torch.cat([p.detach().reshape(-1) for p in ours_net.parameters()])
    sums = torch.zeros(WORLD, dtype=torch.float64)
    sums[rank] = flat.double().sum()
    comm.wait(comm.allreduce(sums), 30)
    dist.destroy_process_group()
    return {
        "buckets": n_buckets,
        "worst_grad": worst_grad,
        "worst_param": worst_param,
        "local_differs": local_differs,
        "accum_local": accum_local,
        "sums": sums.tolist(),
    }


def test_data_parallel_averages_like_ddp_on_every_rank() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, port, out), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + 100
    try:
        while len(results) < WORLD:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"only ranks {sorted(results)} reported within 100 s")
            try:
                rank, status, payload = out.get(timeout=min(1.0, left))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                assert not dead, f"ranks {dead} died without reporting"
                continue
            results[rank] = (status, payload)
    finally:
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    errors = {r: payload for r, (status, payload) in results.items() if status != "ok"}
    assert not errors, "\n".join(f"rank {r}:\n{tb}" for r, tb in errors.items())
    for rank, (_, res) in sorted(results.items()):
        assert res["buckets"] >= 3, f"the test needs several buckets to catch a skipped one: {res}"
        assert res["local_differs"], f"rank {rank}: the reduced gradient equals its local one; no averaging?"
        assert res["accum_local"], f"rank {rank}: a micro-batch under no_sync was all-reduced: {res}"
    sums = [res["sums"] for _, res in results.values()]
    assert all(s == sums[0] for s in sums), sums
    assert len(set(sums[0])) == 1, f"the replicas' weights differ after {STEPS} steps: {sums[0]}"
