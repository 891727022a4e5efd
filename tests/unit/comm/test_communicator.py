"""The mechanism that unblocks a survivor waiting in a gloo collective, tested for real.

gloo's own abort() does not wake a waiting collective (see shared/REFERENCES.md). Our
Communicator fails the pending Handle from another thread, so the waiter leaves at once even
though its peer is alive and silent; a new generation then works with the same ranks.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(90)


def _run_pair(target: Callable[..., None], count: int) -> dict[str, Any]:
    """Run ``target(rank, port, queue)`` in two fresh processes; the first ``count`` (name,
    value) results they put on the queue."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    procs = [ctx.Process(target=target, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return dict(q.get(timeout=60) for _ in range(count))
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def _worker(rank: int, port: int, out: mp.Queue) -> None:  # type: ignore[type-arg]
    import torch
    import torch.distributed as dist

    from checkpointless.comm.communicator import Communicator
    from checkpointless.errors import CommAborted

    base = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    comm = Communicator(rank, 2, datetime.timedelta(seconds=60))
    comm.rebuild(0, dist.PrefixStore("gen0/", base), rank, 2, time.monotonic() + 30)
    t = torch.ones(4) * (rank + 1)
    comm.wait(comm.allreduce(t), 30)
    assert t.tolist() == [3.0] * 4
    base.set(f"ready{rank}", "1")
    if rank == 1:
        # alive, sockets open, but never joins the next collective of generation 0
        base.wait(["gen1go"], datetime.timedelta(seconds=30))
    else:
        threading.Timer(0.5, lambda: comm.abort("peer is stuck")).start()
        t0 = time.monotonic()
        try:
            comm.wait(comm.allreduce(torch.ones(1000)), 30)
            out.put(("no-abort", 0.0))
        except CommAborted:
            out.put(("aborted", time.monotonic() - t0))
        base.set("gen1go", "1")
    comm.rebuild(1, dist.PrefixStore("gen1/", base), rank, 2, time.monotonic() + 30)
    t = torch.full((3,), float(rank + 10))
    comm.wait(comm.allreduce(t), 30)
    out.put((f"gen1-rank{rank}", t.tolist()))
    out.close()
    out.join_thread()  # flush the queue before leaving without destructors
    import os

    os._exit(0)  # skip tearing down the parked generation-0 group


def test_abort_unblocks_a_waiting_collective_and_next_generation_works() -> None:
    results = _run_pair(_worker, 3)
    assert "aborted" in results, results
    assert 0.4 < results["aborted"] < 1.5, f"abort took {results['aborted']:.3f} s"
    assert results["gen1-rank0"] == [21.0, 21.0, 21.0]
    assert results["gen1-rank1"] == [21.0, 21.0, 21.0]


def test_polled_wait_honours_its_timeout_and_an_abort() -> None:
    """The waiting thread polls gloo in bounded slices: a wait with a timeout returns at it, and
    an abort from another thread ends a wait without a timeout within a slice or two."""
    import torch
    import torch.distributed as dist

    from checkpointless.comm.communicator import Communicator
    from checkpointless.errors import CommAborted

    store = dist.HashStore()
    comms = [Communicator(r, 2, datetime.timedelta(seconds=30), backend="gloo") for r in range(2)]
    builders = [
        threading.Thread(
            target=c.rebuild, args=(0, dist.PrefixStore("g0/", store), r, 2, time.monotonic() + 20)
        )
        for r, c in enumerate(comms)
    ]
    for th in builders:
        th.start()
    for th in builders:
        th.join(30)
    c0 = comms[0]  # rank 1 never joins the collectives below
    t0 = time.monotonic()
    with pytest.raises(CommAborted, match="did not complete"):
        c0.wait(c0.allreduce(torch.ones(4)), 0.3)
    assert 0.25 < time.monotonic() - t0 < 1.0
    h = c0.allreduce(torch.ones(4))
    threading.Timer(0.2, lambda: c0.abort("test")).start()
    t0 = time.monotonic()
    with pytest.raises(CommAborted, match="test"):
        c0.wait(h)
    assert time.monotonic() - t0 < 0.5


class _CompletesAsTheWaitGivesUp:
    """c10d's bounded ``Work.wait`` raises "Operation timed out!" when its slice ends; the
    collective can complete right between that and our ``is_completed()`` check. This work does
    exactly that, on its first wait, so the race is reproduced every time."""

    def __init__(self) -> None:
        self.completed = False
        self.waits = 0

    def get_future(self) -> object:
        return object()

    def is_completed(self) -> bool:
        return self.completed

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.waits += 1
        if self.waits == 1:
            self.completed = True
            raise RuntimeError("Operation timed out!")
        return True


