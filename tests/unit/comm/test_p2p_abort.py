"""Point-to-point on a resilient group as pipeline schedules issue it: ``batch_isend_irecv``.

``torch.distributed.pipelining`` moves activations and their gradients between stages with
``dist.batch_isend_irecv`` (and ``isend``/``irecv``) on the pipeline group and waits on each work.
Two real processes (gloo, CPU) on our 1-D mesh: a batched exchange delivers the peer's bytes; a
batched send and receive to a peer that stopped is woken by an abort from another thread at
once, with ``CommAborted``, as a collective is; and the same group object exchanges again in the
next generation, into fresh buffers. Every send and receive passes the group's hook as "send"
or "recv" (where the job's ``p2p`` fault site fires).
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any

import pytest

from tests.helpers.ranks import spawn_ranks

pytestmark = pytest.mark.timeout(120)

WORLD = 2


def _sent(rank: int, gen: int) -> Any:
    import torch

    return torch.arange(6, dtype=torch.float32) * (rank + 1) + 100 * gen


def _exchange(rank: int, pg: Any, gen: int) -> bytes:
    """One batched send and receive with the other rank, as a 1F1B stage does in steady state."""
    import torch
    import torch.distributed as dist

    peer = 1 - rank
    mine = _sent(rank, gen)
    got = torch.empty(6)
    ops = [dist.P2POp(dist.isend, mine, peer, pg), dist.P2POp(dist.irecv, got, peer, pg)]
    if rank == 1:
        ops.reverse()  # the peers list them in opposite orders, as stages do
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return got.numpy().tobytes()


def _stopped_peer(rank: int, store: Any, rm: Any, pg: Any) -> dict[str, Any]:
    """Rank 1 stops (alive, never sends, never receives); rank 0 waits in a batched send and
    receive to it until a thread aborts the groups."""
    import torch
    import torch.distributed as dist

    info: dict[str, Any] = {}
    if rank == 1:
        store.set("stopped", "1")
        store.wait(["caught0"], datetime.timedelta(seconds=60))
        rm.abort("stopped")
        return info
    store.wait(["stopped"], datetime.timedelta(seconds=60))
    fired: dict[str, float] = {}

    def aborter() -> None:
        time.sleep(0.5)  # let the main thread block in its wait
        fired["t"] = time.monotonic()
        info["pending"] = rm.abort("peer stopped")

    th = threading.Thread(target=aborter, daemon=True)
    th.start()
    ops = [dist.P2POp(dist.isend, torch.ones(6), 1, pg), dist.P2POp(dist.irecv, torch.empty(6), 1, pg)]
    try:
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    except Exception as e:
        info["latency"] = time.monotonic() - fired["t"]
        info["error"] = f"{type(e).__name__}: {e}"
    th.join(5)
    store.set("caught0", "1")
    return info


def _run(rank: int, port: int) -> dict[str, Any]:
    import torch.distributed as dist

    from checkpointless.comm.mesh import make_device_mesh

    store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0, timeout=datetime.timedelta(seconds=60))
    rm = make_device_mesh(("pp",), (WORLD,), rank, WORLD, store)
    rm.configure(0, store, time.monotonic() + 30)
    pg = rm.device_mesh.get_group(0)
    kinds: list[str] = []
    pg.before_collective = kinds.append  # the job's fault-site hook (the "p2p" site)
    res: dict[str, Any] = {"gen0": _exchange(rank, pg, 0), "hooked": list(kinds)}
    pg.before_collective = None
    res["abort"] = _stopped_peer(rank, store, rm, pg)
    rm.configure(1, store, time.monotonic() + 30)  # the next generation, under the same objects
    rm.release_graveyard()
    res["gen1"] = _exchange(rank, pg, 1)
    return res


def test_batched_send_and_receive_deliver_and_an_abort_wakes_them() -> None:
    ours = spawn_ranks(_run, WORLD, (), timeout=90, what="p2p")
    for rank in range(WORLD):  # each received the other's tensor, bit for bit, in both generations
        for gen in (0, 1):
            assert ours[rank][f"gen{gen}"] == _sent(1 - rank, gen).numpy().tobytes(), (rank, gen)
    # each send and receive that batch_isend_irecv issued passed the hook, in issue order
    assert ours[0]["hooked"] == ["send", "recv"] and ours[1]["hooked"] == ["recv", "send"], ours
    info = ours[0]["abort"]
    assert "error" in info, "a batched receive from a stopped peer completed"
    assert "CommAborted" in info["error"] and "aborted" in info["error"], info["error"]
    assert info["latency"] < 1.0, f"left {info['latency']:.2f} s after the abort"
    assert info["pending"] >= 1, "rank 0 was not waiting on the group when it was aborted"
