"""Ranks as spawned processes on one machine, for tests of process groups below the launcher.

``spawn_ranks(run, world, args)`` starts ``world`` processes; each calls ``run(rank, port,
*args)`` (a module-level function: it is pickled by name) with the port of a free TCPStore
address and returns a dict, which comes back by rank. A rank that raises comes back as its
traceback, and the call fails naming it. A rank named in ``lost`` is expected to die without
reporting (a test's SIGKILL of itself): only the others are waited for.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Collection
from typing import Any

__all__ = ["spawn_ranks"]


def _rank_main(
    run: Callable[..., dict[str, Any]], rank: int, port: int, args: tuple[Any, ...], out: Any
) -> None:
    try:
        out.put((rank, run(rank, port, *args)))
    except BaseException:
        out.put((rank, {"error": traceback.format_exc()}))
    out.close()
    out.join_thread()
    # leave without destructors: aborted gloo groups may still hold a collective in flight
    os._exit(0)


def _context() -> Any:
    # A fork server that has imported torch once, and forks each rank from it: a spawned rank
    # would import torch again (~2 s of CPU each, 8 per test of two 4-rank launches). The server
    # has run nothing but imports, so it holds no thread or gloo state a fork could copy half of;
    # this test process (which has) is never forked.
    ctx = mp.get_context("forkserver")
    # and DTensor, which DDP and FSDP import: registering its ops took each rank 20 s and more
    # on two loaded cores
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.tensor"])
    return ctx


def spawn_ranks(
    run: Callable[..., dict[str, Any]],
    world: int,
    args: tuple[Any, ...],
    timeout: float,
    what: str,
    lost: Collection[int] = (),
) -> dict[int, dict[str, Any]]:
    """Every rank's result but ``lost`` ones', or an assertion naming ``what`` and the ranks
    that failed."""
    ctx = _context()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(run, r, port, args, q)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    try:
        deadline = time.monotonic() + timeout
        while len(results) < world - len(lost):
            try:
                rank, res = q.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            results[rank] = res
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    errors = "".join(f"\nrank {r}:\n{res['error']}" for r, res in results.items() if "error" in res)
    assert sorted(results) == sorted(set(range(world)) - set(lost)), (
        f"{what}: ranks {sorted(results)} reported{errors}"
    )
    for rank, res in results.items():
        assert "error" not in res, f"{what} rank {rank}:\n{res['error']}"
    return results
