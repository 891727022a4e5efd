"""Degraded mode's reduction is exact (docs/fault-model.md, "Degraded mode"): a process holding two
data-parallel slots trains both slots' micro-batches as two passes of one step, and the weights
end bitwise equal to the full-width job's.

Seven members over gloo on the CPU (threads of this process, each with its own groups and
model, as processes would be), in two jobs side by side: the full-width job (4
processes, one slot each) and the degraded one (3 processes: the second holds slots 1 and 2, as
after losing rank 2). The holder is slot 1's and slot 2's rank in two width-4 groups
(``Communicator`` each); ``DataParallel.hold`` keeps slot 1's gradient aside in the first pass
and all-reduces both on their own groups in the last. A sum of the two slots' gradients made
locally and all-reduced over 3 processes would round differently: the test also checks that such
a shortcut is not what happens, by requiring bitwise equality on every process of both jobs after
several Adam steps (Adam amplifies any last-bit difference).
"""

from __future__ import annotations

import datetime
import hashlib
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(120)

WIDTH = 4
STEPS = 4
SEED = 7
FULL = {0: [0], 1: [1], 2: [2], 3: [3]}
DEGRADED = {0: [0], 1: [1, 2], 3: [3]}  # rank 2 lost; its slot held by rank 1


def _model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(SEED)
    return nn.Sequential(
        nn.Linear(12, 48), nn.GELU(), nn.LayerNorm(48), nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 5)
    )


def _batch(slot: int, step: int) -> tuple[Any, Any]:
    """The micro-batch of (slot, step): a function of those two alone, as the job's data is."""
    import torch

    g = torch.Generator().manual_seed(10_000 * step + slot)
    return torch.randn(16, 12, generator=g), torch.randint(0, 5, (16,), generator=g)


def _train(slots: list[int], store: Any, initial: dict[str, Any]) -> dict[str, Any]:
    """One process of a job (here a thread: gloo groups and autograd work the same), holding
    ``slots``."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from checkpointless.comm.communicator import Communicator
    from checkpointless.comm.data_parallel import DataParallel

    timeout = datetime.timedelta(seconds=60)
    comms = [Communicator(slot, WIDTH, timeout, backend="gloo") for slot in slots]
    # every group waits for the whole width, so a holder forms its slots' groups together
    _together(
        [
            lambda c=c, s=s: c.rebuild(0, dist.PrefixStore("g0/", store), s, WIDTH, time.monotonic() + 60)
            for c, s in zip(comms, slots, strict=True)
        ]
    )
    net = _model()
    net.load_state_dict(initial)  # the global RNG is shared by the threads: one initial state
    dp = DataParallel(net, comms[0], bucket_cap_mb=0.004, first_bucket_cap_mb=0.002)  # several buckets
    dp.hold(comms)
    assert dp.passes == len(slots)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    grads: list[str] = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for i, slot in enumerate(slots):
            dp.begin_pass(i)
            x, y = _batch(slot, step)
            F.cross_entropy(dp(x), y).backward()
        grads.append(_digest(p.grad for p in net.parameters()))
        opt.step()
    # leave together (a holder's groups each wait for it once per slot)
    _together([lambda c=c: c.barrier(30.0) for c in comms])
    for c in comms:
        c.close()
    return {"digest": _digest(p.detach() for p in net.parameters()), "grads": grads}


def _digest(tensors: Any) -> str:
    return hashlib.sha256(b"".join(t.numpy().tobytes() for t in tensors)).hexdigest()


def _together(fns: list[Callable[[], Any]]) -> None:
    errors: list[BaseException] = []

    def run(fn: Callable[[], Any]) -> None:
        try:
            fn()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    if errors:
        raise errors[0]


def test_a_process_holding_two_slots_reduces_bitwise_like_the_full_width_job() -> None:
    import torch.distributed as dist

    initial = _model().state_dict()
    results: dict[tuple[str, int], dict[str, Any]] = {}
    errors: list[str] = []

    def run(job: str, proc: int, slots: list[int], store: Any) -> None:
        try:
            results[(job, proc)] = _train(slots, store, initial)
        except BaseException:
            errors.append(f"{job} process {proc}:\n{traceback.format_exc()}")

    threads = [
        threading.Thread(target=run, args=(job, proc, slots, store), daemon=True)
        for job, layout, store in (("full", FULL, dist.HashStore()), ("degraded", DEGRADED, dist.HashStore()))
        for proc, slots in layout.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert not errors, "\n".join(errors)
    assert len(results) == len(threads), f"only {sorted(results)} finished"
    digests = {key: r["digest"] for key, r in results.items()}
    assert len(set(digests.values())) == 1, f"weights differ between processes or jobs: {digests}"
    # the reduced gradient of every step, too, is the same on every process of both jobs
    grads = {key: tuple(r["grads"]) for key, r in results.items()}
    assert len(set(grads.values())) == 1, grads