def test_polled_wait_does_not_take_its_own_timeout_for_the_collectives_failure() -> None:
    from checkpointless.comm.handle import Handle

    work = _CompletesAsTheWaitGivesUp()
    finished: list[Handle] = []
    h = Handle(work, "result", finished.append, poll=True)
    assert h.wait(5) == "result"  # the collective succeeded: no CommAborted
    assert finished == [h] and work.waits == 2


def _barrier_worker(rank: int, port: int, out: mp.Queue) -> None:  # type: ignore[type-arg]
    import os

    import torch
    import torch.distributed as dist

    from checkpointless.comm.communicator import Communicator
    from checkpointless.errors import CommAborted

    base = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    comm = Communicator(rank, 2, datetime.timedelta(seconds=60))

    def barrier() -> str:
        t0 = time.monotonic()
        try:
            comm.barrier(30)
            return f"passed {time.monotonic() - t0:.2f}"
        except CommAborted:
            return f"aborted {time.monotonic() - t0:.2f}"

    # A: rank 0's barrier is aborted while rank 1, alive and on its way, has not reached it yet.
    # Rank 1 passes it once it arrives, so rank 0 must pass it too.
    comm.rebuild(0, dist.PrefixStore("gen0/", base), rank, 2, time.monotonic() + 30)
    if rank == 0:
        threading.Timer(0.2, lambda: comm.abort("a peer failed")).start()
    else:
        time.sleep(0.5)
    out.put((f"late-peer-rank{rank}", barrier()))
    # B: rank 1 never comes: rank 0's aborted barrier fails once the settle time has passed
    comm.rebuild(1, dist.PrefixStore("gen1/", base), rank, 2, time.monotonic() + 30)
    if rank == 0:
        threading.Timer(0.2, lambda: comm.abort("a peer failed")).start()
        out.put(("absent-peer", barrier()))
        base.set("b-done", "1")
    else:
        base.wait(["b-done"], datetime.timedelta(seconds=30))
    # C: an all-reduce that completed before the abort, unobserved by its waiter, keeps its result
    comm.rebuild(2, dist.PrefixStore("gen2/", base), rank, 2, time.monotonic() + 30)
    t = torch.ones(2) * (rank + 1)
    h = comm.allreduce(t)
    if rank == 0:
        h.work.wait()  # the collective completes; our handle has not seen it
        comm.abort("a peer failed")
    try:
        out.put((f"completed-rank{rank}", comm.wait(h, 30).tolist()))
    except CommAborted as e:
        out.put((f"completed-rank{rank}", f"aborted: {e}"))
    out.close()
    out.join_thread()
    os._exit(0)  # skip tearing down the parked groups


def test_a_barrier_aborted_as_it_completes_is_passed_like_its_peers_passed_it() -> None:
    # The barrier before a sharded update (recovery/guard.py): a rank must not fail a barrier its
    # peer passed, or the peer updates and it does not, and the shard groups end a step apart.
    results = _run_pair(_barrier_worker, 5)
    assert results["late-peer-rank1"].startswith("passed"), results
    assert results["late-peer-rank0"].startswith("passed"), results
    outcome, took = results["absent-peer"].split()
    assert outcome == "aborted" and 1.1 <= float(took) < 5, results
    assert results["completed-rank0"] == results["completed-rank1"] == [3.0, 3.0], results


def test_a_collective_issued_without_work_is_complete_on_its_callers_stream() -> None:
    """NCCL returns no work for a synchronous collective (``async_op=False``: from torch 2.8 it
    runs on the caller's stream), which is how FSDP2 issues its all-gathers, reduce-scatters and
    HSDP all-reduces, and what a script's plain ``dist.all_reduce`` is; its handle must be
    complete at once, return its result, and leave nothing pending for an abort (the first GPU
    run of FSDP2 under the launcher failed every step in its HSDP all-reduce here)."""
    from checkpointless.comm.handle import Handle

    finished: list[Handle] = []
    h = Handle(None, "result", finished.append, poll=False)
    assert h.done() and h.work is None
    assert h.wait(0) == "result"
    h.abort("late abort")  # already complete: its outcome stands
    assert h.wait(0) == "result"
